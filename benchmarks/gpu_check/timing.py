"""The device timer every section uses: n calls chained in one compiled loop (`chained`, timed by `time_call`), not
n dispatches from Python, whose ~40-60 us floor hid the small kernels in the first H200 run; `checked_time` times
a baseline only where its answer matches."""

import time

import jax
import jax.numpy as jnp
import numpy as np

from .common import max_rel


def chained(f, a, n):
    """A jitted loop of n calls of f, each call's first floating-point input made to depend on the previous
    call's output (it gets 0 times one value of that output added: XLA does not fold a float product with zero,
    which a NaN would break), so the calls can be neither hoisted out of the loop nor merged."""
    i = next((j for j, x in enumerate(a) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize > 1), None)
    if i is None:
        raise ValueError("time_call: no float16 / bfloat16 / float32 input to chain the calls through")

    def first_value(out):
        leaf = jax.tree.leaves(out)[0]
        return leaf.reshape(-1)[0].astype(jnp.float32)

    @jax.jit
    def loop(*a):
        def body(_, c):
            args = list(a)
            args[i] = a[i] + (0 * c).astype(a[i].dtype)
            return first_value(f(*args))
        return jax.lax.fori_loop(0, n, body, jnp.float32(0))

    return loop


def time_call(f, *a, n=50):
    """Seconds per call of f(*a) on the device, without the per-call dispatch: the n chained calls of
    `chained` in one compiled loop, the best of 3 runs of it. The first H200 run
    (benchmarks/results/h200-2026-12-04) timed separate calls, whose dispatch (about 40-60 us) hid every kernel
    faster than that."""
    return time_loop(chained(f, a, n), a, n)


def time_loop(loop, a, n):
    """Seconds per call of a compiled loop of n calls run on a: one run to compile it, then the best of 3."""
    jax.block_until_ready(loop(*a))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        jax.block_until_ready(loop(*a))
        best = min(best, time.perf_counter() - t)
    return best / n


def checked_time(fn, want, *a, n=50):
    """Seconds per call of fn(*a) (`time_call`) if its answer is within bf16 rounding of `want`, else why not: a
    baseline is timed only where it computes the same thing."""
    rel = max_rel(np.asarray(fn(*a).astype(jnp.float32)), want)
    return time_call(fn, *a, n=n) if rel < 2e-2 else f"wrong answer (max_rel {rel:.1e})"
