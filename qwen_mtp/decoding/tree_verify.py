"""The trunk over a whole draft tree in one forward, and the state after the accepted path.

tree_forward runs the N1 tree rows (root x at position pos, node i at pos + depth_i) through every layer:
  - attention: node i sees the cache's committed slots (< pos) and its own ancestors and itself among the
    tree rows (the ancestor mask); the rows' K / V are not written: commit_path writes the accepted path's;
  - GDN: node i's conv window is its path's last kernel inputs (its ancestors', then the state's), and its
    recurrent state is its parent's updated by the node. The tree-shaped chunk form: with G_i = the sum of g
    over i's path (ancestors and itself),
        S_i = exp(G_i) S + sum_{s anc-or-self of i} exp(G_i - G_s) k_s delta_s^T
        delta_i = beta_i (v_i - exp(G_i) S^T k_i - sum_{s strict anc of i} exp(G_i - G_s) (k_i . k_s) delta_s)
    a unit lower-triangular system over the ancestors (parents come first), solved depth by depth (every row of one depth at once);
    o_i = S_i^T q_i. It reads the state once; what it leaves (a TreeGDN) rebuilds S and the conv window after
    any node (commit_path), as rollback.py does for the chain. A chain's mask (lower triangular) gives the
    chain verify's values. (`per_path_core` is the other form, every root-to-leaf path as its own chain verify:
    the test oracle, and benchmarks/bench_tree.py times both.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kernels_pallas.gdn_rollback import rec_rebuilt
from kernels_pallas.gdn_verify import solve_deltas, unit_lower_inverse, verify_gated_delta_rule
from qwen_mtp.head.tree import attend_tree
from qwen_mtp.trunk.attention import output, project_qkv, write_kv
from qwen_mtp.trunk.gdn import HIGHEST, gated_output, in_projections, rule_inputs
from qwen_mtp.trunk.mlp import feed_forward
from qwen_mtp.trunk.ops import embed_rows, rmsnorm_1pw
from qwen_mtp.trunk.state import GDNState, KVCache, to_cache


@struct.dataclass
class TreeKV:
    k: jax.Array  # [B, N1, nkv, hd] the tree rows' keys (RoPE applied, in the cache dtype)
    v: jax.Array


@struct.dataclass
class TreeGDN:
    xc: jax.Array  # [B, kernel - 1 + N1, conv_dim]: the conv state, then the tree rows' conv inputs
    rec: jax.Array  # [B, h, dk, dv] the recurrent state before the tree
    G: jax.Array  # [B, h, N1] path-cumulative log decay
    k: jax.Array  # [B, h, N1, dk]
    delta: jax.Array  # [B, h, N1, dv]


def _mm(a, b):
    return jnp.matmul(a, b, precision=HIGHEST)


def depth_lower_inverse(L, depth, max_depth: int):
    """(I + L)^-1 for L [B, h, T, T] nonzero only at (node, strict ancestor): gdn_verify.unit_lower_inverse's row
    recurrence N[i] = -L[i] - L[i] @ N, for all the rows of one depth at once (their ancestors lie at smaller
    depths, already final): max_depth steps instead of T. depth [B, T]."""
    N = jnp.zeros_like(L)
    at = depth[:, None, :, None]
    for d in range(1, max_depth + 1):
        N = jnp.where(at == d, -L - jnp.einsum("...ij,...jk->...ik", L, N, precision=HIGHEST), N)
    return N + jnp.eye(L.shape[-1], dtype=L.dtype)


def tree_core(q, k, v, g, beta, state, mask, depth=None, max_depth: int = 0):
    """The gated delta rule over a tree. q, k [B, N1, h, dk]; v [B, N1, h, dv]; g, beta [B, N1, h];
    state [B, h, dk, dv]; mask [B, N1, N1] ancestor-or-self (lower triangular); depth [B, N1] with max_depth:
    the solve runs depth by depth (depth_lower_inverse; None: row by row, gdn_verify.unit_lower_inverse). Returns out
    [B, N1, h, dv] and (G [B, h, N1], k [B, h, N1, dk], delta [B, h, N1, dv])."""
    T = k.shape[1]
    tr = lambda x: jnp.moveaxis(x, 1, 2)
    q, k, v, g, beta = map(tr, (q, k, v, g, beta))
    m = mask[:, None]  # [B, 1, T, T]
    G = jnp.einsum("bts,bhs->bht", mask.astype(g.dtype), g, precision=HIGHEST)
    decay = jnp.exp(jnp.where(m, G[..., :, None] - G[..., None, :], -jnp.inf))
    strict = m & ~jnp.eye(T, dtype=bool)
    L = jnp.where(strict, _mm(k * beta[..., None], jnp.swapaxes(k, -1, -2)) * decay, 0.0)
    inv = unit_lower_inverse(L) if depth is None else depth_lower_inverse(L, depth, max_depth)
    intra = _mm(q, jnp.swapaxes(k, -1, -2)) * decay
    out, delta = solve_deltas(q, k, v, beta, G, inv, intra, state)
    return jnp.moveaxis(out, 1, 2), (G, k, delta)


def per_path_core(q, k, v, g, beta, state, paths):
    """The other form: each root-to-leaf path (paths [P, D + 1] node indices, static numpy, each path's rows
    in depth order, a short path padded by repeating its leaf) run as its own chain verify
    (gdn_verify.verify_gated_delta_rule); a node's output is taken from the first path through it. Same arguments
    and output as tree_core's first result."""
    paths = np.asarray(paths)
    P, L = paths.shape
    take = lambda x: x[:, paths.reshape(-1)].reshape((x.shape[0], P, L) + x.shape[2:])
    fold = lambda x: jnp.moveaxis(x, 1, 0).reshape((-1, L) + x.shape[3:]) if x.ndim > 3 else \
        jnp.moveaxis(x, 1, 0).reshape(-1, L, x.shape[-1])
    B = q.shape[0]
    valid = np.concatenate([np.ones((P, 1), bool), paths[:, 1:] != paths[:, :-1]], axis=1)  # padding: no-op
    vm = jnp.asarray(valid)[None, :, :, None]
    args = [take(x) for x in (q, k, v)] + [jnp.where(vm, take(x), 0.0) for x in (g, beta)]
    st = jnp.broadcast_to(state[None], (P,) + state.shape).reshape((P * B,) + state.shape[1:])
    out, _ = verify_gated_delta_rule(*(fold(a) for a in args), st)
    out = jnp.moveaxis(out.reshape((P, B, L) + out.shape[2:]), 0, 1)  # [B, P, L, h, dv]
    first = {}
    for p in range(P):
        for j in range(L):
            if valid[p, j]:
                first.setdefault(int(paths[p, j]), (p, j))
    rows = [first[i] for i in range(len(first))]
    return jnp.stack([out[:, p, j] for p, j in rows], axis=1)


