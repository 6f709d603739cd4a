"""The repetition penalty (Hugging Face's `repetition_penalty`, CTRL's rule): before temperature / top-k / top-p,
every token id already in the row's context (prompt and every token chosen so far) has its logit divided by the
penalty when positive and multiplied by it when negative. 1 is off; above 1 discourages repeats.

A row's context is kept as `seen` [B, V] bool (empty, [B, 0], when the penalty is off, so nothing is paid for it).
Speculation stays exact under it: the verify's row i is penalised with seen | {d_1..d_i} (the context the plain
loop would have had there, `verify_seen`), so a greedy round emits the plain loop's tokens and rejection
sampling the plain loop's distribution. The drafts are penalised the same way (for acceptance only: any draft
distribution keeps the output exact).

With per-row settings (sampling.RowSampling, the serving engine's) the penalty is a [B] array (1 in the rows
without one, which leaves their logits bit-identical) and `seen` is kept when its static `penalize` is set.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen_mtp.decoding.sampling import RowSampling
from qwen_mtp.errors import ArgumentError


def active(sampling) -> bool:
    if isinstance(sampling, RowSampling):
        return sampling.penalize
    return sampling.repetition_penalty != 1.0


def empty(batch: int):
    """The `seen` of a call without a penalty."""
    return jnp.zeros((batch, 0), jnp.bool_)


def check_seen(seen, sampling, vocab_size: int) -> None:
    """A decode loop's carry must hold the context ids [B, V] under a penalty, and none ([B, 0]) without one
    (checked as the loop is traced: a carry made without the prompt's ids would penalise nothing)."""
    want = vocab_size if active(sampling) else 0
    if seen.shape[-1] != want:
        what = (f"penalize={sampling.penalize}" if isinstance(sampling, RowSampling)
                else f"repetition_penalty {sampling.repetition_penalty:g}")
        raise ArgumentError("carry.seen", f"[batch, {want}] with {what} (the start function's seen=)",
                            str(tuple(seen.shape)))


def prompt_seen(tokens, lens, vocab_size: int, sampling):
    """tokens [B, T] right-padded prompts, lens [B] -> seen [B, V]: the ids of each row's first lens[b] tokens."""
    B, T = tokens.shape
    if not active(sampling):
        return empty(B)
    valid = jnp.arange(T)[None, :] < lens[:, None]
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    return jnp.zeros((B, vocab_size), jnp.bool_).at[rows, tokens].max(valid)


def add(seen, tok, sampling, where=None):
    """seen [B, V] with tok [B] added (where [B] given: only in those rows)."""
    if not active(sampling):
        return seen
    B = tok.shape[0]
    on = jnp.ones((B,), jnp.bool_) if where is None else where
    return seen.at[jnp.arange(B), tok].max(on)


def add_many(seen, toks, keep, sampling):
    """seen [B, V] with toks [B, n] added where keep [B, n]."""
    if not active(sampling):
        return seen
    B, n = toks.shape
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, n))
    return seen.at[rows, toks].max(keep)


def verify_seen(seen, drafts, sampling):
    """seen [B, V] (the context through the round's last committed token), drafts [B, k] -> [B, k + 1, V]: row i
    is the context before the verify's logits row i, seen | {d_1..d_i}."""
    if not active(sampling):
        return seen[:, None]
    onehot = jax.nn.one_hot(drafts, seen.shape[-1], dtype=jnp.int32)  # [B, k, V]
    upto = jnp.cumsum(onehot, axis=1) > 0  # row j: d_1..d_{j+1}
    return jnp.concatenate([seen[:, None], seen[:, None] | upto], axis=1)


def apply(logits, seen, sampling):
    """logits [..., V] f32 with the penalty applied at the ids in seen (broadcast against logits); unchanged
    when the penalty is off."""
    if not active(sampling):
        return logits
    x = logits.astype(jnp.float32)
    if isinstance(sampling, RowSampling):
        r = sampling.repetition_penalty.reshape((-1,) + (1,) * (x.ndim - 1))
    else:
        r = jnp.float32(sampling.repetition_penalty)
    return jnp.where(seen, jnp.where(x > 0, x / r, x * r), x)
