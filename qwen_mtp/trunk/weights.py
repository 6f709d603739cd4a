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
    # draft_vocab.DraftVocab | None: the draft head's reduced vocabulary (ids and their lm_head columns); derived
    # at load time, never read from or saved to a checkpoint
    draft_vocab: Any = None


def weight_shapes(cfg, dtype="bfloat16", *, mtp: bool = True) -> Weights:
    """The `Weights` pytree a checkpoint of `cfg` loads into, as jax.ShapeDtypeStruct leaves (every tensor in
    `dtype`, as the loader casts them). For lowering and exporting programs at real model shapes without
    allocating them, and for building random weights of a shape (jax.tree.map over it)."""
    import jax.numpy as jnp

    dt = jnp.dtype(dtype)
    a = lambda *shape: jax.ShapeDtypeStruct(shape, dt)
    H, V = cfg.hidden_size, cfg.vocab_size

    def attn():
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        return AttnWeights(q_proj=a(H, 2 * nh * hd), k_proj=a(H, nkv * hd), v_proj=a(H, nkv * hd),
                           o_proj=a(nh * hd, H), q_norm=a(hd), k_norm=a(hd))

    def gdn():
        nv = cfg.gdn_num_v_heads
        return GDNWeights(in_proj_qkv=a(H, cfg.conv_dim), in_proj_z=a(H, cfg.gdn_value_dim), in_proj_b=a(H, nv),
                          in_proj_a=a(H, nv), conv=a(cfg.conv_kernel, cfg.conv_dim), A_log=a(nv), dt_bias=a(nv),
                          norm=a(cfg.gdn_v_head_dim), out_proj=a(cfg.gdn_value_dim, H))

    def mlp(inter):
        return MLPWeights(gate=a(H, inter), up=a(H, inter), down=a(inter, H))

    def moe():
        E, inter = cfg.num_experts, cfg.moe_intermediate_size
        return MoEWeights(router=a(H, E), gate=a(E, H, inter), up=a(E, H, inter), down=a(E, inter, H),
                          shared=mlp(cfg.shared_expert_intermediate_size), shared_gate=a(H, 1))

    def layer(kind, mlp_kind):
        return LayerWeights(input_norm=a(H), post_norm=a(H), mixer=attn() if kind == "full_attention" else gdn(),
                            mlp=moe() if mlp_kind == "moe" else mlp(cfg.intermediate_size))

    layers = tuple(layer(k, m) for k, m in zip(cfg.layer_types, cfg.mlp_types))
    head = None
    if mtp:
        head = MTPWeights(fc=a(2 * H, H), pre_fc_norm_embedding=a(H), pre_fc_norm_hidden=a(H), norm=a(H),
                          layer=layer("full_attention", cfg.mtp_mlp_type))
    return Weights(embed=a(V, H), layers=layers, final_norm=a(H),
                   lm_head=None if cfg.tie_word_embeddings else a(H, V), mtp=head)
