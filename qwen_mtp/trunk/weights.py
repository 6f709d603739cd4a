"""Weight pytrees (registered dataclasses; matrices are stored [in, out]), and one description per leaf.

The description of a leaf: its shape, dtype, logical sharding axes and Hugging Face tensor name.

`weight_info(cfg, dtype, mtp=True)` is the `Weights` pytree of a checkpoint of `cfg` with a `LeafInfo` at every
leaf (the model is jax-llm-examples' per-leaf ArrayInfo). Everything that needs to know a weight reads it
from here: weight_shapes (the abstract tree), qwen_mtp/parallel/sharding.py (the logical axes; which
mesh axis a logical axis goes to is decided there), the Hugging Face reader and writer
(qwen_mtp/loading/safetensors.py, hf_write.py: the tensor names).

Logical axes (sharding.py's docstring says which mesh axis each goes to): heads, kv_heads, v_heads, conv, mlp,
expert_mlp, vocab, fc_in; "hidden" and None are never split.

Hugging Face names. `hf` is the name in a Qwen3.5 / Qwen3.5-MoE checkpoint, with "{P}" standing for the text
model's prefix (cfg.tensor_prefix, "model." or "model.language_model."; the reader also accepts the other) and,
for a leaf of stacked MoE experts [E, ...], "{e}" for the expert index (one HF tensor per expert). `hf_form`
says how the HF tensor relates to the leaf: "T" a matrix HF stores [..., out, in] (ours is [..., in, out]),
"same" as stored, "conv" HF's depthwise conv weight [C, 1, K] (ours: taps [K, C]). Not every HF tensor is one
leaf: `hf_fused` names the tensor a leaf is a row range of in the other layouts, and the reader keeps the
row-splitting logic (qwen_mtp/loading/hf_layout.py):
  Qwen3-Next (family "qwen3_next") stores in_proj_qkv and in_proj_z as one in_proj_qkvz (rows grouped per key
  head), in_proj_b and in_proj_a as one in_proj_ba; `hf` is then absent from the checkpoint;
  newer transformers releases store MoE experts fused: gate and up as rows of experts.gate_up_proj
  [E, 2I, H] (gate first), down as experts.down_proj [E, H, I].
A tied lm_head is no leaf (lm_head None): a checkpoint may still hold lm_head.weight, which the reader
ignores. The MTP head's tensors carry the prefix "mtp." and no "{P}".
"""

from __future__ import annotations

import dataclasses
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


# ------------------------------------------------------------------------------------------ one description per leaf
@dataclasses.dataclass(frozen=True)
class LeafInfo:
    """One weight: shape (ours, [in, out] for matrices), dtype, logical axis per dimension (None: never split),
    Hugging Face name / pattern and form, and the fused HF tensor it is a row range of (module docstring)."""

    shape: tuple
    dtype: Any
    axes: tuple
    hf: str
    hf_form: str = "same"  # "same" | "T" | "conv"
    hf_fused: str | None = None

    @property
    def hf_shape(self) -> tuple:
        """The shape of the HF tensor `hf` names (one expert's for an "{e}" pattern)."""
        shape = self.shape[1:] if "{e}" in self.hf else self.shape
        if self.hf_form == "T":
            return (*shape[:-2], shape[-1], shape[-2])
        if self.hf_form == "conv":
            return (shape[1], 1, shape[0])
        return tuple(shape)

    def hf_name(self, prefix: str = "model.", expert: int | None = None) -> str:
        """`hf` with the text prefix (and the expert index) filled in."""
        return self.hf.format(P=prefix, e=expert)


