"""GPU check of the Pallas kernels: compiled for the device (not interpret mode), against their pure-JAX
references, with timings. One short script for a lent accelerator; never part of CI.

    python benchmarks/gpu_check.py            # on a GPU machine
    python benchmarks/gpu_check.py --interpret  # the same checks in interpret mode, on CPU (smoke test)
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.windowed_attention import unsupported_reason, windowed_attend_pallas, windowed_attend_reference

# (B, T, nkv, G, hd, sinks, window, k, starts): the test shapes plus realistic Qwen3.5 draft shapes
CASES = [(1, 1, 2, 1, 16, 0, 4, 1, [3]), (2, 4, 2, 6, 16, 4, 16, 3, [1000, 19]), (1, 7, 1, 1, 64, 0, 5, 6, [77]),
         (1, 1, 2, 8, 256, 64, 4032, 7, [100_000]), (8, 8, 2, 8, 256, 64, 4032, 7, [50_000 + 997 * i for i in range(8)]),
         (4, 4, 4, 4, 128, 16, 1024, 3, [3000, 70, 1040, 9999])]


def _time(f, *a, n=20):
    f(*a).block_until_ready()
    t = time.perf_counter()
    for _ in range(n):
        out = f(*a)
    out.block_until_ready()
    return 1e3 * (time.perf_counter() - t) / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--interpret", action="store_true")
    args = ap.parse_args()
    print("backend:", jax.default_backend(), jax.devices())
    rng = np.random.default_rng(0)
    worst = 0.0
    for B, T, nkv, G, hd, S, W, k, starts in CASES:
        if args.interpret and hd * (S + W) > 200_000:
            continue  # the big shapes are for the device
        L = S + W + k
        f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
        q, rk, rv, nk, nv = f(B, T, nkv * G, hd), f(B, L, nkv, hd), f(B, L, nkv, hd), f(B, T, nkv, hd), f(B, T, nkv, hd)
        start = jnp.asarray(starts, jnp.int32)
        assert unsupported_reason(q, rk, nk, S) is None
        kern = jax.jit(lambda *a: windowed_attend_pallas(*a, W, S, interpret=args.interpret))
        ref = jax.jit(lambda *a: windowed_attend_reference(*a, W, S))
        a = (q, rk, rv, nk, nv, start)
        got, want = np.asarray(kern(*a)), np.asarray(ref(*a))
        rel = float(np.abs(got - want).max() / np.abs(want).max())
        worst = max(worst, rel)
        print(f"B{B} T{T} kv{nkv} G{G} hd{hd} S{S} W{W}: max_rel {rel:.1e}; kernel {_time(kern, *a):.3f} ms, "
              f"reference {_time(ref, *a):.3f} ms")
    print(f"worst max_rel {worst:.1e}: {'OK' if worst < 1e-4 else 'FAIL'}")


if __name__ == "__main__":
    main()
