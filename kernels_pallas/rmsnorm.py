"""Qwen3.5's RMSNorm of a decode row as one kernel: a Pallas kernel beside its pure-JAX reference (same
signature).

    rmsnorm_rows(x, w, *, eps, pad_row=False) -> y
      x  [..., H]   rows (any leading shape), f32 / bf16 / f16
      w  [H]        the norm's weight; the scale is (1 + w)
      y  [..., H]   x * rsqrt(mean(x^2) + eps) * (1 + w), computed in f32, in x's dtype
      pad_row       x [B, 1, .., 1, H] -> (y, y2): y2 [B + 1, 1, .., 1, H] the rows again and a row of zeros,
                    what ops.linear hands a plain weight on cuda (ops.two_rows), written by the same kernel

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


def rmsnorm_reference(x, w, *, eps: float, pad_row: bool = False):
    """x * rsqrt(mean(x^2) + eps) * (1 + w), computed in f32, cast back to x's dtype (Qwen3.5's RMSNorm); pad_row:
    a row of zeros after them (the module doc)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
    return (y, jnp.concatenate([y, jnp.zeros_like(y[:1])])) if pad_row else y


def check_inputs(x, w, pad_row: bool = False) -> None:
    """ValueError naming what is wrong when the arrays are not rows and their norm's weight."""
    if x.ndim < 1 or w.ndim != 1 or w.shape[0] != x.shape[-1]:
        raise ValueError(f"rmsnorm_rows takes x [..., H] and w [H]; found x {list(x.shape)}, w {list(w.shape)}")
    if pad_row and (x.ndim < 2 or math.prod(x.shape[1:-1]) != 1):
        raise ValueError(f"rmsnorm_rows(pad_row=True) takes x [B, 1, .., 1, H] (a zero row after the B rows); "
                         f"found x {list(x.shape)}")


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


def norm_and_store(x, w_ref, y_refs, *, r, rows: int, H: int, HP: int, eps: float) -> None:
    """Program r's part of a row kernel: x [HP] (float32, row min(r, rows - 1), lanes past H zero) normed with
    w_ref's weight, stored as row r of each of y_refs [n, H] in their dtype. pad_row: the rows go to both outputs
    and the program past them (r = rows) writes the second one's zero row. add_rmsnorm.py's kernel ends with it
    too."""
    ok = jnp.arange(HP, dtype=jnp.int32) < H
    w = plt.load(w_ref.at[pl.ds(0, HP)], mask=ok, other=0).astype(jnp.float32)
    y = (x * jax.lax.rsqrt(jnp.sum(x * x) / H + eps) * (1.0 + w)).astype(y_refs[0].dtype)
    for y_ref in y_refs:
        n = y_ref.shape[0]
        plt.store(y_ref.at[jnp.minimum(r, n - 1), pl.ds(0, HP)], jnp.where(r < rows, y, 0), mask=ok & (r < n))


def _kernel(x_ref, w_ref, *y_refs, H, HP, eps, rows):
    r = pl.program_id(0)
    ok = jnp.arange(HP, dtype=jnp.int32) < H
    x = plt.load(x_ref.at[jnp.minimum(r, rows - 1), pl.ds(0, HP)], mask=ok, other=0).astype(jnp.float32)
    norm_and_store(x, w_ref, y_refs, r=r, rows=rows, H=H, HP=HP, eps=eps)


@functools.partial(jax.jit, static_argnames=("eps", "pad_row", "num_warps", "interpret"))
def rmsnorm_rows_pallas(x, w, *, eps: float, pad_row: bool = False, num_warps: int = NUM_WARPS,
                        interpret: bool = False):
    """The Pallas kernel; one program per row (and one for pad_row's zero row). Inputs must pass check_inputs and
    unsupported_reason."""
    H = x.shape[-1]
    rows = x.reshape(math.prod(x.shape[:-1]), H)
    R = rows.shape[0]
    HP = max(16, 1 << (H - 1).bit_length())
    whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * len(a.shape))  # each program indexes in place
    out = [jax.ShapeDtypeStruct((R, H), x.dtype)] + [jax.ShapeDtypeStruct((R + 1, H), x.dtype)] * pad_row
    ys = pl.pallas_call(
        functools.partial(_kernel, H=H, HP=HP, eps=eps, rows=R),
        grid=(R + pad_row,),
        in_specs=[whole(rows), whole(w)],
        out_specs=[whole(o) for o in out],
        out_shape=out,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="rmsnorm_rows",
    )(rows, w)
    if pad_row:
        return ys[0].reshape(x.shape), ys[1].reshape((x.shape[0] + 1, *x.shape[1:]))
    return ys[0].reshape(x.shape)


def rmsnorm_rows(x, w, *, eps: float, pad_row: bool = False, backend: str = "auto", interpret: bool = False):
    """The kernel in a program lowered for cuda, the reference elsewhere (dispatch.run); see the module doc."""
    check_inputs(x, w, pad_row)
    kernel = functools.partial(rmsnorm_rows_pallas, eps=eps, pad_row=pad_row, interpret=interpret)
    reference = functools.partial(rmsnorm_reference, eps=eps, pad_row=pad_row)
    return dispatch.run("RMSNorm rows", kernel, reference, unsupported_reason(x, w), backend, x, w)
