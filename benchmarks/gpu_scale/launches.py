"""Kernels a decode step launches, counted in the compiled program's HLO (`per_iteration`): each instruction of
the decode loop's body that runs as a kernel (a fusion, a custom call such as a Pallas kernel or a cuBLAS gemm,
any unfused op), a nested loop's body times its known trip count, a conditional's largest branch, a call's
callee. Parameters, constants, tuples and their elements, bitcasts and the done halves of async pairs launch
nothing. An approximation from the program's text, not a profile: it tells how much of a step's time beyond its
bytes' time at the HBM peak the launches may explain (report.py prints the time beyond the bytes per kernel)."""

import re

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


def count(comps: dict, name: str, seen=()) -> int:
    """Kernels one run of computation `name` launches (module doc)."""
    if name in seen or name not in comps:
        return 0
    seen = seen + (name,)
    n = 0
    for line in comps[name]:
        op = opcode(line)
        if op in FREE or op.endswith("-done") or op.endswith("-update"):
            continue
        if op == "while":
            body, cond = _called(line, "body"), _called(line, "condition")
            n += _trip(line) * sum(count(comps, c, seen) for c in body + cond)
        elif op == "conditional":
            branches = _called(line, "branch_computations") or (
                _called(line, "true_computation") + _called(line, "false_computation"))
            n += max((count(comps, c, seen) for c in branches), default=0)
        elif op == "call":
            n += sum(count(comps, c, seen) for c in _called(line, "to_apply"))
        else:
            n += 1
    return n


def per_iteration(hlo: str) -> int:
    """Kernels one iteration of the program's decode loop launches: the entry's while loop with the most of them
    (its body and its condition, which runs each iteration too). 0 if the entry holds no loop."""
    comps, entry = computations(hlo)
    best = 0
    for line in comps.get(entry, []):
        if opcode(line) == "while":
            best = max(best, sum(count(comps, c) for c in _called(line, "body") + _called(line, "condition")))
    return best
