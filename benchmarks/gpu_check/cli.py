"""The command line: its flags, and which sections each form runs in which order (`main`, the exit code)."""

import argparse
import sys
import time

import jax

from . import budget
from .budget import section, summary
from .causal import CAUSAL_LONG, CAUSAL_SMALL, check_causal
from .e2e_27b import check_end_to_end_27b
from .end_to_end import check_end_to_end
from .gate_up import GATE_UP_REAL, GATE_UP_SMALL, GATE_UP_SMOKE, check_gate_up
from .gdn import GDN_REAL, GDN_SMALL, check_gdn
from .long_context import check_long_context_27b
from .moe import (
    MOE_PLANS_REAL,
    MOE_PLANS_SMOKE,
    MOE_PREFILL_REAL,
    MOE_PREFILL_SMOKE,
    MOE_REAL,
    MOE_SMALL,
    MOE_SMOKE,
    check_moe,
    check_moe_plans,
    check_moe_prefill,
)
from .moe_swiglu import (
    SHARED_REAL,
    SHARED_SMOKE,
    SWIGLU_REAL,
    SWIGLU_SMALL,
    SWIGLU_SMOKE,
    check_moe_swiglu,
)
from .quant import (
    QUANT_PLANS_REAL,
    QUANT_PLANS_SMOKE,
    QUANT_REAL,
    QUANT_SMALL,
    QUANT_SMOKE,
    check_quant,
    check_quant_plans,
)
from .norms import (ADD_NORM_REAL, ADD_NORM_SMALL, ADD_NORM_SMOKE, NORM_REAL, NORM_SMALL, NORM_SMOKE, check_add_rmsnorm,
                    check_rmsnorm)
from .new_rows import NEW_ROWS_REAL, NEW_ROWS_SMALL, NEW_ROWS_SMOKE, check_new_rows
from .rollback import ROLLBACK_REAL, ROLLBACK_SMALL, ROLLBACK_SMOKE, check_rollback
from .router import ROUTER_REAL, ROUTER_SMALL, ROUTER_SMOKE, check_router
from .tensor_parallel import check_tensor_parallel
from .windowed import REAL, SMALL, check_kernels


def main(argv=None):
    ap = argparse.ArgumentParser(description=sys.modules[__package__].__doc__.split("\n\n")[0])
    ap.add_argument("--interpret", action="store_true", help="kernels in interpret mode (CPU smoke test)")
    ap.add_argument("--max-new", type=int, default=128, help="new tokens per end-to-end run")
    ap.add_argument("--quant-only", action="store_true",
                    help="only the quantized-matmul checks (item 5); the --*-only flags combine: each part named runs, "
                         "in the order quant, moe, gdn, long, tp, e2e27b")
    ap.add_argument("--long-only", action="store_true", help="only the causal attention checks (item 8)")
    ap.add_argument("--moe-only", action="store_true",
                    help="only the MoE checks (item 10): routed experts at decode, grouped at prefill, the router's "
                         "top-k")
    ap.add_argument("--gdn-only", action="store_true",
                    help="only the GDN decode step and verify kernel checks (gdn.py), the RMSNorm row (norms.py), "
                         "the residual add + norm (norms.py), the attention's new-rows kernel (new_rows.py) and the "
                         "GDN rollback (rollback.py)")
    ap.add_argument("--tp-only", action="store_true", help="only the tensor-parallel check (item 6)")
    ap.add_argument("--e2e27b-only", action="store_true",
                    help="only the end-to-end timing on the Qwen3.5-27B slice (item 7; on CPU a small config)")
    ap.add_argument("--e2e27b-layers", type=int, default=4,
                    help="layers of the item 7 slice on a GPU (default 4, one 3 GDN : 1 attention period)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds: parts and cases not started by then are skipped and named (a lease is short); "
                         "the full GPU run then also prefills the 27B slice at 128K and 1M while time is left")
    ap.add_argument("--long-contexts", default="131072,1048576",
                    help="contexts of the end-to-end long-context run (item 8), comma separated")
    args = ap.parse_args(argv)
    if args.e2e27b_layers < 1:
        ap.error(f"--e2e27b-layers: expected an integer >= 1, found {args.e2e27b_layers}")
    if args.budget is not None and args.budget <= 0:
        ap.error(f"--budget: expected seconds > 0, found {args.budget}")
    try:
        contexts = tuple(int(c) for c in args.long_contexts.split(","))
        assert all(c > 0 for c in contexts)
    except (ValueError, AssertionError):
        ap.error(f"--long-contexts: expected positive integers separated by commas, found {args.long_contexts!r}")
    print("backend:", jax.default_backend(), jax.devices(), "jax", jax.__version__, flush=True)
    t0 = time.perf_counter()
    budget.set_deadline(t0, args.budget)
    try:
        return _run(args, t0, contexts)
    finally:  # the --budget is this run's: a later call in the same process (the tests) starts without it
        budget.set_deadline(t0, None)


