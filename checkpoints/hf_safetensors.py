"""Read a Hugging Face Qwen3.5 / Qwen3.5-MoE / Qwen3-Next safetensors checkpoint into `Weights`.

Every tensor is checked against the config before anything is built: presence, shape and a floating dtype.
Tensors the config does not account for are an error too (a config that undercounts layers must not load
silently), except the vision tower (`model.visual.*`) and a tied `lm_head.weight`.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from qwen_mtp.config import ModelConfig
from qwen_mtp.errors import CheckpointError
from qwen_mtp.quant import QuantPolicy, quantize
from qwen_mtp.weights import (AttnWeights, GDNWeights, LayerWeights, MLPWeights, MoEWeights, MTPWeights,
                              Weights)

FLOAT_DTYPES = {"F32", "F16", "BF16"}
IGNORED_PREFIXES = ("model.visual.",)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _shard_files(folder: Path) -> dict:
    """tensor name -> file path, from model.safetensors.index.json or the single model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(index, None, "a JSON object with a 'weight_map'", f"{type(e).__name__}: {e}") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(index, None, "'weight_map' to be an object", type(weight_map).__name__)
        root = folder.resolve()
        files = {}
        for name, shard in weight_map.items():
            p = (folder / str(shard)).resolve()
            if Path(str(shard)).is_absolute() or not p.is_relative_to(root):
                raise CheckpointError(index, name, f"a shard path inside {root}", repr(shard))
            if not p.is_file():
                raise CheckpointError(index, name, "an existing shard file", f"missing file {shard!r}")
            files[name] = p
        return files
    single = folder / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(folder, None, "model.safetensors or model.safetensors.index.json", "neither")
    return {name: single for name in _open(single).keys()}


def _open(file: Path):
    try:
        return safe_open(str(file), framework="numpy")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(file, None, "a readable safetensors file", f"{type(e).__name__}: {e}") from None


class _Reader:
    """Hands out validated numpy tensors and records which names were used."""

    def __init__(self, folder: Path):
        self.files = _shard_files(folder)
        self.handles = {f: _open(f) for f in set(self.files.values())}
        for f, h in self.handles.items():  # the index must not name tensors its shard lacks
            keys = set(h.keys())
            for name, g in self.files.items():
                if g == f and name not in keys:
                    raise CheckpointError(f, name, "the tensor named for this shard in the index", "absent")
        self.used = set()

    def has(self, name):
        return name in self.files

    def get(self, name, shape):
        if name not in self.files:
            where = sorted({str(f) for f in self.files.values()})
            raise CheckpointError(", ".join(where), name, f"a tensor of shape {list(shape)}", "no such tensor")
        file = self.files[name]
        sl = self.handles[file].get_slice(name)
        dtype, found = sl.get_dtype(), list(sl.get_shape())
        if found != list(shape):
            raise CheckpointError(file, name, f"shape {list(shape)}", f"shape {found}")
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(file, name, f"a floating dtype ({'/'.join(sorted(FLOAT_DTYPES))})", dtype)
        try:
            arr = self.handles[file].get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(file, name, "readable tensor data", f"{type(e).__name__}: {e}") from None
        self.used.add(name)
        return arr

    def check_all_used(self, allowed_unused=()):
        for name, file in sorted(self.files.items()):
            if name in self.used or name in allowed_unused or name.startswith(IGNORED_PREFIXES):
                continue
            raise CheckpointError(file, name, "only tensors the config accounts for", "an unexpected tensor")


def _attention(r, p, cfg, cast, lin):
    H, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    return AttnWeights(
        q_proj=lin(r.get(p + "q_proj.weight", (2 * nh * hd, H)).T),
        k_proj=lin(r.get(p + "k_proj.weight", (nkv * hd, H)).T),
        v_proj=lin(r.get(p + "v_proj.weight", (nkv * hd, H)).T),
        o_proj=lin(r.get(p + "o_proj.weight", (H, nh * hd)).T),
        q_norm=cast(r.get(p + "q_norm.weight", (hd,))),
        k_norm=cast(r.get(p + "k_norm.weight", (hd,))))


