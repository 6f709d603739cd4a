"""Tree drafts with the MTP head: tree shapes, the tree layout (parents, depths, ancestor mask) and the head's
drafting per tree level.

Node 0 of a round's tree is the root, the last committed token x at position pos; node i > 0 is a draft at
depth d_i >= 1 (position pos + d_i), its parent p_i < i (parents come before their children, so every ancestor
mask is lower triangular). Two shapes, both one compiled program:
  - StaticTree(widths): widths[d-1] children per node of depth d-1 (e.g. (2, 2, 1, 1): top-2 at the first two
    depths, a chain after), level by level, siblings in rank order (rank 0: the head's first choice).
  - DynamicTree(depth, topk, budget): EAGLE-2's choice. Each depth expands the `topk` candidates of highest
    cumulative draft probability into `topk` children each; the `budget` nodes of highest cumulative
    probability among all candidates are kept (an ancestor always ranks before its descendants, so the kept
    set is a tree).

The head drafts per level: the nodes of depth j run through the head together at logical head row pos - 1 + j
(RoPE position pos + j), each fed (its token, its parent's head output), attending to the committed rows (the
native cache, or the Wind-MTP ring with its window) and to the entries of its own ancestors (the ancestor mask).
With Wind-MTP the entries live in the ring itself: a tree spec's ring holds sinks + W + depth * width slots
(width: the most nodes the head runs at one depth; a chain's width is 1, its ring sinks + W + k), constant in
the context; the committed rows wrap in the last W + depth * width, and the round's entries take the slots of
rows pos .. pos + depth * width - 1, whose committed rows lie out of every window of the round. After the
verify the committed path is refilled over them (tree_loop.py); the other branches' entries are dropped: their
slots name rows no window reaches and are overwritten before any does. Native: the entries live in a small
buffer of the round beside the cache (one slot per expanded node).

Sampling: a static tree's siblings are independent draws from their parent's draft distribution q (SpecInfer);
a dynamic tree's siblings are the head's top choices, deterministic, whose draft distribution is the point mass
on each (tree_accept.py treats both with one recursive rejection rule).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.masked_attention import BLOCK_DIAGONAL_ROWS, attend, attend_with_new
from kernels_pallas.ring_layout import ring_rows, ring_slot, visible
from qwen_mtp.errors import ArgumentError, is_python_int
from qwen_mtp.head import draft_vocab
from qwen_mtp.trunk.attention import output, project_qkv
from qwen_mtp.trunk.forward import lm_logits
from qwen_mtp.trunk.mlp import feed_forward
from qwen_mtp.trunk.ops import embed_rows, linear, rmsnorm_1pw
from qwen_mtp.trunk.state import KVCache, to_cache

MAX_NODES = 64  # draft nodes per tree (the verify's rows, root excluded)


@dataclasses.dataclass(frozen=True)
class StaticTree:
    """widths[d-1]: children of every node of depth d-1. (1,) * k is the chain of k drafts."""
    widths: tuple = (2, 2, 1, 1)

    def __post_init__(self):
        w = self.widths
        if not isinstance(w, tuple) or not w or not all(is_python_int(x) and 1 <= x <= 8 for x in w):
            raise ArgumentError("StaticTree.widths", "a non-empty tuple of integers in [1, 8]", repr(w))
        if self.nodes > MAX_NODES:
            raise ArgumentError("StaticTree.widths", f"a tree of at most {MAX_NODES} nodes", f"{self.nodes} nodes")

    @property
    def depth(self) -> int:
        return len(self.widths)

    @property
    def level_sizes(self) -> tuple:
        return tuple(int(np.prod(self.widths[:d + 1])) for d in range(self.depth))

    @property
    def nodes(self) -> int:
        return sum(self.level_sizes)

    @property
    def max_children(self) -> int:
        return max(self.widths)

    @property
    def expanded(self) -> int:
        """Nodes that run through the head (depths 1 .. depth-1): their head entries this round."""
        return sum(self.level_sizes[:-1])

    @property
    def width(self) -> int:
        """The most nodes the head runs at one depth: the Wind-MTP ring holds depth * width draft slots."""
        return max(self.level_sizes[:-1], default=1)

    def entry_offsets(self) -> np.ndarray:
        """[expanded]: entry e (node e + 1) of depth j, i-th of its level, goes to draft slot (j - 1) * width + i."""
        return np.asarray([(j - 1) * self.width + i for j, n in enumerate(self.level_sizes[:-1], start=1)
                           for i in range(n)], np.int32)


@dataclasses.dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2: `topk` nodes expanded per depth into `topk` children each; `budget` nodes kept."""
    depth: int = 4
    topk: int = 2
    budget: int = 8

    def __post_init__(self):
        if not is_python_int(self.depth) or not 1 <= self.depth <= 16:
            raise ArgumentError("DynamicTree.depth", "an integer in [1, 16]", repr(self.depth))
        if not is_python_int(self.topk) or not 1 <= self.topk <= 8:
            raise ArgumentError("DynamicTree.topk", "an integer in [1, 8]", repr(self.topk))
        pool = self.topk + (self.depth - 1) * self.topk ** 2
        if not is_python_int(self.budget) or not 1 <= self.budget <= min(pool, MAX_NODES):
            raise ArgumentError("DynamicTree.budget", f"an integer in [1, {min(pool, MAX_NODES)}] (the candidates)",
                                repr(self.budget))

    @property
    def nodes(self) -> int:
        return self.budget

    @property
    def max_children(self) -> int:
        return self.topk

    @property
    def expanded(self) -> int:
        return (self.depth - 1) * self.topk

    @property
    def width(self) -> int:
        return self.topk

    def entry_offsets(self) -> np.ndarray:
        """Entry e = (j - 1) * topk + i (the i-th frontier node of depth j) goes to draft slot e."""
        return np.arange(self.expanded, dtype=np.int32)


