"""A layer's residual add and the RMSNorm after it as one kernel (vLLM's fused_add_rms_norm), the product added
from its K partials. A Pallas kernel beside its pure-JAX reference (same signature).

    add_rmsnorm_rows(x, parts, w, *, eps, pad_row=False) -> (x_new, y) | (x_new, y, y2)
      x      [R, H]      the residual stream's rows, f32 / bf16 / f16
      parts  [S, R, H]   the product to add (a mixer's out-projection): S >= 2 float32 K partials of the decode
                         kernel (quant.linear_parts), or the product itself (S = 1)
      w      [H]         the norm's weight; the scale is (1 + w)
      x_new  [R, H]      x + the product (the partials' sum rounded to x's dtype, as ops.linear's), in x's dtype
      y      [R, H]      rmsnorm_reference of x_new, in x's dtype
      pad_row            (one row) y2 [2, H]: the row again and a row of zeros, rmsnorm.py's two rows

The reference is the layer as it was: x + the product, then rmsnorm.py's reference, so a program lowered for cpu
computes the same numbers (off cuda the partials are the product and zeros). The kernel adds in f32 and rounds,
as XLA does a bf16 add; it sums the partials and the squares in other orders than the reference, so f32 results
agree to a few units of f32 rounding and bf16 / f16 ones to their rounding (from one part x_new is the
reference's bits).

Why a kernel: compiled for a GPU, a layer's residual add after its mixer was a kernel of its own (XLA sums the
out-projection's K partials in it) and the norm before the MLP another (rmsnorm.py's at one row; at a verify's
rows, where quantized products read the normed rows, XLA's reduce and write): one program per row now reads the
partials and the residual row, writes the new residual row and its norm. forward.decoder_layer runs it where the
MLP's products are quantized (forward.post_norm) at decode and verify rows (under a mesh at one row);
dispatch.py's rule picks the backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas import dispatch
from kernels_pallas.rmsnorm import DTYPES, MAX_HIDDEN, NUM_WARPS, norm_and_store, rmsnorm_reference
from kernels_pallas.split_k import product_of

MAX_ROWS = 64  # decode and verify rows (a prefill's norm is XLA's, folded into its products)


def add_rmsnorm_reference(x, parts, w, *, eps: float, pad_row: bool = False):
    """x + the product (product_of the partials in x's dtype), then rmsnorm_reference of it (the module doc)."""
    x_new = x + product_of(parts, x.dtype).reshape(x.shape)
    y = rmsnorm_reference(x_new, w, eps=eps, pad_row=pad_row)
    return (x_new, *y) if pad_row else (x_new, y)


def check_inputs(x, parts, w, pad_row: bool = False) -> None:
    """ValueError naming what is wrong when the arrays are not rows, a product's partials of them and a norm's
    weight."""
    if x.ndim != 2 or w.shape != (x.shape[-1],) or parts.ndim != 3 or parts.shape[1:] != x.shape:
        raise ValueError(f"add_rmsnorm_rows takes x [R, H], parts [S, R, H] and w [H]; found x {list(x.shape)}, "
                         f"parts {list(parts.shape)}, w {list(w.shape)}")
    if pad_row and x.shape[0] != 1:
        raise ValueError(f"add_rmsnorm_rows(pad_row=True) takes one row (a zero row after it); found x "
                         f"{list(x.shape)}")


def rows_reason(named, x, rows: str = "decode and verify rows"):
    """None if the named arrays ((name, array), ...) are of the kernels' dtypes and x [R, H] rows one program a
    row holds, R of them at most MAX_ROWS; else why not (this kernel's and moe_add_rmsnorm.py's)."""
    for name, a in named:
        if jnp.dtype(a.dtype) not in {jnp.dtype(d) for d in DTYPES}:
            return f"{name} of dtype {jnp.dtype(a.dtype)}: the kernel takes float32 / bfloat16 / float16"
    R, H = x.shape
    if not 1 <= H <= MAX_HIDDEN:
        return f"rows of {H}: one program's row holds 1 .. {MAX_HIDDEN}"
    if not 1 <= R <= MAX_ROWS:
        return f"{R} rows: the kernel takes 1 .. {MAX_ROWS} ({rows})"
    return None


def unsupported_reason(x, parts, w):
    """None if the kernel takes these arrays, else why not (the caller falls back to the reference)."""
    return rows_reason((("rows", x), ("product", parts), ("weight", w)), x)


def _kernel(x_ref, p_ref, w_ref, xo_ref, *y_refs, S, H, HP, eps, rows):
    r = pl.program_id(0)
    row = jnp.minimum(r, rows - 1)
    ok = jnp.arange(HP, dtype=jnp.int32) < H
    load = lambda ref: plt.load(ref, mask=ok, other=0).astype(jnp.float32)
    dt = xo_ref.dtype
    # the partials in order, in a loop (a dense MLP's down hands up to ~100 at one row: 27B int8)
    h = jax.lax.fori_loop(0, S, lambda s, acc: acc + load(p_ref.at[s, row, pl.ds(0, HP)]),
                          jnp.zeros((HP,), jnp.float32))
    h = h.astype(dt).astype(jnp.float32)
    x = (load(x_ref.at[row, pl.ds(0, HP)]) + h).astype(dt)
    plt.store(xo_ref.at[row, pl.ds(0, HP)], x, mask=ok & (r < rows))
    norm_and_store(x.astype(jnp.float32), w_ref, y_refs, r=r, rows=rows, H=H, HP=HP, eps=eps)


@functools.partial(jax.jit, static_argnames=("eps", "pad_row", "num_warps", "interpret"))
def add_rmsnorm_rows_pallas(x, parts, w, *, eps: float, pad_row: bool = False, num_warps: int = NUM_WARPS,
                            interpret: bool = False):
    """The Pallas kernel; one program per row (and one for pad_row's zero row). Inputs must pass check_inputs and
    unsupported_reason."""
    R, H = x.shape
    HP = max(16, 1 << (H - 1).bit_length())
    whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * len(a.shape))  # each program indexes in place
    out = [jax.ShapeDtypeStruct((R, H), x.dtype)] * 2 + [jax.ShapeDtypeStruct((R + 1, H), x.dtype)] * pad_row
    return tuple(pl.pallas_call(
        functools.partial(_kernel, S=parts.shape[0], H=H, HP=HP, eps=eps, rows=R),
        grid=(R + pad_row,),
        in_specs=[whole(a) for a in (x, parts, w)],
        out_specs=[whole(o) for o in out],
        out_shape=out,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="add_rmsnorm_rows",
    )(x, parts, w))


def add_rmsnorm_rows(x, parts, w, *, eps: float, pad_row: bool = False, backend: str = "auto",
                     interpret: bool = False):
    """The kernel in a program lowered for cuda, the reference elsewhere (dispatch.run); see the module doc."""
    check_inputs(x, parts, w, pad_row)
    kernel = functools.partial(add_rmsnorm_rows_pallas, eps=eps, pad_row=pad_row, interpret=interpret)
    reference = functools.partial(add_rmsnorm_reference, eps=eps, pad_row=pad_row)
    return dispatch.run("residual add and RMSNorm rows", kernel, reference, unsupported_reason(x, parts, w), backend,
                        x, parts, w)
