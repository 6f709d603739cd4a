"""Token selection: greedy, or temperature / top-k / top-p sampling from a processed distribution. The
repetition penalty (penalty.py) is applied to the logits before either.

The same `probs` function shapes both the trunk's distribution p and the draft's q, so speculative
rejection sampling reproduces plain sampling from p exactly.

Per-row settings (the serving engine's): `RowSampling` holds each row's temperature / top-k / top-p / penalty as
traced arrays in a decode loop's carry (so one compiled program serves any mix of requests; its static flags
choose a greedy-only or a sampling program and whether the penalty's context is kept). Its rows choose by
`row_scores`: the argmax of log p + Gumbel noise drawn from (the row's key, the position of the token being
chosen), the Gumbel-max form of a draw from p. The noise depends on the row's own seed and position only, never
on the batch or the step count, so the plain loop and the speculative loop (which then accepts a draft exactly
when it equals that argmax, as greedy does) commit the same tokens, and a seeded row's output does not depend on
what runs beside it. generate keeps its static `Sampling` and its key chain, unchanged.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from qwen_mtp.errors import ArgumentError


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    repetition_penalty: float = 1.0  # 1: off; applied before the rest (penalty.py)

    def __post_init__(self):
        t, k, p, r = self.temperature, self.top_k, self.top_p, self.repetition_penalty
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0 or t == float("inf"):
            raise ArgumentError("temperature", "a finite number >= 0 (0 = greedy)", repr(t))
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ArgumentError("top_k", "an integer >= 0 (0 = off)", repr(k))
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ArgumentError("top_p", "a number in (0, 1] (1 = off)", repr(p))
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < float("inf"):
            raise ArgumentError("repetition_penalty", "a finite number > 0 (1 = off)", repr(r))
        object.__setattr__(self, "repetition_penalty", float(r))  # 1 and 1.0: one program

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs(logits, s: Sampling):
    """logits [..., V] -> the sampling distribution [..., V] (f32) after temperature, top-k and top-p."""
    x = logits.astype(jnp.float32) / s.temperature
    if s.top_k and s.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, s.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    p = jax.nn.softmax(x, axis=-1)
    if s.top_p < 1.0:
        order = jnp.argsort(-p, axis=-1)
        sorted_p = jnp.take_along_axis(p, order, axis=-1)
        before = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly above each token
        keep_sorted = before < s.top_p  # smallest prefix whose mass reaches top_p (the top token always kept)
        keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)  # back to vocab order
        p = jnp.where(keep, p, 0.0)
        p = p / jnp.sum(p, axis=-1, keepdims=True)
    return p


def argmax(x):
    """jnp.argmax(x, axis=-1) as int32: the first maximum, or the first NaN where there is one. Computed as a
    max and then the smallest index that holds it: XLA's CPU backend runs argmax's (value, index) reduction
    4x to 7x slower (one row of 248320 f32 logits: 1.1 ms against 0.16-0.18; four rows 2.4 ms against
    0.53-0.58; 2-core CPU, paired), a cost every decode step and every draft pays."""
    top = jnp.max(x, axis=-1, keepdims=True)
    at = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where((x == top) | jnp.isnan(x), at, x.shape[-1]), axis=-1)


def draw(key, p):
    """One token per row from p [B, V]: jax.random.categorical(key, log p), the same Gumbel draw, argmax'd by
    `argmax`."""
    return argmax(jax.random.gumbel(key, p.shape, p.dtype) + jnp.log(p))


def choose(key, logits, s: Sampling):
    """Next token per row from logits [B, V]: argmax when greedy, else a draw from probs(logits)."""
    if s.greedy:
        return argmax(logits)
    return draw(key, probs(logits, s))


@struct.dataclass
class RowSampling:
    """Per-row sampling values, traced ([B] each), carried in a decode loop's carry (PlainCarry.rows,
    SpecCarry.rows). temperature 0: that row is greedy. sample False (static): every row greedy, the noise and the
    distribution are not computed at all; penalize False (static): no row has a repetition penalty and no context
    `seen` is kept (penalty.py)."""
    temperature: jax.Array  # [B] f32
    top_k: jax.Array  # [B] int32, 0 = off
    top_p: jax.Array  # [B] f32, 1 = off
    repetition_penalty: jax.Array  # [B] f32, 1 = off
    sample: bool = struct.field(pytree_node=False, default=False)
    penalize: bool = struct.field(pytree_node=False, default=False)

    @property
    def greedy(self) -> bool:  # static: the program is greedy-only
        return not self.sample

    def take(self, idx):
        """The rows idx [b] (a sub-batch)."""
        return self.replace(temperature=self.temperature[idx], top_k=self.top_k[idx], top_p=self.top_p[idx],
                            repetition_penalty=self.repetition_penalty[idx])


def row_sampling(temperature, top_k, top_p, repetition_penalty, sample: bool, penalize: bool) -> RowSampling:
    f32 = lambda v: jnp.asarray(np.asarray(v, np.float32))
    return RowSampling(f32(temperature), jnp.asarray(np.asarray(top_k, np.int32)), f32(top_p),
                       f32(repetition_penalty), sample, penalize)


def _per_row(v, ndim):
    """[B] -> [B, 1, ..., 1] with ndim dims in all."""
    return v.reshape(v.shape + (1,) * (ndim - 1))


def row_probs(logits, s: RowSampling):
    """logits [B, ..., V] -> each row's distribution [B, ..., V] (f32) under its own temperature, top-k and
    top-p: the same operations as `probs` with per-row values (a greedy row's is computed at temperature 1 and
    not used)."""
    x = logits.astype(jnp.float32)
    V = x.shape[-1]
    t = _per_row(s.temperature, x.ndim)
    x = x / jnp.where(t > 0, t, 1.0)
    k = _per_row(s.top_k, x.ndim)

    def cut_top_k(x):
        desc = -jnp.sort(-x, axis=-1)
        kth = jnp.take_along_axis(desc, jnp.broadcast_to(jnp.clip(k - 1, 0, V - 1), x.shape[:-1] + (1,)), axis=-1)
        return jnp.where((k > 0) & (k < V) & (x < kth), -jnp.inf, x)

    x = jax.lax.cond(jnp.any((s.top_k > 0) & (s.top_k < V)), cut_top_k, lambda x: x, x)
    p = jax.nn.softmax(x, axis=-1)
    top_p = _per_row(s.top_p, x.ndim)

    def cut_top_p(p):
        order = jnp.argsort(-p, axis=-1)
        sorted_p = jnp.take_along_axis(p, order, axis=-1)
        before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
        keep = jnp.take_along_axis(before < top_p, jnp.argsort(order, axis=-1), axis=-1)
        q = jnp.where(keep, p, 0.0)
        return jnp.where(top_p < 1.0, q / jnp.sum(q, axis=-1, keepdims=True), p)

    return jax.lax.cond(jnp.any(s.top_p < 1.0), cut_top_p, lambda p: p, p)


def position_noise(keys, positions, V: int):
    """Gumbel noise [B, ..., V]: row b's at position p from jax.random.fold_in(keys[b], p) alone. keys [B, 2]
    uint32 (one PRNG key per row), positions [B, ...] int32."""
    B = keys.shape[0]
    flat = positions.reshape(B, -1)

    def row(key, ps):
        return jax.vmap(lambda p: jax.random.gumbel(jax.random.fold_in(key, p), (V,), jnp.float32))(ps)

    return jax.vmap(row)(keys, flat).reshape(positions.shape + (V,))


def row_scores(logits, s: RowSampling, keys, positions, ids=None, vocab_size: int = 0):
    """What a RowSampling row takes the argmax of: the (penalised) logits for a greedy row; log p + Gumbel noise
    of (its key, the position of the token being chosen) for a sampled one, p = row_probs. logits [B, ..., V'],
    positions [B, ...]; ids [V'] with vocab_size (a reduced draft vocabulary, head/draft_vocab.py): the
    full-vocabulary ids of the last axis, whose noise is the full vocabulary's at those ids, so a draft sees the
    noise its verify will see."""
    x = logits.astype(jnp.float32)
    if not s.sample:
        return x
    noise = position_noise(keys, positions, x.shape[-1] if ids is None else vocab_size)
    if ids is not None:
        noise = noise[..., ids]
    scores = jnp.log(row_probs(x, s)) + noise
    return jnp.where(_per_row(s.temperature, x.ndim) > 0, scores, x)
