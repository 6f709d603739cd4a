"""Reading a jax.profiler trace without TensorBoard: the top XLA ops of a trace folder.

`jax.profiler.trace(logdir)` writes plugins/profile/<run>/<host>.xplane.pb (what `xprof --logdir LOGDIR` or
TensorBoard's profile plugin opens) and <host>.trace.json.gz (Chrome trace events). Every event the XLA
runtime records for an executed op carries args.hlo_op and args.hlo_module; `top_ops` sums their durations.
"""

from __future__ import annotations

import collections
import gzip
import json
from pathlib import Path


def latest_run(logdir) -> Path:
    runs = sorted((Path(logdir) / "plugins" / "profile").glob("*"))
    if not runs:
        raise FileNotFoundError(f"{logdir}: no plugins/profile/<run> folder (was jax.profiler.trace used?)")
    return runs[-1]


def trace_files(logdir) -> dict:
    run = latest_run(logdir)
    return {"run": run, "xplane": sorted(run.glob("*.xplane.pb")), "trace_json": sorted(run.glob("*.trace.json.gz"))}


def top_ops(logdir, n: int = 15):
    """[(hlo_module, hlo_op, total_ms, calls)] of the latest run, the most time first."""
    files = trace_files(logdir)["trace_json"]
    if not files:
        raise FileNotFoundError(f"{logdir}: the latest run has no *.trace.json.gz")
    total, calls = collections.Counter(), collections.Counter()
    for f in files:
        with gzip.open(f) as fh:
            events = json.load(fh)["traceEvents"]
        for e in events:
            args = e.get("args") or {}
            if e.get("ph") == "X" and "hlo_op" in args:
                key = (args.get("hlo_module", "?"), args["hlo_op"])
                total[key] += e.get("dur", 0.0) / 1e3
                calls[key] += 1
    return [(m, op, ms, calls[(m, op)]) for (m, op), ms in total.most_common(n)]


def format_top_ops(rows) -> str:
    lines = [f"{'ms':>9} {'calls':>6}  module / op"]
    lines += [f"{ms:9.2f} {c:6d}  {m} / {op}" for m, op, ms, c in rows]
    return "\n".join(lines)