def _gdn(r, p, cfg, cast, lin):
    H, nk, nv, dk, dv = (cfg.hidden_size, cfg.gdn_num_k_heads, cfg.gdn_num_v_heads, cfg.gdn_k_head_dim,
                         cfg.gdn_v_head_dim)
    kd, vd = cfg.gdn_key_dim, cfg.gdn_value_dim
    if cfg.family == "qwen3_next":
        # fused projections, grouped per key head: [q(dk) k(dk) v(r*dv) z(r*dv)] and [b(r) a(r)]
        rep = nv // nk
        qkvz = r.get(p + "in_proj_qkvz.weight", (2 * kd + 2 * vd, H)).reshape(nk, 2 * dk + 2 * rep * dv, H)
        q, k, v, z = np.split(qkvz, [dk, 2 * dk, 2 * dk + rep * dv], axis=1)
        qkv = np.concatenate([q.reshape(kd, H), k.reshape(kd, H), v.reshape(vd, H)], axis=0)
        z = z.reshape(vd, H)
        ba = r.get(p + "in_proj_ba.weight", (2 * nv, H)).reshape(nk, 2 * rep, H)
        b, a = ba[:, :rep].reshape(nv, H), ba[:, rep:].reshape(nv, H)
    else:
        qkv = r.get(p + "in_proj_qkv.weight", (2 * kd + vd, H))
        z = r.get(p + "in_proj_z.weight", (vd, H))
        b = r.get(p + "in_proj_b.weight", (nv, H))
        a = r.get(p + "in_proj_a.weight", (nv, H))
    conv = r.get(p + "conv1d.weight", (cfg.conv_dim, 1, cfg.conv_kernel))
    return GDNWeights(
        in_proj_qkv=lin(qkv.T), in_proj_z=lin(z.T), in_proj_b=cast(b.T), in_proj_a=cast(a.T),
        conv=cast(conv[:, 0, :].T), A_log=cast(r.get(p + "A_log", (nv,))),
        dt_bias=cast(r.get(p + "dt_bias", (nv,))), norm=cast(r.get(p + "norm.weight", (dv,))),
        out_proj=lin(r.get(p + "out_proj.weight", (H, vd)).T))


def _mlp(r, p, H, inter, lin):
    return MLPWeights(gate=lin(r.get(p + "gate_proj.weight", (inter, H)).T),
                      up=lin(r.get(p + "up_proj.weight", (inter, H)).T),
                      down=lin(r.get(p + "down_proj.weight", (H, inter)).T))


def _moe(r, p, cfg, cast, lin):
    H, E, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    if r.has(p + "experts.gate_up_proj"):  # fused: [E, 2I, H] (gate rows first), [E, H, I]
        gu = r.get(p + "experts.gate_up_proj", (E, 2 * inter, H))
        gate, up = gu[:, :inter], gu[:, inter:]
        down = r.get(p + "experts.down_proj", (E, H, inter))
    else:
        e = lambda i, n, s: r.get(f"{p}experts.{i}.{n}_proj.weight", s)
        gate = np.stack([e(i, "gate", (inter, H)) for i in range(E)])
        up = np.stack([e(i, "up", (inter, H)) for i in range(E)])
        down = np.stack([e(i, "down", (H, inter)) for i in range(E)])
    t = lambda x: np.swapaxes(x, 1, 2)
    return MoEWeights(router=cast(r.get(p + "gate.weight", (E, H)).T), gate=lin(t(gate)), up=lin(t(up)),
                      down=lin(t(down)),
                      shared=_mlp(r, p + "shared_expert.", H, cfg.shared_expert_intermediate_size, lin),
                      shared_gate=cast(r.get(p + "shared_expert_gate.weight", (1, H)).T))


