"""The engine's slots on the device, and the programs that run them.

`Slots` holds, for each of max_batch slots (rows), what `generate` keeps per row: the trunk's state (KV caches,
GDN conv / recurrent state), the MTP head's cache (native, or the Wind-MTP ring sized for the largest k), the
last committed token and its position, the head's bridge output for it, the PRNG key, the repetition penalty's
context `seen`, the request's sampling values, its stop ids and the tokens it may still commit.

Programs (each jitted once per shape; none depends on a request's values):
  * prefill_chunk_program / head_chunk_program: one chunk of one request's prefill at batch 1 (prefill.py's
    trunk_chunk and mtp_chunk, chunk sizes bucketed as generate buckets them: 16, 32, ... prefill_chunk);
  * first_pick: the first token, from prefill's last hidden, by sampling.row_scores;
  * insert: writes a prefilled request (batch 1) into slot b (b traced);
  * segment: gathers the busy slots' rows (a sub-batch of `bucket` rows), runs the plain loop (plain.py's
    plain_decode) for `steps` steps or the speculative loop (speculative.py's spec_decode) for `steps` rounds
    on them, with per-row settings (sampling.RowSampling), per-row stop ids and per-row token budgets, and
    scatters them back. After a plain segment in an engine that may speculate, the head's cache is caught up
    from the trunk's hiddens of those steps (row p gets the token at p + 1 and the trunk hidden at p, exactly
    what a speculative round's refill writes), so the next segment may speculate.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import struct

from qwen_mtp.decoding import penalty
from qwen_mtp.decoding.nonfinite import BIG
from qwen_mtp.decoding.plain import PlainCarry, plain_decode
from qwen_mtp.decoding.sampling import RowSampling, Sampling, argmax, row_scores
from qwen_mtp.decoding.speculative import SpecCarry, SpecConfig, spec_decode
from qwen_mtp.head.mtp import init_mtp_cache, mtp_forward
from qwen_mtp.trunk.forward import lm_logits
from qwen_mtp.trunk.ops import DECODE_COMPILER_OPTIONS, FEW_ROWS, LOOP_COMPILER_OPTIONS
from qwen_mtp.trunk.state import init_state

PAD = -1  # out-buffer filler and stop-id filler (no token id is negative)


@struct.dataclass
class Slots:
    state: tuple  # the trunk's per-layer state, batch max_batch
    mcache: object  # the head's cache (KVCache, native or ring), or None without speculation
    tok: jax.Array  # [B] last committed token, not yet run through the trunk
    pos: jax.Array  # [B] its position
    m1: jax.Array  # [B, H] the head's bridge output for tok ([B, 0] without speculation)
    key: jax.Array  # [B, 2] uint32: each request's own PRNG key (the seed's)
    seen: jax.Array  # [B, V] bool: each row's context ids (for the repetition penalty)
    temperature: jax.Array  # [B] f32
    top_k: jax.Array  # [B] int32
    top_p: jax.Array  # [B] f32
    penalty: jax.Array  # [B] f32
    eos: jax.Array  # [B, E] int32 stop ids (EOS and the request's), PAD-filled
    remaining: jax.Array  # [B] int32 tokens the request may still commit
    done: jax.Array  # [B] bool: nothing runs in this slot (free, or its request finished)


@partial(jax.jit, static_argnames=("cfg", "batch", "length", "dtype", "kv_dtype", "head", "n_stop"))
def init_slots(cfg, batch, length, dtype, kv_dtype, head, n_stop) -> Slots:
    """Zero slots, all free. head: None (no speculation) or (window, sinks, largest k) of the head's cache."""
    mcache, m1 = None, jnp.zeros((batch, 0), dtype)
    if head is not None:
        window, sinks, kmax = head
        mcache = init_mtp_cache(cfg, batch, length, kv_dtype, window=window, sinks=sinks, k=kmax)
        m1 = jnp.zeros((batch, cfg.hidden_size), dtype)
    f32, i32 = jnp.float32, jnp.int32
    return Slots(init_state(cfg, batch, length, dtype, kv_dtype), mcache, jnp.zeros((batch,), i32),
                 jnp.zeros((batch,), i32), m1, jnp.zeros((batch, 2), jnp.uint32),
                 jnp.zeros((batch, cfg.vocab_size), jnp.bool_), jnp.zeros((batch,), f32), jnp.zeros((batch,), i32),
                 jnp.ones((batch,), f32), jnp.ones((batch,), f32), jnp.full((batch, n_stop), PAD, i32),
                 jnp.zeros((batch,), i32), jnp.ones((batch,), jnp.bool_))


