"""The RMSNorm row kernel on the device (kernels_pallas/rmsnorm.py, `check_rmsnorm`): the kernel against its
reference (the trunk's RMSNorm in XLA ops) at small shapes and at the real hidden sizes (27B 5120, 35B-A3B 2048,
122B-A10B 3072, 397B-A17B 4096) for one decode row, timed beside the reference, which XLA runs as a reduce and an
elementwise kernel. The bytes are a few KB: the figure is a launch and its tail, what the trunk's input and final
norms pay once a layer at one row. One row again with pad_row (the row and its two rows, a layer's input norm
before a padded product: forward.PADDED_INPUT)."""

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.rmsnorm import rmsnorm_reference, rmsnorm_rows_pallas

from .budget import out_of_time
from .common import max_rel, one_line
from .timing import time_call

# (rows, hidden, dtype)
NORM_SMOKE = [(1, 1000, "float32")]
NORM_SMALL = NORM_SMOKE + [(3, 640, "bfloat16"), (1, 2048, "float16")]
NORM_REAL = [(1, H, "bfloat16") for H in (5120, 2048, 3072, 4096)]


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