def _run(args, t0, contexts):
    """The checks `args` select, in order, each one section; returns the summary's exit code."""
    results = []
    sec = lambda name, fn, min_left=0.0: section(results, name, fn, min_left=min_left)
    interp = args.interpret
    parts = [name for name in ("quant", "moe", "gdn", "long", "tp", "e2e27b") if getattr(args, f"{name}_only")]
    if parts:  # the --*-only flags combine (one command on a short lease): the numerics of every part named, then
        # the timed sections, parts in the order quant, moe, gdn, long, tp, e2e27b
        small = {"quant": [("quantized matmul, small",
                            lambda: check_quant(QUANT_SMOKE if interp else QUANT_SMALL, interp, False)),
                           ("decode kernel plan alternatives, small",
                            lambda: check_quant_plans(QUANT_PLANS_SMOKE, interp, False)),
                           ("dense gate / up in one launch, small",
                            lambda: check_gate_up(GATE_UP_SMOKE if interp else GATE_UP_SMALL, interp, False))],
                 "moe": [("MoE routed experts, small",
                          lambda: check_moe(MOE_SMOKE if interp else MOE_SMALL, interp, False)),
                         ("MoE experts' SwiGLU, small",
                          lambda: check_moe_swiglu(SWIGLU_SMOKE if interp else SWIGLU_SMALL, interp, False)),
                         ("MoE experts and the shared expert, small",
                          lambda: check_moe_swiglu(SHARED_SMOKE, interp, False, shared=True)),
                         ("MoE router top-k, small",
                          lambda: check_router(ROUTER_SMOKE if interp else ROUTER_SMALL, interp, False)),
                         ("MoE prefill paths, small", lambda: check_moe_prefill(MOE_PREFILL_SMOKE, interp, False)),
                         ("MoE routed plan alternatives, small",
                          lambda: check_moe_plans(MOE_PLANS_SMOKE, interp, False))],
                 "gdn": [("GDN step and verify, small", lambda: check_gdn(GDN_SMALL, interp, timings=False)),
                         ("RMSNorm rows, small",
                          lambda: check_rmsnorm(NORM_SMOKE if interp else NORM_SMALL, interp, False)),
                         ("residual add + RMSNorm rows, small",
                          lambda: check_add_rmsnorm(ADD_NORM_SMOKE if interp else ADD_NORM_SMALL, interp, False)),
                         ("attention new rows, small",
                          lambda: check_new_rows(NEW_ROWS_SMOKE if interp else NEW_ROWS_SMALL, interp, False)),
                         ("GDN rollback, small",
                          lambda: check_rollback(ROLLBACK_SMOKE if interp else ROLLBACK_SMALL, interp, False))],
                 "long": [("causal attention, small", lambda: check_causal(CAUSAL_SMALL, interp, timings=False))]}
        timed = {"quant": [("quantized matmul, 27B matrices, timed", lambda: check_quant(QUANT_REAL, False, True)),
                           ("dense gate / up in one launch, 27B and 35B-A3B shared expert, timed",
                            lambda: check_gate_up(GATE_UP_REAL, False, True)),
                           ("decode kernel plan alternatives, 27B matrices, timed",
                            lambda: check_quant_plans(QUANT_PLANS_REAL, False, timings=True))],
                 "moe": [("MoE routed experts, 35B-A3B experts, timed", lambda: check_moe(MOE_REAL, False, True)),
                         ("MoE experts' SwiGLU, 35B-A3B experts, timed",
                          lambda: check_moe_swiglu(SWIGLU_REAL, False, True)),
                         ("MoE experts and the shared expert, 35B-A3B, timed",
                          lambda: check_moe_swiglu(SHARED_REAL, False, True, shared=True)),
                         ("MoE router top-k, real routers, timed", lambda: check_router(ROUTER_REAL, False, True)),
                         ("MoE routed plan alternatives, 35B-A3B experts, timed",
                          lambda: check_moe_plans(MOE_PLANS_REAL, False, timings=True)),
                         ("MoE prefill paths, 35B-A3B experts, timed",
                          lambda: check_moe_prefill(MOE_PREFILL_REAL, False, timings=True))],
                 "gdn": [("GDN step and verify, real shapes, timed", lambda: check_gdn(GDN_REAL, False, True)),
                         ("RMSNorm rows, real hidden sizes, timed", lambda: check_rmsnorm(NORM_REAL, False, True)),
                         ("residual add + RMSNorm rows, real hidden sizes, timed",
                          lambda: check_add_rmsnorm(ADD_NORM_REAL, False, True)),
                         ("attention new rows, real heads, timed", lambda: check_new_rows(NEW_ROWS_REAL, False, True)),
                         ("GDN rollback, real layers, timed", lambda: check_rollback(ROLLBACK_REAL, False, True))],
                 "long": [("causal attention, 27B long caches, timed",
                           lambda: check_causal(CAUSAL_LONG, False, timings=True)),
                          ("long context end to end, 27B slice", lambda: check_long_context_27b(contexts=contexts))],
                 "tp": [("tensor parallel", lambda: check_tensor_parallel(args.max_new))],
                 "e2e27b": [("end to end, 27B slice",
                             lambda: check_end_to_end_27b(args.max_new, args.e2e27b_layers))]}
        for name in parts:
            for title, fn in small.get(name, []):
                sec(title, fn)
        # the first timed section of every part named, then the rest (plan sweeps, prefill, the long prefill): a
        # --budget cuts the sweeps before a part's main timings; in the --interpret smoke form only the parts that
        # run on CPU (tp, e2e27b)
        timed = {name: timed[name] if not interp or name in ("tp", "e2e27b") else [] for name in parts}
        for first in (True, False):
            for name in parts:
                for title, fn in timed[name][:1] if first else timed[name][1:]:
                    sec(title, fn)
        return summary(results, t0)
    if interp:  # the CPU smoke form: the first and the fp8-ring case; the kernel tests cover the rest
        sec("windowed attention, small", lambda: check_kernels([SMALL[0], SMALL[-1]], True, timings=False))
        sec("causal attention, small", lambda: check_causal(CAUSAL_SMALL[:1], True, timings=False))
        sec("GDN step and verify, small", lambda: check_gdn(GDN_SMALL[:2], True, timings=False))
        sec("RMSNorm rows, small", lambda: check_rmsnorm(NORM_SMOKE, True, timings=False))
        sec("residual add + RMSNorm rows, small", lambda: check_add_rmsnorm(ADD_NORM_SMOKE, True, timings=False))
        sec("attention new rows, small", lambda: check_new_rows(NEW_ROWS_SMOKE, True, timings=False))
        sec("GDN rollback, small", lambda: check_rollback(ROLLBACK_SMOKE, True, timings=False))
        sec("quantized matmul, small", lambda: check_quant(QUANT_SMOKE, True, timings=False))
        sec("dense gate / up in one launch, small", lambda: check_gate_up(GATE_UP_SMOKE, True, timings=False))
        sec("end to end, shipped model", lambda: check_end_to_end(args.max_new, thorough=False))
        sec("tensor parallel", lambda: check_tensor_parallel(args.max_new))
        print("end to end 27B slice: skipped in the --interpret smoke form (its compiles would cost CI "
              "seconds; `--e2e27b-only` runs it, on CPU at a small config)", flush=True)
        return summary(results, t0)
    # on the device: every kernel's numerics first (what must be fixed before anything else), then the end to end
    # token equality with the kernels in the program, then the timings, the costliest last
    sec("windowed attention, small", lambda: check_kernels(SMALL, False, timings=False))
    sec("causal attention, small", lambda: check_causal(CAUSAL_SMALL, False, timings=False))
    sec("GDN step and verify, small", lambda: check_gdn(GDN_SMALL, False, timings=False))
    sec("RMSNorm rows, small", lambda: check_rmsnorm(NORM_SMALL, False, timings=False))
    sec("residual add + RMSNorm rows, small", lambda: check_add_rmsnorm(ADD_NORM_SMALL, False, timings=False))
    sec("attention new rows, small", lambda: check_new_rows(NEW_ROWS_SMALL, False, timings=False))
    sec("GDN rollback, small", lambda: check_rollback(ROLLBACK_SMALL, False, timings=False))
    sec("quantized matmul, small", lambda: check_quant(QUANT_SMALL, False, timings=False))
    sec("decode kernel plan alternatives, small", lambda: check_quant_plans(QUANT_PLANS_SMOKE, False, timings=False))
    sec("dense gate / up in one launch, small", lambda: check_gate_up(GATE_UP_SMALL, False, timings=False))
    sec("MoE routed experts, small", lambda: check_moe(MOE_SMALL, False, timings=False))
    sec("MoE experts' SwiGLU, small", lambda: check_moe_swiglu(SWIGLU_SMALL, False, timings=False))
    sec("MoE experts and the shared expert, small",
        lambda: check_moe_swiglu(SHARED_SMOKE, False, timings=False, shared=True))
    sec("MoE router top-k, small", lambda: check_router(ROUTER_SMALL, False, timings=False))
    sec("MoE prefill paths, small", lambda: check_moe_prefill(MOE_PREFILL_SMOKE, False, timings=False))
    sec("MoE routed plan alternatives, small", lambda: check_moe_plans(MOE_PLANS_SMOKE, False, timings=False))
    sec("windowed attention, real shapes, timed", lambda: check_kernels(REAL, False, timings=True))
    sec("causal attention, 27B long caches, timed", lambda: check_causal(CAUSAL_LONG, False, timings=True))
    sec("GDN step and verify, real shapes, timed", lambda: check_gdn(GDN_REAL, False, timings=True))
    sec("RMSNorm rows, real hidden sizes, timed", lambda: check_rmsnorm(NORM_REAL, False, timings=True))
    sec("residual add + RMSNorm rows, real hidden sizes, timed",
        lambda: check_add_rmsnorm(ADD_NORM_REAL, False, timings=True))
    sec("attention new rows, real heads, timed", lambda: check_new_rows(NEW_ROWS_REAL, False, timings=True))
    sec("GDN rollback, real layers, timed", lambda: check_rollback(ROLLBACK_REAL, False, timings=True))
    sec("end to end, shipped model", lambda: check_end_to_end(args.max_new, thorough=True))
    sec("tensor parallel", lambda: check_tensor_parallel(args.max_new))
    sec("end to end, 27B slice", lambda: check_end_to_end_27b(args.max_new, args.e2e27b_layers))
    sec("quantized matmul, 27B matrices, timed", lambda: check_quant(QUANT_REAL, False, timings=True))
    sec("dense gate / up in one launch, 27B and 35B-A3B shared expert, timed",
        lambda: check_gate_up(GATE_UP_REAL, False, timings=True))
    sec("MoE routed experts, 35B-A3B experts, timed", lambda: check_moe(MOE_REAL, False, timings=True))
    sec("MoE experts' SwiGLU, 35B-A3B experts, timed", lambda: check_moe_swiglu(SWIGLU_REAL, False, timings=True))
    sec("MoE experts and the shared expert, 35B-A3B, timed",
        lambda: check_moe_swiglu(SHARED_REAL, False, timings=True, shared=True))
    sec("MoE router top-k, real routers, timed", lambda: check_router(ROUTER_REAL, False, timings=True))
    sec("decode kernel plan alternatives, 27B matrices, timed",
        lambda: check_quant_plans(QUANT_PLANS_REAL, False, timings=True))
    sec("MoE routed plan alternatives, 35B-A3B experts, timed",
        lambda: check_moe_plans(MOE_PLANS_REAL, False, timings=True))
    sec("MoE prefill paths, 35B-A3B experts, timed", lambda: check_moe_prefill(MOE_PREFILL_REAL, False, timings=True))
    if args.budget is not None:  # the long-context prefill only where a budget says how long the lease is
        sec("long context end to end, 27B slice", lambda: check_long_context_27b(contexts=contexts), min_left=60)
    return summary(results, t0)
