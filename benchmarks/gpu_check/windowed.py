"""Items 1-3: the windowed (Wind-MTP ring) attention kernel against its pure-JAX reference at the test shapes and
at real Qwen3.5 draft shapes, timed beside the reference and tokamax.dot_product_attention where installed."""

import jax
import jax.numpy as jnp
import numpy as np
from kernels_pallas.windowed_attention import (
    plan,
    unsupported_reason,
    windowed_attend_pallas,
    windowed_attend_reference,
)

from .budget import out_of_time
from .common import bandwidth, max_rel, one_line
from .timing import checked_time, time_call

# (B, T, nkv, G, hd, sinks, window, k, starts, dtype, parts): test shapes, then real Qwen3.5 draft shapes
SMALL = [(1, 1, 2, 1, 16, 0, 4, 1, [3], "float32", None), (2, 4, 2, 6, 16, 4, 16, 3, [1000, 19], "float32", 3),
         (1, 7, 1, 1, 64, 0, 5, 6, [77], "float32", None), (1, 9, 1, 16, 256, 4, 24, 8, [100], "float32", 2)]
REAL = [(1, 1, 4, 6, 256, 64, 4032, 7, [100_000], "bfloat16", None),      # 27B draft step
        (1, 8, 4, 6, 256, 64, 4032, 7, [100_000], "bfloat16", None),      # 27B refill, k = 7
        (8, 1, 2, 8, 256, 64, 4032, 7, [50_000 + 997 * i for i in range(8)], "bfloat16", None),  # 35B-A3B, B 8
        (4, 9, 2, 16, 256, 128, 8192, 8, [3000, 70, 9040, 99_999], "bfloat16", None),  # 397B refill k 8, W 8192
        (1, 1, 4, 6, 256, 64, 4032, 7, [100_000], "bfloat16", 1),         # the 27B step without the split
        (1, 1, 4, 6, 256, 64, 4032, 7, [100_000], "float32", None),
        # an fp8 ring (generate(kv_dtype="float8_e4m3fn")): the 27B step and refill, read as e4m3, bf16 math
        (1, 1, 4, 6, 256, 64, 4032, 7, [100_000], "bfloat16", None, "float8_e4m3fn"),
        (1, 8, 4, 6, 256, 64, 4032, 7, [100_000], "bfloat16", None, "float8_e4m3fn")]
# a small fp8-ring case for every form of the check (the 12th field: the ring's dtype, default q's)
SMALL += [(2, 4, 2, 6, 16, 4, 16, 3, [1000, 19], "bfloat16", 3, "float8_e4m3fn")]


def _tokamax_times(args, W, S, want, impls=("mosaic", "triton", "cudnn", "xla")):
    """tokamax.dot_product_attention on [ring ; new rows] with the Wind-MTP mask: seconds per call for each
    implementation that takes the case and matches our reference, else why not. {} without tokamax."""
    try:
        import tokamax
    except ImportError:
        return {}
    except Exception as e:  # noqa: BLE001 - installed but broken (a dependency of another version): say why
        return {"import": f"not used ({one_line(e)})"}
    from kernels_pallas.ring_layout import window_mask

    q, rk, rv, nk, nv, start = args
    T, L = q.shape[1], rk.shape[1]
    mask = window_mask(start, T, W, S, L - S)[:, None]  # [B, 1, T, L + T]
    keys, vals = jnp.concatenate([rk, nk], 1), jnp.concatenate([rv, nv], 1)
    out = {}
    for impl in impls:
        fn = jax.jit(lambda q, k, v, m, impl=impl: tokamax.dot_product_attention(
            q, k, v, mask=m, implementation=impl, precision=jax.lax.Precision.HIGHEST))
        try:
            out[impl] = checked_time(fn, want, q, keys, vals, mask)
        except Exception as e:  # an implementation that does not take the case says why, in one line
            out[impl] = f"not used ({one_line(e, 120)})"
    return out


def check_kernels(cases, interpret, timings):
    rng = np.random.default_rng(0)
    kind, bw = bandwidth()
    failures = 0
    for case in cases:
        if out_of_time(f"windowed attention case {case[:8]} and the rest"):
            break
        B, T, nkv, G, hd, S, W, k, starts, dtype, parts = case[:11]
        kv = jnp.dtype(case[11] if len(case) > 11 else dtype)
        L = S + W + k
        dt = jnp.dtype(dtype)
        f = lambda *s, d=dt: jnp.asarray(rng.standard_normal(s), jnp.float32).astype(d)
        q = f(B, T, nkv * G, hd)
        rk, rv, nk, nv = f(B, L, nkv, hd, d=kv), f(B, L, nkv, hd, d=kv), f(B, T, nkv, hd, d=kv), f(B, T, nkv, hd, d=kv)
        if kv != dt:
            dtype = f"{dtype} q, {kv.name} ring"
        start = jnp.asarray(starts, jnp.int32)
        assert unsupported_reason(q, rk, nk, S) is None
        kern = jax.jit(lambda *a: windowed_attend_pallas(*a, W, S, num_splits=parts, interpret=interpret))
        ref = jax.jit(lambda *a: windowed_attend_reference(*a, W, S))
        a = (q, rk, rv, nk, nv, start)
        want = np.asarray(ref(*a).astype(jnp.float32))
        try:
            got = np.asarray(kern(*a).astype(jnp.float32))
        except Exception as e:  # one case that does not compile or run must not hide the others
            print(f"B{B} T{T} kv{nkv} G{G} hd{hd} S{S} W{W} {dtype}: FAIL {type(e).__name__}: {e}", flush=True)
            failures += 1
            continue
        rel = max_rel(got, want)
        tol = 1e-4 if dt == jnp.float32 else 2e-2
        ok = rel < tol and np.isfinite(got).all()
        failures += not ok
        p = plan(B, T, nkv * G, nkv, hd, L, dt.itemsize, num_splits=parts, kv_itemsize=kv.itemsize)
        line = (f"B{B} T{T} kv{nkv} G{G} hd{hd} S{S} W{W} {dtype}: grid ({B},{nkv},{p.row_tiles},{p.splits}) "
                f"block_k {p.block_k} warps {p.num_warps} stages {p.num_stages}, "
                f"max_rel {rel:.1e} {'OK' if ok else 'FAIL'}")
        if timings:
            t_k, t_r = time_call(kern, *a), time_call(ref, *a)
            baseline = _tokamax_times(a, W, S, want)
            nbytes = kv.itemsize * (2 * B * L * nkv * hd + 2 * B * T * nkv * hd) + dt.itemsize * 2 * B * T * nkv * G * hd
            gbs = nbytes / t_k / 1e9
            frac = f" = {100 * nbytes / t_k / bw:.0f}% of {kind}'s {bw / 1e12:.2f} TB/s" if bw else ""
            line += (f"; kernel {1e6 * t_k:.1f} us ({gbs:.0f} GB/s{frac}), reference {1e6 * t_r:.1f} us, "
                     f"kernel/reference {t_k / t_r:.2f}x")
            for impl, t_or_why in baseline.items():
                line += (f"; tokamax {impl} {1e6 * t_or_why:.1f} us (kernel/tokamax {t_k / t_or_why:.2f}x)"
                         if isinstance(t_or_why, float) else f"; tokamax {impl}: {t_or_why}")
        print(line, flush=True)
    return failures