class Layout(NamedTuple):
    """A tree of N1 = nodes + 1 rows (root first), per batch row."""
    parent: jax.Array  # [B, N1] int32, parent[:, 0] = 0
    depth: jax.Array  # [B, N1] int32
    mask: jax.Array  # [B, N1, N1] bool: mask[i, j] = j is an ancestor of i or i itself
    anc: jax.Array  # [B, N1, D + 1] int32: the ancestor-or-self of i at depth e (i's own index past its depth)
    children: jax.Array  # [B, N1, W] int32: children in rank order, -1 past the last
    rank: jax.Array  # [B, N1] int32: the node's rank among its siblings (0 for the root)


def layout_from_parents(parent, depth_max: int, width: int) -> Layout:
    """Layout of trees given by parent pointers [B, N1] (parent[:, i] < i for i >= 1; parent[:, 0] is ignored).
    Traced: dynamic trees build theirs in the program."""
    B, N1 = parent.shape
    idx = jnp.arange(N1, dtype=jnp.int32)
    parent = jnp.where(idx[None] == 0, 0, parent).astype(jnp.int32)
    # walk up depth_max times: hops[e][:, i] = the e-th ancestor of i (the root stays at the root)
    hops = [jnp.broadcast_to(idx, (B, N1))]
    for _ in range(depth_max):
        hops.append(jnp.take_along_axis(parent, hops[-1], axis=1))
    hops = jnp.stack(hops, axis=-1)  # [B, N1, D + 1]
    depth = jnp.sum((hops[..., :-1] != 0).astype(jnp.int32), axis=-1)  # hops until the root
    mask = jnp.any(hops[..., :, None] == idx[None, None, None, :], axis=2)  # [B, N1, N1]
    # the ancestor at depth e is hop depth - e (past its own depth: itself)
    e = jnp.arange(depth_max + 1, dtype=jnp.int32)
    hop = jnp.clip(depth[..., None] - e, 0, depth_max)
    anc = jnp.take_along_axis(hops, hop, axis=-1)
    is_child = (parent[:, None, :] == idx[None, :, None]) & (idx[None, None, :] > 0)  # [B, i, j]: j child of i
    order = jnp.cumsum(is_child.astype(jnp.int32), axis=-1) - 1  # rank of child j among i's children
    rank = jnp.sum(jnp.where(is_child, order, 0), axis=1)  # [B, N1]
    r = jnp.arange(width, dtype=jnp.int32)
    hit = is_child[..., None, :] & (order[..., None, :] == r[:, None])  # [B, N1, W, N1]
    children = jnp.where(jnp.any(hit, -1), jnp.argmax(hit, -1), -1).astype(jnp.int32)
    return Layout(parent, depth, mask, anc, children, rank)