def tree_conv(x, conv_state, w_conv, depth, anc):
    """The depthwise causal conv along each node's path, then SiLU. x [B, N1, C]; conv_state [B, K-1, C];
    depth [B, N1]; anc [B, N1, D + 1]. Returns out [B, N1, C] and xc = [conv_state ; x]."""
    K = w_conv.shape[0]
    xc = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)
    idx = window_index(depth, anc, K)  # [B, N1, K]
    win = jnp.take_along_axis(xc[:, None], idx[..., None], axis=2)  # [B, N1, K, C]
    w = w_conv.astype(x.dtype)
    out = sum(win[:, :, j] * w[j] for j in range(K))
    return jax.nn.silu(out), xc


def window_index(depth, anc, K: int):
    """Indices into [conv_state (K-1) ; tree rows] of each node's last K conv inputs along its path, oldest
    first: [B, N1, K]. Path depth e >= 0 is the ancestor at depth e; e < 0 reaches into the conv state."""
    e = depth[..., None] - (K - 1) + jnp.arange(K, dtype=depth.dtype)  # [B, N1, K]
    tree_row = jnp.take_along_axis(anc, jnp.clip(e, 0, anc.shape[-1] - 1), axis=-1)
    return jnp.where(e >= 0, K - 1 + tree_row, K - 1 + e)