@partial(jax.jit, static_argnames=("length", "dtype", "kv_dtype", "cfg"))
def one_state(cfg, length, dtype, kv_dtype):
    """A zero trunk state for one request's prefill."""
    return init_state(cfg, 1, length, dtype, kv_dtype)


@partial(jax.jit, static_argnames=("cfg", "length", "kv_dtype", "head"))
def one_head_cache(cfg, length, kv_dtype, head):
    window, sinks, kmax = head
    return init_mtp_cache(cfg, 1, length, kv_dtype, window=window, sinks=sinks, k=kmax)


@partial(jax.jit, static_argnames=("sample", "penalize"))
def first_pick(weights, last, prompt, n_prompt, key, temperature, top_k, top_p, pen, *, sample, penalize):
    """The first token of one request (batch 1) from prefill's last hidden [1, H]: (token [1], its logits are
    finite [1], seen [1, V] = the prompt's ids and that token). prompt [1, S] padded, n_prompt [1]."""
    rows = RowSampling(temperature, top_k, top_p, pen, sample, penalize)
    logits = lm_logits(weights, last)
    V = logits.shape[-1]
    valid = jnp.arange(prompt.shape[1])[None] < n_prompt[:, None]
    seen = jnp.zeros((1, V), jnp.bool_).at[jnp.zeros_like(prompt), prompt].max(valid)
    picked = penalty.apply(logits, seen if penalize else penalty.empty(1), rows)
    first = argmax(row_scores(picked, rows, key, n_prompt))  # the token at position n_prompt
    return first, jnp.all(jnp.isfinite(logits), axis=-1), seen.at[0, first[0]].set(True)


@partial(jax.jit, donate_argnames=("slots",))
def insert(slots: Slots, b, state, mcache, tok, pos, m1, key, seen, temperature, top_k, top_p, pen, eos, remaining):
    """Slot b := one prefilled request (every argument after b has batch 1)."""
    put = lambda big, one: big.at[b].set(one[0].astype(big.dtype))
    return slots.replace(
        state=jax.tree.map(put, slots.state, state),
        mcache=None if slots.mcache is None else jax.tree.map(put, slots.mcache, mcache),
        tok=put(slots.tok, tok), pos=put(slots.pos, pos),
        m1=slots.m1 if slots.m1.shape[1] == 0 else put(slots.m1, m1), key=put(slots.key, key),
        seen=put(slots.seen, seen), temperature=put(slots.temperature, temperature), top_k=put(slots.top_k, top_k),
        top_p=put(slots.top_p, top_p), penalty=put(slots.penalty, pen), eos=put(slots.eos, eos),
        remaining=put(slots.remaining, remaining), done=slots.done.at[b].set(remaining[0] <= 0))


@partial(jax.jit, donate_argnames=("slots",))
def release(slots: Slots, free):
    """Mark the slots where free [B] is set as done (their requests finished or were cancelled)."""
    return slots.replace(done=slots.done | free)


def _take(tree, idx):
    return jax.tree.map(lambda x: x[idx], tree)


def _put(tree, idx, sub):
    return jax.tree.map(lambda x, s: x.at[idx].set(s), tree, sub)


