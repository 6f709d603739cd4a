"""Causal attention over a KV cache that walks the keys in blocks: prefill, decode and verify at any context.

    causal_attend(q, k_cache, v_cache, q_pos) -> [B, T, nh, hd]

q [B, T, nh, hd] are T new queries per row at cache positions q_pos [B, T] (RoPE applied); k_cache / v_cache
[B, S, nkv, hd] hold every row's keys and values, the call's own already written, in the cache dtype (the
compute dtype or float8_e4m3fn). Query (b, t) sees slots s <= q_pos[b, t]: the causal mask of the trunk and of
the native MTP head. GQA: nh = G * nkv, query head h reads kv head h // G.

The dense form (`masked_attention.attend`) scores every query against every slot, future ones included, and
holds [B, nkv, G, T, S] f32 scores at once: at Qwen3.5-27B's 24 query heads a 256-row chunk against a 1M-slot
cache is 25 GB for one layer. Here (`causal_attend_reference`, pure JAX, and the one CPUs run):
- the keys are read in parts of `split` blocks of `block` slots, in a loop that stops after the last slot any
  query of the call can see (the batch's furthest q_pos), so a prefill chunk never reads the future of the
  cache and the whole prompt costs about the causal half of the dense work;
- each block's partial softmax (its max, sum and weighted values, f32) is computed independently (split-K /
  flash-decoding: decode and verify have few queries, so several blocks per step), then the partials are
  combined with the running ones by their log-sum-exp: memory for scores is one part, whatever the context;
- cache blocks are upcast to q's dtype one part at a time (an fp8 cache is never widened whole).
A cache no longer than one part takes the dense form unchanged (the same program as before for short contexts).
Scores and the softmax run in f32; the products in q's dtype with f32 accumulation at the project's precision
rule (HIGHEST for f32).

The result equals the dense form up to the order of f32 sums (tests/test_causal_attention.py: block
boundaries, ragged batches, chunks that do not divide the prompt, positions past one block, fp8 caches).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .masked_attention import attend, precision_for

PREFILL_BLOCK = 512  # slots per block when the call has many queries (prefill chunks)
DECODE_BLOCK = 1024  # ... and when it has few (decode: 1 row, verify: k + 1 rows)
DECODE_SPLIT = 4  # blocks per loop step for few queries, each its own partial softmax
FEW_QUERIES = 32  # T at or below which a call is decode-like


def plan(T: int, S: int) -> tuple:
    """(block, split) for T queries against an S-slot cache."""
    if T <= FEW_QUERIES:
        return DECODE_BLOCK, DECODE_SPLIT
    return PREFILL_BLOCK, 1


def causal_attend_reference(q, k_cache, v_cache, q_pos, *, block: int | None = None, split: int | None = None):
    """Pure JAX: the blocked online softmax described in the module docstring."""
    B, T, nh, hd = q.shape
    S, nkv = k_cache.shape[1], k_cache.shape[2]
    G = nh // nkv
    b0, s0 = plan(T, S)
    block, split = block or b0, split or s0
    part = block * split
    if S <= part:  # one part holds the whole cache: the dense form
        slots = jnp.arange(S, dtype=q_pos.dtype)
        key_ok = slots[None, None, :] <= q_pos[:, :, None]
        return attend(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), key_ok)

    prec = precision_for(q.dtype)
    qg = q.reshape(B, T, nkv, G, hd)
    scale = hd ** -0.5
    last = jnp.max(q_pos)  # the furthest slot any query sees
    n_parts = last // part + 1

    def body(i, carry):
        m, l, acc = carry  # [B, nkv, G, T], [B, nkv, G, T], [B, nkv, G, T, hd] (f32)
        start = i * part
        lo = jnp.minimum(start, S - part)  # dynamic_slice's clamp, made explicit: the tail part overlaps
        kb = jax.lax.dynamic_slice_in_dim(k_cache, lo, part, axis=1).astype(q.dtype)
        vb = jax.lax.dynamic_slice_in_dim(v_cache, lo, part, axis=1).astype(q.dtype)
        kb = kb.reshape(B, split, block, nkv, hd)
        vb = vb.reshape(B, split, block, nkv, hd)
        s = jnp.einsum("btkgd,bjskd->bkgtjs", qg, kb, precision=prec, preferred_element_type=jnp.float32) * scale
        slot = lo + jnp.arange(part, dtype=q_pos.dtype).reshape(split, block)
        # visible: causal, and not already taken by an earlier part (the overlapped tail)
        ok = (slot[None, None] <= q_pos[:, :, None, None]) & (slot >= start)[None, None]  # [B, T, split, block]
        s = jnp.where(ok[:, None, None], s, -jnp.inf)
        # each block's partial softmax
        m_j = jnp.max(s, axis=-1)  # [B, nkv, G, T, split]
        m_j_safe = jnp.where(jnp.isfinite(m_j), m_j, 0.0)
        p = jnp.exp(s - m_j_safe[..., None])
        l_j = jnp.sum(p, axis=-1)
        acc_j = jnp.einsum("bkgtjs,bjskd->bkgtjd", p.astype(q.dtype), vb, precision=prec,
                           preferred_element_type=jnp.float32)
        # combined with the running partial by log-sum-exp
        m_new = jnp.maximum(m, jnp.max(m_j, axis=-1))
        m_new_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        a_old = jnp.exp(jnp.where(jnp.isfinite(m), m - m_new_safe, -jnp.inf))
        a_j = jnp.exp(jnp.where(jnp.isfinite(m_j), m_j - m_new_safe[..., None], -jnp.inf))
        l = l * a_old + jnp.sum(l_j * a_j, axis=-1)
        acc = acc * a_old[..., None] + jnp.sum(acc_j * a_j[..., None], axis=-2)
        return m_new, l, acc

    m0 = jnp.full((B, nkv, G, T), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((B, nkv, G, T), jnp.float32)
    acc0 = jnp.zeros((B, nkv, G, T, hd), jnp.float32)
    _, l, acc = jax.lax.fori_loop(0, n_parts, body, (m0, l0, acc0))
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # every query sees its own slot: l > 0
    return jnp.moveaxis(out, 3, 1).reshape(B, T, nh, hd).astype(q.dtype)


def causal_attend(q, k_cache, v_cache, q_pos):
    """The trunk's and the native MTP head's attention over their KV caches (see the module docstring)."""
    return causal_attend_reference(q, k_cache, v_cache, q_pos)
