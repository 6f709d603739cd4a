"""The RMSNorm row kernel on the device (kernels_pallas/rmsnorm.py, `check_rmsnorm`): the kernel against its
reference (the trunk's RMSNorm in XLA ops) at small shapes and at the real hidden sizes (27B 5120, 35B-A3B 2048,
122B-A10B 3072, 397B-A17B 4096) for one decode row, timed beside the reference, which XLA runs as a reduce and an
elementwise kernel. The bytes are a few KB: the figure is a launch and its tail, what the trunk's input and final
norms pay once a layer at one row. One row again with pad_row (the row and its two rows, a layer's input norm
before a padded product: forward.PADDED_INPUT). Then the residual add and norm kernel (kernels_pallas/add_rmsnorm.py,
`check_add_rmsnorm`): the out-projection's K partials added to the residual rows and normed, at a decode row (16
partials, 27B int4's out_proj; 46, its MLP's down) and a verify's 4 rows, timed beside XLA's add (the partials' sum
in it) and norm; and the MoE block's (kernels_pallas/moe_add_rmsnorm.py): its pairs' and shared expert's rows from
down's partials, combined by the router's weights and the shared gate, added and normed at one row (35B-A3B,
122B-A10B, 397B-A17B), timed beside XLA's combine, add and norm."""

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.add_rmsnorm import add_rmsnorm_reference, add_rmsnorm_rows_pallas
from kernels_pallas.moe_add_rmsnorm import moe_add_rmsnorm_reference, moe_add_rmsnorm_rows_pallas
from kernels_pallas.rmsnorm import rmsnorm_reference, rmsnorm_rows_pallas

from .budget import out_of_time
from .common import max_rel, one_line
from .timing import time_call

# (rows, hidden, dtype)
NORM_SMOKE = [(1, 1000, "float32")]
NORM_SMALL = NORM_SMOKE + [(3, 640, "bfloat16"), (1, 2048, "float16")]
NORM_REAL = [(1, H, "bfloat16") for H in (5120, 2048, 3072, 4096)]
# (rows, hidden, K partials, dtype[, k: a MoE block's pairs a row, moe_add_rmsnorm.py])
ADD_NORM_SMOKE = [(1, 1000, 3, "float32"), (1, 1000, 2, "float32", 8)]
ADD_NORM_SMALL = ADD_NORM_SMOKE + [(4, 640, 8, "bfloat16"), (1, 2048, 1, "float16"), (2, 640, 1, "bfloat16", 3)]
ADD_NORM_REAL = [(1, H, 16, "bfloat16") for H in (5120, 2048, 3072, 4096)] + [(4, 5120, 8, "bfloat16")] + \
    [(1, 5120, 46, "bfloat16"), (4, 5120, 20, "bfloat16")] + \
    [(1, H, 2, "bfloat16", k) for H, k in ((2048, 8), (3072, 8), (4096, 10))]  # 27B int4's down; MoE blocks


def check_rmsnorm(cases, interpret, timings):
    """Each case's kernel against the reference (f32 within 1e-5, bf16 / f16 at their rounding); with timings, both
    timed. Returns the failures."""
    failures = 0
    for i, (R, H, dtype) in enumerate(cases):
        label = f"RMSNorm rows R{R} H{H} {dtype}"
        if out_of_time(f"{label} and the rest"):
            break
        rng = np.random.default_rng(i)
        x = jnp.asarray(rng.standard_normal((R, H)) * 3, jnp.float32).astype(dtype)
        w = jnp.asarray(0.3 * rng.standard_normal(H), jnp.float32).astype(dtype)
        kern = jax.jit(lambda x, w: rmsnorm_rows_pallas(x, w, eps=1e-6, interpret=interpret))
        ref = jax.jit(lambda x, w: rmsnorm_reference(x, w, eps=1e-6))
        try:
            got = np.asarray(kern(x, w).astype(jnp.float32))
            want = np.asarray(ref(x, w).astype(jnp.float32))
        except Exception as e:  # noqa: BLE001 - one case that does not compile or run must not hide the others
            print(f"{label}: FAIL {one_line(e)}", flush=True)
            failures += 1
            continue
        rel = max_rel(got, want)
        ok = rel < (1e-5 if dtype == "float32" else 2e-2) and np.isfinite(got).all()
        failures += not ok
        line = f"{label}: grid ({R},), max_rel {rel:.1e} {'OK' if ok else 'FAIL'}"
        if timings:
            t_k, t_r = time_call(kern, x, w), time_call(ref, x, w)
            line += f"; kernel {1e6 * t_k:.1f} us, XLA reference {1e6 * t_r:.1f} us, kernel/XLA {t_k / t_r:.2f}x"
        print(line, flush=True)
        if R == 1:
            failures += _padded(label, x, w, interpret, timings)
    return failures