def _layer(r, p, cfg, kind, mlp_kind, cast, lin):
    H = cfg.hidden_size
    mixer = (_attention(r, p + "self_attn.", cfg, cast, lin) if kind == "full_attention"
             else _gdn(r, p + "linear_attn.", cfg, cast, lin))
    ff = (_moe(r, p + "mlp.", cfg, cast, lin) if mlp_kind == "moe"
          else _mlp(r, p + "mlp.", H, cfg.intermediate_size, lin))
    return LayerWeights(input_norm=cast(r.get(p + "input_layernorm.weight", (H,))),
                        post_norm=cast(r.get(p + "post_attention_layernorm.weight", (H,))),
                        mixer=mixer, mlp=ff)


def _mtp(r, cfg, cast, lin):
    H = cfg.hidden_size
    return MTPWeights(fc=lin(r.get("mtp.fc.weight", (H, 2 * H)).T),
                      pre_fc_norm_embedding=cast(r.get("mtp.pre_fc_norm_embedding.weight", (H,))),
                      pre_fc_norm_hidden=cast(r.get("mtp.pre_fc_norm_hidden.weight", (H,))),
                      norm=cast(r.get("mtp.norm.weight", (H,))),
                      layer=_layer(r, "mtp.layers.0.", cfg, "full_attention", cfg.mtp_mlp_type, cast, lin))


def load_weights(folder, cfg: ModelConfig, dtype="float32", policy: QuantPolicy | None = None) -> Weights:
    """`policy` None: every tensor in `dtype`. Otherwise the matrices it names are quantized as they load
    (qwen_mtp/quant.py), each from its float32 values, so a bf16 load and an f32 load quantize alike."""
    if dtype not in DTYPES:
        raise CheckpointError(folder, None, f"dtype one of {sorted(DTYPES)}", repr(dtype))
    jdtype = DTYPES[dtype]
    np_dtype = np.float32 if jdtype == jnp.float32 else ml_dtypes.bfloat16

    def cast(x):
        return jnp.asarray(np.ascontiguousarray(x).astype(np_dtype))

    def quantizer(on):
        if policy is None or not on:
            return cast
        return lambda x: quantize(x, policy.method, policy.group_size)

    lin, lin_mtp = quantizer(True), quantizer(policy is not None and policy.mtp)

    r = _Reader(Path(folder))
    P, H, V = cfg.tensor_prefix, cfg.hidden_size, cfg.vocab_size
    if not r.has(P + "embed_tokens.weight"):
        other = "model." if P != "model." else "model.language_model."
        if r.has(other + "embed_tokens.weight"):  # e.g. a text checkpoint saved with the multimodal prefix
            P = other
    embed_raw = r.get(P + "embed_tokens.weight", (V, H))
    embed = cast(embed_raw)
    layers = tuple(_layer(r, f"{P}layers.{i}.", cfg, kind, mk, cast, lin)
                   for i, (kind, mk) in enumerate(zip(cfg.layer_types, cfg.mlp_types)))
    final_norm = cast(r.get(P + "norm.weight", (H,)))
    lm_head = None if cfg.tie_word_embeddings else r.get("lm_head.weight", (V, H)).T
    if policy is not None and policy.lm_head:  # tied: a quantized copy of embed^T; the embedding stays as loaded
        lm_head = quantize(embed_raw.T if lm_head is None else lm_head, policy.method,
                           policy.group_size)
    elif lm_head is not None:
        lm_head = cast(lm_head)
    mtp = None
    if any(name.startswith("mtp.") for name in r.files):
        n = max(cfg.mtp_num_layers, 1)
        if n != 1:
            raise CheckpointError(folder, "mtp.layers.*", "mtp_num_hidden_layers == 1 (as released)", n)
        mtp = _mtp(r, cfg, cast, lin_mtp)
    r.check_all_used(allowed_unused={"lm_head.weight"} if cfg.tie_word_embeddings else ())
    return Weights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head, mtp=mtp)
