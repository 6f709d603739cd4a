"""SwiGLU MLP and the sparse MoE block (softmax router, top-k, optional renormalisation, shared expert)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen_mtp.trunk.config import ModelConfig
from qwen_mtp.trunk.ops import linear
from qwen_mtp.trunk.quant import ragged_dot
from qwen_mtp.trunk.weights import MLPWeights, MoEWeights


def mlp(x, w: MLPWeights):
    return linear(jax.nn.silu(linear(x, w.gate)) * linear(x, w.up), w.down)


def moe(x, w: MoEWeights, cfg: ModelConfig):
    """x [..., H]. Tokens are sorted by expert and run through grouped matmuls (quant.ragged_dot: lax.ragged_dot
    on plain or quantized experts)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    n, k, E = x2.shape[0], cfg.top_k, cfg.num_experts
    probs = jax.nn.softmax(linear(x2, w.router).astype(jnp.float32), axis=-1)
    top_p, top_e = jax.lax.top_k(probs, k)
    if cfg.norm_topk_prob:
        top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    top_p = top_p.astype(x.dtype)

    flat_e = top_e.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    token = order // k
    group_sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)
    xs = x2[token]
    row_expert = flat_e[order]
    g = ragged_dot(xs, w.gate, group_sizes, row_expert)
    u = ragged_dot(xs, w.up, group_sizes, row_expert)
    y = ragged_dot(jax.nn.silu(g) * u, w.down, group_sizes, row_expert)
    y = y * top_p.reshape(-1)[order][:, None]
    routed = jnp.zeros_like(x2).at[token].add(y)
    shared = mlp(x2, w.shared) * jax.nn.sigmoid(linear(x2, w.shared_gate))
    return (routed + shared).reshape(shape)


def feed_forward(x, w, cfg: ModelConfig):
    return moe(x, w, cfg) if isinstance(w, MoEWeights) else mlp(x, w)