def _padded(label, x, w, interpret, timings):
    """pad_row (a layer's input norm at one row, forward.PADDED_INPUT): the row and its two rows, the second a row
    of zeros, against the reference's; with timings beside the reference (XLA's norm, then its pad)."""
    kern = jax.jit(lambda x, w: rmsnorm_rows_pallas(x, w, eps=1e-6, pad_row=True, interpret=interpret))
    ref = jax.jit(lambda x, w: rmsnorm_reference(x, w, eps=1e-6, pad_row=True))
    try:
        (y, y2), (r, r2) = kern(x, w), ref(x, w)
        rel = max(max_rel(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
                  for a, b in ((y, r), (y2, r2)))
        ok = rel < (1e-5 if x.dtype == jnp.float32 else 2e-2) and not np.asarray(y2[-1], np.float32).any()
    except Exception as e:  # noqa: BLE001 - one case that does not compile or run must not hide the others
        print(f"{label} pad_row: FAIL {one_line(e)}", flush=True)
        return 1
    line = f"{label} pad_row (the row and its two rows): max_rel {rel:.1e} {'OK' if ok else 'FAIL'}"
    if timings:
        t_k, t_r = time_call(kern, x, w), time_call(ref, x, w)
        line += f"; kernel {1e6 * t_k:.1f} us, XLA reference {1e6 * t_r:.1f} us, kernel/XLA {t_k / t_r:.2f}x"
    print(line, flush=True)
    return 0 if ok else 1


def _add_norm_case(i, case, interpret):
    """(label, kernel, reference, args) of one case: (R, H, S, dtype) the residual add and norm kernel from S K
    partials; (R, H, S, dtype, k) the MoE one from down's S partials of R k + R pairs' and shared rows."""
    R, H, S, dtype, *moe = case
    rng = np.random.default_rng(i)
    rows = lambda n, scale=1.0: jnp.asarray(rng.standard_normal((n, H)) * scale, jnp.float32).astype(dtype)
    x, w = rows(R, 3.0), jnp.asarray(0.3 * rng.standard_normal(H), jnp.float32).astype(dtype)
    if not moe:
        parts = jnp.asarray(rng.standard_normal((S, R, H)), jnp.float32)
        return (f"residual add + RMSNorm rows R{R} H{H} from {S} K partials {dtype}",
                jax.jit(lambda *a: add_rmsnorm_rows_pallas(*a, eps=1e-6, interpret=interpret)),
                jax.jit(lambda *a: add_rmsnorm_reference(*a, eps=1e-6)),
                (x, parts if S > 1 else parts.astype(dtype), w))
    k = moe[0]
    parts = jnp.asarray(rng.standard_normal((S, R * k + R, H)), jnp.float32)
    top_v = jnp.asarray(rng.uniform(0.01, 0.3, (R, k)), jnp.float32)
    h, wg = rows(R), jnp.asarray(rng.standard_normal((H, 1)) / np.sqrt(H), jnp.float32).astype(dtype)
    logit = jnp.einsum("rh,ho->ro", h, wg, preferred_element_type=jnp.float32)  # (as mlp.moe's, ops.linear_wide)
    kw = dict(eps=1e-6, norm_topk=True)
    return (f"MoE combine + residual add + RMSNorm rows R{R} H{H} k{k} from {S} K partials {dtype}",
            jax.jit(lambda *a: moe_add_rmsnorm_rows_pallas(*a, **kw, interpret=interpret)),
            jax.jit(lambda *a: moe_add_rmsnorm_reference(*a, **kw)),
            (x, parts if S > 1 else parts.astype(dtype), top_v, (logit, h, wg), w))


def check_add_rmsnorm(cases, interpret, timings):
    """Each case's kernel (_add_norm_case: add_rmsnorm.py's, or moe_add_rmsnorm.py's where the case names k
    pairs) against the reference (the new residual rows and their norm: f32 within 1e-5, bf16 / f16 at their
    rounding); with timings, both timed. Returns the failures."""
    failures = 0
    for i, case in enumerate(cases):
        label, kern, ref, args = _add_norm_case(i, case, interpret)
        if out_of_time(f"{label} and the rest"):
            break
        try:
            got, want = kern(*args), ref(*args)
            rel = max(max_rel(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
                      for a, b in zip(got, want))
        except Exception as e:  # noqa: BLE001 - one case that does not compile or run must not hide the others
            print(f"{label}: FAIL {one_line(e)}", flush=True)
            failures += 1
            continue
        ok = rel < (1e-5 if case[3] == "float32" else 2e-2) and all(np.isfinite(np.asarray(a, np.float32)).all()
                                                                     for a in got)
        failures += not ok
        line = f"{label}: grid ({case[0]},), max_rel {rel:.1e} {'OK' if ok else 'FAIL'}"
        if timings:
            t_k, t_r = time_call(kern, *args), time_call(ref, *args)
            line += f"; kernel {1e6 * t_k:.1f} us, XLA reference {1e6 * t_r:.1f} us, kernel/XLA {t_k / t_r:.2f}x"
        print(line, flush=True)
    return failures