def static_parents(tree: StaticTree) -> np.ndarray:
    """Parent pointers [N1] of a static tree, level by level, each parent's children consecutive in rank
    order."""
    parent = [0]
    prev = [0]
    for w in tree.widths:
        level = []
        for p in prev:
            for _ in range(w):
                parent.append(p)
                level.append(len(parent) - 1)
        prev = level
    return np.asarray(parent, np.int32)


def level_ranges(tree: StaticTree):
    """[(start, stop)] of the node indices of depths 1 .. depth."""
    out, start = [], 1
    for n in tree.level_sizes:
        out.append((start, start + n))
        start += n
    return out


def static_layout(tree: StaticTree, batch: int) -> Layout:
    parent = jnp.broadcast_to(jnp.asarray(static_parents(tree)), (batch, tree.nodes + 1))
    return layout_from_parents(parent, tree.depth, tree.max_children)


def tree_of(spec):
    """The spec's tree; a chain of k drafts (width 1 everywhere) when it has none."""
    return spec.tree if spec.tree is not None else StaticTree((1,) * spec.k)


def path_seen(seen, tokens, mask):
    """seen [B, V] (the committed context), tokens [B, N1], mask [B, N1, N1] -> [B, N1, V]: row i is seen with
    the drafts of i's path (root excluded) added: the context before node i's logits."""
    V = seen.shape[-1]
    onehot = jax.nn.one_hot(tokens.at[:, 0].set(0), V, dtype=jnp.float32).at[:, 0].set(0.0)
    on_path = jnp.einsum("bij,bjv->biv", mask.astype(jnp.float32), onehot) > 0
    return seen[:, None] | on_path


# --------------------------------------------------------------------------------------------- the head per level
def head_level(weights, cfg, tokens, hidden, cache, pos, j: int, buf, slots, buf_ok, buf_depth, *,
               window=None, sinks: int = 0, offsets=None):
    """The head for the T nodes of depth j (tokens [B, T], hidden [B, T, H]: their parents' head outputs, or
    the bridge's for j = 1) at head row pos - 1 + j. The round's E head entries (one per expanded node): slots
    [B, T] the entries of these nodes, buf_ok [B, T, E] the entries of each node's ancestors and its own,
    buf_depth [B, E] each entry's depth. Native (window None): the entries live in buf = (k, v) [B, E, nkv, hd],
    beside the cache. Wind-MTP: buf is None and entry e lives in the ring itself, at the slot of row
    pos + offsets[e] (offsets: the tree's entry_offsets(), below depth * width), a slot whose committed row is
    out of every window of the round (ring_draft_slots). Returns (out [B, T, H], buf, cache)."""
    w = weights.mtp
    eps = cfg.rms_norm_eps
    B, T = tokens.shape
    row = pos - 1 + j  # [B]
    e = rmsnorm_1pw(embed_rows(weights.embed, tokens), w.pre_fc_norm_embedding, eps)
    h = rmsnorm_1pw(hidden.astype(e.dtype), w.pre_fc_norm_hidden, eps)
    x = linear(jnp.concatenate([e, h], axis=-1), w.fc)
    ah = rmsnorm_1pw(x, w.layer.input_norm, eps)
    q, k, v, gate = project_qkv(ah, w.layer.mixer, cfg, jnp.broadcast_to(row[:, None] + 1, (B, T)))
    b = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    S = cache.k.shape[1]
    buf_rows = pos[:, None] - 1 + buf_depth  # [B, E]
    if window is None:  # native: slot = row, the committed rows are those before pos
        bk, bv = buf
        bk = bk.at[b, slots].set(to_cache(k, bk.dtype))
        bv = bv.at[b, slots].set(to_cache(v, bv.dtype))
        held = jnp.broadcast_to(jnp.arange(S, dtype=pos.dtype), (B, S))
        held = jnp.where(held < pos[:, None], held, -1)
        committed = visible(held, row[:, None], S + 1, 0)
        in_window = visible(buf_rows, row[:, None], S + 1, 0)
        o = attend_tree(q, cache.k, cache.v, jnp.broadcast_to(committed[:, None], (B, T, S)), bk, bv,
                        buf_ok & in_window[:, None])
        buf = (bk, bv)
    else:  # Wind-MTP: the entries in the ring, the ancestor mask over their slots
        ring = S - sinks
        entry_slot = ring_slot(pos[:, None] + jnp.asarray(offsets, pos.dtype)[None], sinks, ring)  # [B, E]
        mine = jnp.take_along_axis(entry_slot, slots, axis=1)  # [B, T]
        cache = KVCache(cache.k.at[b, mine].set(to_cache(k, cache.k.dtype)),
                        cache.v.at[b, mine].set(to_cache(v, cache.v.dtype)))
        committed = visible(ring_rows(pos - 1, sinks, ring), row[:, None], window, sinks)  # [B, S]
        in_window = visible(buf_rows, row[:, None], window, sinks)
        E = entry_slot.shape[1]
        bt = (jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None])
        ancestors = jnp.zeros((B, T, S), bool).at[bt[0], bt[1], jnp.broadcast_to(entry_slot[:, None], (B, T, E))] \
            .set(buf_ok & in_window[:, None])
        up = lambda c: c.astype(q.dtype)
        o = attend(q, up(cache.k), up(cache.v), committed[:, None] | ancestors)
    res1 = x + output(o, gate, w.layer.mixer)
    res2 = res1 + feed_forward(rmsnorm_1pw(res1, w.layer.post_norm, eps), w.layer.mlp, cfg)
    return rmsnorm_1pw(res2, w.norm, eps), buf, cache


