"""Reading a jax.profiler trace without a browser: the top XLA ops of a trace folder, and the time of each phase
of prefill, of a plain decode step and of a speculative round (draft, verify, accept, commit, rollback, refill)
with the trunk's and the MTP head's stages inside them.

`jax.profiler.trace(logdir)` writes plugins/profile/<run>/<host>.xplane.pb (what `xprof --logdir LOGDIR` or
TensorBoard's profile plugin opens) and <host>.trace.json.gz (Chrome trace events). Every event the XLA runtime
records for an executed op carries args.hlo_op and args.hlo_module; ops nest (a `while` op's event spans its
body's), so `op_events` charges each op its self time: its duration less that of the events inside it.

The phases are jax.named_scope regions in the code: "prefill" / "mtp_prefill" / "first_token" (prefill.py, plain.py),
"step" / "pick" / "commit" (a plain decode step: the trunk, then lm_head and the choice), "draft" / "verify" / "accept" / "commit" / "rollback" /
"refill" (a round, speculative.py), and inside them the stages "embed", "gdn", "attention", "mlp", "final_norm",
"lm_head" (model.py), "mtp_embed", "mtp_fc", "mtp_attention", "mtp_mlp", "mtp_norm" (mtp.py) and "pick" (a
draft's lm_head and choice, speculative.py; the lm_head product is charged to "pick" where XLA drops its
metadata). A trace event
names only its HLO instruction (`ynn_fusion.12`); the instruction's scope path is in the compiled program's
op_name metadata, which `generate.program_texts` returns and `op_scopes` reads. On a GPU, XProf reads the same
metadata itself (Trace Viewer's op details, Framework Op Stats); on a CPU only this table groups by phase.
"""

from __future__ import annotations

import collections
import gzip
import json
import re
from pathlib import Path

PHASES = ("prefill", "mtp_prefill", "first_token", "step", "pick", "draft", "verify", "accept", "commit",
          "rollback", "refill")
ROUND_PHASES = ("draft", "verify", "accept", "commit", "rollback", "refill")
STAGES = ("embed", "gdn", "attention", "mlp", "final_norm", "lm_head", "pick", "mtp_embed", "mtp_fc",
          "mtp_attention", "mtp_mlp", "mtp_norm")
_INSTR = re.compile(r'^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$')
_META = re.compile(r'metadata=\{[^}]*?op_name="([^"]*)"')
_REF = re.compile(r'%([\w.\-]+)')


def latest_run(logdir) -> Path:
    runs = sorted((Path(logdir) / "plugins" / "profile").glob("*"))
    if not runs:
        raise FileNotFoundError(f"{logdir}: no plugins/profile/<run> folder (was jax.profiler.trace used?)")
    return runs[-1]


def trace_files(logdir) -> dict:
    run = latest_run(logdir)
    return {"run": run, "xplane": sorted(run.glob("*.xplane.pb")), "trace_json": sorted(run.glob("*.trace.json.gz"))}


def op_events(logdir) -> list:
    """[(hlo_module, hlo_op, self_ms, start_us)] of every XLA op event of the latest run. Self time: the event's
    duration less the durations of the op events directly inside it on the same thread."""
    files = trace_files(logdir)["trace_json"]
    if not files:
        raise FileNotFoundError(f"{logdir}: the latest run has no *.trace.json.gz")
    out = []
    for f in files:
        with gzip.open(f) as fh:
            events = json.load(fh)["traceEvents"]
        per_thread = collections.defaultdict(list)
        for e in events:
            args = e.get("args") or {}
            if e.get("ph") == "X" and "hlo_op" in args:
                per_thread[(e.get("pid"), e.get("tid"))].append(e)
        for evs in per_thread.values():
            evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0.0)))
            stack = []  # [event, its children's summed duration]
            done = []

            def close(item):
                e, child = item
                done.append((e["args"].get("hlo_module", "?"), e["args"]["hlo_op"],
                             max(0.0, e.get("dur", 0.0) - child) / 1e3, e["ts"]))

            for e in evs:
                while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0].get("dur", 0.0):
                    close(stack.pop())
                if stack:
                    stack[-1][1] += e.get("dur", 0.0)
                stack.append([e, 0.0])
            while stack:
                close(stack.pop())
            out += done
    return out


