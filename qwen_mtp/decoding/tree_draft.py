"""Tree drafting with the MTP head, level by level (head/tree.py has the shapes, the layout and the head's
attention over the committed rows and the round's tree buffer).

draft_tree(...) -> (tokens [B, N1] with the root x in column 0, Layout, Q, mcache): Q [B, N1, V] is, per node, the
draft distribution its children were drawn from (a static tree under sampling: siblings are independent draws
from it, SpecInfer); None when greedy or for a dynamic tree, whose siblings are the head's deterministic top
choices (their draft distribution is the point mass on each; tree_accept.py). mcache: the head's cache, with
the round's head entries written into it under Wind-MTP (the ring; head/tree.py), unchanged when native.

A static tree of width 1 everywhere drafts exactly what speculative._draft drafts: the same head rows, the same
choice (greedy: the first maximum; sampling: the same keys, split the same way, and the same Gumbel draws).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from qwen_mtp.decoding import penalty
from qwen_mtp.decoding.sampling import draw, probs
from qwen_mtp.head.tree import (
    DynamicTree,
    empty_buffer,
    full_vocab,
    head_level,
    head_logits,
    layout_from_parents,
    level_ranges,
    path_seen,
    static_layout,
    static_parents,
    tree_of,
)


def _ids(top, ids):
    return top if ids is None else ids[top]


def _penalised(logits, seen_rows, ids, sampling):
    """The head's logits [B, T, Vd] under the repetition penalty of each node's context seen_rows [B, T, V]."""
    if seen_rows is None:
        return logits
    return penalty.apply(logits, seen_rows if ids is None else seen_rows[..., ids], sampling)


def draft_tree(weights, cfg, mcache, m1, x, pos, spec, sampling, key, seen=None):
    tree = tree_of(spec)
    use_seen = seen is not None and penalty.active(sampling)
    if isinstance(tree, DynamicTree):
        return _draft_dynamic(weights, cfg, mcache, m1, x, pos, spec, tree, sampling, key, seen if use_seen else None)
    return _draft_static(weights, cfg, mcache, m1, x, pos, spec, tree, sampling, key, seen if use_seen else None)[:4]


def _entries(cfg, mcache, spec, tree, B):
    """The round's head entries: a buffer beside a native cache (None with Wind-MTP: they go into the ring)."""
    return empty_buffer(cfg, B, tree.expanded, mcache.k.dtype) if spec.window is None else None


def _draft_static(weights, cfg, mcache, m1, x, pos, spec, tree, sampling, key, seen):
    """draft_tree's four results and M [B, E + 1, H]: the head outputs of the bridge and every expanded node."""
    B, V = x.shape[0], cfg.vocab_size
    D, N1, E = tree.depth, tree.nodes + 1, tree.expanded
    keys = jax.random.split(key, D)
    parent = static_parents(tree)
    layout = static_layout(tree, B)
    mask_np = np.zeros((N1, N1), bool)  # the same ancestor-or-self mask, as numpy (static slices of it)
    for i in range(N1):
        a = i
        while True:
            mask_np[i, a] = True
            if a == 0:
                break
            a = parent[a]
    depth_np = mask_np[:, 1:].sum(1)
    buf = _entries(cfg, mcache, spec, tree, B)
    buf_depth = jnp.broadcast_to(jnp.asarray(depth_np[1:E + 1] if E else np.ones(1, np.int32)), (B, max(E, 1)))
    # the drafted tokens level by level, joined where the whole row is read: written into one array at each level,
    # XLA made the writes copies that a CUDA graph holds only with a CUDA 12.9 driver (docs/on-a-gpu.md)
    levels = [x[:, None].astype(jnp.int32)]
    joined = lambda: jnp.concatenate(levels + [jnp.zeros((B, N1 - sum(t.shape[1] for t in levels)), jnp.int32)],
                                     axis=1)
    M = jnp.zeros((B, E + 1, m1.shape[-1]), m1.dtype).at[:, 0].set(m1)
    Q = None if sampling.greedy else jnp.zeros((B, N1, V), jnp.float32)
    prev = np.array([0])
    for d, (lo, hi) in enumerate(level_ranges(tree), start=1):
        if d == 1:
            m = m1[:, None]
        else:
            ok = jnp.broadcast_to(jnp.asarray(mask_np[prev][:, 1:E + 1]), (B, len(prev), E))
            slots = jnp.broadcast_to(jnp.asarray(prev - 1), (B, len(prev)))
            m, buf, mcache = head_level(weights, cfg, joined()[:, prev], M[:, parent[prev]], mcache, pos, d - 1, buf,
                                        slots, ok, buf_depth, window=spec.window, sinks=spec.sinks,
                                        offsets=tree.entry_offsets())
            M = M.at[:, prev].set(m)
        logits, ids = head_logits(weights, m, V)
        node_seen = None if seen is None else path_seen(seen, joined(), layout.mask)[:, prev]
        logits = _penalised(logits, node_seen, ids, sampling)
        w = tree.widths[d - 1]
        if sampling.greedy:
            children = _ids(jax.lax.top_k(logits, w)[1], ids)  # [B, T, w], the first maximum first
        else:
            q_sub = probs(logits, sampling)  # [B, T, Vd]
            children = _ids(draw(keys[d - 1], jnp.broadcast_to(q_sub[:, :, None], q_sub.shape[:2] + (w,) +
                                                               q_sub.shape[2:])), ids)
            Q = Q.at[:, prev].set(full_vocab(q_sub, ids, V))
        assert lo == sum(t.shape[1] for t in levels), (lo, [t.shape for t in levels])  # levels in node order
        levels.append(children.reshape(B, hi - lo).astype(jnp.int32))
        prev = np.arange(lo, hi)
    return joined(), layout, Q, mcache, M


