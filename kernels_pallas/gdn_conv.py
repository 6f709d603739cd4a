"""The GDN layer's causal conv at one decode row, with its next conv state written in place, as one kernel: a
Pallas kernel beside its pure-JAX reference (same signature).

    conv_step(x, state, w, valid) -> (out, state)
      x      [B, C]       the row's qkv in-projection (q | k | v channels), before the conv
      state  [B, K-1, C]  the conv state: the K - 1 inputs before this row, oldest first (x's dtype)
      w      [K, C]       the depthwise conv taps
      valid  [B] bool     rows that take the step (False: a padding row, its state is left as it was)
      out    [B, C]       silu(sum_j window[j] w[j]) over the window [state ; x], in x's dtype
      state  [B, K-1, C]  the window's last K - 1 inputs (valid rows), the state as it was (padding rows)

x may instead be float32 partial products [S, B, C] (a quantized qkv in-projection's K parts as the decode kernel
writes them, quant.linear_parts): the row is their sum rounded to the state's dtype, which the kernel forms as it
loads them (on cuda XLA summed them in a kernel of its own before this one: one a GDN layer fewer).

The reference is the conv every GDN mode runs (causal_conv, here; trunk/gdn.py's prefill and verify call it too),
then conv_window_at at n_valid 0 or 1: the taps and the window in x's dtype, each product and partial sum in it,
then SiLU. The kernel computes the same in f32 and rounds to x's dtype after each operation as XLA's GPU code
does (on a CPU XLA may keep f32 between them: bf16 / f16 results agree to their rounding).

Why a kernel: XLA runs the conv, the next state and a copy of it as three kernels a GDN layer and step. The
fusion that cuts the next state from the window reads the loop-carried state it replaces, so it cannot write over
it, and copy insertion adds a copy (docs/on-a-gpu.md: 48 copies a 27B step). One program per (row, block of
channels) reads its channels' K - 1 state rows, the row's input and the taps, and only then writes the K - 1
shifted rows back: no program reads what another writes, so the state is updated in place
(input_output_aliases), and the step's three kernels become one.

Backend: kernels_pallas/dispatch.py's rule (the kernel in a program lowered for cuda, the reference elsewhere;
backend="pallas" with interpret=True runs the kernel on a CPU, as the tests do). Inputs the kernel does not take
(`unsupported_reason`) fall back to the reference with a one-time warning. Under a mesh the call runs per shard
(per_shard.conv_rows: rows over `data`, channels over `model`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas import dispatch
from kernels_pallas.split_k import sum_parts

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
BLOCK_C = 512  # channels a program (27B: 10240 channels, 20 programs a row)
NUM_WARPS = 4


def causal_conv(x, conv_state, w_conv):
    """Depthwise causal conv over [conv_state ; x] followed by SiLU.

    x [B, T, C]; conv_state [B, K-1, C] (previous inputs, oldest first); w_conv [K, C].
    Returns out [B, T, C] and the window [conv_state ; x] [B, K-1+T, C]: `conv_window_at` cuts the next conv
    state from it.
    """
    K = w_conv.shape[0]
    T = x.shape[1]
    xc = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    w = w_conv.astype(x.dtype)
    out = sum(xc[:, j:j + T, :] * w[j] for j in range(K))
    return jax.nn.silu(out), xc


def conv_window_at(xc, count, width):
    """The conv state after `count` [B] of the window's new inputs: the `width` (= kernel - 1) inputs ending
    there, xc[b, count[b] : count[b] + width]."""
    return jax.vmap(lambda r, n: jax.lax.dynamic_slice_in_dim(r, n, width, axis=0))(xc, count)


def conv_step_reference(x, state, w, valid):
    """Pure-JAX reference: the conv of every GDN mode (causal_conv) at one row, the next state cut from its window
    (conv_window_at) after 1 input (valid rows) or 0 (padding rows); partials x [S, B, C] summed first."""
    if x.ndim == 3:
        x = sum_parts(x).astype(state.dtype)
    out, window = causal_conv(x[:, None], state, w)
    return out[:, 0], conv_window_at(window, valid.astype(jnp.int32), state.shape[1])


def check_inputs(x, state, w, valid) -> None:
    """ValueError naming what is wrong when the arrays are not one row's conv of one layout."""
    if x.ndim not in (2, 3) or state.ndim != 3 or w.ndim != 2 or valid.ndim != 1:
        raise ValueError(f"conv_step takes x [B, C] (or its partials [S, B, C]), state [B, K-1, C], w [K, C], valid "
                         f"[B]; found x {list(x.shape)}, state {list(state.shape)}, w {list(w.shape)}, valid "
                         f"{list(valid.shape)}")
    if x.ndim == 3 and x.dtype != jnp.float32:
        raise ValueError(f"conv_step: partials x [S, B, C] in float32, found {jnp.dtype(x.dtype)}")
    B, C = x.shape[-2:]
    K = w.shape[0]
    if state.shape != (B, K - 1, C) or w.shape[1] != C or valid.shape != (B,):
        raise ValueError(f"conv_step: state [{B}, {K - 1}, {C}], w [{K}, {C}], valid [{B}] for x {list(x.shape)} "
                         f"and {K} taps; found state {list(state.shape)}, w {list(w.shape)}, "
                         f"valid {list(valid.shape)}")


