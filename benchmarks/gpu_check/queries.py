"""The attention queries' kernel on the device (kernels_pallas/attention_q.py, `check_queries`): the kernel against
its reference (XLA's sum of the q | gate product's K partials, the query slice, q_norm, RoPE, the regrouping into
the causal attention kernel's rows and their positions) at small shapes and at the real models' heads (27B 24 / 4,
35B-A3B 16 / 2, 122B-A10B and 397B-A17B 32 / 2; head_dim 256, rotary 64) for a decode step and a k = 3 verify,
with the K partials the quantized decode kernels hand on (27B q_proj: 14 at one row, 8 at 4), timed beside the
reference, which XLA runs as three kernels. The bytes are the partials (f32 S x rows x nh 2 hd: 1.4 MB at 27B's
decode): the figure is mostly a launch and its tail, what every attention layer pays a step."""

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.attention_q import queries_grouped_pallas, queries_grouped_reference
from kernels_pallas.causal_attention import kernel_plan

from .budget import out_of_time
from .common import max_rel, one_line
from .timing import time_call

# (label, B, T, nh, nkv, hd, rotary, S partials, dtype)
QUERIES_SMOKE = [("small", 2, 3, 4, 2, 32, 10, 2, "float32")]
QUERIES_SMALL = QUERIES_SMOKE + [("small", 1, 4, 6, 2, 64, 16, 1, "bfloat16")]
QUERIES_REAL = [("27B decode", 1, 1, 24, 4, 256, 64, 14, "bfloat16"), ("27B verify k3", 1, 4, 24, 4, 256, 64, 8,
                                                                        "bfloat16"),
                ("35B-A3B decode", 1, 1, 16, 2, 256, 64, 4, "bfloat16"),
                ("122B-A10B decode", 1, 1, 32, 2, 256, 64, 6, "bfloat16"),
                ("27B decode batch 8", 8, 1, 24, 4, 256, 64, 14, "bfloat16")]


def check_queries(cases, interpret, timings):
    """Each case's kernel against the reference (the queries within 1e-5 in f32, at bf16's rounding in bf16; the
    positions exactly); with timings, both timed. Returns the failures."""
    failures = 0
    for i, (name, B, T, nh, nkv, hd, rd, S, dtype) in enumerate(cases):
        label = f"attention queries {name} B{B} T{T} heads {nh}/{nkv}x{hd} rotary {rd} S{S} {dtype}"
        if out_of_time(f"{label} and the rest"):
            break
        rng = np.random.default_rng(i)
        parts = jnp.asarray(rng.standard_normal((S, B * T, nh * 2 * hd)) * 2 / np.sqrt(S), jnp.float32)
        w = jnp.asarray(0.3 * rng.standard_normal(hd), jnp.float32).astype(dtype)
        start = jnp.asarray(rng.integers(0, 1 << 20, B), jnp.int32)
        p = kernel_plan((B, T, nh, hd), dtype, jax.ShapeDtypeStruct((B, 4096, nkv, hd), dtype))
        kw = dict(offset=0, num_kv_heads=nkv, rows=p.row_tile * p.row_tiles, rotary_dim=rd, theta=1e7, eps=1e-6,
                  dtype=jnp.dtype(dtype))
        kern = jax.jit(lambda parts, w, s: queries_grouped_pallas(parts, w, s, interpret=interpret, **kw))
        ref = jax.jit(lambda parts, w, s: queries_grouped_reference(parts, w, s, **kw))
        try:
            (q, qpos), (want, want_pos) = kern(parts, w, start), ref(parts, w, start)
            rel = max_rel(np.asarray(q.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
            same_pos = bool((np.asarray(qpos) == np.asarray(want_pos)).all())
        except Exception as e:  # noqa: BLE001 - one case that does not compile or run must not hide the others
            print(f"{label}: FAIL {one_line(e)}", flush=True)
            failures += 1
            continue
        ok = rel < (1e-5 if dtype == "float32" else 2e-2) and same_pos and np.isfinite(np.asarray(q, np.float32)).all()
        failures += not ok
        line = f"{label}: grid ({B}, {nkv}, {kw['rows']}), max_rel {rel:.1e}, positions {same_pos} " \
               f"{'OK' if ok else 'FAIL'}"
        if timings:
            t_k, t_r = time_call(kern, parts, w, start), time_call(ref, parts, w, start)
            line += (f"; {parts.nbytes / 1e6:.2f} MB of partials; kernel {1e6 * t_k:.1f} us, XLA reference "
                     f"{1e6 * t_r:.1f} us, kernel/XLA {t_k / t_r:.2f}x")
        print(line, flush=True)
    return failures
