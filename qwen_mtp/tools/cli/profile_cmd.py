"""`python -m qwen_mtp profile`: trace generate calls and print each phase's time read back from the trace
(tools/profiling.py does the tracing and reading)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from qwen_mtp.errors import ArgumentError
from qwen_mtp.loading.folder import default_model_path, load_tokenizer

XPROF_PORT = 8791  # xprof's default web port


def cmd_profile(args) -> int:
    """Trace `--repeats` generate calls (prefill, then plain steps or speculative rounds) into --logdir, each in a
    step marker, and print the time of each phase and stage read back from the trace (profiling.py)."""
    from qwen_mtp import load
    from qwen_mtp.decoding.speculative import SpecConfig
    from qwen_mtp.tools.profiling import (
        format_phase_table,
        format_top_ops,
        profile_generate,
        top_ops,
        trace_files,
    )

    path = Path(args.model) if args.model else default_model_path()
    model = load(path)
    tok = load_tokenizer(path)
    ids = np.asarray(tok.encode(args.prompt).ids, np.int32)
    if ids.size == 0:
        raise ArgumentError("prompt", "text of at least one token", repr(args.prompt))
    spec = None if args.no_spec else SpecConfig(k=args.k, window=args.window, sinks=args.sinks)
    if spec is not None and not model.has_mtp:
        raise ArgumentError("--model", "a checkpoint with an MTP head, or --no-spec", f"{path} without mtp.*")
    logdir = Path(args.logdir)
    where = "the default ./traces" if args.logdir == "traces" else "--logdir"
    print(f"tracing {args.repeats} generate call(s) into {logdir.resolve()} ({where}; created if missing)",
          flush=True)
    t = time.perf_counter()
    r, texts, rows, calls = profile_generate(model, ids, args.max_new_tokens, logdir, repeats=args.repeats,
                                             spec=spec, kv_dtype=args.kv_dtype)
    print(r.stats.summary())
    loop = next(iter(calls))
    what = "round" if spec is not None else "plain decode step"
    print(f"\n{len(texts)} programs compiled, {args.repeats} calls traced in {time.perf_counter() - t:.1f}s; self "
          f"time per phase and stage over the traced calls ({loop}: ms per {what})")
    print(format_phase_table(rows, calls))
    print("\ntop ops\n" + format_top_ops(top_ops(logdir, args.top, texts)))
    run = trace_files(logdir)["run"]
    print(f"\ntrace: {run}\nopen it: pip install xprof && xprof --logdir {logdir} --port {XPROF_PORT}, then "
          f"http://localhost:{XPROF_PORT}/ (Trace Viewer; on a GPU also Overview, HLO Op Profile, Roofline). xprof "
          "listens on every network interface: use it on a trusted machine or through an SSH tunnel.")
    return 0
