"""Kernels a decode step launches, counted in the compiled program's HLO (`per_iteration`): each instruction of
the decode loop's body that runs as a kernel (a fusion, a custom call such as a Pallas kernel or a cuBLAS gemm,
any unfused op), a nested loop's body times its known trip count, a conditional's largest branch, a call's
callee. Parameters, constants, tuples and their elements, bitcasts and the done halves of async pairs launch
nothing. An approximation from the program's text, not a profile: it tells how much of a step's time beyond its
bytes' time at the HBM peak the launches may explain (report.py prints the time beyond the bytes per kernel)."""

import re
from collections import Counter

from qwen_mtp.tools.gpu_compile import pallas_kernels

FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "opt-barrier",
        "add-dependency", "partition-id", "replica-id"}
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{$")
_NAME = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = ")


def computations(hlo: str) -> tuple[dict, str | None]:
    """{name: [instruction lines]} of an HLO module's text, and the entry computation's name."""
    comps, entry, cur = {}, None, None
    for line in hlo.splitlines():
        m = _HEADER.match(line)
        if m:
            cur = m.group(2)
            comps[cur] = []
            entry = cur if m.group(1) else entry
        elif line.startswith("}"):
            cur = None
        elif cur is not None and _NAME.match(line):
            comps[cur].append(line)
    return comps, entry


def opcode(line: str) -> str:
    """The opcode of one instruction line: the word before its operands, after the result's type (a tuple's type
    holds parentheses and spaces: skipped as a balanced group)."""
    rest = _NAME.sub("", line, count=1)
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                rest = rest[i + 1:]
                break
    else:
        rest = rest.split(" ", 1)[1] if " " in rest else rest
    return rest.strip().split("(", 1)[0]


def _called(line: str, key: str) -> list[str]:
    m = re.search(key + r"=\{?([^}\s,]+(?:, *%?[\w.\-]+)*)\}?", line)
    return [n.strip().lstrip("%") for n in m.group(1).split(",")] if m else []


def _trip(line: str) -> int:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
    return int(m.group(1)) if m else 1


def _launches(op: str) -> bool:
    """Whether an instruction of opcode `op` runs as a kernel (module doc)."""
    return not (op in FREE or op.endswith("-done") or op.endswith("-update"))


def count(comps: dict, name: str, seen=()) -> Counter:
    """Kernels one run of computation `name` launches (module doc), by opcode (a fusion, a custom-call, ...)."""
    n = Counter()
    if name in seen or name not in comps:
        return n
    seen = seen + (name,)
    for line in comps[name]:
        op = opcode(line)
        if not _launches(op):
            continue
        if op == "while":
            trips = _trip(line)
            for c in _called(line, "body") + _called(line, "condition"):
                n.update({k: trips * v for k, v in count(comps, c, seen).items()})
        elif op == "conditional":
            branches = _called(line, "branch_computations") or (
                _called(line, "true_computation") + _called(line, "false_computation"))
            n.update(max((count(comps, c, seen) for c in branches), key=lambda b: b.total(), default=Counter()))
        elif op == "call":
            for c in _called(line, "to_apply"):
                n.update(count(comps, c, seen))
        else:
            n[op] += 1
    return n


def _decode_loop(comps: dict, entry) -> tuple:
    """(the computations one iteration of the decode loop runs: the body and the condition of the entry's while
    loop that launches the most kernels, those kernels by opcode); ([], empty) if the entry holds no loop."""
    best = ([], Counter())
    for line in comps.get(entry, []):
        if opcode(line) == "while":
            names = _called(line, "body") + _called(line, "condition")
            got = Counter()
            for c in names:
                got.update(count(comps, c))
            if got.total() > best[1].total() or not best[0]:
                best = (names, got)
    return best


def per_iteration(hlo: str) -> Counter:
    """Kernels one iteration of the program's decode loop launches, by opcode: the entry's while loop with the
    most of them (its body and its condition, which runs each iteration too). Empty if the entry holds no loop."""
    return _decode_loop(*computations(hlo))[1]


def describe(kernels: Counter) -> str:
    """'N kernels (fusion a, custom-call b, ...)', the most frequent opcodes first."""
    top = ", ".join(f"{op} {n}" for op, n in kernels.most_common(4))
    rest = kernels.total() - sum(n for _, n in kernels.most_common(4))
    return f"{kernels.total()} kernels ({top}{f', other {rest}' if rest else ''})"


def _shape_bytes(line: str) -> int:
    m = re.search(r"= (\w+)\[([\d,]*)\]", line)
    if not m:
        return 0
    size = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4}
    n = 1
    for d in filter(None, m.group(2).split(",")):
        n *= int(d)
    return n * size.get(m.group(1), 4)


