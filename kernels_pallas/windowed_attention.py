"""Wind-MTP windowed decode attention: a Pallas kernel beside its pure-JAX reference (same signature).

    windowed_attend(q, ring_k, ring_v, new_k, new_v, start, window, sinks) -> [B, T, nh, hd]

q [B, T, nh, hd] are the draft head's queries for rows start .. start+T-1 (T = 1 for a draft step, k+1 for the
refill), RoPE applied. ring_k/v [B, S + ring, nkv, hd] hold the head's KV ring as it was before this call
(qwen_mtp/draft_ring.py: sinks keep slot = row, later rows wrap); new_k/v [B, T, nkv, hd] are the call's own
rows. Row r attends to rows [0, S) and (r - W, r]. GQA: nh = G * nkv, query head h reads kv head h // G.

The kernel runs one program per (batch row, kv head): the G query heads x T rows of that kv head form one
[M, hd] tile; it streams the ring in blocks of `block_k` slots with an online softmax, computing each slot's
logical row from `start` (no gather, no materialised mask), then the new rows. Backend choice (`backend=`):
"auto" uses the kernel on GPU and the reference elsewhere; "pallas" forces the kernel (interpret=True runs it
on CPU, as the tests do); "reference" forces the reference. A shape the kernel does not take falls back to
the reference, with the reason from `unsupported_reason` in a one-time warning: never a wrong answer.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from qwen_mtp.attention import attend
from qwen_mtp.draft_ring import slot_rows, visible, window_mask

MAX_ROWS = 128  # G * T per program
HIGHEST = jax.lax.Precision.HIGHEST  # no TF32 in f32 dots on GPU
MAX_HEAD_DIM = 256


def windowed_attend_reference(q, ring_k, ring_v, new_k, new_v, start, window: int, sinks: int):
    """Pure-JAX reference: one softmax over [ring slots ; new rows] with draft_ring.window_mask."""
    T = q.shape[1]
    ring = ring_k.shape[1] - sinks
    key_ok = window_mask(start, T, window, sinks, ring)
    keys = jnp.concatenate([ring_k, new_k.astype(ring_k.dtype)], axis=1)
    vals = jnp.concatenate([ring_v, new_v.astype(ring_v.dtype)], axis=1)
    return attend(q, keys, vals, key_ok)


def unsupported_reason(q, ring_k, new_k, sinks: int):
    """None if the kernel takes these shapes, else why not (the caller falls back to the reference)."""
    B, T, nh, hd = q.shape
    nkv = ring_k.shape[2]
    if nh % nkv:
        return f"query heads {nh} not a multiple of kv heads {nkv}"
    if hd > MAX_HEAD_DIM or hd & (hd - 1):
        return f"head_dim {hd} is not a power of two <= {MAX_HEAD_DIM}"
    if (nh // nkv) * T > MAX_ROWS:
        return f"GQA group {nh // nkv} x query length {T} = {(nh // nkv) * T} rows > {MAX_ROWS} per program"
    if ring_k.shape[1] <= sinks:
        return f"ring of {ring_k.shape[1]} slots has no room past {sinks} sinks"
    if new_k.shape[1] != T:
        return f"new_k has {new_k.shape[1]} rows for {T} queries"
    return None


def _pow2(x, at_least=16):
    return max(at_least, 1 << (int(x) - 1).bit_length())


def _kernel(qrow_ref, newest_ref, newrow_ref, q_ref, rk_ref, rv_ref, nk_ref, nv_ref, o_ref, *, sinks, ring, window,
            n_blocks, block_k, scale):
    q = q_ref[...].astype(jnp.float32)  # [M, hd]
    qrow = qrow_ref[...]  # [M] logical row of each query row; -1 for padding
    newest = newest_ref[...]  # [block_k], all equal to start - 1
    M, hd = q.shape

    def update(carry, k, v, key_row):
        m_i, l_i, acc = carry
        s = jnp.dot(q, k.astype(jnp.float32).T, precision=HIGHEST, preferred_element_type=jnp.float32)
        s = s * scale  # [M, block_k]
        ok = visible(key_row[None, :], qrow[:, None], window, sinks)
        s = jnp.where(ok, s, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.where(ok, jnp.exp(s - m_safe[:, None]), 0.0)
        corr = jnp.where(m_i == -jnp.inf, 0.0, jnp.exp(m_i - m_safe))
        l_i = l_i * corr + jnp.sum(p, axis=1)
        acc = acc * corr[:, None] + jnp.dot(p, v.astype(jnp.float32), precision=HIGHEST,
                                             preferred_element_type=jnp.float32)
        return m_new, l_i, acc

    def ring_block(j, carry):
        k = rk_ref[pl.ds(j * block_k, block_k), :]
        v = rv_ref[pl.ds(j * block_k, block_k), :]
        slot = j * block_k + jnp.arange(block_k, dtype=jnp.int32)
        return update(carry, k, v, slot_rows(slot, newest, sinks, ring))

    carry = (jnp.full((M,), -jnp.inf, jnp.float32), jnp.zeros((M,), jnp.float32), jnp.zeros((M, hd), jnp.float32))
    carry = jax.lax.fori_loop(0, n_blocks, ring_block, carry)
    _, l_i, acc = update(carry, nk_ref[...], nv_ref[...], newrow_ref[...])
    o_ref[...] = (acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("window", "sinks", "block_k", "interpret"))
def windowed_attend_pallas(q, ring_k, ring_v, new_k, new_v, start, window: int, sinks: int, block_k: int = 64,
                           interpret: bool = False):
    """The Pallas kernel. Shapes must pass unsupported_reason (windowed_attend checks it)."""
    B, T, nh, hd = q.shape
    L, nkv = ring_k.shape[1], ring_k.shape[2]
    G = nh // nkv
    ring = L - sinks
    M = _pow2(G * T)
    Tn = _pow2(T)
    Lp = -(-L // block_k) * block_k
    # [B, nkv, M, hd] with rows (t, g) t-major; padding rows are masked out by qrow = -1
    qg = jnp.moveaxis(q.reshape(B, T, nkv, G, hd), 2, 1).reshape(B, nkv, T * G, hd)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, M - T * G), (0, 0)))
    kv = lambda x, n: jnp.pad(jnp.moveaxis(x, 2, 1), ((0, 0), (0, 0), (0, n - x.shape[1]), (0, 0)))
    rk, rv, nk, nv = kv(ring_k, Lp), kv(ring_v, Lp), kv(new_k, Tn), kv(new_v, Tn)
    m = jnp.arange(M, dtype=jnp.int32)
    qrow = jnp.where(m[None] < T * G, start[:, None].astype(jnp.int32) + m[None] // G, -1)  # [B, M]
    newest = jnp.broadcast_to((start.astype(jnp.int32) - 1)[:, None], (B, block_k))
    t = jnp.arange(Tn, dtype=jnp.int32)
    newrow = jnp.where(t[None] < T, start[:, None].astype(jnp.int32) + t[None], -1)  # [B, Tn]
    kernel = functools.partial(_kernel, sinks=sinks, ring=ring, window=window, n_blocks=Lp // block_k,
                               block_k=block_k, scale=hd ** -0.5)
    per_head = lambda n: pl.BlockSpec((None, None, n, hd), lambda b, h: (b, h, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid=(B, nkv),
        in_specs=[pl.BlockSpec((None, M), lambda b, h: (b, 0)), pl.BlockSpec((None, block_k), lambda b, h: (b, 0)),
                  pl.BlockSpec((None, Tn), lambda b, h: (b, 0)), per_head(M), per_head(Lp), per_head(Lp), per_head(Tn), per_head(Tn)],
        out_specs=per_head(M),
        out_shape=jax.ShapeDtypeStruct((B, nkv, M, hd), q.dtype),
        interpret=interpret,
    )(qrow, newest, newrow, qg, rk, rv, nk, nv)
    out = out[:, :, :T * G].reshape(B, nkv, T, G, hd)
    return jnp.moveaxis(out, 1, 2).reshape(B, T, nh, hd)


_warned = set()


def windowed_attend(q, ring_k, ring_v, new_k, new_v, start, window: int, sinks: int, *, backend: str = "auto",
                    interpret: bool = False):
    """Dispatch: the kernel on GPU (or when forced), the reference otherwise or when the shape is unsupported."""
    if backend not in ("auto", "pallas", "reference"):
        raise ValueError(f"backend: expected 'auto', 'pallas' or 'reference', found {backend!r}")
    use_kernel = backend == "pallas" or (backend == "auto" and jax.default_backend() == "gpu")
    if use_kernel:
        reason = unsupported_reason(q, ring_k, new_k, sinks)
        if reason is None:
            return windowed_attend_pallas(q, ring_k, ring_v, new_k, new_v, start, window, sinks,
                                          interpret=interpret)
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"windowed draft attention: Pallas kernel not used ({reason}); using the reference",
                          stacklevel=2)
    return windowed_attend_reference(q, ring_k, ring_v, new_k, new_v, start, window, sinks)