def unsupported_reason(x, state, w):
    """None if the kernel takes these shapes and dtypes, else why not (the caller falls back to the reference)."""
    if w.shape[0] < 2:
        return f"a conv of {w.shape[0]} tap: no state to keep"
    if jnp.dtype(state.dtype) not in {jnp.dtype(d) for d in DTYPES}:
        return f"rows of dtype {jnp.dtype(state.dtype)}: the kernel takes float32 / bfloat16 / float16"
    if state.dtype != x.dtype and x.ndim == 2:
        return f"a state of dtype {jnp.dtype(state.dtype)} beside rows of {jnp.dtype(x.dtype)}: written in place, " \
               "the state keeps the rows' dtype"
    if jnp.dtype(w.dtype) not in {jnp.dtype(d) for d in DTYPES}:
        return f"taps of dtype {jnp.dtype(w.dtype)}: the kernel takes float32 / bfloat16 / float16"
    return None


def _kernel(x_ref, s_ref, w_ref, v_ref, out_ref, new_ref, *, C, K, bc, dt, parts):
    row, blk = pl.program_id(0), pl.program_id(1)
    c0 = blk * bc
    ok = (c0 + jnp.arange(bc, dtype=jnp.int32)) < C
    f32 = jnp.float32
    rnd = lambda t: t.astype(dt).astype(f32)  # rounded to x's dtype, as XLA's GPU code rounds each operation
    old = [plt.load(s_ref.at[row, jnp.int32(j), pl.ds(c0, bc)], mask=ok, other=0) for j in range(K - 1)]
    if parts:  # the row: K's partials summed in f32, rounded to the state's dtype (split_k.sum_parts, then a cast)
        x = rnd(sum(plt.load(x_ref.at[jnp.int32(i), row, pl.ds(c0, bc)], mask=ok, other=0) for i in range(parts)))
    else:
        x = plt.load(x_ref.at[row, pl.ds(c0, bc)], mask=ok, other=0).astype(f32)
    window = [t.astype(f32) for t in old] + [x]
    acc = None
    for j in range(K):
        tap = rnd(plt.load(w_ref.at[jnp.int32(j), pl.ds(c0, bc)], mask=ok, other=0).astype(f32))
        p = rnd(window[j] * tap)
        acc = p if acc is None else rnd(acc + p)
    sig = rnd(1.0 / (1.0 + jnp.exp(-acc)))
    plt.store(out_ref.at[row, pl.ds(c0, bc)], (acc * sig).astype(dt), mask=ok)
    take = v_ref[row] != 0
    for j in range(K - 1):  # every read above is done: the shifted rows go over the old ones
        plt.store(new_ref.at[row, jnp.int32(j), pl.ds(c0, bc)], jnp.where(take, window[j + 1].astype(dt), old[j]),
                  mask=ok)


@functools.partial(jax.jit, static_argnames=("block_c", "num_warps", "interpret"))
def conv_step_pallas(x, state, w, valid, *, block_c: int = BLOCK_C, num_warps: int = NUM_WARPS,
                     interpret: bool = False):
    """The Pallas kernel; grid (row, block of channels); the state updated in place. Inputs must pass
    check_inputs and unsupported_reason (conv_step checks both)."""
    B, C = x.shape[-2:]
    K = w.shape[0]
    bc = min(block_c, max(16, 1 << (C - 1).bit_length()))
    dt = state.dtype
    kernel = functools.partial(_kernel, C=C, K=K, bc=bc, dt=dt, parts=x.shape[0] if x.ndim == 3 else 0)
    args = (x, state, w, valid.astype(jnp.int32))
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)  # each program indexes in place
    out_shape = [jax.ShapeDtypeStruct((B, C), dt), jax.ShapeDtypeStruct(state.shape, state.dtype)]
    return tuple(pl.pallas_call(
        kernel,
        grid=(B, pl.cdiv(C, bc)),
        in_specs=[whole(a) for a in args],
        out_specs=[whole(s) for s in out_shape],
        out_shape=out_shape,
        input_output_aliases={1: 1},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_conv_step",
    )(*args))


def conv_step(x, state, w, valid, *, backend: str = "auto", interpret: bool = False):
    """The kernel in a program lowered for cuda, the reference elsewhere (dispatch.run); see the module doc."""
    check_inputs(x, state, w, valid)
    kernel = functools.partial(conv_step_pallas, interpret=interpret)
    return dispatch.run("GDN conv step", kernel, conv_step_reference, unsupported_reason(x, state, w), backend,
                        x, state, w, valid)