def attend_tree(q, k, v, key_ok, k_new, v_new, new_ok):
    """One softmax over the cache's slots (key_ok [B, T, S]) and N more rows k_new, v_new (new_ok [B, T, N]),
    read upcast to q's dtype. Few query rows: the two held apart (masked_attention.attend_with_new, the cache
    read in place); more: over their concatenation."""
    up = lambda x: x.astype(q.dtype)
    if q.shape[1] <= BLOCK_DIAGONAL_ROWS:
        return attend_with_new(q, up(k), up(v), key_ok, up(k_new), up(v_new), new_ok)
    return attend(q, up(jnp.concatenate([k, k_new], axis=1)), up(jnp.concatenate([v, v_new], axis=1)),
                  jnp.concatenate([key_ok, new_ok], axis=-1))


def head_logits(weights, m, vocab_size: int):
    """The head's logits over its draft vocabulary [..., Vd] and the ids they stand for (None: all)."""
    if weights.draft_vocab is not None:
        return draft_vocab.draft_logits(weights.draft_vocab, m), weights.draft_vocab.ids
    return lm_logits(weights, m), None


def full_vocab(q_sub, ids, vocab_size: int):
    """A distribution over the draft vocabulary [..., Vd] as one over the full vocabulary (zero outside)."""
    if ids is None:
        return q_sub
    return jnp.zeros(q_sub.shape[:-1] + (vocab_size,), q_sub.dtype).at[..., ids].set(q_sub)


def ring_draft_slots(k: int, tree) -> int:
    """The Wind-MTP ring's slots past sinks + window (SpecConfig.draft_slots): k for a chain (tree None),
    depth * width for a tree."""
    return k if tree is None else tree.depth * tree.width


def empty_buffer(cfg, batch: int, size: int, dtype):
    shape = (batch, max(size, 1), cfg.num_kv_heads, cfg.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def check_tree(tree, k: int) -> None:
    """SpecConfig.tree: None (a chain), or a StaticTree / DynamicTree whose depth is k."""
    if not isinstance(tree, (StaticTree, DynamicTree)):
        raise ArgumentError("SpecConfig.tree", "None, a StaticTree or a DynamicTree", repr(tree))
    if tree.depth != k:
        raise ArgumentError("SpecConfig.tree", f"a tree of depth k = {k}", f"depth {tree.depth}")
