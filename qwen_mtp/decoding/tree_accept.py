"""Accepting a path of a verified draft tree.

Greedy: from the root, move to the child whose token is the trunk's argmax at the current node, while one is;
the bonus is the argmax at the last node reached. The result is the plain greedy continuation.

Sampling (SpecInfer's recursive rejection over siblings): at the current node c with the trunk's distribution
p_c, the residual r starts as p_c; each child s (in rank order) with draft token x_s drawn from q_s is accepted
with probability min(1, r(x_s) / q_s(x_s)); on rejection r <- norm(max(r - q_s, 0)). The first accepted child
becomes c; if none is, the bonus is drawn from the last residual (at a leaf, from p_c). With q_s = q_c for every
child of c (independent draws, a static tree) or q_s = the point mass on x_s (a dynamic tree's deterministic
top choices), the emitted tokens have plain sampling's distribution. One child per node is exactly the chain's
Leviathan / Chen rule (speculative._accept), with the same random numbers.

Statistics per round and row: n the accepted depth (the histogram H[n]); per depth d, whether the walk tried a
child at d and accepted one; per sibling rank, tries and accepts; `hits` [D]: the rank-0 path's own test at each
depth, whether or not the walk got there (the chain's position_hits when the width is 1).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from qwen_mtp.decoding.sampling import argmax, draw, probs


class Accepted(NamedTuple):
    n: jax.Array  # [B] accepted depth
    path: jax.Array  # [B, D + 1] node index at each depth (after the last accepted: the last accepted)
    bonus: jax.Array  # [B]
    depth_try: jax.Array  # [B, D] the walk tried a child at depth d (d = 1..D)
    depth_acc: jax.Array  # [B, D]
    rank_try: jax.Array  # [B, W]
    rank_acc: jax.Array  # [B, W]
    hits: jax.Array  # [B, D]


def _normalised(r):
    mass = jnp.sum(r, axis=-1, keepdims=True)
    return mass, r / jnp.where(mass > 0, mass, 1.0)


def accept_tree(tokens, layout, Q, logits, sampling, key, deterministic: bool, broken_residual: bool = False):
    """tokens [B, N1], logits [B, N1, V] (the trunk's, penalised), Q [B, N1, V] (each node's children's draft
    distribution; None when greedy or deterministic). broken_residual (a test's control only; a traced bool
    too, so one program runs both): every sibling is tried against p_c instead of the residual."""
    B = tokens.shape[0]
    D = layout.anc.shape[-1] - 1
    W = layout.children.shape[-1]
    rows = jnp.arange(B)
    children = layout.children
    c = jnp.zeros((B,), jnp.int32)
    alive = jnp.ones((B,), bool)
    n = jnp.zeros((B,), jnp.int32)
    path = [c]
    d_try, d_acc, r_try, r_acc, hits = [], [], jnp.zeros((B, W), bool), jnp.zeros((B, W), bool), []
    rank0 = jnp.zeros((B,), jnp.int32)  # the rank-0 path's node at the current depth
    if sampling.greedy:
        Y = argmax(logits)  # [B, N1]
        for _ in range(D):
            ch = children[rows, c]  # [B, W]
            match = (ch >= 0) & (tokens[rows[:, None], jnp.maximum(ch, 0)] == Y[rows, c][:, None]) & alive[:, None]
            found = jnp.any(match, axis=1)
            first = jnp.argmax(match, axis=1)
            tried = alive & (ch[:, 0] >= 0)
            # greedy siblings hold distinct tokens: every child up to the match (or all) was tried
            upto = jnp.where(found, first, W - 1)
            r_try = r_try | (tried[:, None] & (jnp.arange(W)[None] <= upto[:, None]) & (ch >= 0))
            r_acc = r_acc | (jax.nn.one_hot(first, W, dtype=bool) & found[:, None])
            d_try.append(tried)
            d_acc.append(found)
            r0 = children[rows, rank0, 0]
            hits.append((r0 >= 0) & (tokens[rows, jnp.maximum(r0, 0)] == Y[rows, rank0]))
            rank0 = jnp.where(r0 >= 0, r0, rank0)
            c = jnp.where(found, ch[rows, first], c)
            n = n + found.astype(jnp.int32)
            alive = found
            path.append(c)
        return Accepted(n, jnp.stack(path, axis=1), Y[rows, c], jnp.stack(d_try, 1), jnp.stack(d_acc, 1), r_try,
                        r_acc, jnp.stack(hits, 1))

    P = probs(logits, sampling)  # [B, N1, V]
    k_u, k_res = jax.random.split(key)
    u = jax.random.uniform(k_u, (B, D, W))
    r = P[:, 0]
    tried_here = jnp.zeros((B,), bool)  # a sibling of the current node's children was tried (and rejected)
    for d in range(D):
        ch = children[rows, c]
        p_c = P[rows, c]
        r = jnp.where(alive[:, None], p_c, r)
        tried_here = jnp.where(alive, False, tried_here)
        searching = alive
        acc_node = c
        d_try.append(alive & (ch[:, 0] >= 0))
        for s in range(W):
            child = ch[:, s]
            valid = searching & (child >= 0)
            x = tokens[rows, jnp.maximum(child, 0)]
            q_s = jax.nn.one_hot(x, P.shape[-1], dtype=P.dtype) if deterministic else Q[rows, c]
            ref = r if broken_residual is False else jnp.where(broken_residual, p_c, r)
            ok = valid & (u[:, d, s] * q_s[rows, x] < ref[rows, x])  # u < min(1, r/q), q(x) > 0
            r_try = r_try.at[:, s].set(r_try[:, s] | valid)
            r_acc = r_acc.at[:, s].set(r_acc[:, s] | ok)
            acc_node = jnp.where(ok, child, acc_node)
            rejected = valid & ~ok
            mass, res = _normalised(jnp.maximum(r - q_s, 0.0))
            r = jnp.where(rejected[:, None], jnp.where(mass > 0, res, r), r)
            tried_here = tried_here | rejected
            searching = searching & ~ok
        found = alive & ~searching
        d_acc.append(found)
        r0 = children[rows, rank0, 0]
        x0 = tokens[rows, jnp.maximum(r0, 0)]
        q0 = jax.nn.one_hot(x0, P.shape[-1], dtype=P.dtype) if deterministic else Q[rows, rank0]
        hits.append((r0 >= 0) & (u[:, d, 0] * q0[rows, x0] < P[rows, rank0, x0]))
        rank0 = jnp.where(r0 >= 0, r0, rank0)
        c = jnp.where(found, acc_node, c)
        n = n + found.astype(jnp.int32)
        alive = found
        path.append(c)
    r = jnp.where(alive[:, None], P[rows, c], r)
    # no child tried at the last node (a leaf): the chain's residual max(p - 0, 0), normalised, i.e. p
    mass, res = _normalised(r)
    last = jnp.where((tried_here & ~alive)[:, None], r, jnp.where(mass > 0, res, r))
    bonus = draw(k_res, last)
    return Accepted(n, jnp.stack(path, axis=1), bonus, jnp.stack(d_try, 1), jnp.stack(d_acc, 1), r_try, r_acc,
                    jnp.stack(hits, 1))