def _segment(weights, cfg, slots: Slots, idx, *, k, spec, steps, full, sample, penalize, catch_up):
    """Run `steps` plain steps (k = 0) or speculative rounds (k > 0) over the slots idx [bucket] (every slot when
    full). Returns (slots, out [bucket, W] committed ids (PAD after each row's count), n_out [bucket], done,
    bad [bucket] (BIG: finite), rounds [bucket], accepted [bucket], hist [k + 1], hits [k])."""
    sub = slots if full else _take(slots, idx)
    b = sub.tok.shape[0]
    rows = RowSampling(sub.temperature, sub.top_k, sub.top_p, sub.penalty, sample, penalize)
    seen = sub.seen if penalize else penalty.empty(b)
    zeros = jnp.zeros((b,), jnp.int32)
    pad = jnp.int32(PAD)
    greedy = Sampling()
    mcache, m1 = sub.mcache, sub.m1
    if k == 0:
        hidden = jnp.zeros((b, steps, cfg.hidden_size), sub.m1.dtype) if catch_up else None
        carry = PlainCarry(sub.tok, sub.pos, jnp.full((b, steps), pad), jnp.zeros((b, 1, 1), jnp.float32), zeros,
                           sub.done, sub.key, jnp.int32(0), jnp.full((b,), BIG, jnp.int32), seen, rows, hidden)
        state, carry = plain_decode.__wrapped__(weights, cfg, sub.state, carry, sub.eos, pad, sub.remaining,
                                                jnp.int32(steps), keep_logits=False, sampling=greedy)
        if catch_up:  # head row p: (the token at p + 1, the trunk hidden at p), as a round's refill writes it
            with jax.named_scope("head_catch_up"):
                fill = jnp.where(carry.out == pad, 0, carry.out)
                m_all, mcache, _ = mtp_forward(weights, cfg, fill, carry.hidden, mcache, sub.pos,
                                               window=spec.window, sinks=spec.sinks)
                m1 = m_all[:, -1]
        tok, rounds, accepted = carry.tok, zeros, zeros
        hist, hits = jnp.zeros((1,), jnp.int32), jnp.zeros((0,), jnp.int32)
    else:
        width = steps * (k + 1) + k + 1
        carry = SpecCarry(sub.pos, sub.tok, sub.m1, jnp.full((b, width), pad), zeros, sub.done, sub.key,
                          jnp.zeros((k + 1,), jnp.int32), jnp.zeros((k,), jnp.int32), jnp.int32(0),
                          jnp.full((b,), BIG, jnp.int32), seen, rows, zeros, zeros)
        state, mcache, carry = spec_decode.__wrapped__(weights, cfg, sub.state, mcache, carry, sub.eos,
                                                       sub.remaining, jnp.int32(steps), spec=spec, sampling=greedy)
        tok, m1, rounds, accepted = carry.x, carry.m1, carry.row_rounds, carry.row_accepted
        hist, hits = carry.hist, carry.hits
    new = sub.replace(state=state, mcache=mcache, tok=tok, pos=carry.pos, m1=m1,
                      seen=carry.seen if penalize else sub.seen, remaining=sub.remaining - carry.n_out,
                      done=carry.done)
    slots = new if full else _put(slots, idx, new)
    return slots, carry.out, carry.n_out, carry.done, carry.bad, rounds, accepted, hist, hits


_STATIC = ("cfg", "k", "spec", "steps", "full", "sample", "penalize", "catch_up")
_segment_many = jax.jit(_segment, static_argnames=_STATIC, donate_argnames=("slots",),
                        compiler_options=LOOP_COMPILER_OPTIONS)
_segment_few = jax.jit(_segment, static_argnames=_STATIC, donate_argnames=("slots",),
                       compiler_options=DECODE_COMPILER_OPTIONS)


def segment_program(bucket: int, k: int):
    """The compiled form generate would pick for these rows (ops.FEW_ROWS): the same compiler options."""
    return _segment_few if bucket * (k + 1) <= FEW_ROWS else _segment_many


def spec_for(k: int, window, sinks) -> SpecConfig | None:
    return None if k == 0 else SpecConfig(k=k, window=window, sinks=sinks)
