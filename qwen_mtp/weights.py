"""Weight pytrees (registered dataclasses). Matrices are stored [in, out]."""

from __future__ import annotations

from typing import Any

import jax
from flax import struct


@struct.dataclass
class AttnWeights:
    q_proj: jax.Array  # [H, 2 * heads * head_dim]: per head, query then output gate
    k_proj: jax.Array  # [H, kv_heads * head_dim]
    v_proj: jax.Array  # [H, kv_heads * head_dim]
    o_proj: jax.Array  # [heads * head_dim, H]
    q_norm: jax.Array  # [head_dim], (1 + w)
    k_norm: jax.Array  # [head_dim], (1 + w)


@struct.dataclass
class GDNWeights:
    in_proj_qkv: jax.Array  # [H, 2 * key_dim + value_dim]
    in_proj_z: jax.Array  # [H, value_dim]
    in_proj_b: jax.Array  # [H, num_v_heads]
    in_proj_a: jax.Array  # [H, num_v_heads]
    conv: jax.Array  # [kernel, conv_dim] depthwise causal conv taps
    A_log: jax.Array  # [num_v_heads]
    dt_bias: jax.Array  # [num_v_heads]
    norm: jax.Array  # [v_head_dim], plain w (gated norm)
    out_proj: jax.Array  # [value_dim, H]


@struct.dataclass
class MLPWeights:
    gate: jax.Array  # [H, I]
    up: jax.Array  # [H, I]
    down: jax.Array  # [I, H]


@struct.dataclass
class MoEWeights:
    router: jax.Array  # [H, E]
    gate: jax.Array  # [E, H, I]
    up: jax.Array  # [E, H, I]
    down: jax.Array  # [E, I, H]
    shared: MLPWeights
    shared_gate: jax.Array  # [H, 1]


@struct.dataclass
class LayerWeights:
    input_norm: jax.Array  # [H], (1 + w)
    post_norm: jax.Array  # [H], (1 + w)
    mixer: Any  # AttnWeights | GDNWeights
    mlp: Any  # MLPWeights | MoEWeights


@struct.dataclass
class MTPWeights:
    fc: jax.Array  # [2H, H]; input is concat(embedding, hidden)
    pre_fc_norm_embedding: jax.Array  # [H]
    pre_fc_norm_hidden: jax.Array  # [H]
    norm: jax.Array  # [H]
    layer: LayerWeights  # one full-attention decoder layer


@struct.dataclass
class Weights:
    embed: jax.Array  # [V, H]
    layers: tuple  # LayerWeights per layer
    final_norm: jax.Array  # [H]
    lm_head: Any  # [H, V], or None when tied to embed
    mtp: Any = None  # MTPWeights | None