def loop_instructions(hlo: str):
    """(the instruction lines, the computations) of every instruction that runs inside the decode loop
    (per_iteration's loop, its body and condition; nested loops, branches and calls included), each once."""
    comps, entry = computations(hlo)
    out = []

    def walk(name, seen):
        if name in seen or name not in comps:
            return
        seen = seen + (name,)
        for line in comps[name]:
            op = opcode(line)
            key = {"while": "body", "call": "to_apply", "conditional": "branch_computations"}.get(op)
            if key:
                for c in _called(line, key) + _called(line, "true_computation") + _called(line, "false_computation"):
                    walk(c, seen)
            else:
                out.append(line)

    for c in _decode_loop(comps, entry)[0]:
        walk(c, ())
    return out, comps


def kernel_list(hlo: str) -> list[str]:
    """One line per kernel of the decode loop, in program order: the opcode, a fusion's root opcode, the result
    type, a custom call's target (a Pallas kernel by its name). Each instruction once, as loop_instructions walks
    them: a nested loop's body once, every branch of a conditional (per_iteration counts trips and the largest
    branch), so for a loop with neither the list is as long as per_iteration's total."""
    lines, comps = loop_instructions(hlo)
    out = []
    for line in lines:
        op = opcode(line)
        if not _launches(op):
            continue
        root = opcode(_root(line, comps)) if op == "fusion" else ""
        m = re.search(r"= ((?:\([^=]*?\))|\S+) ", line)
        what = (m.group(1) if m else "?")[:60]
        target = ""
        if op == "custom-call":
            called = re.search(r'custom_call_target="([^"]+)"', line)
            target = next(iter(pallas_kernels(line)), "") or (called.group(1) if called else "")
        out.append(f"{op:12s} {root:20s} {what:60s} {target}".rstrip())
    return out


def _root(line: str, comps: dict) -> str:
    """The ROOT instruction line of a fusion's computation ("" for anything else)."""
    if opcode(line) != "fusion":
        return ""
    body = comps.get((_called(line, "calls") or [""])[0], [])
    return next((x for x in body if x.lstrip().startswith("ROOT")), "")


def concatenations(hlo: str, min_bytes: int = 4 << 20) -> list:
    """The concatenations of at least `min_bytes` that run inside the decode loop, as (result type, bytes): a
    concatenate, or a fusion whose root is one. In a decode step that is a weight copied at every iteration (the
    rows' own values are far smaller)."""
    lines, comps = loop_instructions(hlo)
    found = []
    for line in lines:
        root = _root(line, comps)
        if "concatenate" in (opcode(line), root and opcode(root)) and _shape_bytes(line) >= min_bytes:
            found.append((line.split(" = ", 1)[1].split(" ", 1)[0], _shape_bytes(line)))
    return found


def products(hlo: str, min_bytes: int = 1 << 20) -> list:
    """The fusions inside the decode loop whose result is an elementwise multiply (or a tuple of them) of at least
    `min_bytes`, as (result type, bytes): at decode that is a weight-sized product written out, a dot that XLA
    strength-reduced into a multiply and a reduce without fusing the two (ops.VECTOR_DOT_MAX)."""
    lines, comps = loop_instructions(hlo)
    found = []
    for line in lines:
        root = _root(line, comps)
        if not root:
            continue
        parts = [root]
        body = comps[_called(line, "calls")[0]]
        if opcode(root) == "tuple":
            names = [n.strip().lstrip("%") for n in root.split("tuple(", 1)[1].rsplit(")", 1)[0].split(",")]
            parts = [x for x in body if x.strip().split(" = ")[0].strip().lstrip("%") in names]
        for part in parts:
            if opcode(part) == "multiply" and _shape_bytes(part) >= min_bytes:
                found.append((part.split(" = ", 1)[1].split(" ", 1)[0], _shape_bytes(part)))
    return found


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def collectives(hlo: str) -> list:
    """The collectives inside the decode loop, as (opcode without -start, bytes of the largest array in its
    result: for an async start, the tuple of operand and result)."""
    lines, _ = loop_instructions(hlo)
    found = []
    for line in lines:
        op = opcode(line).removesuffix("-start")
        if op in COLLECTIVES:
            types = re.findall(r"(\w+)\[([\d,]*)\]", line.split(" = ", 1)[1].split(op, 1)[0])
            found.append((op, max((_shape_bytes(f"= {t}[{d}]") for t, d in types), default=0)))
    return found
