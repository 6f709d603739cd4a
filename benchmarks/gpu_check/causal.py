"""Item 8, the kernel: the causal attention kernel of the trunk and the native head against its blocked pure-JAX
reference at small shapes, then at Qwen3.5-27B's attention over 128K and 1M-slot caches, timed beside the
reference and cuDNN."""

import jax
import jax.numpy as jnp
import numpy as np

from .budget import out_of_time
from .common import bandwidth, max_rel, one_line
from .timing import checked_time, time_call

# causal attention (item 8): (B, T, nkv, G, hd, S, first query position per row, dtype, cache dtype, parts)
CAUSAL_SMALL = [(2, 5, 2, 2, 16, 100, [7, 90], "float32", None, 2), (1, 37, 1, 4, 32, 300, [200], "float32", None, 1),
                (2, 4, 2, 2, 16, 130, [3, 120], "bfloat16", "float8_e4m3fn", 2)]
K128, M1 = 131072, 1 << 20
CAUSAL_LONG = [(1, 256, 4, 6, 256, K128, [K128 - 256], "bfloat16", None, None),   # 27B prefill chunk, 128K
               (1, 256, 4, 6, 256, M1, [M1 - 256], "bfloat16", None, None),       # ... at the end of 1M
               (1, 1, 4, 6, 256, K128, [K128 - 1], "bfloat16", None, None),       # decode step, 128K
               (1, 1, 4, 6, 256, M1, [M1 - 1], "bfloat16", None, None),           # decode step, 1M
               (1, 9, 4, 6, 256, M1, [M1 - 9], "bfloat16", None, None),           # k = 8 verify, 1M
               (1, 1, 4, 6, 256, M1, [M1 - 1], "bfloat16", "float8_e4m3fn", None)]  # decode over an fp8 cache


def _cudnn_decode_time(q, k, v, q_pos, want):
    """jax.nn.dot_product_attention(implementation="cudnn") for one query per row over the first q_pos + 1 slots:
    seconds per call, or why it is not used."""
    lens = (q_pos[:, 0] + 1).astype(jnp.int32)
    fn = jax.jit(lambda q, k, v, n: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=n,
                                                                 implementation="cudnn"))
    try:
        return checked_time(fn, want, q, k.astype(q.dtype), v.astype(q.dtype), lens, n=20)
    except Exception as e:  # noqa: BLE001 - the library's refusal, in one line
        return f"not used ({one_line(e, 120)})"


def _cudnn_masked_time(q, k, v, q_pos, want):
    """jax.nn.dot_product_attention(implementation="cudnn") for T > 1 query rows at positions q_pos over the
    cache, the causal rule as an explicit boolean mask [B, 1, T, S] (cuDNN's own causal mask is aligned at the
    top left, not at each row's position): seconds per call, or why it is not used."""
    S = k.shape[1]
    mask = (jnp.arange(S)[None, None, None, :] <= q_pos[:, None, :, None])
    fn = jax.jit(lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m, implementation="cudnn"))
    try:
        return checked_time(fn, want, q, k.astype(q.dtype), v.astype(q.dtype), mask, n=20)
    except Exception as e:  # noqa: BLE001 - the library's refusal, in one line
        return f"not used ({one_line(e, 120)})"


def check_causal(cases, interpret, timings):
    from kernels_pallas import causal_attention as ca

    kind, bw = bandwidth()
    failures = 0
    for B, T, nkv, G, hd, S, starts, dtype, kv_dtype, parts in cases:
        if out_of_time(f"causal case B{B} T{T} S{S} and the rest"):
            break
        dt, kvd = jnp.dtype(dtype), jnp.dtype(kv_dtype or dtype)
        key = jax.random.PRNGKey(S + T)
        k1, k2, k3 = jax.random.split(key, 3)
        q = jax.random.normal(k1, (B, T, nkv * G, hd), jnp.float32).astype(dt)
        kc = jax.random.normal(k2, (B, S, nkv, hd), jnp.float32).astype(kvd)
        vc = jax.random.normal(k3, (B, S, nkv, hd), jnp.float32).astype(kvd)
        q_pos = jnp.asarray(np.asarray(starts)[:, None] + np.arange(T)[None], jnp.int32)
        label = f"causal B{B} T{T} kv{nkv} G{G} hd{hd} S{S} {dt.name}" + (f", {kvd.name} cache" if kv_dtype else "")
        assert ca.unsupported_reason(q, kc, q_pos) is None
        kern = jax.jit(lambda *a: ca.causal_attend_pallas(*a, num_splits=parts, interpret=interpret))
        ref = jax.jit(ca.causal_attend_reference)
        try:
            got = np.asarray(kern(q, kc, vc, q_pos).astype(jnp.float32))
            want = np.asarray(ref(q, kc, vc, q_pos).astype(jnp.float32))
        except Exception as e:  # one case that does not compile or run must not hide the others
            print(f"{label}: FAIL {type(e).__name__}: {e}", flush=True)
            failures += 1
            continue
        rel = max_rel(got, want)
        ok = rel < (1e-4 if dt == jnp.float32 else 2e-2) and np.isfinite(got).all()
        failures += not ok
        line = f"{label}: max_rel {rel:.1e} {'OK' if ok else 'FAIL'}"
        if timings:
            t_k, t_r = time_call(kern, q, kc, vc, q_pos, n=20), time_call(ref, q, kc, vc, q_pos, n=20)
            visible = int(q_pos.max()) + 1
            nbytes = kvd.itemsize * 2 * B * visible * nkv * hd + dt.itemsize * 2 * B * T * nkv * G * hd
            frac = f" = {100 * nbytes / t_k / bw:.0f}% of {kind}'s {bw / 1e12:.2f} TB/s" if bw else ""
            line += (f"; kernel {1e6 * t_k:.1f} us ({nbytes / t_k / 1e9:.0f} GB/s{frac}), reference (XLA, blocked) "
                     f"{1e6 * t_r:.1f} us, kernel/reference {t_k / t_r:.2f}x")
            flops = 4 * B * T * visible * nkv * G * hd
            line += f", kernel {flops / t_k / 1e12:.1f} TFLOP/s" if T > 1 else ""
            c = (_cudnn_decode_time if T == 1 else _cudnn_masked_time)(q, kc, vc, q_pos, want)
            line += (f"; cuDNN {1e6 * c:.1f} us (kernel/cuDNN {t_k / c:.2f}x)" if isinstance(c, float)
                     else f"; cuDNN: {c}")
        print(line, flush=True)
        del kc, vc
    return failures