def op_scopes(hlo_text: str) -> dict:
    """{HLO instruction name: its op_name metadata (the jit / while / named-scope path)} of a compiled program's
    text (`compiled.as_text()`). Some instructions XLA creates carry no metadata (on a CPU, the products it
    rewrites for one row, copies, bitcasts); each takes the op_name of the nearest instruction that consumes
    its result and has one (else of an operand), so a draft's lm_head product is charged to the draft."""
    named, uses, operands = {}, collections.defaultdict(list), {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, rest = m.group(1), m.group(2)
        meta = _META.search(rest)
        if meta:
            named[name] = meta.group(1)
        args = rest.split("metadata=", 1)[0]
        refs = _REF.findall(args)
        operands[name] = refs
        for r in refs:
            uses[r].append(name)
    out = dict(named)
    for name in operands:
        if name in out:
            continue
        seen, frontier = {name}, [name]
        found = None
        for _ in range(8):  # breadth-first over users, a few hops
            nxt = [u for f in frontier for u in uses.get(f, ()) if u not in seen]
            found = next((named[u] for u in nxt if u in named), None)
            if found or not nxt:
                break
            seen.update(nxt)
            frontier = nxt
        if found is None:
            found = next((named[o] for o in operands[name] if o in named), None)
        if found is not None:
            out[name] = found
    return out


def phase_of(op_name: str | None) -> tuple:
    """(phase, stage) of an op_name path: its outermost PHASES scope (or "(loop)" for a while loop's own control
    ops, "(other)" outside every phase, "(no metadata)" for an op XLA made up) and its innermost STAGES scope
    ("" if none)."""
    if not op_name:
        return "(no metadata)", ""
    parts = op_name.split("/")
    phase = next((p for p in parts if p in PHASES), "(loop)" if "while" in parts else "(other)")
    stage = next((p for p in reversed(parts) if p in STAGES), "")
    return phase, "" if stage == phase else stage


def _scoped(texts: dict | None):
    scopes = {m: op_scopes(t) for m, t in (texts or {}).items()}

    def lookup(module, op):
        table = scopes.get(module)
        return phase_of(table.get(op)) if table is not None else ("?", "")
    return lookup


def top_ops(logdir, n: int = 15, texts: dict | None = None):
    """[(hlo_module, hlo_op, self_ms, calls, phase, stage)] of the latest run, the most self time first; phase /
    stage from `texts` (generate.program_texts), "?" without them."""
    lookup = _scoped(texts)
    total, calls = collections.Counter(), collections.Counter()
    for m, op, ms, _ in op_events(logdir):
        total[(m, op)] += ms
        calls[(m, op)] += 1
    return [(m, op, ms, calls[(m, op)]) + lookup(m, op) for (m, op), ms in total.most_common(n)]


def format_top_ops(rows) -> str:
    lines = [f"{'self ms':>9} {'calls':>6}  {'phase / stage':<28} module / op"]
    lines += [f"{ms:9.2f} {c:6d}  {(ph + (' / ' + st if st else ''))[:28]:<28} {m} / {op}"
              for m, op, ms, c, ph, st in rows]
    return "\n".join(lines)


def phase_table(logdir, texts: dict) -> list:
    """[(hlo_module, phase, stage, self_ms, share of the module's time, ops)] of the latest run, by module (the
    most time first), then phase in PHASES order, then stage. texts: generate.program_texts of what ran."""
    lookup = _scoped(texts)
    ms, ops = collections.Counter(), collections.Counter()
    for m, op, t, _ in op_events(logdir):
        key = (m,) + lookup(m, op)
        ms[key] += t
        ops[key] += 1
    module_ms = collections.Counter()
    for (m, _, _), t in ms.items():
        module_ms[m] += t
    order = {p: i for i, p in enumerate(PHASES)}
    keys = sorted(ms, key=lambda k: (-module_ms[k[0]], order.get(k[1], len(order)), k[1], k[2]))
    return [(m, ph, st, ms[(m, ph, st)], ms[(m, ph, st)] / module_ms[m] if module_ms[m] else 0.0, ops[(m, ph, st)])
            for m, ph, st in keys]


def phase_shares(rows, module: str) -> dict:
    """{phase: share of `module`'s time} summed over stages, from phase_table rows."""
    out = collections.Counter()
    for m, ph, _, _, share, _ in rows:
        if m == module:
            out[ph] += share
    return dict(out)


def format_phase_table(rows, per_call: dict | None = None, min_share: float = 0.01) -> str:
    """The table, a block per module with the phase subtotals; per_call {module: calls} adds ms per call (per
    round for jit_spec_decode when given the rounds run). Modules under min_share of all the time are summed
    in one last line."""
    lines = []
    module_ms = collections.Counter()
    for r in rows:
        module_ms[r[0]] += r[3]
    everything = sum(module_ms.values()) or 1.0
    small = [m for m, t in module_ms.items() if t / everything < min_share]
    for module in dict.fromkeys(r[0] for r in rows):
        if module in small:
            continue
        mine = [r for r in rows if r[0] == module]
        total = sum(r[3] for r in mine)
        n = (per_call or {}).get(module)
        head = f"{module}: {total:.2f} ms" + (f" over {n} calls, {total / n:.3f} ms each" if n else "")
        lines += ["", head, f"  {'phase':<14} {'stage':<14} {'self ms':>9} {'share':>7} {'ops':>6}"]
        for phase in dict.fromkeys(r[1] for r in mine):
            sub = [r for r in mine if r[1] == phase]
            if len(sub) > 1:
                lines.append(f"  {phase:<14} {'(all)':<14} {sum(r[3] for r in sub):9.2f} "
                             f"{sum(r[4] for r in sub):7.1%} {sum(r[5] for r in sub):6d}")
            for _, ph, st, t, share, k in sub:
                lines.append(f"  {ph if len(sub) == 1 else '':<14} {st or '-':<14} {t:9.2f} {share:7.1%} {k:6d}")
    if small:
        lines += ["", f"{len(small)} more programs under {min_share:.0%} of the time each: "
                  f"{sum(module_ms[m] for m in small):.2f} ms ({', '.join(sorted(small))})"]
    return "\n".join(lines[1:])


def profile_generate(model, prompt_ids, max_new_tokens: int, logdir, *, repeats: int = 2, **kwargs):
    """Trace `repeats` calls of generate(model, prompt_ids, max_new_tokens, **kwargs) into logdir, each inside a
    jax.profiler.StepTraceAnnotation("generate", step_num=i) (XProf's step views need the markers). The
    programs are compiled first and one untraced call runs, so the trace holds steady-state calls only.
    Returns (the last GenerateResult, program texts, phase_table rows, {loop module: rounds or steps traced})."""
    import jax

    from qwen_mtp.decoding.generate import generate, program_texts

    texts = program_texts(model, prompt_ids, max_new_tokens, **kwargs)
    generate(model, prompt_ids, max_new_tokens, **kwargs)
    with jax.profiler.trace(str(logdir)):
        for i in range(repeats):
            with jax.profiler.StepTraceAnnotation("generate", step_num=i):
                r = generate(model, prompt_ids, max_new_tokens, **kwargs)
    s = r.stats
    if kwargs.get("spec") is not None:
        calls = {"jit_spec_decode": repeats * s.rounds}
    else:
        calls = {"jit_plain_decode": repeats * max(1, (s.new_tokens - s.batch) // max(1, s.batch))}
    return r, texts, phase_table(logdir, texts), calls
