"""A GDN layer's rollback after a speculative verify, both states rebuilt in place by one kernel: a Pallas kernel
beside its pure-JAX reference (same signature).

    gdn_rollback(conv, x, rec, G, k, delta, index) -> (conv, rec)
      conv   [B, K-1, C]     the conv state before the verify (oldest input first)
      x      [B, T, C]       the verified rows' conv inputs (the qkv in-projection before the conv), conv's dtype;
                             or their float32 K partials [S, B, T, C] (a quantized qkv as the decode kernel writes
                             them, quant.linear_parts): each row is their sum rounded to conv's dtype
      rec    [B, h, dk, dv]  the recurrent state before the verify, f32
      G [B, h, T], k [B, h, T, dk], delta [B, h, T, dv]: what the verify left (gdn_verify.py), f32
      index  [B] int         the verified position each row continues from, n (clamped to 0 .. T - 1)
    returns the states after position n:
      conv = window[n + 1 : n + K] of the window [conv ; x]
      rec  = exp(G_n) rec + sum_{s <= n} exp(G_n - G_s) k_s delta_s^T

The reference is decoding/rollback.py's rebuild as it was (the window's slice, conv_window_at; rec_after, here):
bit for bit on a CPU. The kernel computes the same terms in f32 in the same order.

Why a kernel: XLA ran a GDN layer's rollback as four kernels a round (the weights exp(G_n - G_s), the state's
rebuild, the window's slice and a copy of it into the loop-carried conv state: the slice's fusion reads the state
it replaces, so copy insertion adds the copy). Here programs (row, value head) rebuild their head's [dk, dv]
state in registers, and programs (row, block of channels) read their channels' K - 1 state rows and T inputs
before they write the K - 1 rows that follow position n: no program reads what another writes, so both states
are updated in place (input_output_aliases). One kernel a GDN layer and round instead of four.

Backend: kernels_pallas/dispatch.py's rule (the kernel in a program lowered for cuda, the reference elsewhere;
backend="pallas" with interpret=True runs the kernel on a CPU, as the tests do). Inputs the kernel does not take
(`unsupported_reason`) fall back to the reference with a one-time warning. Under a mesh the call runs per shard
(per_shard.rollback_rows: rows over `data`, channels and value heads over `model`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas import dispatch
from kernels_pallas.gdn_conv import conv_window_at
from kernels_pallas.gdn_step import MAX_HEAD_DIM, MIN_HEAD_DIM
from kernels_pallas.split_k import sum_parts

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_ROWS = 17  # a verify's k + 1 rows (the window's candidates are unrolled)
BLOCK_C = 1024  # channels a conv program (27B: 10240 channels, 10 programs a row beside its 48 heads')
NUM_WARPS = 8  # a [128, 128] f32 state in registers: 64 values a thread


def rec_after(rec, G, k, delta, n):
    """The recurrent state [B, h, dk, dv] after verified position n [B] (0-based: n + 1 positions applied)."""
    T = G.shape[-1]
    n = jnp.clip(n, 0, T - 1)
    g_n = jnp.take_along_axis(G, n[:, None, None], axis=-1)  # [B, h, 1]
    return rec_rebuilt(rec, G, k, delta, g_n, jnp.arange(T) <= n[:, None, None])


def rec_rebuilt(rec, G, k, delta, g_n, keep):
    """exp(g_n) rec + sum over the verified rows s that `keep` [B, h or 1, T] holds of exp(g_n - G_s) k_s
    delta_s^T: the state after a row whose cumulative log decay is g_n [B, h, 1], from the state before the verify.
    A chain keeps rows 0 .. n (rec_after); a tree the accepted node's ancestors and itself
    (decoding/tree_verify.py's gdn_state_after)."""
    w = jnp.where(keep, jnp.exp(g_n - G), 0.0)  # [B, h, T]
    kw = k * w[..., None]
    # T outer products summed elementwise: one pass over the state that XLA fuses (a CPU's batched dot of
    # inner size T, then the add, took 2.8x as long at the Qwen3.5-0.8B shape)
    out = jnp.exp(g_n)[..., None] * rec
    for t in range(G.shape[-1]):
        out = out + kw[:, :, t, :, None] * delta[:, :, t, None, :]
    return out


def inputs_of(x, dtype):
    """The verified rows' conv inputs [B, T, C] in `dtype`: x, or its float32 K partials' sum rounded to it."""
    return sum_parts(x).astype(dtype) if x.ndim == 4 else x


def gdn_rollback_reference(conv, x, rec, G, k, delta, index):
    """Pure-JAX reference: the window [conv ; x] sliced after position n (conv_window_at), rec_after."""
    T = G.shape[-1]
    n = jnp.clip(index.astype(jnp.int32), 0, T - 1)
    window = jnp.concatenate([conv, inputs_of(x, conv.dtype)], axis=1)
    return conv_window_at(window, n + 1, conv.shape[1]), rec_after(rec, G, k, delta, n)


def check_inputs(conv, x, rec, G, k, delta, index) -> None:
    """ValueError naming what is wrong when the arrays are not one GDN layer's verify of one layout."""
    if conv.ndim != 3 or x.ndim not in (3, 4) or rec.ndim != 4 or G.ndim != 3 or k.ndim != 4 or delta.ndim != 4 \
            or index.ndim != 1:
        raise ValueError(f"gdn_rollback takes conv [B, K-1, C], x [B, T, C] (or its partials [S, B, T, C]), rec [B, "
                         f"h, dk, dv], G [B, h, T], k [B, h, T, dk], delta [B, h, T, dv], index [B]; found conv "
                         f"{list(conv.shape)}, x {list(x.shape)}, rec {list(rec.shape)}, G {list(G.shape)}, k "
                         f"{list(k.shape)}, delta {list(delta.shape)}, index {list(index.shape)}")
    B, _, C = conv.shape
    _, h, dk, dv = rec.shape
    T = G.shape[-1]
    want = {"x": (B, T, C), "rec": (B, h, dk, dv), "G": (B, h, T), "k": (B, h, T, dk), "delta": (B, h, T, dv),
            "index": (B,)}
    found = {"x": x.shape[-3:], "rec": rec.shape, "G": G.shape, "k": k.shape, "delta": delta.shape,
             "index": index.shape}
    bad = [f"{name} {list(found[name])} (expected {list(s)})" for name, s in want.items() if tuple(found[name]) != s]
    if bad:
        raise ValueError(f"gdn_rollback: for conv {list(conv.shape)} and a verify of {T} rows over {h} heads of "
                         f"{dk} / {dv}: " + ", ".join(bad))
    if x.ndim == 4 and x.dtype != jnp.float32:
        raise ValueError(f"gdn_rollback: partials x [S, B, T, C] in float32, found {jnp.dtype(x.dtype)}")
    if x.ndim == 3 and x.dtype != conv.dtype:
        raise ValueError(f"gdn_rollback: x of the conv state's dtype {jnp.dtype(conv.dtype)}, found "
                         f"{jnp.dtype(x.dtype)}")
    for name, t in (("rec", rec), ("G", G), ("k", k), ("delta", delta)):
        if t.dtype != jnp.float32:
            raise ValueError(f"gdn_rollback: {name} in float32, found {jnp.dtype(t.dtype)}")
    if not jnp.issubdtype(index.dtype, jnp.integer):
        raise ValueError(f"gdn_rollback: index of an integer dtype, found {jnp.dtype(index.dtype)}")


def unsupported_reason(conv, x, rec, G):
    """None if the kernel takes these shapes and dtypes, else why not (the caller falls back to the reference)."""
    _, _, dk, dv = rec.shape
    for name, d in (("key", dk), ("value", dv)):
        if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM or d & (d - 1):
            return f"{name} head dim {d} is not a power of two in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]"
    if conv.shape[1] < 1:
        return "a conv of 1 tap: no state to keep"
    if G.shape[-1] > MAX_ROWS:
        return f"a verify of {G.shape[-1]} rows: the kernel takes up to {MAX_ROWS}"
    if jnp.dtype(conv.dtype) not in {jnp.dtype(d) for d in DTYPES}:
        return f"a conv state of dtype {jnp.dtype(conv.dtype)}: the kernel takes float32 / bfloat16 / float16"
    return None


def _kernel(conv_ref, x_ref, rec_ref, G_ref, k_ref, d_ref, n_ref, conv_out, rec_out, *, T, K, C, heads, bc, dt,
            parts):
    row, p = pl.program_id(0), pl.program_id(1)
    n = jnp.clip(n_ref[row], 0, T - 1)

    @pl.when(p < heads)
    def _():  # value head p: its state rebuilt after position n (rec_after's terms in its order)
        g_n = G_ref[row, p, n]
        S = jnp.exp(g_n) * rec_ref[row, p]
        for t in range(T):
            w = jnp.where(t <= n, jnp.exp(g_n - G_ref[row, p, t]), 0.0)
            S = S + (k_ref[row, p, t] * w)[:, None] * d_ref[row, p, t][None, :]
        rec_out[row, p] = S

    @pl.when(p >= heads)
    def _():  # channels c0 .. c0 + bc: the K - 1 window rows after position n
        c0 = (p - heads) * bc
        ok = (c0 + jnp.arange(bc, dtype=jnp.int32)) < C
        load = lambda ref, *i: plt.load(ref.at[(*map(jnp.int32, i), pl.ds(c0, bc))], mask=ok, other=0)
        window = [load(conv_ref, row, j) for j in range(K - 1)]
        for t in range(T):  # the row's input, or its partials summed in f32 and rounded (inputs_of)
            window.append(sum(load(x_ref, i, row, t) for i in range(parts)).astype(dt) if parts
                          else load(x_ref, row, t))
        for j in range(K - 1):  # every read above is done: the rows n + 1 + j go over the old ones
            new = window[1 + j]
            for s in range(2, T + 1):
                new = jnp.where(n + 1 == s, window[s + j], new)
            plt.store(conv_out.at[row, jnp.int32(j), pl.ds(c0, bc)], new.astype(dt), mask=ok)


@functools.partial(jax.jit, static_argnames=("block_c", "num_warps", "interpret"))
def gdn_rollback_pallas(conv, x, rec, G, k, delta, index, *, block_c: int = BLOCK_C, num_warps: int = NUM_WARPS,
                        interpret: bool = False):
    """The Pallas kernel; grid (row, value heads then blocks of channels); both states updated in place. Inputs
    must pass check_inputs and unsupported_reason (gdn_rollback checks both)."""
    B, K1, C = conv.shape
    heads, T = rec.shape[1], G.shape[-1]
    bc = min(block_c, max(16, 1 << (C - 1).bit_length()))
    kernel = functools.partial(_kernel, T=T, K=K1 + 1, C=C, heads=heads, bc=bc, dt=conv.dtype,
                               parts=x.shape[0] if x.ndim == 4 else 0)
    args = (conv, x, rec, G, k, delta, index.astype(jnp.int32))
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)  # each program indexes in place
    out_shape = [jax.ShapeDtypeStruct(conv.shape, conv.dtype), jax.ShapeDtypeStruct(rec.shape, rec.dtype)]
    return tuple(pl.pallas_call(
        kernel,
        grid=(B, heads + pl.cdiv(C, bc)),
        in_specs=[whole(a) for a in args],
        out_specs=[whole(s) for s in out_shape],
        out_shape=out_shape,
        input_output_aliases={0: 0, 2: 1},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_rollback",
    )(*args))


def gdn_rollback(conv, x, rec, G, k, delta, index, *, backend: str = "auto", interpret: bool = False):
    """The kernel in a program lowered for cuda, the reference elsewhere (dispatch.run); see the module doc."""
    check_inputs(conv, x, rec, G, k, delta, index)
    kernel = functools.partial(gdn_rollback_pallas, interpret=interpret)
    return dispatch.run("GDN rollback", kernel, gdn_rollback_reference, unsupported_reason(conv, x, rec, G),
                        backend, conv, x, rec, G, k, delta, index)
