"""Qwen3.5's RMSNorm of a decode row as one kernel: a Pallas kernel beside its pure-JAX reference (same
signature).

    rmsnorm_rows(x, w, *, eps) -> y
      x  [..., H]   rows (any leading shape), f32 / bf16 / f16
      w  [H]        the norm's weight; the scale is (1 + w)
      y  [..., H]   x * rsqrt(mean(x^2) + eps) * (1 + w), computed in f32, in x's dtype

The reference is the trunk's RMSNorm (qwen_mtp/trunk/ops.rmsnorm_1pw calls it: CPU programs are unchanged). The
kernel computes the same in f32; its sum of squares adds in another order, so f32 results agree to a few units
of f32 rounding and bf16 / f16 ones to their rounding.

Why a kernel: compiled for a GPU, XLA runs the norm of one row as a reduce kernel and, where the normed row must
be written out (a GDN layer's in-projections take it out of an optimization barrier, gdn.in_projections; the
final norm hands it to lm_head and the MTP head), an elementwise kernel after it: two kernels where one program
per row (the row in one block of lanes, H <= 16384) does both. trunk/forward.py uses it for a layer's input norm
and the final norm at one row, where it saves a kernel a GDN layer (docs/on-a-gpu.md); at several rows XLA fuses
the normalisation into the products that read it, and there the kernel would cost kernels, not save them.

Backend: kernels_pallas/dispatch.py's rule (the kernel in a program lowered for cuda, the reference elsewhere;
backend="pallas" with interpret=True runs the kernel on a CPU, as the tests do). Rows the kernel does not take
(`unsupported_reason`) fall back to the reference with a one-time warning.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas import dispatch

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_HIDDEN = 16384  # lanes of one program's row (Qwen3.5: 2048 .. 5120)
NUM_WARPS = 8


def rmsnorm_reference(x, w, *, eps: float):
    """x * rsqrt(mean(x^2) + eps) * (1 + w), computed in f32, cast back to x's dtype (Qwen3.5's RMSNorm)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def check_inputs(x, w) -> None:
    """ValueError naming what is wrong when the arrays are not rows and their norm's weight."""
    if x.ndim < 1 or w.ndim != 1 or w.shape[0] != x.shape[-1]:
        raise ValueError(f"rmsnorm_rows takes x [..., H] and w [H]; found x {list(x.shape)}, w {list(w.shape)}")


def unsupported_reason(x, w):
    """None if the kernel takes these rows, else why not (the caller falls back to the reference)."""
    H = x.shape[-1]
    if jnp.dtype(x.dtype) not in {jnp.dtype(d) for d in DTYPES}:
        return f"rows of dtype {jnp.dtype(x.dtype)}: the kernel takes float32 / bfloat16 / float16"
    if jnp.dtype(w.dtype) not in {jnp.dtype(d) for d in DTYPES}:
        return f"a weight of dtype {jnp.dtype(w.dtype)}: the kernel takes float32 / bfloat16 / float16"
    if not 1 <= H <= MAX_HIDDEN:
        return f"rows of {H}: one program's row holds 1 .. {MAX_HIDDEN}"
    if x.size == 0:
        return "no rows"
    return None


def _kernel(x_ref, w_ref, y_ref, *, H, HP, eps):
    r = pl.program_id(0)
    lanes = jnp.arange(HP, dtype=jnp.int32)
    ok = lanes < H
    x = plt.load(x_ref.at[r, pl.ds(0, HP)], mask=ok, other=0).astype(jnp.float32)
    w = plt.load(w_ref.at[pl.ds(0, HP)], mask=ok, other=0).astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.sum(x * x) / H + eps)
    plt.store(y_ref.at[r, pl.ds(0, HP)], (y * (1.0 + w)).astype(y_ref.dtype), mask=ok)


@functools.partial(jax.jit, static_argnames=("eps", "num_warps", "interpret"))
def rmsnorm_rows_pallas(x, w, *, eps: float, num_warps: int = NUM_WARPS, interpret: bool = False):
    """The Pallas kernel; one program per row. Inputs must pass check_inputs and unsupported_reason."""
    H = x.shape[-1]
    rows = x.reshape(math.prod(x.shape[:-1]), H)
    HP = max(16, 1 << (H - 1).bit_length())
    whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)  # each program indexes in place
    y = pl.pallas_call(
        functools.partial(_kernel, H=H, HP=HP, eps=eps),
        grid=(rows.shape[0],),
        in_specs=[whole(rows), whole(w)],
        out_specs=whole(rows),
        out_shape=jax.ShapeDtypeStruct(rows.shape, x.dtype),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="rmsnorm_rows",
    )(rows, w)
    return y.reshape(x.shape)


def rmsnorm_rows(x, w, *, eps: float, backend: str = "auto", interpret: bool = False):
    """The kernel in a program lowered for cuda, the reference elsewhere (dispatch.run); see the module doc."""
    check_inputs(x, w)
    kernel = functools.partial(rmsnorm_rows_pallas, eps=eps, interpret=interpret)
    reference = functools.partial(rmsnorm_reference, eps=eps)
    return dispatch.run("RMSNorm rows", kernel, reference, unsupported_reason(x, w), backend, x, w)
