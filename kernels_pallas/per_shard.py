"""The Pallas kernels under a mesh: run each per shard (jax.shard_map) instead of handing it whole operands.

XLA's partitioner splits every einsum, gather and scan of the model by the shardings of its inputs, but a
Pallas kernel is a custom call it cannot look inside: given sharded operands it would gather them whole
(a whole weight matrix, for the quantized matmul). So the kernel call sites ask here first:
  quant_linear  x [M, K] @ QuantArray [K, N] with N split (column parallel: local, no communication) or K
                split (row parallel: local partial products, then one psum over `model`, in f32), rows of x
                split over `data` where they divide;
  routed        the MoE experts at decode (moe_gemv): x's row of each (token, expert) pair (its own row, or its
                token's) times its expert of the stacked w [E, K, N], the experts' intermediate dimension split
                over `model` as sharding.py places it (gate / up: N, column parallel; down: K, row parallel,
                one psum in f32), pairs split over `data` where they divide; every shard holds every expert's
                slice, so the ids need no routing between devices;
  windowed      the draft head's windowed attention, split over batch rows (`data`) and kv heads (`model`),
                each shard attending over its own heads of its own rows: no communication;
  causal        the trunk's and the native head's causal attention over their KV caches, split the same way;
  gdn_rows      the GDN decode step and verify, split over batch rows (`data`) and heads (`model`): local;
  conv_rows     the GDN conv at a decode row, split over rows (`data`) and channels (`model`): local;
  rollback_rows a GDN layer's rollback after a verify, split over rows (`data`), channels and heads (`model`): local;
  router_rows   the MoE router's top-k, split over tokens (`data`): local (every device holds all experts' rows).
The mesh is the one `generate` runs under (jax.set_mesh(model.mesh)); with none, or nothing split, the kernel
call is made as it is. Leaf module: the mesh-axis names and the batch rule live here, sharding.py builds on them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

AXES = ("data", "model")


def active_mesh():
    """The ('data', 'model') mesh set by jax.set_mesh for the program being traced, or None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or tuple(mesh.axis_names) != AXES:
        return None
    return mesh


def batch_axis(mesh, batch: int):
    """'data' if the data axis divides `batch` (and has size > 1), else None (rows replicated over data)."""
    n = mesh.shape["data"]
    return "data" if n > 1 and batch % n == 0 else None


def heads_axis(mesh, kv_heads: int):
    """'model' if the model axis divides the kv heads (and has size > 1), else None."""
    n = mesh.shape["model"]
    return "model" if n > 1 and kv_heads % n == 0 else None


def quant_linear(x, q, scale, spec, k: int, block, call):
    """x [M, K] @ (q, scale) -> [M, N] in x's dtype. call(x, q, scale, k, block) runs the kernel (or its
    reference) on whole or local operands; spec = (K axis, N axis) of the QuantArray (QuantArray.spec)."""
    mesh = active_mesh()
    if mesh is None or spec is None:
        return call(x, q, scale, k, block)
    kax, nax = spec
    dax = batch_axis(mesh, x.shape[0])
    if kax is None and nax is None and dax is None:
        return call(x, q, scale, k, block)
    k_local = k // mesh.shape[kax] if kax else k
    n_local = q.shape[-1] // mesh.shape[nax] if nax else q.shape[-1]
    # a block wider than a split dimension covers all of each shard's part (a per-channel scale's one row)
    local_block = (min(block[0], k_local) if kax else block[0], min(block[1], n_local) if nax else block[1])
    s_spec = P(kax if scale.shape[0] > 1 else None, nax if scale.shape[1] > 1 else None)

    def local(x, q, s):
        y = call(x, q, s, k_local, local_block)
        if kax:
            y = jax.lax.psum(y.astype(jnp.float32), kax).astype(x.dtype)
        return y

    return jax.shard_map(local, mesh=mesh, in_specs=(P(dax, kax), P(kax, nax), s_spec), out_specs=P(dax, nax),
                         check_vma=False)(x, q, scale)


def expert_spec(split: str, k: int, n: int):
    """(K axis, N axis) of plain stacked experts [E, k, n] whose `split` ("k" or "n") dimension is the experts'
    intermediate one: 'model' where that axis divides it (sharding.py's rule for expert_mlp), else None. A
    QuantArray carries its own (QuantArray.spec). None when no mesh is active."""
    mesh = active_mesh()
    if mesh is None:
        return None
    m = mesh.shape["model"]
    dim = k if split == "k" else n
    ax = "model" if m > 1 and dim % m == 0 else None
    return (ax, None) if split == "k" else (None, ax)