def _draft_dynamic(weights, cfg, mcache, m1, x, pos, spec, tree, sampling, key, seen):
    """EAGLE-2: expand the topk most probable candidates per depth, keep the budget most probable overall."""
    B, V = x.shape[0], cfg.vocab_size
    K, D, E = tree.topk, tree.depth, tree.expanded
    rows = jnp.arange(B)[:, None]

    def choices(m, node_seen):  # top-K children of each of T nodes: tokens [B, T, K], log q [B, T, K]
        logits, ids = head_logits(weights, m, V)
        logits = _penalised(logits, node_seen, ids, sampling)
        q = jax.nn.softmax(logits, axis=-1) if sampling.greedy else probs(logits, sampling)
        top_q, top = jax.lax.top_k(q, K)
        return _ids(top, ids).astype(jnp.int32), jnp.log(top_q)

    buf = _entries(cfg, mcache, spec, tree, B)
    buf_depth = jnp.broadcast_to(jnp.asarray(np.arange(max(E, 1)) // K + 1, jnp.int32), (B, max(E, 1)))
    onehot = lambda t: jax.nn.one_hot(t, V, dtype=jnp.bool_)
    tok, logq = choices(m1[:, None], None if seen is None else seen[:, None])
    pool_tok, pool_score = [tok[:, 0]], [logq[:, 0]]  # depth 1: K candidates, children of the root
    pool_par = [jnp.full((B, K), -1, jnp.int32)]
    f_pool = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, K))  # the frontier: pool indices
    f_tok, f_score, f_hidden = tok[:, 0], logq[:, 0], jnp.broadcast_to(m1[:, None], (B, K, m1.shape[-1]))
    f_ok = jnp.broadcast_to(jnp.eye(K, max(E, 1), dtype=bool), (B, K, max(E, 1)))
    f_seen = None if seen is None else seen[:, None] | onehot(f_tok)
    base = K
    for d in range(2, D + 1):
        slots = jnp.broadcast_to(jnp.arange((d - 2) * K, (d - 1) * K, dtype=jnp.int32), (B, K))
        m, buf, mcache = head_level(weights, cfg, f_tok, f_hidden, mcache, pos, d - 1, buf, slots, f_ok, buf_depth,
                                    window=spec.window, sinks=spec.sinks, offsets=tree.entry_offsets())
        tok, logq = choices(m, f_seen)  # [B, K, K]
        score = f_score[:, :, None] + logq
        pool_tok.append(tok.reshape(B, K * K))
        pool_score.append(score.reshape(B, K * K))
        pool_par.append(jnp.repeat(f_pool, K, axis=1))
        if d < D:
            _, f = jax.lax.top_k(score.reshape(B, K * K), K)  # the next frontier among these children
            src = f // K
            f_pool = base + f.astype(jnp.int32)
            f_tok = tok.reshape(B, K * K)[rows, f]
            f_score = score.reshape(B, K * K)[rows, f]
            f_hidden = m[rows, src]
            own = jnp.eye(K, max(E, 1), k=(d - 1) * K, dtype=bool)
            f_ok = f_ok[rows, src] | own[None]
            f_seen = None if seen is None else f_seen[rows, src] | onehot(f_tok)
        base += K * K
    p_tok, p_score, p_par = (jnp.concatenate(a, axis=1) for a in (pool_tok, pool_score, pool_par))
    P = p_tok.shape[1]
    p_depth = jnp.asarray(np.concatenate([np.ones(K, np.int32)] + [np.full(K * K, d, np.int32)
                                                                   for d in range(2, D + 1)]))
    p_idx = jnp.arange(P, dtype=jnp.int32)
    # highest score first; on a tie the shallower, then the earlier: an ancestor (score >= its descendants')
    # always ranks before them, so the kept set is closed under parents
    order = jax.vmap(lambda s: jnp.lexsort((p_idx, p_depth, -s)))(p_score)
    keep = jnp.sort(order[:, :tree.budget], axis=1)  # by pool index: parents before children, siblings by rank
    node_of = jnp.zeros((B, P), jnp.int32).at[rows, keep].set(jnp.arange(1, tree.budget + 1, dtype=jnp.int32))
    par_pool = jnp.take_along_axis(p_par, keep, axis=1)
    parent = jnp.where(par_pool < 0, 0, jnp.take_along_axis(node_of, jnp.maximum(par_pool, 0), axis=1))
    parent = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), parent], axis=1)
    tokens = jnp.concatenate([x[:, None].astype(jnp.int32), jnp.take_along_axis(p_tok, keep, axis=1)], axis=1)
    return tokens, layout_from_parents(parent, D, K), None, mcache
