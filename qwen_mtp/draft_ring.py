"""Wind-MTP: the draft head's windowed attention over a ring-buffer KV (SPEC.md section 4).

The head's row r (its query sits at RoPE position p = r + 1) sees head rows [0, S) (the sinks) and the last W
rows up to itself, [p - W, p) = (r - W, r]. Its KV lives in S + W + k physical slots, whatever the context
length: rows < S keep slot = row; a row r >= S goes to slot S + (r - S) mod (W + k). Keys are stored with
RoPE applied, so a key's slot does not change its score.

Attention is computed BEFORE the new rows are written: the queries of a call that starts at row `start` see
the ring as it was (rows < start) plus the call's own new keys. That makes one function serve a 1-row draft
step, the (k+1)-row refill after a verify, and prefill chunks of any length. The ring can hold stale rows
(drafts of a rejected round, or rows past `start`): `ring_rows` names the one row each slot can hold that is
< start, and the visibility mask never admits a stale one, because W + k slots outlive every stale write
(tests/test_draft_ring.py checks this through generate's write pattern). The attention itself is
kernels_pallas/windowed_attention.py: a Pallas kernel on GPU, its pure-JAX reference elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .state import KVCache


def ring_slot(row, sinks: int, ring: int):
    """Physical slot of logical head row `row` (>= 0): sinks keep their row, the rest wrap in `ring` slots."""
    return jnp.where(row < sinks, row, sinks + (row - sinks) % ring)


def slot_rows(slots, newest, sinks: int, ring: int):
    """The logical row <= newest that each physical slot holds (-1 if none; slots past sinks + ring hold
    none). Elementwise over slots and newest (the last row written, start - 1), so the Pallas kernel calls it
    on one block of slots at a time. The remainder is written with lax.rem (non-negative either way)."""
    off = slots - sinks
    ring_row = newest - jax.lax.rem(jax.lax.rem(newest - sinks - off, ring) + ring, ring)
    ring_row = jnp.where((newest >= sinks) & (ring_row >= sinks), ring_row, -1)
    sink_row = jnp.where(slots <= newest, slots, -1)
    return jnp.where(slots < sinks, sink_row, jnp.where(slots < sinks + ring, ring_row, -1))


def ring_rows(newest, sinks: int, ring: int):
    """For each of the sinks + ring slots, the logical row <= newest it holds ([..., S + ring], -1 if none);
    newest [...] is the last row written (start - 1)."""
    newest = jnp.asarray(newest)[..., None]
    return slot_rows(jnp.arange(sinks + ring, dtype=newest.dtype), newest, sinks, ring)


def visible(key_row, query_row, window: int, sinks: int):
    """The Wind-MTP mask: key rows [0, S) and (query - W, query], causal, none negative."""
    return (key_row >= 0) & (key_row <= query_row) & ((key_row < sinks) | (key_row > query_row - window))


def window_mask(start, T: int, window: int, sinks: int, ring: int):
    """key_ok for [ring slots ; T new rows] of queries start .. start+T-1: [B, T, S + ring + T]."""
    rows = start[:, None] + jnp.arange(T, dtype=start.dtype)[None]  # [B, T]
    held = ring_rows(start - 1, sinks, ring)  # [B, S + ring]
    ok_ring = visible(held[:, None, :], rows[:, :, None], window, sinks)
    ok_new = visible(rows[:, None, :], rows[:, :, None], window, sinks)
    return jnp.concatenate([ok_ring, ok_new], axis=-1)


def ring_write(cache: KVCache, k, v, start, sinks: int) -> KVCache:
    """Write new rows start .. start+T-1 (k, v [B, T, nkv, hd]) into the ring. When T exceeds the ring, only
    the last rows that land in each slot are written (the others are dropped, never raced)."""
    B, T = k.shape[:2]
    ring = cache.k.shape[1] - sinks
    rows = start[:, None] + jnp.arange(T, dtype=start.dtype)[None]
    slots = ring_slot(rows, sinks, ring)
    last = start[:, None] + T - 1
    keep = (rows < sinks) | (rows > last - ring)  # a later row of this call lands in the same slot otherwise
    slots = jnp.where(keep, slots, sinks + ring)  # out of range: dropped
    b = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    put = lambda c, x: c.at[b, slots].set(x.astype(c.dtype), mode="drop")
    return KVCache(put(cache.k, k), put(cache.v, v))


def init_ring(batch: int, sinks: int, window: int, k: int, kv_heads: int, head_dim: int, dtype) -> KVCache:
    shape = (batch, sinks + window + k, kv_heads, head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def ring_attention_layer(x, w, cfg, cache: KVCache, start, window: int, sinks: int, rope_offset: int,
                         attend_fn=None):
    """The head's attention with Wind-MTP: windowed over the ring, then this call's rows are written."""
    from .attention import output, project_qkv

    B, T, _ = x.shape
    rows = start[:, None] + jnp.arange(T, dtype=start.dtype)[None]
    q, k, v, gate = project_qkv(x, w, cfg, rows + rope_offset)
    if attend_fn is None:  # the Pallas kernel on GPU, its pure-JAX reference elsewhere
        from kernels_pallas.windowed_attention import windowed_attend as attend_fn
    o = attend_fn(q, cache.k, cache.v, k, v, start, window, sinks)
    return output(o, gate, w), ring_write(cache, k, v, start, sinks)

