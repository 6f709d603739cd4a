"""Prefill (chunked) and greedy decode, the decode steps inside one jitted lax.while_loop."""

from __future__ import annotations

import dataclasses
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .errors import ArgumentError
from .model import forward, lm_logits
from .state import init_state

DEFAULT_PREFILL_CHUNK = 256


@dataclasses.dataclass
class GenerateStats:
    batch: int
    prompt_tokens: int  # summed over rows
    new_tokens: int  # summed over rows
    prefill_s: float
    decode_s: float

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens per second of the decode loop (the first new token comes from prefill)."""
        decoded = self.new_tokens - self.batch
        return decoded / self.decode_s if self.decode_s > 0 and decoded > 0 else float("nan")


@dataclasses.dataclass
class GenerateResult:
    tokens: np.ndarray  # [B, N] new token ids; a row that stopped early is padded with pad_id after its EOS
    lengths: np.ndarray  # [B] number of new tokens of each row (its EOS included)
    pad_id: int
    stats: GenerateStats
    logits: np.ndarray | None = None  # [B, N, V] f32, only with generate(..., return_logits=True)


# ----------------------------------------------------------------------------------------------- validation
def _as_rows(prompt_ids, name="prompt_ids"):
    """1-D ids -> one row; a 2-D array or a list of 1-D sequences -> B rows. Returns a list of int64 arrays."""
    if isinstance(prompt_ids, (jax.Array, np.ndarray)):
        arr = np.asarray(prompt_ids)
        if arr.ndim not in (1, 2):
            raise ArgumentError(name, "a 1-D prompt or a 2-D batch of prompts", f"an array of shape {arr.shape}")
        rows = [arr] if arr.ndim == 1 else list(arr)
    elif isinstance(prompt_ids, (list, tuple)):
        if len(prompt_ids) and all(isinstance(r, (list, tuple, np.ndarray, jax.Array)) for r in prompt_ids):
            rows = [np.asarray(r) for r in prompt_ids]
        else:
            rows = [np.asarray(prompt_ids)]
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
        out.append(r.astype(np.int64))
    return out


def _check_ids(rows, cfg: ModelConfig, extra_len: int, name="prompt_ids"):
    for i, r in enumerate(rows):
        where = f"{name}[{i}]" if len(rows) > 1 else name
        bad = np.flatnonzero((r < 0) | (r >= cfg.vocab_size))
        if bad.size:
            raise ArgumentError(where, f"token ids in [0, {cfg.vocab_size})",
                                f"id {int(r[bad[0]])} at index {int(bad[0])}")
        if len(r) + extra_len > cfg.max_position_embeddings:
            raise ArgumentError(where, f"prompt length + new tokens <= max_position_embeddings "
                                       f"({cfg.max_position_embeddings})", f"{len(r)} + {extra_len}")


def _eos_ids(cfg: ModelConfig, eos_token_id):
    if eos_token_id is None:
        return cfg.eos_token_ids
    ids = (eos_token_id,) if isinstance(eos_token_id, (int, np.integer)) else tuple(eos_token_id)
    for e in ids:
        if isinstance(e, bool) or not isinstance(e, (int, np.integer)) or not 0 <= e < cfg.vocab_size:
            raise ArgumentError("eos_token_id", f"token ids in [0, {cfg.vocab_size})", repr(e))
    return tuple(int(e) for e in ids)


def _round_up(x, m):
    return -(-x // m) * m


def _pow2_at_least(x):
    return 1 << max(int(x) - 1, 0).bit_length()


# ----------------------------------------------------------------------------------------------- jitted steps
@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def _prefill_chunk(weights, cfg, tokens, state, pos, n_valid):
    return forward(weights, cfg, tokens, state, pos, n_valid, gdn_mode="chunk")


@partial(jax.jit, static_argnames=("cfg", "max_new", "keep_logits"))
def _greedy_decode(weights, cfg, state, first_logits, pos, eos, pad_id, max_new, keep_logits):
    """first_logits [B, V]: prefill's logits for the token at positions pos [B]. Emits up to max_new tokens
    per row; with keep_logits also returns the logits each token was chosen from [B, max_new, V]."""
    B, V = first_logits.shape
    is_eos = lambda t: jnp.any(t[:, None] == eos[None, :], axis=-1)
    first = jnp.argmax(first_logits, axis=-1).astype(jnp.int32)
    out = jnp.full((B, max_new), pad_id, jnp.int32).at[:, 0].set(first)
    logits_buf = jnp.zeros((B, max_new if keep_logits else 1, V), jnp.float32).at[:, 0].set(first_logits)
    carry = (state, first, pos, out, logits_buf, jnp.ones((B,), jnp.int32), is_eos(first), jnp.int32(1))

    def cond(c):
        return (c[-1] < max_new) & ~jnp.all(c[-2])

    def body(c):
        state, tok, pos, out, logits_buf, n_out, done, i = c
        hidden, state = forward(weights, cfg, tok[:, None], state, pos, jnp.ones((B,), jnp.int32), gdn_mode="step")
        logits = lm_logits(weights, hidden[:, 0])
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out = out.at[:, i].set(jnp.where(done, pad_id, nxt))
        if keep_logits:
            logits_buf = logits_buf.at[:, i].set(logits)
        n_out = n_out + (~done).astype(jnp.int32)
        return state, nxt, pos + 1, out, logits_buf, n_out, done | is_eos(nxt), i + 1

    c = jax.lax.while_loop(cond, body, carry)
    return c[3], c[5], c[4]


_logits = jax.jit(lm_logits)


# ----------------------------------------------------------------------------------------------- drivers
def prefill(model, rows, cache_len: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, keep_hidden=False):
    """Chunked prefill of right-padded rows. Returns (state, last post-norm hidden [B, H], per-position hidden
    [B, T, H] or None). Feeding a prompt in pieces equals one pass (the GDN state carries over exactly)."""
    cfg, weights = model.config, model.weights
    lens = np.array([len(r) for r in rows], np.int32)
    B, T = len(rows), int(lens.max())
    C = min(_pow2_at_least(max(T, 16)), prefill_chunk)
    n_chunks = -(-T // C)
    if cache_len < n_chunks * C:
        raise ValueError(f"cache_len {cache_len} < padded prompt {n_chunks * C}")
    tokens = np.zeros((B, n_chunks * C), np.int32)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    state = init_state(cfg, B, cache_len, weights.embed.dtype)
    last = None
    hiddens = []
    for c in range(n_chunks):
        n_valid = np.clip(lens - c * C, 0, C).astype(np.int32)
        hidden, state = _prefill_chunk(weights, cfg, jnp.asarray(tokens[:, c * C:(c + 1) * C]), state,
                                       jnp.full((B,), c * C, jnp.int32), jnp.asarray(n_valid))
        idx = np.clip(lens - 1 - c * C, 0, C - 1)
        here = jnp.asarray((lens - 1 >= c * C) & (lens - 1 < (c + 1) * C))
        h_last = hidden[jnp.arange(B), jnp.asarray(idx)]
        last = h_last if last is None else jnp.where(here[:, None], h_last, last)
        if keep_hidden:
            hiddens.append(hidden)
    all_hidden = jnp.concatenate(hiddens, axis=1)[:, :T] if keep_hidden else None
    return state, last, all_hidden


def prefill_logits(model, ids, *, prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> np.ndarray:
    """Trunk logits [T, vocab] (f32) at every position of a 1-D prompt."""
    rows = _as_rows(ids, "ids")
    if len(rows) != 1 or np.asarray(ids).ndim != 1:
        raise ArgumentError("ids", "a 1-D prompt", f"{len(rows)} rows")
    _check_ids(rows, model.config, 0, "ids")
    T = len(rows[0])
    C = min(_pow2_at_least(max(T, 16)), prefill_chunk)
    _, _, hidden = prefill(model, rows, _round_up(T, C), prefill_chunk, keep_hidden=True)
    return np.asarray(_logits(model.weights, hidden[0]))


def generate(model, prompt_ids, max_new_tokens: int, *, eos_token_id=None,
             prefill_chunk: int = DEFAULT_PREFILL_CHUNK, return_logits: bool = False) -> GenerateResult:
    """Greedy generation. prompt_ids: 1-D ids (B = 1), or a batch (list of 1-D sequences of any lengths, or a
    2-D array). Stops a row at an id of `eos_token_id` (default: the config's; [] disables) or after
    max_new_tokens. Returns GenerateResult with tokens [B, N], lengths [B] and stats."""
    cfg = model.config
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ArgumentError("max_new_tokens", "an integer >= 1", repr(max_new_tokens))
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise ArgumentError("prefill_chunk", "an integer >= 1", repr(prefill_chunk))
    max_new = int(max_new_tokens)
    rows = _as_rows(prompt_ids)
    _check_ids(rows, cfg, max_new)
    eos = _eos_ids(cfg, eos_token_id)
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else 0)
    lens = np.array([len(r) for r in rows], np.int32)
    T = int(lens.max())
    C = min(_pow2_at_least(max(T, 16)), prefill_chunk)
    cache_len = _round_up(max(_round_up(T, C), T + max_new), 128)

    t0 = time.perf_counter()
    state, last, _ = prefill(model, rows, cache_len, prefill_chunk)
    first_logits = _logits(model.weights, last)
    first_logits.block_until_ready()
    t1 = time.perf_counter()
    out, n_out, logits = _greedy_decode(model.weights, cfg, state, first_logits, jnp.asarray(lens),
                                        jnp.asarray(eos, jnp.int32).reshape(-1), jnp.int32(pad_id), max_new,
                                        bool(return_logits))
    out, n_out = np.asarray(out), np.asarray(n_out)
    t2 = time.perf_counter()
    n = int(n_out.max())
    stats = GenerateStats(batch=len(rows), prompt_tokens=int(lens.sum()), new_tokens=int(n_out.sum()),
                          prefill_s=t1 - t0, decode_s=t2 - t1)
    return GenerateResult(tokens=out[:, :n], lengths=n_out, pad_id=int(pad_id), stats=stats,
                          logits=np.asarray(logits)[:, :n] if return_logits else None)
