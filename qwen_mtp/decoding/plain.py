"""Plain decoding: the first token, chosen from prefill's last hidden (both loops start from it), then one trunk
step per token inside one jitted lax.while_loop (`plain_decode`), its progress between calls in a PlainCarry.
The speculative loop is speculative.py.

The serving engine (qwen_mtp/serving/) runs the same loop over its slots, with per-row settings: carry.rows a
sampling.RowSampling (then carry.key holds one PRNG key per row [B, 2] and each token is chosen by
sampling.row_scores at its own position), eos per row [B, E] (-1 pads), max_new per row [B], and carry.hidden
a [B, until, H] buffer that keeps each step's trunk hidden (so the MTP head's cache can be caught up after a
plain segment). With none of these (generate's call) the loop is the one it always was."""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from qwen_mtp.decoding import penalty
from qwen_mtp.decoding.nonfinite import BIG
from qwen_mtp.decoding.sampling import argmax, choose, row_scores
from qwen_mtp.trunk.forward import forward, lm_logits
from qwen_mtp.trunk.ops import DECODE_COMPILER_OPTIONS, LOOP_COMPILER_OPTIONS


@partial(jax.jit, static_argnames=("sampling",))
def first_token(weights, last, key, seen=None, *, sampling):
    """The logits [B, V] after the prompt, the token chosen from them (under the repetition penalty over the
    prompt's ids `seen` [B, V], penalty.py), and whether they are all finite [B]."""
    with jax.named_scope("first_token"):
        logits = lm_logits(weights, last)
        picked = logits if seen is None else penalty.apply(logits, seen, sampling)
        return logits, choose(key, picked, sampling), jnp.all(jnp.isfinite(logits), axis=-1)


@partial(jax.jit, static_argnames=("vocab_size", "sampling"))
def prompt_seen(tokens, lens, vocab_size, sampling):
    return penalty.prompt_seen(tokens, lens, vocab_size, sampling)


class PlainCarry(NamedTuple):
    """The plain loop's progress between calls of plain_decode (everything but the trunk's state)."""
    tok: jax.Array  # [B] last chosen token, not yet run through the trunk
    pos: jax.Array  # [B] its position
    out: jax.Array  # [B, cap] chosen tokens (pad_id after a row's EOS)
    logits: jax.Array  # [B, cap or 1, V] the logits each token was chosen from (keep_logits)
    n_out: jax.Array  # [B]
    done: jax.Array  # [B]
    key: jax.Array
    i: jax.Array  # () tokens per row so far (the next column of out)
    bad: jax.Array  # [B] the new token whose logits held a NaN / Inf (the row is frozen there); BIG: none
    seen: jax.Array  # [B, V] the ids in each row's context so far (the repetition penalty's); [B, 0] without one
    rows: object = None  # sampling.RowSampling: per-row settings (the engine's); None: the static `sampling`
    hidden: jax.Array | None = None  # [B, until, H]: each step's trunk hidden, kept (the engine's head catch-up)


@partial(jax.jit, static_argnames=("cap", "keep_logits"))
def plain_start(first, first_logits, pos, key, eos, pad_id, seen=None, *, cap, keep_logits) -> PlainCarry:
    """seen: the prompt's ids [B, V] under a repetition penalty (the first token is added), None without one."""
    B, V = first_logits.shape
    seen = penalty.empty(B) if seen is None or seen.shape[1] == 0 else seen.at[jnp.arange(B), first].set(True)
    out = jnp.full((B, cap), pad_id, jnp.int32).at[:, 0].set(first)
    logits = jnp.zeros((B, cap if keep_logits else 1, V), jnp.float32).at[:, 0].set(first_logits)
    done = jnp.any(first[:, None] == eos[None, :], axis=-1)
    return PlainCarry(first, pos, out, logits, jnp.ones((B,), jnp.int32), done, key, jnp.int32(1),
                      jnp.full((B,), BIG, jnp.int32), seen)


@partial(jax.jit, static_argnames=("cfg", "keep_logits", "sampling"), donate_argnames=("state", "carry"),
         compiler_options=LOOP_COMPILER_OPTIONS)
def plain_decode(weights, cfg, state, carry: PlainCarry, eos, pad_id, max_new, until, keep_logits, sampling):
    """Plain decode steps until every row is done, max_new (traced, <= the buffer size cap) tokens per row, or
    `until` tokens per row in all (a streaming caller calls again with a larger one). Returns (state, carry)."""
    B = carry.tok.shape[0]
    rows = carry.rows
    s = sampling if rows is None else rows  # what the penalty reads
    is_eos = lambda t: jnp.any(t[:, None] == (eos[None, :] if eos.ndim == 1 else eos), axis=-1)
    penalty.check_seen(carry.seen, s, cfg.vocab_size)

    def cond(c):
        i = c[1].i
        return jnp.any(i < max_new) & (i < until) & ~jnp.all(c[1].done)

    def body(c):
        state, (tok, pos, out, logits_buf, n_out, done, key, i, bad, seen, _, hid_buf) = c
        with jax.named_scope("step"):  # the trunk; "pick": lm_head and the choice (profiling.py's phases)
            hidden, state = forward(weights, cfg, tok[:, None], state, pos, jnp.ones((B,), jnp.int32),
                                    gdn_mode="step")
        with jax.named_scope("pick"):
            logits = lm_logits(weights, hidden[:, 0])
            if rows is None:
                key, sub = jax.random.split(key)
                nxt = choose(sub, penalty.apply(logits, seen, sampling), sampling)
            else:  # per row: noise of (the row's key, the new token's position)
                nxt = argmax(row_scores(penalty.apply(logits, seen, rows), rows, key, pos + 1))
        with jax.named_scope("commit"):
            nonfinite = ~jnp.all(jnp.isfinite(logits), axis=-1) & ~done  # nothing is emitted from these
            bad = jnp.where(nonfinite, i, bad)
            out = out.at[:, i].set(jnp.where(done | nonfinite, pad_id, nxt))
            if keep_logits:
                logits_buf = logits_buf.at[:, i].set(logits)
            n_out = n_out + (~done & ~nonfinite).astype(jnp.int32)
            done = done | nonfinite | is_eos(nxt) | (n_out >= max_new)
            seen = penalty.add(seen, nxt, s)
            if hid_buf is not None:
                hid_buf = hid_buf.at[:, i].set(hidden[:, 0].astype(hid_buf.dtype))
        return state, PlainCarry(nxt, pos + 1, out, logits_buf, n_out, done, key, i + 1, bad, seen, rows, hid_buf)

    return jax.lax.while_loop(cond, body, (state, carry))


# the same program compiled for few rows (ops.FEW_ROWS): generate picks it at a small batch
plain_decode_few_rows = jax.jit(plain_decode.__wrapped__, static_argnames=("cfg", "keep_logits", "sampling"),
                                donate_argnames=("state", "carry"), compiler_options=DECODE_COMPILER_OPTIONS)
