"""Chunked prefill: the trunk over right-padded prompt rows (`prefill`) and the MTP head's KV filled from the
trunk's hiddens (`mtp_prefill`), a fixed-size chunk per program call, with the small jitted programs that glue
the chunks together (the last position's hidden, padding, slicing and joining along time).

Both drivers run their programs through a placement.Runner (or a Compiler, which only compiles them)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from qwen_mtp.decoding.placement import Runner, mesh_of, state_program
from qwen_mtp.decoding.request import DEFAULT_PREFILL_CHUNK, chunk_size
from qwen_mtp.decoding.speculative import SpecConfig
from qwen_mtp.head.mtp import mtp_forward
from qwen_mtp.trunk.forward import forward, lm_logits


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def trunk_chunk(weights, cfg, tokens, state, pos, n_valid):
    """One chunk of the trunk's prefill: (hidden [B, C, H], state)."""
    with jax.named_scope("prefill"):
        return forward(weights, cfg, tokens, state, pos, n_valid, gdn_mode="chunk")


@partial(jax.jit, donate_argnames=("last",))
def keep_last(hidden, last, lens, start):
    """last [B, H]: each row's hidden at position lens-1, taken from the chunk hidden [B, C, H] at `start` when
    that position lies in it."""
    C = hidden.shape[1]
    idx = jnp.clip(lens - 1 - start, 0, C - 1)
    here = (lens - 1 >= start) & (lens - 1 < start + C)
    return jnp.where(here[:, None], hidden[jnp.arange(hidden.shape[0]), idx], last)


@partial(jax.jit, static_argnames=("cfg", "window", "sinks"), donate_argnames=("cache",))
def mtp_chunk(weights, cfg, tokens, hidden, cache, slot, window=None, sinks=0):
    """One chunk of the head's prefill: (out [B, C, H], cache)."""
    with jax.named_scope("mtp_prefill"):
        out, cache, _ = mtp_forward(weights, cfg, tokens, hidden, cache, slot, window=window, sinks=sinks)
    return out, cache


@partial(jax.jit, static_argnames=("length",))
def pad_time(x, length):
    """x [B, T, ...] -> [B, length, ...] with zero rows past T."""
    return jnp.pad(x, [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


@partial(jax.jit, static_argnames=("size",))
def time_slice(x, start, size):
    """x [B, T, ...] -> x[:, start:start+size] (start + size <= T)."""
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)


@partial(jax.jit, static_argnames=("length",))
def concat_time(parts, length):
    return jnp.concatenate(parts, axis=1)[:, :length]


hidden_logits = jax.jit(lm_logits)  # the trunk's logits [..., V] of hiddens [..., H] (prefill_logits, mtp_logits)


@jax.jit
def take_rows(x, idx):
    """x [B, T, ...], idx [B] -> x[b, idx[b]]"""
    return x[jnp.arange(x.shape[0]), idx]


def prefill(model, rows, cache_len: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, keep_hidden=False,
            kv_dtype=None, runner=None):
    """Chunked prefill of right-padded rows. Returns (state, last post-norm hidden [B, H], per-position hidden
    [B, T, H] or None). Feeding a prompt in pieces equals one pass (the GDN state carries over exactly).
    kv_dtype: the attention caches' dtype (None: the compute dtype; validated by the public callers)."""
    cfg, weights = model.config, model.weights
    ex = runner or Runner(model)
    lens = np.array([len(r) for r in rows], np.int32)
    B, T = len(rows), int(lens.max())
    C = chunk_size(T, prefill_chunk)
    n_chunks = -(-T // C)
    if cache_len < n_chunks * C:
        raise ValueError(f"cache_len {cache_len} < padded prompt {n_chunks * C}")
    tokens = np.zeros((B, n_chunks * C), np.int32)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    dtype = weights.embed.dtype
    state = ex.call(state_program(cfg, B, cache_len, dtype, kv_dtype, False, None, 0, 0, mesh_of(model)))
    last = ex.rows(np.zeros((B, cfg.hidden_size), dtype))
    lens_dev = ex.rows(lens)
    hiddens = []
    for c in range(n_chunks):
        n_valid = np.clip(lens - c * C, 0, C).astype(np.int32)
        start = ex.rows(np.full((B,), c * C, np.int32))
        hidden, state = ex.call(trunk_chunk, weights, cfg, ex.rows(tokens[:, c * C:(c + 1) * C]), state, start,
                                ex.rows(n_valid))
        last = ex.call(keep_last, hidden, last, lens_dev, start)
        if keep_hidden:
            hiddens.append(hidden)
    all_hidden = ex.call(concat_time, hiddens, length=n_chunks * C) if keep_hidden else None
    return state, last, all_hidden


def mtp_prefill(model, tokens, hidden, cache_len: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                spec: SpecConfig | None = None, kv_dtype=None, runner=None):
    """Fill the MTP head's KV from the trunk: row t gets (tokens[:, t], hidden[:, t]).
    tokens [B, T] (the token AFTER each hidden's position), hidden [B, >= T, H]. Returns (out [B, T, H], cache).
    With spec.window set, the head attends Wind-MTP style and the cache is its ring (head/ring.py).
    kv_dtype: the head cache's dtype (None: the compute dtype)."""
    cfg, weights = model.config, model.weights
    ex = runner or Runner(model)
    B, T = tokens.shape
    C = chunk_size(T, prefill_chunk)
    n_chunks = -(-T // C)
    tokens = np.pad(np.asarray(tokens, np.int32), ((0, 0), (0, n_chunks * C - T)))
    window = spec.window if spec is not None else None
    sinks = spec.sinks if spec is not None else 0
    cache_dtype = weights.embed.dtype if kv_dtype is None else kv_dtype
    cache = ex.call(state_program(cfg, B, max(cache_len, n_chunks * C), None, cache_dtype, True, window, sinks,
                                  spec.draft_slots if spec is not None else 0, mesh_of(model)))
    if hidden.shape[1] < n_chunks * C:
        hidden = ex.call(pad_time, hidden, length=n_chunks * C)
    outs = []
    for c in range(n_chunks):
        start = ex.rows(np.full((B,), c * C, np.int32))
        out, cache = ex.call(mtp_chunk, weights, cfg, ex.rows(tokens[:, c * C:(c + 1) * C]),
                             ex.call(time_slice, hidden, ex.shared(np.int32(c * C)), size=C), cache, start,
                             window, sinks)
        outs.append(out)
    return ex.call(concat_time, outs, length=T), cache
