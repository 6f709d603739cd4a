"""The argument checks of the public calls (generate, precompile, prefill_logits, mtp_logits, kv_cache_bytes):
prompts as rows of integer ids in the vocabulary and within max_position_embeddings, EOS ids, positive integers.
Each refusal is an ArgumentError naming the argument, what was expected and what was given."""

from __future__ import annotations

import jax
import numpy as np

from qwen_mtp.errors import ArgumentError, is_integer
from qwen_mtp.trunk.config import ModelConfig


def as_rows(prompt_ids, name="prompt_ids"):
    """1-D ids -> one row; a 2-D array or a list of 1-D sequences -> B rows. Returns a list of int64 arrays."""
    if isinstance(prompt_ids, (jax.Array, np.ndarray)):
        arr = np.asarray(prompt_ids)
        if arr.ndim not in (1, 2):
            raise ArgumentError(name, "a 1-D prompt or a 2-D batch of prompts", f"an array of shape {arr.shape}")
        rows = [arr] if arr.ndim == 1 else list(arr)
    elif isinstance(prompt_ids, (list, tuple)):
        nested = [isinstance(r, (list, tuple, np.ndarray, jax.Array)) for r in prompt_ids]
        if any(nested) and not all(nested):
            raise ArgumentError(name, "either token ids or a batch of rows of token ids",
                                "a list mixing ids and rows")
        rows = [np.asarray(r) for r in prompt_ids] if nested and all(nested) else [np.asarray(prompt_ids)]
    else:
        raise ArgumentError(name, "a sequence or array of token ids", type(prompt_ids).__name__)
    if not rows:
        raise ArgumentError(name, "at least one prompt", "an empty batch")
    out = []
    for i, r in enumerate(rows):
        where = f"{name}[{i}]" if len(rows) > 1 else name
        if r.ndim != 1:
            raise ArgumentError(where, "a 1-D sequence of token ids", f"shape {r.shape}")
        if r.size == 0:
            raise ArgumentError(where, "a non-empty prompt", "an empty prompt")
        if not np.issubdtype(r.dtype, np.integer):
            raise ArgumentError(where, "integer token ids", f"dtype {r.dtype}")
        out.append(r)
    return out


def check_ids(rows, cfg: ModelConfig, extra_len: int, name="prompt_ids"):
    """Range and length checks, on the caller's own integer dtype (before any conversion)."""
    for i, r in enumerate(rows):
        where = f"{name}[{i}]" if len(rows) > 1 else name
        bad = np.flatnonzero((r < 0) | (r >= cfg.vocab_size))
        if bad.size:
            raise ArgumentError(where, f"token ids in [0, {cfg.vocab_size})",
                                f"id {r[bad[0]]} at index {int(bad[0])}")
        if len(r) + extra_len > cfg.max_position_embeddings:
            raise ArgumentError(where, f"prompt length + new tokens <= max_position_embeddings "
                                       f"({cfg.max_position_embeddings})", f"{len(r)} + {extra_len}")


def single_prompt(ids, cfg):
    """prefill_logits' and mtp_logits' `ids`: one 1-D prompt, checked. Returns it as one row."""
    rows = as_rows(ids, "ids")
    if len(rows) != 1 or np.asarray(ids).ndim != 1:
        raise ArgumentError("ids", "a 1-D prompt", f"{len(rows)} rows")
    check_ids(rows, cfg, 0, "ids")
    return rows


def check_positive_int(name, value):
    if not is_integer(value) or value < 1:
        raise ArgumentError(name, "an integer >= 1", repr(value))
    return int(value)


def check_chunk(prefill_chunk):
    return check_positive_int("prefill_chunk", prefill_chunk)


def eos_ids(cfg: ModelConfig, eos_token_id):
    if eos_token_id is None:
        return cfg.eos_token_ids
    if is_integer(eos_token_id):
        ids = (eos_token_id,)
    elif isinstance(eos_token_id, (list, tuple, np.ndarray)):
        ids = tuple(eos_token_id)
    else:
        raise ArgumentError("eos_token_id", f"a token id in [0, {cfg.vocab_size}) or a list of such ids",
                            repr(eos_token_id))
    for e in ids:
        if not is_integer(e) or not 0 <= e < cfg.vocab_size:
            raise ArgumentError("eos_token_id", f"token ids in [0, {cfg.vocab_size})", repr(e))
    return tuple(int(e) for e in ids)
