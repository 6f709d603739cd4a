"""A MoE block's output, the residual add after it and the next norm as one kernel at decode rows: the block's
combine (its k routed pairs weighted by the router, its shared expert by its gate), then add_rmsnorm.py's add
and norm. A Pallas kernel beside its pure-JAX reference (same signature).

    moe_add_rmsnorm_rows(x, parts, top_v, gate, w, *, eps, norm_topk, pad_row=False) -> (x_new, y[, y2])
      x      [R, H]            the residual stream's rows (R tokens), f32 / bf16 / f16
      parts  [S, R k + R, H]   the pairs' SwiGLU outputs (pair p = t k + j: token t with its j-th expert), then
                               each token's shared expert's, as moe_expert_mlp.py's down writes them: S float32 K
                               partials, or the rows themselves in x's dtype (S = 1)
      top_v  [R, k]            the router's top-k probabilities (float32), renormalised here where norm_topk
      gate   (logit, h, wg)    the shared expert's gate before its sigmoid: logit [R, 1] as XLA computed it (its
                               product in float32, rounded to x's dtype first as trunk/ops.linear rounds it, or
                               in x's dtype), which the reference reads; h [R' >= R, H] the block's input rows
                               (the first R; at one row the experts' two rows do) and wg [H, 1] the gate's plain
                               weight, from which the kernel computes it itself
      w      [H]               the norm's weight; the scale is (1 + w)
      x_new  [R, H]            x + the block's output (moe_combine), in x's dtype
      y      [R, H]            rmsnorm_reference of x_new; pad_row (one row): y2 [2, H], the row and a zero row

The reference is the block as trunk/mlp.moe computes it (router_weights, the gate's sigmoid, moe_combine: each
pair's output times its weight rounded to x's dtype, the k summed in f32 and rounded, plus the shared expert's
output times its gate, rounded), then the add and the norm as they were: a program lowered for cpu computes the
same numbers bit for bit. The kernel rounds at each of those steps to x's dtype, as the program says (XLA may
keep a result in f32 inside a fusion instead); its sums (the partials, the k pairs, the probabilities, the
squares) may add in other orders than XLA's and its sigmoid is its own, so f32 results agree to a few units of
f32 rounding, bf16 ones to their rounding.

Why a kernel: compiled for a GPU, at one decode row XLA ran the block's combine with the residual add as one
kernel and the next layer's input norm (rmsnorm.py's) as another. This kernel does both: it reads down's partials,
the router's probabilities, the block's input row and the gate's weight (handed the combine's pieces as XLA
computed them, XLA gave the router's weights, the gate's product and the partials' sum kernels of their own) and
writes the new residual row and its norm (35B-A3B: a kernel a MoE layer fewer). forward.decoder_layer runs it
where a MoE block's routed and shared experts come from one launch (mlp._routed_and_shared) at one row;
dispatch.py's rule picks the backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas import dispatch
from kernels_pallas.add_rmsnorm import rows_reason
from kernels_pallas.rmsnorm import NUM_WARPS, norm_and_store, rmsnorm_reference
from kernels_pallas.split_k import product_of


def router_weights(top_v, norm_topk: bool, dtype):
    """The router's weights of the pairs [R, k] in dtype (trunk/mlp.moe's): the top-k probabilities top_v
    (float32), renormalised to sum 1 over each token's k where norm_topk."""
    if norm_topk:
        top_v = top_v / jnp.sum(top_v, axis=-1, keepdims=True)
    return top_v.astype(dtype)


def moe_combine(y, own, top_p, gate, dtype):
    """A MoE block's output [R, H] in dtype (trunk/mlp.moe's) from its pairs' rows y [R k, H] and its shared
    expert's own [R, H]: the pairs weighted by top_p [R, k] and summed over each token's k in float32, rounded,
    plus own times its gate [R, 1]."""
    R, k = top_p.shape
    y = (y * top_p.reshape(-1, 1)).astype(jnp.float32)
    return y.reshape(R, k, -1).sum(axis=1).astype(dtype) + own * gate


def moe_add_rmsnorm_reference(x, parts, top_v, gate, w, *, eps: float, norm_topk: bool, pad_row: bool = False):
    """x + the block's output, then rmsnorm_reference of it (the module doc; the gate from its logit)."""
    R, k = top_v.shape
    logit = gate[0]
    both = product_of(parts, x.dtype)
    top_p, gate = router_weights(top_v, norm_topk, x.dtype), jax.nn.sigmoid(logit.astype(x.dtype))
    x_new = x + moe_combine(both[:R * k], both[R * k:], top_p, gate, x.dtype)
    y = rmsnorm_reference(x_new, w, eps=eps, pad_row=pad_row)
    return (x_new, *y) if pad_row else (x_new, y)


def check_inputs(x, parts, top_v, gate, w, pad_row: bool = False) -> None:
    """ValueError naming what is wrong when the arrays are not R rows, their block's pairs' and shared rows'
    partials, the router's probabilities, the shared gate's (logit, input rows, weight) and a norm's weight."""
    R, k = top_v.shape if top_v.ndim == 2 else (-1, 0)
    H = x.shape[-1]
    logit, h, wg = gate
    if x.ndim != 2 or R != x.shape[0] or parts.ndim != 3 or parts.shape[1:] != (R * k + R, H) or \
            logit.shape != (R, 1) or h.ndim != 2 or h.shape[0] < R or h.shape[1] != H or wg.shape != (H, 1) or \
            w.shape != (H,):
        raise ValueError(f"moe_add_rmsnorm_rows takes x [R, H], parts [S, R k + R, H], top_v [R, k], gate (logit "
                         f"[R, 1], h [>= R, H], wg [H, 1]) and w [H]; found x {list(x.shape)}, parts "
                         f"{list(parts.shape)}, top_v {list(top_v.shape)}, logit {list(logit.shape)}, h "
                         f"{list(h.shape)}, wg {list(wg.shape)}, w {list(w.shape)}")
    if pad_row and R != 1:
        raise ValueError(f"moe_add_rmsnorm_rows(pad_row=True) takes one row (a zero row after it); found x "
                         f"{list(x.shape)}")


