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
(tests/test_draft_ring.py checks this through generate's write pattern).

The slot mapping and the mask (ring_slot, slot_rows, ring_rows, visible, window_mask) are pure functions in
kernels_pallas/ring_layout.py, shared with the kernel and re-exported here. The attention itself is
kernels_pallas/windowed_attention.py: the Pallas kernel in a program lowered for cuda, its pure-JAX reference
elsewhere.

KV dtype (state.py): the ring may be stored in float8_e4m3fn. The call's new rows are rounded to the ring's
dtype (state.to_cache) BEFORE the attention, and the kernel / reference read ring and new rows alike upcast to
the compute dtype, so a row sees itself and the rows of its own call exactly as later calls see them in the
ring (what the native head gets by writing before attending).
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas import per_shard as spmd
from kernels_pallas.ring_layout import ring_rows, ring_slot, slot_rows, visible, window_mask  # noqa: F401
from kernels_pallas.windowed_attention import windowed_attend
from qwen_mtp.trunk.attention import output, project_qkv
from qwen_mtp.trunk.state import KVCache, to_cache


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
    put = lambda c, x: c.at[b, slots].set(to_cache(x, c.dtype), mode="drop")
    return KVCache(put(cache.k, k), put(cache.v, v))


def init_ring(batch: int, sinks: int, window: int, k: int, kv_heads: int, head_dim: int, dtype) -> KVCache:
    shape = (batch, sinks + window + k, kv_heads, head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def ring_attention_layer(x, w, cfg, cache: KVCache, start, window: int, sinks: int, rope_offset: int,
                         attend_fn=None, out_parts: bool = False):
    """The head's attention with Wind-MTP: windowed over the ring, then this call's rows are written. The new
    rows enter the attention rounded to the ring's dtype, as they will be read from the ring later. out_parts:
    the output as o_proj's K partials (attention.output's parts, for ops.add_norm_written)."""
    B, T, _ = x.shape
    rows = start[:, None] + jnp.arange(T, dtype=start.dtype)[None]
    q, k, v, gate = project_qkv(x, w, cfg, rows + rope_offset)
    k, v = to_cache(k, cache.k.dtype), to_cache(v, cache.v.dtype)
    if attend_fn is None:  # the Pallas kernel in a program lowered for cuda, its pure-JAX reference elsewhere;
        # under a mesh, per (row, kv head) shard (spmd.py)
        call = lambda *a: windowed_attend(*a, window, sinks)
        o = spmd.windowed(q, cache.k, cache.v, k, v, start, call)
    else:
        o = attend_fn(q, cache.k, cache.v, k, v, start, window, sinks)
    return output(o, gate, w, parts=out_parts), ring_write(cache, k, v, start, sinks)