def weight_info(cfg, dtype="bfloat16", *, mtp: bool = True) -> Weights:
    """The `Weights` pytree of a checkpoint of `cfg` with a LeafInfo per leaf (every tensor in `dtype`, as the
    loader casts them); lm_head None when tied, mtp None without the MTP head."""
    import jax.numpy as jnp

    dt = jnp.dtype(dtype)
    H, V = cfg.hidden_size, cfg.vocab_size

    def leaf(shape, axes, hf, form="same", fused=None):
        assert len(shape) == len(axes), (shape, axes, hf)
        return LeafInfo(tuple(shape), dt, tuple(axes), hf, form, fused)

    def mat(shape, axes, hf, fused=None):
        return leaf(shape, axes, hf, "T", fused)

    def attn(p):
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        p += "self_attn."
        return AttnWeights(q_proj=mat((H, 2 * nh * hd), ("hidden", "heads"), p + "q_proj.weight"),
                           k_proj=mat((H, nkv * hd), ("hidden", "kv_heads"), p + "k_proj.weight"),
                           v_proj=mat((H, nkv * hd), ("hidden", "kv_heads"), p + "v_proj.weight"),
                           o_proj=mat((nh * hd, H), ("heads", "hidden"), p + "o_proj.weight"),
                           q_norm=leaf((hd,), (None,), p + "q_norm.weight"),
                           k_norm=leaf((hd,), (None,), p + "k_norm.weight"))

    def gdn(p):
        nv, vd = cfg.gdn_num_v_heads, cfg.gdn_value_dim
        p += "linear_attn."
        qkvz, ba = p + "in_proj_qkvz.weight", p + "in_proj_ba.weight"
        return GDNWeights(in_proj_qkv=mat((H, cfg.conv_dim), ("hidden", "conv"), p + "in_proj_qkv.weight", qkvz),
                          in_proj_z=mat((H, vd), ("hidden", "v_heads"), p + "in_proj_z.weight", qkvz),
                          in_proj_b=mat((H, nv), ("hidden", "v_heads"), p + "in_proj_b.weight", ba),
                          in_proj_a=mat((H, nv), ("hidden", "v_heads"), p + "in_proj_a.weight", ba),
                          conv=leaf((cfg.conv_kernel, cfg.conv_dim), (None, "conv"), p + "conv1d.weight", "conv"),
                          A_log=leaf((nv,), ("v_heads",), p + "A_log"),
                          dt_bias=leaf((nv,), ("v_heads",), p + "dt_bias"),
                          norm=leaf((cfg.gdn_v_head_dim,), (None,), p + "norm.weight"),
                          out_proj=mat((vd, H), ("v_heads", "hidden"), p + "out_proj.weight"))

    def mlp(p, inter):
        return MLPWeights(gate=mat((H, inter), ("hidden", "mlp"), p + "gate_proj.weight"),
                          up=mat((H, inter), ("hidden", "mlp"), p + "up_proj.weight"),
                          down=mat((inter, H), ("mlp", "hidden"), p + "down_proj.weight"))

    def moe(p):
        E, inter = cfg.num_experts, cfg.moe_intermediate_size
        x, gate_up, down = p + "experts.{e}.", p + "experts.gate_up_proj", p + "experts.down_proj"
        return MoEWeights(router=mat((H, E), ("hidden", None), p + "gate.weight"),
                          gate=mat((E, H, inter), (None, "hidden", "expert_mlp"), x + "gate_proj.weight", gate_up),
                          up=mat((E, H, inter), (None, "hidden", "expert_mlp"), x + "up_proj.weight", gate_up),
                          down=mat((E, inter, H), (None, "expert_mlp", "hidden"), x + "down_proj.weight", down),
                          shared=mlp(p + "shared_expert.", cfg.shared_expert_intermediate_size),
                          shared_gate=mat((H, 1), ("hidden", None), p + "shared_expert_gate.weight"))

    def layer(p, kind, mlp_kind):
        return LayerWeights(input_norm=leaf((H,), (None,), p + "input_layernorm.weight"),
                            post_norm=leaf((H,), (None,), p + "post_attention_layernorm.weight"),
                            mixer=attn(p) if kind == "full_attention" else gdn(p),
                            mlp=moe(p + "mlp.") if mlp_kind == "moe" else mlp(p + "mlp.", cfg.intermediate_size))

    layers = tuple(layer(f"{{P}}layers.{i}.", k, m) for i, (k, m) in enumerate(zip(cfg.layer_types, cfg.mlp_types)))
    head = None
    if mtp:
        head = MTPWeights(fc=mat((2 * H, H), ("fc_in", "hidden"), "mtp.fc.weight"),
                          pre_fc_norm_embedding=leaf((H,), (None,), "mtp.pre_fc_norm_embedding.weight"),
                          pre_fc_norm_hidden=leaf((H,), (None,), "mtp.pre_fc_norm_hidden.weight"),
                          norm=leaf((H,), (None,), "mtp.norm.weight"),
                          layer=layer("mtp.layers.0.", "full_attention", cfg.mtp_mlp_type))
    return Weights(embed=leaf((V, H), ("vocab", "hidden"), "{P}embed_tokens.weight"), layers=layers,
                   final_norm=leaf((H,), (None,), "{P}norm.weight"),
                   lm_head=None if cfg.tie_word_embeddings else lm_head_info(cfg, dtype), mtp=head)


def lm_head_info(cfg, dtype="bfloat16") -> LeafInfo:
    """The lm_head [H, V]: a leaf of weight_info when untied; a tied model's quantized copy of embed^T and a draft
    vocabulary's columns are split alike."""
    import jax.numpy as jnp

    return LeafInfo((cfg.hidden_size, cfg.vocab_size), jnp.dtype(dtype), ("hidden", "vocab"), "lm_head.weight", "T")


def weight_shapes(cfg, dtype="bfloat16", *, mtp: bool = True) -> Weights:
    """The `Weights` pytree a checkpoint of `cfg` loads into, as jax.ShapeDtypeStruct leaves (every tensor in
    `dtype`, as the loader casts them). For lowering and exporting programs at real model shapes without
    allocating them, and for building random weights of a shape (jax.tree.map over it). The shapes are those of
    weight_info, the one description of each leaf."""
    return jax.tree.map(lambda i: jax.ShapeDtypeStruct(i.shape, i.dtype), weight_info(cfg, dtype, mtp=mtp))