def unsupported_reason(x, parts, top_v, gate, w):
    """None if the kernel takes these arrays, else why not (the caller falls back to the reference)."""
    logit, h, wg = gate
    reason = rows_reason((("rows", x), ("weight", w), ("gate's input rows", h), ("gate's weight", wg)), x,
                         "decode rows")
    if reason is None and jnp.dtype(parts.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(x.dtype)):
        reason = f"parts of dtype {jnp.dtype(parts.dtype)}: the kernel takes float32 partials or rows in x's dtype"
    if reason is None and (jnp.dtype(top_v.dtype) != jnp.float32 or
                           jnp.dtype(logit.dtype) not in (jnp.float32, jnp.dtype(x.dtype))):
        reason = (f"probabilities of dtype {jnp.dtype(top_v.dtype)} and a logit of {jnp.dtype(logit.dtype)}: the "
                  f"kernel takes float32, and float32 or x's dtype (mlp.moe's)")
    return reason


def _kernel(x_ref, parts_ref, v_ref, h_ref, wg_ref, w_ref, xo_ref, *y_refs, S, k, H, HP, eps, rows, norm_topk):
    r = pl.program_id(0)
    row = jnp.minimum(r, rows - 1)
    f32 = jnp.float32
    ok = jnp.arange(HP, dtype=jnp.int32) < H
    dt = xo_ref.dtype
    rnd = lambda v: v.astype(dt).astype(f32)  # an op's result in x's dtype, as XLA rounds each op
    load = lambda ref: plt.load(ref, mask=ok, other=0).astype(f32)
    both = lambda i: rnd(sum(load(parts_ref.at[jnp.int32(s), i, pl.ds(0, HP)]) for s in range(S)))
    prob = lambda j: v_ref[row * k + j].astype(f32)
    total = jax.lax.fori_loop(0, k, lambda j, t: t + prob(j), jnp.zeros((), f32)) if norm_topk else None
    weight = lambda j: rnd(prob(j) / total if norm_topk else prob(j))
    pair = lambda j, acc: acc + rnd(both(row * k + j) * weight(j))
    routed = rnd(jax.lax.fori_loop(0, k, pair, jnp.zeros((HP,), f32)))
    # the gate's product in f32 (its weight in x's dtype, as ops.linear casts it), rounded
    logit = rnd(jnp.sum(load(h_ref.at[row, pl.ds(0, HP)]) * rnd(load(wg_ref.at[pl.ds(0, HP)]))))
    gate = rnd(1.0 / (1.0 + jnp.exp(-logit)))
    x = rnd(load(x_ref.at[row, pl.ds(0, HP)]) + rnd(routed + rnd(both(rows * k + row) * gate)))
    plt.store(xo_ref.at[row, pl.ds(0, HP)], x.astype(dt), mask=ok & (r < rows))
    norm_and_store(x, w_ref, y_refs, r=r, rows=rows, H=H, HP=HP, eps=eps)


@functools.partial(jax.jit, static_argnames=("eps", "norm_topk", "pad_row", "num_warps", "interpret"))
def moe_add_rmsnorm_rows_pallas(x, parts, top_v, gate, w, *, eps: float, norm_topk: bool, pad_row: bool = False,
                                num_warps: int = NUM_WARPS, interpret: bool = False):
    """The Pallas kernel; one program per row (and one for pad_row's zero row). Inputs must pass check_inputs and
    unsupported_reason."""
    R, H = x.shape
    HP = max(16, 1 << (H - 1).bit_length())
    args = (x, parts, top_v.reshape(-1), gate[1], gate[2].reshape(-1), w)  # (the logit: the reference's)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * len(a.shape))  # each program indexes in place
    out = [jax.ShapeDtypeStruct((R, H), x.dtype)] * 2 + [jax.ShapeDtypeStruct((R + 1, H), x.dtype)] * pad_row
    return tuple(pl.pallas_call(
        functools.partial(_kernel, S=parts.shape[0], k=top_v.shape[1], H=H, HP=HP, eps=eps, rows=R,
                          norm_topk=norm_topk),
        grid=(R + pad_row,),
        in_specs=[whole(a) for a in args],
        out_specs=[whole(o) for o in out],
        out_shape=out,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="moe_add_rmsnorm_rows",
    )(*args))


def moe_add_rmsnorm_rows(x, parts, top_v, gate, w, *, eps: float, norm_topk: bool, pad_row: bool = False,
                         backend: str = "auto", interpret: bool = False):
    """The kernel in a program lowered for cuda, the reference elsewhere (dispatch.run); see the module doc."""
    check_inputs(x, parts, top_v, gate, w, pad_row)
    kw = dict(eps=eps, norm_topk=norm_topk, pad_row=pad_row)
    kernel = functools.partial(moe_add_rmsnorm_rows_pallas, **kw, interpret=interpret)
    reference = functools.partial(moe_add_rmsnorm_reference, **kw)
    return dispatch.run("MoE combine, residual add and RMSNorm rows", kernel, reference,
                        unsupported_reason(x, parts, top_v, gate, w), backend, x, parts, top_v, gate, w)
