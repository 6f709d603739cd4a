"""Wind-MTP ring layout: which logical head row each physical slot of the draft ring holds, and the window mask.

Pure jnp functions of integers, shared by the model (qwen_mtp/head/ring.py writes the ring) and the kernels
(kernels_pallas/windowed_attention.py reads it), so neither imports the other's package.

The head's row r sees rows [0, S) (the sinks) and (r - W, r]. Its KV lives in S + W + k physical slots: rows < S
keep slot = row; a row r >= S goes to slot S + (r - S) mod (W + k).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
