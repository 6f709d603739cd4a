"""Decode state pytrees: a KV cache per full-attention layer, conv window + recurrent state per GDN layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from .config import ModelConfig


@struct.dataclass
class KVCache:
    k: jax.Array  # [B, S, kv_heads, head_dim], RoPE applied; slot = logical position
    v: jax.Array  # [B, S, kv_heads, head_dim]


@struct.dataclass
class GDNState:
    conv: jax.Array  # [B, kernel - 1, conv_dim]: the last kernel-1 conv inputs, oldest first
    rec: jax.Array  # [B, num_v_heads, k_head_dim, v_head_dim], f32


def init_state(cfg: ModelConfig, batch: int, max_len: int, dtype) -> tuple:
    layers = []
    for kind in cfg.layer_types:
        if kind == "full_attention":
            shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
            layers.append(KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)))
        else:
            layers.append(GDNState(
                jnp.zeros((batch, cfg.conv_kernel - 1, cfg.conv_dim), dtype),
                jnp.zeros((batch, cfg.gdn_num_v_heads, cfg.gdn_k_head_dim, cfg.gdn_v_head_dim), jnp.float32)))
    return tuple(layers)