def routed(x, w, scale, ids, spec, k: int, block, call, rows_per_x: int = 1):
    """x[p // rows_per_x] @ w[ids[p]] -> [P, N] per shard (module doc). call(x, w, scale, ids, k, block,
    rows_per_x) runs moe_gemv (kernel or reference) on whole or local operands; scale None for plain experts;
    spec = (K axis, N axis) of w. Pairs split over `data` take x's rows with them where each shard's pairs read
    whole rows of their own; otherwise (a padded row of x, pairs of one row on two shards) each pair's row is
    gathered first and the shards read those."""
    mesh = active_mesh()
    if mesh is None or spec is None:
        return call(x, w, scale, ids, k, block, rows_per_x)
    kax, nax = spec
    P_ = ids.shape[0]
    dax = batch_axis(mesh, P_)
    if dax is not None and rows_per_x > 1 and (x.shape[0] * rows_per_x != P_
                                               or (P_ // mesh.shape[dax]) % rows_per_x):
        x, rows_per_x = x[jnp.arange(P_) // rows_per_x], 1
    if kax is None and nax is None and dax is None:
        return call(x, w, scale, ids, k, block, rows_per_x)
    k_local = k // mesh.shape[kax] if kax else k
    n_local = w.shape[-1] // mesh.shape[nax] if nax else w.shape[-1]
    local_block = (min(block[0], k_local) if kax else block[0], min(block[1], n_local) if nax else block[1])
    specs = [P(dax, kax), P(None, kax, nax), P(dax)]
    args = [x, w, ids]
    if scale is not None:
        specs.append(P(None, kax if scale.shape[1] > 1 else None, nax if scale.shape[2] > 1 else None))
        args.append(scale)

    def local(x, w, ids, s=None):
        y = call(x, w, s, ids, k_local, local_block, rows_per_x)
        if kax:
            y = jax.lax.psum(y.astype(jnp.float32), kax).astype(x.dtype)
        return y

    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=P(dax, nax), check_vma=False)(*args)


def _per_row_and_head(call, args, kv_heads: int, in_specs):
    """call(*args) per (batch row, kv head) shard under the active mesh, or as it is when there is none or
    nothing splits; in_specs(t, dax) gives the operands' specs from the [B, T, heads, hd] spec t."""
    mesh = active_mesh()
    if mesh is None:
        return call(*args)
    dax, hax = batch_axis(mesh, args[0].shape[0]), heads_axis(mesh, kv_heads)
    if dax is None and hax is None:
        return call(*args)
    t = P(dax, None, hax, None)
    return jax.shard_map(call, mesh=mesh, in_specs=in_specs(t, dax), out_specs=t, check_vma=False)(*args)


def windowed(q, ring_k, ring_v, new_k, new_v, start, call):
    """The draft head's windowed attention per (row, kv head) shard; call(q, ring_k, ring_v, new_k, new_v,
    start) is the kernel dispatch (windowed_attend)."""
    return _per_row_and_head(call, (q, ring_k, ring_v, new_k, new_v, start), ring_k.shape[2],
                             lambda t, dax: (t, t, t, t, t, P(dax)))


def causal(q, k_cache, v_cache, q_pos, call):
    """The causal attention over a KV cache per (row, kv head) shard; call(q, k_cache, v_cache, q_pos) is the
    kernel dispatch (causal_attention.causal_attend)."""
    return _per_row_and_head(call, (q, k_cache, v_cache, q_pos), k_cache.shape[2],
                             lambda t, dax: (t, t, t, P(dax, None)))


def causal_before_write(q, k_cache, v_cache, k_new, v_new, q_pos, call):
    """causal for a call whose new rows are held apart from the cache (causal_attention.
    causal_attend_before_write), per (row, kv head) shard the same way."""
    return _per_row_and_head(call, (q, k_cache, v_cache, k_new, v_new, q_pos), k_cache.shape[2],
                             lambda t, dax: (t, t, t, t, t, P(dax, None)))



def conv_rows(call, x, state, w, valid):
    """The GDN conv at one decode row (gdn_conv.py) per shard: rows over `data`, channels over `model` as
    sharding.py's `conv` rule splits them (contiguous channels; the conv is per channel, so any split is local).
    call(x [B, C], state [B, K-1, C], w [K, C], valid [B]) -> (out [B, C], state) is the dispatch on whole or
    local operands."""
    mesh = active_mesh()
    if mesh is None:
        return call(x, state, w, valid)
    dax = batch_axis(mesh, x.shape[0])
    n = mesh.shape["model"]
    cax = "model" if n > 1 and x.shape[1] % n == 0 else None
    if dax is None and cax is None:
        return call(x, state, w, valid)
    rows, st = P(dax, cax), P(dax, None, cax)
    return jax.shard_map(call, mesh=mesh, in_specs=(rows, st, P(None, cax), P(dax)), out_specs=(rows, st),
                         check_vma=False)(x, state, w, valid)


def router_rows(call, probs):
    """The MoE router's top-k (moe_router.py) per shard: tokens over `data` where it divides them, each row whole
    (the router is replicated over `model`). call(probs [n, E]) -> (weights [n, k], ids [n, k]) is the dispatch
    on whole or local operands."""
    mesh = active_mesh()
    dax = batch_axis(mesh, probs.shape[0]) if mesh is not None else None
    if dax is None:
        return call(probs)
    rows = P(dax, None)
    return jax.shard_map(call, mesh=mesh, in_specs=(rows,), out_specs=(rows, rows), check_vma=False)(probs)


def gdn_rows(call, qkv, z, b, a, rec, A_log, dt_bias, norm_w, n_valid, num_k_heads: int, *, verify: bool):
    """The GDN decode step or verify (gdn_step.py, gdn_verify.py) per (row, head) shard: rows over `data`, value
    heads over `model` where it divides them (sharding.py's v_heads rule), with their key heads: where `model`
    divides the key heads too, each shard takes its key heads whole; otherwise q and k are repeated per value
    head first (each value head its own key head). qkv [B, T, C] arrives as sharding.py's `conv` rule splits it
    (contiguous channels, not heads): its q, k and v parts are cut apart here, so that each shard gets its heads'
    channels of each, and joined again per shard. call(qkv, z, b, a, rec, A_log, dt_bias, norm_w, n_valid,
    num_k_heads=) is the dispatch on whole or local operands; it returns (out, state) for the step, (out, G, k,
    delta) for the verify."""
    args = (z, b, a, rec, A_log, dt_bias, norm_w, n_valid)
    mesh = active_mesh()
    nv, dk = rec.shape[1], rec.shape[2]
    dax = batch_axis(mesh, qkv.shape[0]) if mesh is not None else None
    hax = heads_axis(mesh, nv) if mesh is not None else None
    if dax is None and hax is None:
        return call(qkv, *args, num_k_heads=num_k_heads)
    kd = num_k_heads * dk
    q, k, v = qkv[..., :kd], qkv[..., kd:2 * kd], qkv[..., 2 * kd:]
    nk = num_k_heads
    if hax and num_k_heads % mesh.shape["model"]:  # the key heads do not split: one per value head
        per_head = lambda t: jnp.repeat(t.reshape(*t.shape[:-1], nk, dk), nv // nk, axis=-2).reshape(
            *t.shape[:-1], nv * dk)
        q, k, nk = per_head(q), per_head(k), nv
    nk_local = nk // (mesh.shape["model"] if hax else 1)

    def local(q, k, v, *rest):
        return call(jnp.concatenate([q, k, v], axis=-1), *rest, num_k_heads=nk_local)

    rows, heads, state = P(dax, None, hax), P(hax), P(dax, hax, None, None)
    specs = (rows,) * 6 + (state, heads, heads, P(None), P(dax))
    outs = (rows, P(dax, hax, None), state, state) if verify else (rows, state)
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=outs, check_vma=False)(q, k, v, *args)


def rollback_rows(call, conv, x, rec, G, k, delta, index):
    """A GDN layer's rollback (gdn_rollback.py) per shard: rows over `data`; the conv state's and the inputs'
    channels over `model` as sharding.py's `conv` rule splits them (contiguous channels: the window is per
    channel) and the value heads over `model` where it divides them (each head's state is its own): local.
    call(conv, x, rec, G, k, delta, index) -> (conv, rec) is the dispatch on whole or local operands."""
    mesh = active_mesh()
    if mesh is None:
        return call(conv, x, rec, G, k, delta, index)
    dax = batch_axis(mesh, conv.shape[0])
    n = mesh.shape["model"]
    cax = "model" if n > 1 and conv.shape[2] % n == 0 else None
    hax = heads_axis(mesh, rec.shape[1])
    if dax is None and cax is None and hax is None:
        return call(conv, x, rec, G, k, delta, index)
    st, heads = P(dax, None, cax), P(dax, hax, None, None)
    rows = P(None, dax, None, cax) if x.ndim == 4 else st
    specs = (st, rows, heads, P(dax, hax, None), heads, heads, P(dax))
    return jax.shard_map(call, mesh=mesh, in_specs=specs, out_specs=(st, heads), check_vma=False)(
        conv, x, rec, G, k, delta, index)