def tree_gdn_layer(x, w, cfg, st: GDNState, layout):
    """gdn.gdn_layer over the tree rows (x [B, N1, H], input-normed). Returns (out, TreeGDN)."""
    pre, z, b, a = in_projections(x, w)
    qkv, xc = tree_conv(pre, st.conv, w.conv, layout.depth, layout.anc)
    q, k, v, z, beta, g = rule_inputs(qkv, z, b, a, w, cfg)
    core, (G, k_all, delta) = tree_core(q, k, v, g, beta, st.rec, layout.mask, layout.depth, layout.anc.shape[-1] - 1)
    return gated_output(core, z, w, cfg, x.dtype), TreeGDN(xc, st.rec, G, k_all, delta)


def tree_attention_layer(x, w, cfg, cache: KVCache, pos, layout):
    """Attention of the tree rows over the committed slots (< pos) and their ancestors (and themselves)."""
    B, T, _ = x.shape
    q, k, v, gate = project_qkv(x, w, cfg, pos[:, None] + layout.depth)
    k, v = to_cache(k, cache.k.dtype), to_cache(v, cache.v.dtype)
    S = cache.k.shape[1]
    committed = jnp.broadcast_to((jnp.arange(S)[None] < pos[:, None])[:, None], (B, T, S))
    o = attend_tree(q, cache.k, cache.v, committed, k, v, layout.mask)
    return output(o, gate, w), TreeKV(k, v)


def tree_forward(weights, cfg, tokens, state: tuple, pos, layout):
    """tokens [B, N1] (root first) -> (post-norm hidden [B, N1, H], per layer a TreeKV or a TreeGDN)."""
    with jax.named_scope("embed"):
        x = embed_rows(weights.embed, tokens)
    verified = []
    for lw, kind, st in zip(weights.layers, cfg.layer_types, state):
        with jax.named_scope("attention" if kind == "full_attention" else "gdn"):
            h = rmsnorm_1pw(x, lw.input_norm, cfg.rms_norm_eps)
            if kind == "full_attention":
                h, st = tree_attention_layer(h, lw.mixer, cfg, st, pos, layout)
            else:
                h, st = tree_gdn_layer(h, lw.mixer, cfg, st, layout)
            x = x + h
        with jax.named_scope("mlp"):
            x = x + feed_forward(rmsnorm_1pw(x, lw.post_norm, cfg.rms_norm_eps), lw.mlp, cfg)
        verified.append(st)
    with jax.named_scope("final_norm"):
        return rmsnorm_1pw(x, weights.final_norm, cfg.rms_norm_eps), tuple(verified)


def gdn_state_after(v: TreeGDN, layout, node) -> GDNState:
    """The GDN state after tree node `node` [B]: the conv window of its path's last kernel-1 inputs and
    S = exp(G_n) S0 + sum_{s anc-or-self of n} exp(G_n - G_s) k_s delta_s^T."""
    B = node.shape[0]
    rows = jnp.arange(B)
    width = v.xc.shape[1] - v.G.shape[-1]  # kernel - 1
    idx = window_index(layout.depth[rows, node][:, None], layout.anc[rows, node][:, None], width + 1)[:, 0, 1:]
    conv = jnp.take_along_axis(v.xc, idx[..., None], axis=1)  # [B, K-1, C]
    on = layout.mask[rows, node]  # [B, N1]
    g_n = jnp.take_along_axis(v.G, node[:, None, None], axis=-1)  # [B, h, 1]
    rec = rec_rebuilt(v.rec, v.G, v.k, v.delta, g_n, on[:, None])  # (the chain's rebuild, over the path's rows)
    return GDNState(conv=conv.astype(v.xc.dtype), rec=rec)


def commit_path(verified: tuple, state: tuple, layout, path, n, pos) -> tuple:
    """The decode state after the accepted path: path [B, D + 1] node indices by depth (the accepted ones up
    to n [B], then anything), pos [B] the root's position. Attention layers get the path's K / V written at
    slots pos .. pos + D (rows past pos + n lie beyond the committed length and are overwritten later); GDN
    layers continue from the state after the path's last node."""
    rows = jnp.arange(path.shape[0])
    last = path[rows, n]
    out = []
    for st, old in zip(verified, state):
        if isinstance(st, TreeKV):
            take = lambda x: jnp.take_along_axis(x, path[:, :, None, None], axis=1)
            out.append(write_kv(old, take(st.k), take(st.v), pos))
        else:
            out.append(gdn_state_after(st, layout, last))
    return tuple(out)
