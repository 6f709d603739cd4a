"""Tree speculation: the rounds of speculative.py with a draft tree instead of a chain, in one jitted
lax.while_loop (generate runs it for spec=SpecConfig(k, tree=...)).

One round, per row, with x the last committed token at pos and m1 the head's bridge output for it:
  1. draft the tree level by level with the head (tree_draft.py);
  2. verify: ONE trunk forward over the N1 tree rows (tree_verify.py: ancestor mask in attention, each node's
     path in GDN);
  3. accept a path (tree_accept.py), emit its n drafts and the bonus (cut at EOS and max_new, as the chain);
  4. commit: the path's K / V into the attention caches, the GDN state and conv window after its last node;
  5. refill the head's KV (native cache or Wind-MTP ring) along the path from the trunk's hiddens, as the chain
     refills its accepted prefix; the other branches' head entries are dropped (native: they lived in the round's
     buffer; Wind-MTP: their ring slots are out of every window until the refills overwrite them, head/tree.py).
Repetition penalty: node i's logits (and its children's drafts) are penalised with the context through i's
path. A NaN / Inf in the logits of the path's rows (root .. last accepted node) freezes the row with `bad` set.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qwen_mtp.decoding import penalty
from qwen_mtp.decoding.nonfinite import BIG
from qwen_mtp.decoding.sampling import Sampling
from qwen_mtp.decoding.tree_accept import accept_tree
from qwen_mtp.decoding.tree_draft import draft_tree
from qwen_mtp.decoding.tree_verify import commit_path, tree_forward
from qwen_mtp.head.mtp import mtp_forward
from qwen_mtp.head.tree import DynamicTree, path_seen, tree_of
from qwen_mtp.trunk.forward import lm_logits
from qwen_mtp.trunk.ops import DECODE_COMPILER_OPTIONS, LOOP_COMPILER_OPTIONS


class TreeCarry(NamedTuple):
    """speculative.SpecCarry's fields (the same meaning; hist [D + 1], hits [D]) and the tree's statistics."""
    pos: jax.Array
    x: jax.Array
    m1: jax.Array
    out: jax.Array  # [B, cap + D + 1]
    n_out: jax.Array
    done: jax.Array
    key: jax.Array
    hist: jax.Array  # [D + 1] H[n] over active rows
    hits: jax.Array  # [D] the rank-0 path's own tests
    rounds: jax.Array
    bad: jax.Array
    seen: jax.Array
    depth_try: jax.Array  # [D] rounds whose walk tried a child at depth d
    depth_acc: jax.Array  # [D] ... and accepted one
    rank_try: jax.Array  # [W] sibling rank s tried
    rank_acc: jax.Array  # [W] ... and accepted


@partial(jax.jit, static_argnames=("cap", "spec"))
def tree_start(first, bridge, pos, key, eos, pad_id, max_new, cap, spec, seen=None) -> TreeCarry:
    """As speculative.spec_start."""
    B, D, W = first.shape[0], spec.k, tree_of(spec).max_children
    seen = penalty.empty(B) if seen is None or seen.shape[1] == 0 else seen.at[jnp.arange(B), first].set(True)
    out = jnp.full((B, cap + D + 1), pad_id, jnp.int32).at[:, 0].set(first)
    done = jnp.any(first[:, None] == eos, axis=-1) | (max_new <= 1)
    z = lambda n: jnp.zeros((n,), jnp.int32)
    return TreeCarry(pos, first, bridge, out, jnp.ones((B,), jnp.int32), done, key, z(D + 1), z(D), jnp.int32(0),
                     jnp.full((B,), BIG, jnp.int32), seen, z(D), z(D), z(W), z(W))


@partial(jax.jit, static_argnames=("cfg", "spec", "sampling"), donate_argnames=("state", "mcache", "carry"),
         compiler_options=LOOP_COMPILER_OPTIONS)
def tree_decode(weights, cfg, state, mcache, carry: TreeCarry, eos, max_new, until, spec, sampling: Sampling):
    """Tree rounds until every row is done or `until` rounds have run in all; as speculative.spec_decode."""
    B, D = carry.x.shape[0], spec.k
    rows = jnp.arange(B)
    penalty.check_seen(carry.seen, sampling, cfg.vocab_size)
    idx = jnp.arange(D + 1)
    is_eos = lambda t: jnp.any(t[..., None] == eos, axis=-1)
    deterministic = isinstance(tree_of(spec), DynamicTree)
    use_seen = penalty.active(sampling)

    def body(c):
        state, mcache, cr = c
        key, k_draft, k_acc = jax.random.split(cr.key, 3)
        with jax.named_scope("draft"):
            tokens, layout, Q, mcache = draft_tree(weights, cfg, mcache, cr.m1, cr.x, cr.pos, spec, sampling,
                                                   k_draft, cr.seen)
        with jax.named_scope("verify"):
            hidden, verified = tree_forward(weights, cfg, tokens, state, cr.pos, layout)
            logits = lm_logits(weights, hidden)  # [B, N1, V]
        with jax.named_scope("accept"):
            picked = penalty.apply(logits, path_seen(cr.seen, tokens, layout.mask), sampling) if use_seen else logits
            acc = accept_tree(tokens, layout, Q, picked, sampling, k_acc, deterministic)
            n, path, bonus = acc.n, acc.path, acc.bonus
        with jax.named_scope("commit"):
            drafts = jnp.take_along_axis(tokens, path, axis=1)[:, 1:]  # [B, D] the path's tokens by depth
            emitted = jnp.where(idx[None] < n[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), bonus[:, None])
            cnt = n + 1
            eos_at = jnp.where(is_eos(emitted) & (idx[None] < cnt[:, None]), idx[None], D + 1).min(axis=1)
            hit_eos = eos_at <= D
            cnt = jnp.minimum(jnp.where(hit_eos, eos_at + 1, cnt), max_new - cr.n_out)
            path_logits = jnp.take_along_axis(logits, path[:, :, None], axis=1)  # [B, D + 1, V]
            nonfinite = jnp.any(~jnp.isfinite(path_logits) & (idx[None, :, None] <= n[:, None, None]),
                                axis=(1, 2)) & ~cr.done
            bad = jnp.where(nonfinite, cr.n_out, cr.bad)
            cnt = jnp.where(cr.done | nonfinite, 0, cnt)
            write = jax.vmap(lambda o, e, s, c_: jax.lax.dynamic_update_slice(
                o, jnp.where(idx < c_, e, jax.lax.dynamic_slice(o, (s,), (D + 1,))), (s,)))
            out = write(cr.out, emitted, cr.n_out, cnt)
            active = ~cr.done
            count = lambda a: jnp.sum(a & active[:, None], axis=0).astype(jnp.int32)
            hist = cr.hist + jnp.zeros((D + 1,), jnp.int32).at[n].add(active.astype(jnp.int32))
            seen = penalty.add_many(cr.seen, emitted, idx[None] < cnt[:, None], sampling)
        with jax.named_scope("rollback"):
            state = commit_path(verified, state, layout, path, n, cr.pos)
        with jax.named_scope("refill"):
            h_path = jnp.take_along_axis(hidden, path[:, :, None], axis=1)  # [B, D + 1, H]
            m_all, mcache, _ = mtp_forward(weights, cfg, emitted, h_path, mcache, cr.pos, window=spec.window,
                                           sinks=spec.sinks)
            m1 = m_all[rows, n]
        n_out = cr.n_out + cnt
        new_done = cr.done | (hit_eos & active) | (n_out >= max_new) | nonfinite
        pos = jnp.where(cr.done, cr.pos, cr.pos + n + 1)
        x = jnp.where(cr.done, cr.x, bonus)
        return state, mcache, TreeCarry(pos, x, m1, out, n_out, new_done, key, hist, cr.hits + count(acc.hits),
                                        cr.rounds + 1, bad, seen, cr.depth_try + count(acc.depth_try),
                                        cr.depth_acc + count(acc.depth_acc), cr.rank_try + count(acc.rank_try),
                                        cr.rank_acc + count(acc.rank_acc))

    cond = lambda c: ~jnp.all(c[2].done) & (c[2].rounds < until)
    return jax.lax.while_loop(cond, body, (state, mcache, carry))


# the same program for few rows (ops.FEW_ROWS): generate picks it when batch x tree rows is small
tree_decode_few_rows = jax.jit(tree_decode.__wrapped__, static_argnames=("cfg", "spec", "sampling"),
                               donate_argnames=("state", "mcache", "carry"), compiler_options=DECODE_COMPILER_OPTIONS)


def tree_rows(spec) -> int:
    """Rows of one verify (root included)."""
    return tree_of(spec).nodes + 1


def tree_stats(depth_try, depth_acc, rank_try, rank_acc) -> dict:
    """The tree's statistics (host arrays: TreeCarry's last four fields) as GenerateStats.tree: per depth d and
    per sibling rank s, tries, accepts and the acceptance rate accepts / tries (nan where never tried)."""
    rate = lambda a, t: np.where(t > 0, a / np.maximum(t, 1), np.nan)
    return {"depth_tries": depth_try, "depth_accepts": depth_acc, "depth_rate": rate(depth_acc, depth_try),
            "rank_tries": rank_try, "rank_accepts": rank_acc, "rank_rate": rate(rank_acc, rank_try)}
