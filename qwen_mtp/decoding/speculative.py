"""Speculative decoding with the MTP head: draft k, verify k+1 in one trunk forward, accept, roll back.

One round, per row, with x = the last committed token at position pos (not yet run through the trunk) and
m1 = the head's bridge output MTP(embed(x), trunk hidden at pos-1) already computed:
  1. drafts d_1 = pick(m1), d_j = pick(MTP(embed(d_{j-1}), m_{j-1})) for j = 2..k (head KV slots pos..pos+k-2);
  2. verify: ONE trunk forward over [x, d_1..d_k] at positions pos..pos+k, leaving what rebuilds the GDN state
     after any of them (rollback.py); y_i = the trunk's choice after position pos+i;
  3. accept the longest prefix n of drafts that pass (greedy: d_{i+1} == y_i; sampling: Leviathan/Chen
     rejection with the residual norm(max(p - q, 0))), emit d_1..d_n and the bonus y_n;
  4. roll back: each GDN layer continues from its state after position pos+n (rollback.py);
  5. refill the head's KV for the committed rows from the TRUNK's hiddens: rows pos..pos+n get
     (d_1..d_n, bonus) with trunk hiddens g_0..g_n; the output at row pos+n is the next round's bridge.
Under a repetition penalty (penalty.py) every verify row i is penalised with the context through d_i, so the
output is still the plain loop's under the same penalty.
EOS and max_new_tokens cut the emitted tokens exactly; finished rows are frozen. A row whose verify logits (the
rows its tokens come from) hold a NaN / Inf emits nothing that round and is frozen with `bad` set; generate then
raises NonFiniteError (nonfinite.py).
With an fp8 KV cache (generate(kv_dtype=...), state.py) the verify's k+1 rows read each other, and themselves,
as stored (rounded), exactly as k+1 plain steps would: the output is still the plain output under that cache.
With per-row settings (carry.rows a sampling.RowSampling: the serving engine's, plain.py has the carry's other
per-row forms) every draft and every verify row is chosen by sampling.row_scores at the position of the token it
chooses, and a draft is accepted when it equals the verify's choice, as in greedy: sampled rows then commit
exactly the tokens the plain loop commits with the same keys (the Gumbel-max draw of p at each position).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from qwen_mtp.decoding import penalty
from qwen_mtp.decoding.nonfinite import BIG
from qwen_mtp.decoding.rollback import select_states
from qwen_mtp.decoding.sampling import Sampling, argmax, draw, probs, row_scores
from qwen_mtp.errors import ArgumentError, is_python_int
from qwen_mtp.head import draft_vocab
from qwen_mtp.head.mtp import mtp_forward
from qwen_mtp.head.tree import check_tree, ring_draft_slots
from qwen_mtp.trunk.forward import forward, lm_logits
from qwen_mtp.trunk.ops import DECODE_COMPILER_OPTIONS, LOOP_COMPILER_OPTIONS


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """k drafts per round. window None: the draft head attends natively to the whole context. window W
    (Wind-MTP): the draft head sees the first `sinks` positions and the last W, from a ring of
    sinks + W + draft_slots KV slots (k; a tree's depth * width); the trunk's verify is unchanged, so the output is still exactly the trunk's."""
    k: int = 4
    window: int | None = None
    sinks: int = 0
    tree: object = None  # None: a chain; a head/tree.py StaticTree or DynamicTree of depth k (tree_loop.py)

    def __post_init__(self):
        if not is_python_int(self.k) or not 1 <= self.k <= 16:
            raise ArgumentError("SpecConfig.k", "an integer in [1, 16]", repr(self.k))
        if self.window is not None and (not is_python_int(self.window) or self.window < 1):
            raise ArgumentError("SpecConfig.window", "None (native attention) or an integer >= 1", repr(self.window))
        if not is_python_int(self.sinks) or self.sinks < 0:
            raise ArgumentError("SpecConfig.sinks", "an integer >= 0", repr(self.sinks))
        if self.sinks and self.window is None:
            raise ArgumentError("SpecConfig.sinks", "0 when window is None (sinks only apply to a window)",
                                repr(self.sinks))
        if self.tree is not None:
            check_tree(self.tree, self.k)

    @property
    def draft_slots(self) -> int:
        """The Wind-MTP ring's slots past sinks + window: k for a chain, depth * width for a tree (head/tree.py)."""
        return ring_draft_slots(self.k, self.tree)


def draft_vocab_pick(dv, m, sampling, key, vocab_size: int, seen=None, rows=None, at=None):
    """One draft per row from the head output m [B, H] over a draft vocabulary dv (head/draft_vocab.py): (d [B]
    int32 full-vocabulary ids, q [B, V] the draft distribution over the full vocabulary, zero outside dv.ids;
    None when greedy). seen [B, V]: the context's ids under a repetition penalty (penalty.py), None without one.
    rows (a RowSampling, with key [B, 2] and `at` [B] the drafted token's position): row_scores' choice, q None."""
    logits = draft_vocab.draft_logits(dv, m)
    if seen is not None:
        logits = penalty.apply(logits, seen[:, dv.ids], sampling if rows is None else rows)
    if rows is not None:
        return dv.ids[argmax(row_scores(logits, rows, key, at, ids=dv.ids, vocab_size=vocab_size))], None
    if sampling.greedy:
        return dv.ids[argmax(logits)], None
    q_sub = probs(logits, sampling)
    d = dv.ids[draw(key, q_sub)]
    q = jnp.zeros((m.shape[0], vocab_size), q_sub.dtype).at[:, dv.ids].set(q_sub)
    return d, q


# platforms whose programs run the draft steps unrolled, not as a loop. XLA's GPU runtime keeps a loop that holds
# a write at the loop's index (the scan's stacked drafts) on the host, its predicate read back each iteration, so a
# round compiled for cuda ran as three CUDA graphs and a host loop of k - 1 iterations between them (gpu_scale
# --compile-for shows it); unrolled, a round is one graph. A CPU program keeps the loop (fewer ops to compile).
DRAFT_UNROLLED = ("cuda",)


def _draft(weights, cfg, mcache, m1, pos, spec, sampling, key, seen=None, rows=None):
    """Returns drafts D [B, k], their draft distributions Q [B, k, V] (None when greedy), the head cache.
    seen [B, V]: the context's ids under a repetition penalty (penalty.py); each draft is penalised with it and
    the drafts before it, as the verify will be. rows: per-row settings (a RowSampling; key is then [B, 2], and
    draft j, the token at pos + j, is row_scores' choice at that position)."""
    s = sampling if rows is None else rows
    use_seen = seen is not None and penalty.active(s)

    @jax.named_scope("pick")  # the draft's lm_head and choice: a stage of profiling.py
    def pick(m, key, seen, j):
        if weights.draft_vocab is not None:  # a reduced draft vocabulary (draft_vocab.py): q zero outside it
            return draft_vocab_pick(weights.draft_vocab, m, sampling, key, cfg.vocab_size,
                                    seen if use_seen else None, rows, pos + j)
        logits = lm_logits(weights, m)
        if use_seen:
            logits = penalty.apply(logits, seen, s)
        if rows is not None:
            return argmax(row_scores(logits, rows, key, pos + j)), None
        if sampling.greedy:
            return argmax(logits), None
        q = probs(logits, sampling)
        return draw(key, q), q

    k = spec.k
    keys = jax.random.split(key, k) if rows is None else jnp.broadcast_to(key, (k,) + key.shape)
    seen = seen if use_seen else penalty.empty(m1.shape[0])
    d1, q1 = pick(m1, keys[0], seen, 1)

    def step(carry, xs):
        d_prev, m_prev, mcache, seen = carry
        j, key = xs  # draft index j = 1..k-1 (0-based), head row / slot pos - 1 + j
        m, mcache, _ = mtp_forward(weights, cfg, d_prev[:, None], m_prev[:, None], mcache, pos - 1 + j,
                                   window=spec.window, sinks=spec.sinks)
        seen = penalty.add(seen, d_prev, s) if use_seen else seen
        d, q = pick(m[:, 0], key, seen, j + 1)
        return (d, m[:, 0], mcache, seen), (d, q)

    if k == 1:
        D, Q = d1[:, None], (None if q1 is None else q1[:, None])
        return D, Q, mcache
    scan = lambda unroll: lambda carry, xs: jax.lax.scan(step, carry, xs, unroll=unroll)
    # for a GPU the k - 1 steps unrolled (DRAFT_UNROLLED): a loop there runs on the host, a round trip a step
    (_, _, mcache, _), (ds, qs) = jax.lax.platform_dependent(
        (d1, m1, mcache, seen), (jnp.arange(1, k), keys[1:]), default=scan(1),
        **{p: scan(True) for p in DRAFT_UNROLLED})
    D = jnp.concatenate([d1[:, None], ds.T], axis=1)
    Q = None if q1 is None else jnp.concatenate([q1[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)
    return D, Q, mcache


def _accept(D, Q, logits, sampling, key):
    """D [B, k] drafts, Q [B, k, V] draft distributions, logits [B, k+1, V] of the verify.
    Returns (n [B] accepted drafts, bonus [B], passed [B, k] each draft's own test)."""
    B, k = D.shape
    rows = jnp.arange(B)
    if sampling.greedy:
        Y = argmax(logits)
        passed = D == Y[:, :k]
        n = jnp.sum(jnp.cumprod(passed.astype(jnp.int32), axis=1), axis=1)
        return n, Y[rows, n], passed
    P = probs(logits, sampling)  # [B, k+1, V]
    k_u, k_res = jax.random.split(key)
    p_d = jnp.take_along_axis(P[:, :k], D[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(Q, D[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(k_u, (B, k))
    passed = u * q_d < p_d  # u < min(1, p/q), without dividing (q_d > 0: d was drawn from q)
    n = jnp.sum(jnp.cumprod(passed.astype(jnp.int32), axis=1), axis=1)
    p_n = P[rows, n]
    q_n = jnp.concatenate([Q, jnp.zeros_like(Q[:, :1])], axis=1)[rows, n]  # q = 0 after the last draft
    residual = jnp.maximum(p_n - q_n, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_n)
    return n, draw(k_res, residual), passed


class SpecCarry(NamedTuple):
    """The speculative loop's progress between calls of spec_decode (everything but the model's caches)."""
    pos: jax.Array  # [B] position of x
    x: jax.Array  # [B] last committed token, not yet run through the trunk
    m1: jax.Array  # [B, H] the head's bridge output for x
    out: jax.Array  # [B, cap + k + 1] committed tokens (pad_id after a row's count)
    n_out: jax.Array  # [B] committed tokens per row
    done: jax.Array  # [B] row finished (EOS or max_new)
    key: jax.Array  # PRNG key
    hist: jax.Array  # [k + 1] accepted-draft histogram H[n] over active rows
    hits: jax.Array  # [k] per draft position, how often its own test passed
    rounds: jax.Array  # () rounds run so far
    bad: jax.Array  # [B] the new token whose logits held a NaN / Inf (the row is frozen there); BIG: none
    seen: jax.Array  # [B, V] the ids in each row's context so far (the repetition penalty's); [B, 0] without one
    rows: object = None  # sampling.RowSampling: per-row settings (the engine's); key is then [B, 2]
    row_rounds: jax.Array | None = None  # [B] rounds each row took part in (kept when given: the engine's)
    row_accepted: jax.Array | None = None  # [B] drafts each row had accepted


@partial(jax.jit, static_argnames=("cap", "spec"))
def spec_start(first, bridge, pos, key, eos, pad_id, max_new, cap, spec: SpecConfig, seen=None) -> SpecCarry:
    """first [B]: the first new token (at positions pos [B]); bridge [B, H]: the head's output for it.
    max_new (traced) <= cap (static buffer size). seen: the prompt's ids [B, V] under a repetition penalty (the
    first token is added), None without one."""
    B, k = first.shape[0], spec.k
    seen = penalty.empty(B) if seen is None or seen.shape[1] == 0 else seen.at[jnp.arange(B), first].set(True)
    out = jnp.full((B, cap + k + 1), pad_id, jnp.int32).at[:, 0].set(first)
    done = jnp.any(first[:, None] == eos, axis=-1) | (max_new <= 1)
    return SpecCarry(pos, first, bridge, out, jnp.ones((B,), jnp.int32), done, key, jnp.zeros((k + 1,), jnp.int32),
                     jnp.zeros((k,), jnp.int32), jnp.int32(0), jnp.full((B,), BIG, jnp.int32), seen)


@partial(jax.jit, static_argnames=("cfg", "spec", "sampling"), donate_argnames=("state", "mcache", "carry"),
         compiler_options=LOOP_COMPILER_OPTIONS)
def spec_decode(weights, cfg, state, mcache, carry: SpecCarry, eos, max_new, until, spec: SpecConfig,
                sampling: Sampling):
    """Speculative rounds until every row is done or `until` rounds have run in all (carry.rounds), in one
    lax.while_loop. A caller streaming tokens calls it again with a larger `until` after reading carry.out;
    otherwise one call with until >= cap runs to the end. Returns (state, mcache, carry);
    carry.out[:, :cap] and carry.n_out are the tokens and counts."""
    B = carry.x.shape[0]
    k = spec.k
    rows = jnp.arange(B)
    per_row = carry.rows  # a RowSampling (per-row settings), or None
    s = sampling if per_row is None else per_row  # what the penalty reads
    if per_row is not None:
        sampling = Sampling()  # per-row rows are chosen by row_scores and accepted as greedy ones are
    penalty.check_seen(carry.seen, s, cfg.vocab_size)
    idx = jnp.arange(k + 1)
    is_eos = lambda t: jnp.any(t[..., None] == (eos if eos.ndim == 1 else eos[:, None, :]), axis=-1)

    def body(c):
        state, mcache, cr = c
        pos, x, m1, out, n_out, done, key, hist, hits, rounds, bad, seen, _, row_rounds, row_accepted = cr
        if per_row is None:
            key, k_draft, k_acc = jax.random.split(key, 3)
        else:
            k_draft = k_acc = key
        with jax.named_scope("draft"):
            D, Q, mcache = _draft(weights, cfg, mcache, m1, pos, spec, sampling, k_draft, seen, per_row)

        with jax.named_scope("verify"):
            tokens = jnp.concatenate([x[:, None], D], axis=1)  # [B, k+1]
            hidden, verified = forward(weights, cfg, tokens, state, pos, jnp.full((B,), k + 1, jnp.int32),
                                       gdn_mode="verify")
            logits = lm_logits(weights, hidden)
        with jax.named_scope("accept"):
            # row i is chosen under the context the plain loop would have there: seen | {d_1..d_i}
            picked = penalty.apply(logits, penalty.verify_seen(seen, D, s), s)
            if per_row is not None:  # verify row i chooses the token at pos + 1 + i
                picked = row_scores(picked, per_row, key, pos[:, None] + 1 + idx[None])
            n, bonus, passed = _accept(D, Q, picked, sampling, k_acc)

        with jax.named_scope("commit"):
            # emitted this round: d_1..d_n, bonus; cut at the first EOS and at max_new
            emitted = jnp.where(idx[None] < n[:, None], jnp.pad(D, ((0, 0), (0, 1))), bonus[:, None])
            cnt = n + 1
            eos_at = jnp.where(is_eos(emitted) & (idx[None] < cnt[:, None]), idx[None], k + 1).min(axis=1)
            hit_eos = eos_at <= k
            cnt = jnp.minimum(jnp.where(hit_eos, eos_at + 1, cnt), max_new - n_out)
            # a NaN / Inf in the logits this round's tokens come from (rows 0..n): nothing is emitted, the row stops
            nonfinite = jnp.any(~jnp.isfinite(logits) & (idx[None, :, None] <= n[:, None, None]), axis=(1, 2)) & ~done
            bad = jnp.where(nonfinite, n_out, bad)
            cnt = jnp.where(done | nonfinite, 0, cnt)
            write = jax.vmap(lambda o, e, s, c_: jax.lax.dynamic_update_slice(
                o, jnp.where(idx < c_, e, jax.lax.dynamic_slice(o, (s,), (k + 1,))), (s,)))
            out = write(out, emitted, n_out, cnt)
            active = ~done
            hist = hist + jnp.zeros((k + 1,), jnp.int32).at[n].add(active.astype(jnp.int32))
            hits = hits + jnp.sum(passed & active[:, None], axis=0).astype(jnp.int32)
            seen = penalty.add_many(seen, emitted, idx[None] < cnt[:, None], s)
            if row_rounds is not None:
                row_rounds = row_rounds + active.astype(jnp.int32)
                row_accepted = row_accepted + jnp.where(active, n, 0)

        # roll back the GDN states to the accepted count; refill the head's KV from the trunk's hiddens
        with jax.named_scope("rollback"):
            state = select_states(verified, n)
        with jax.named_scope("refill"):
            fill = jnp.where(idx[None] < n[:, None], jnp.pad(D, ((0, 0), (0, 1))), bonus[:, None])
            m_all, mcache, _ = mtp_forward(weights, cfg, fill, hidden, mcache, pos, window=spec.window,
                                           sinks=spec.sinks)
            m1 = m_all[rows, n]

        n_out = n_out + cnt
        new_done = done | (hit_eos & active) | (n_out >= max_new) | nonfinite
        pos = jnp.where(done, pos, pos + n + 1)
        x = jnp.where(done, x, bonus)
        return state, mcache, SpecCarry(pos, x, m1, out, n_out, new_done, key, hist, hits, rounds + 1, bad, seen,
                                        per_row, row_rounds, row_accepted)

    cond = lambda c: ~jnp.all(c[2].done) & (c[2].rounds < until)
    return jax.lax.while_loop(cond, body, (state, mcache, carry))


# the same program compiled for few rows (ops.FEW_ROWS): generate picks it when batch x (k + 1) is small
spec_decode_few_rows = jax.jit(spec_decode.__wrapped__, static_argnames=("cfg", "spec", "sampling"),
                               donate_argnames=("state", "mcache", "carry"), compiler_options=DECODE_COMPILER_OPTIONS)
