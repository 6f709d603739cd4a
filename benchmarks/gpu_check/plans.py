"""Plan alternatives (`sweep`): one decode kernel at each launch plan quant_gemv.alternatives lists (a lane's
4-byte words per row x K's parts), each checked against the reference and, with timings, timed, on one line
that names the fastest and how far the plan's own choice is from it. The plan's constants (TARGET_PROGRAMS,
MAX_PARTIAL_TRAFFIC, vector_words, the grouped kernel's one word a lane at few pairs) come from sm_90
instruction counts on a CPU host (benchmarks/sm90_estimates.py), not from a GPU: this is how a GPU run settles
them."""

import jax.numpy as jnp
import numpy as np

from .common import max_rel, one_line
from .timing import time_call


def name_of(words, splits, grid):
    return (f"{words} word{'s' * (words > 1)} a lane, {splits} K part{'s' * (splits > 1)} "
            f"(grid {tuple(grid)})")


def sweep(alternatives, make, args, want, *, tol, timings, nbytes, bw, device):
    """alternatives: quant_gemv.alternatives' [(words, splits, Plan, own)]; make(words, splits) -> (a jitted fn
    of args, its grid). Returns (failures, the line's parts)."""
    failures, times, parts, own_name = 0, {}, [], None
    for words, splits, _, own in alternatives:
        try:
            fn, grid = make(words, splits)
            name = name_of(words, splits, grid)
            own_name = name if own else own_name
            rel = max_rel(np.asarray(fn(*args).astype(jnp.float32)), want)
            if not rel < tol:
                raise AssertionError(f"max_rel {rel:.1e} over {tol:.0e}")
            if timings:
                times[name] = time_call(fn, *args)
            else:
                parts.append(f"{name} max_rel {rel:.1e} OK")
        except Exception as e:  # noqa: BLE001 - an alternative that fails is named, the others still run
            parts.append(f"{words} words, {splits} K parts: FAIL {one_line(e, 160)}")
            failures += 1
    if times:
        fastest = min(times, key=times.get)
        for name, t in times.items():
            frac = f", {100 * nbytes / t / bw:.0f}% of {device}'s HBM" if bw else ""
            parts.append(f"{name}{' [plan]' if name == own_name else ''} {1e6 * t:.1f} us "
                         f"({nbytes / t / 1e9:.0f} GB/s{frac})")
        verdict = "as the plan chooses" if fastest == own_name else (
            f"the plan's choice takes {times[own_name] / times[fastest]:.2f}x its time: quant_gemv_plan.plan should "
            "follow" if own_name in times else "the plan's own choice did not run")
        parts.append(f"fastest: {fastest}, {verdict}")
    return failures, parts
