"""The attention's new-rows kernel on the device (kernels_pallas/attention_rows.py, `check_new_rows`): the queries
into the causal attention kernel's rows with their positions, and the keys and values into the KV caches, in one
launch, against its reference (XLA's sums of the q | gate, k and v products' K partials, q_norm and k_norm, RoPE,
the regrouping into the attention kernel's rows and the caches' dynamic-update-slices) at small shapes and at the
real models' heads (27B 24 / 4, 35B-A3B 16 / 2, 122B-A10B and 397B-A17B 32 / 2; head_dim 256, rotary 64) for a
decode step and a k = 3 verify, with the K partials the quantized decode kernels hand on (27B: q_proj 14 at one
row, 8 at 4; k_proj / v_proj 14), an fp8 cache among them. Timed beside the reference in a loop that carries the
caches, as the decode loop does (so that both write them in place). The bytes are the partials (1.4 MB of q's at
27B's decode): the figure is mostly a launch and its tail, what every attention layer pays a step."""

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.attention_rows import new_rows_pallas, new_rows_reference
from kernels_pallas.causal_attention import kernel_plan

from .budget import out_of_time
from .common import max_rel, one_line
from .timing import time_loop

# (label, B, T, nh, nkv, hd, rotary, Sq, Skv partials, dtype, cache dtype)
NEW_ROWS_SMOKE = [("small", 2, 3, 4, 2, 32, 10, 2, 3, "float32", "float32")]
NEW_ROWS_SMALL = NEW_ROWS_SMOKE + [("small", 1, 4, 6, 2, 64, 16, 1, 1, "bfloat16", "bfloat16"),
                                   ("small fp8 cache", 2, 4, 6, 2, 64, 16, 3, 2, "bfloat16", "float8_e4m3fn")]
NEW_ROWS_REAL = [("27B decode", 1, 1, 24, 4, 256, 64, 14, 14, "bfloat16", "bfloat16"),
                 ("27B verify k3", 1, 4, 24, 4, 256, 64, 8, 14, "bfloat16", "bfloat16"),
                 ("27B verify k3 fp8 cache", 1, 4, 24, 4, 256, 64, 8, 14, "bfloat16", "float8_e4m3fn"),
                 ("35B-A3B decode", 1, 1, 16, 2, 256, 64, 4, 4, "bfloat16", "bfloat16"),
                 ("122B-A10B decode", 1, 1, 32, 2, 256, 64, 6, 6, "bfloat16", "bfloat16"),
                 ("27B decode batch 8", 8, 1, 24, 4, 256, 64, 14, 14, "bfloat16", "bfloat16")]
SLOTS = 4096


def _inputs(rng, B, T, nh, nkv, hd, Sq, Skv, dtype, kv):
    """q_parts, q_norm, kv_parts (k's and v's partials [Skv, 2, B T, nkv hd]), k_norm, k_cache, v_cache, start."""
    parts = lambda *s: jnp.asarray(rng.standard_normal(s) * 2 / np.sqrt(s[0]), jnp.float32)
    norm = lambda: jnp.asarray(0.3 * rng.standard_normal(hd), jnp.float32).astype(dtype)
    cache = lambda: jnp.asarray(rng.standard_normal((B, SLOTS, nkv, hd)), jnp.float32).astype(kv)
    start = jnp.asarray(rng.integers(0, SLOTS - T + 1, B), jnp.int32)
    return parts(Sq, B * T, nh * 2 * hd), norm(), parts(Skv, 2, B * T, nkv * hd), norm(), cache(), cache(), start


def _time_carried(f, args, n=50):
    """Seconds per call of f over n calls in one compiled loop that carries the caches from call to call, as the
    decode loop does (a loop handing the kernel the same caches each call would have XLA copy them first), and
    the queries and positions too, so that XLA computes them every call: timing.time_loop's best of 3 runs."""
    q, qn, kv, kn, kc, vc, start = args

    @jax.jit
    def loop(kc, vc):
        first = f(q, qn, kv, kn, kc, vc, start)
        return jax.lax.fori_loop(1, n, lambda _, c: f(q, qn, kv, kn, c[2], c[3], start), first)

    return time_loop(loop, (kc, vc), n)


def check_new_rows(cases, interpret, timings):
    """Each case's kernel against the reference (the queries and the keys within 1e-5 in f32, at bf16's rounding
    in bf16; the positions, the values and every other slot exactly); with timings, both timed. Returns the
    failures."""
    failures = 0
    for i, (name, B, T, nh, nkv, hd, rd, Sq, Skv, dtype, kv) in enumerate(cases):
        label = f"attention new rows {name} B{B} T{T} heads {nh}/{nkv}x{hd} rotary {rd} S{Sq}/{Skv} {dtype} {kv}"
        if out_of_time(f"{label} and the rest"):
            break
        args = _inputs(np.random.default_rng(i), B, T, nh, nkv, hd, Sq, Skv, jnp.dtype(dtype), jnp.dtype(kv))
        p = kernel_plan((B, T, nh, hd), dtype, args[4])
        kw = dict(offset=0, rows=p.row_tile * p.row_tiles, rotary_dim=rd, theta=1e7, eps=1e-6, dtype=jnp.dtype(dtype))
        kern = jax.jit(lambda *a: new_rows_pallas(*a, interpret=interpret, **kw))
        ref = jax.jit(lambda *a: new_rows_reference(*a, **kw))
        f32 = lambda a: np.asarray(a.astype(jnp.float32))
        try:
            (q, qpos, kc, vc), (want, want_pos, want_k, want_v) = kern(*args), ref(*args)
            rel = max(max_rel(f32(q), f32(want)), max_rel(f32(kc), f32(want_k)))
            exact = bool((np.asarray(qpos) == np.asarray(want_pos)).all()) and np.array_equal(
                np.asarray(vc).view(np.uint8), np.asarray(want_v).view(np.uint8))
        except Exception as e:  # noqa: BLE001 - one case that does not compile or run must not hide the others
            print(f"{label}: FAIL {one_line(e)}", flush=True)
            failures += 1
            continue
        ok = rel < (1e-5 if dtype == "float32" else 2e-2) and exact and np.isfinite(f32(q)).all()
        failures += not ok
        line = f"{label}: grid ({B}, {nkv}, {kw['rows']}), max_rel {rel:.1e}, positions and values exact {exact} " \
               f"{'OK' if ok else 'FAIL'}"
        if timings:
            t_k, t_r = _time_carried(kern, args), _time_carried(ref, args)
            nbytes = args[0].nbytes + args[2].nbytes
            line += (f"; {nbytes / 1e6:.2f} MB of partials; kernel {1e6 * t_k:.1f} us, XLA reference "
                     f"{1e6 * t_r:.1f} us, kernel/XLA {t_k / t_r:.2f}x")
        print(line, flush=True)
    return failures
