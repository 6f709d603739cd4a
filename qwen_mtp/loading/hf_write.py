"""Write `Weights` as a Hugging Face Qwen3.5 safetensors checkpoint (the inverse of hf_safetensors.py).

Used by the training script to ship its model and by the certificate's random architectures; dense and MoE
Qwen3.5 text layouts, MoE experts either per expert (`experts.{e}.gate_proj.weight`, ...) or fused
(`experts.gate_up_proj` [E, 2I, H] with the gate rows first, `experts.down_proj` [E, H, I]) as newer
transformers releases save them.
Files are written to a temporary name and renamed, so a failed write leaves no half-written checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from qwen_mtp.errors import ArgumentError
from qwen_mtp.trunk.config import ModelConfig
from qwen_mtp.trunk.weights import AttnWeights, MoEWeights, Weights


def _np(x, dtype):
    return np.ascontiguousarray(np.asarray(x, np.float32).astype(dtype))


EXPERT_LAYOUTS = ("per-expert", "fused")


def _layer_tensors(lw, p, experts="per-expert"):
    out = {p + "input_layernorm.weight": lw.input_norm, p + "post_attention_layernorm.weight": lw.post_norm}
    m = lw.mixer
    if isinstance(m, AttnWeights):
        a = p + "self_attn."
        out.update({a + "q_proj.weight": m.q_proj.T, a + "k_proj.weight": m.k_proj.T, a + "v_proj.weight": m.v_proj.T,
                    a + "o_proj.weight": m.o_proj.T, a + "q_norm.weight": m.q_norm, a + "k_norm.weight": m.k_norm})
    else:
        g = p + "linear_attn."
        out.update({g + "in_proj_qkv.weight": m.in_proj_qkv.T, g + "in_proj_z.weight": m.in_proj_z.T,
                    g + "in_proj_b.weight": m.in_proj_b.T, g + "in_proj_a.weight": m.in_proj_a.T,
                    g + "conv1d.weight": np.asarray(m.conv).T[:, None, :], g + "A_log": m.A_log,
                    g + "dt_bias": m.dt_bias, g + "norm.weight": m.norm, g + "out_proj.weight": m.out_proj.T})
    f = lw.mlp
    q = p + "mlp."
    if isinstance(f, MoEWeights):
        out[q + "gate.weight"] = f.router.T
        if experts == "fused":
            gate, up, down = (np.asarray(x) for x in (f.gate, f.up, f.down))  # [E, H, I], [E, H, I], [E, I, H]
            out[q + "experts.gate_up_proj"] = np.concatenate([gate, up], axis=2).transpose(0, 2, 1)
            out[q + "experts.down_proj"] = down.transpose(0, 2, 1)
        else:
            for e in range(f.gate.shape[0]):
                out[f"{q}experts.{e}.gate_proj.weight"] = f.gate[e].T
                out[f"{q}experts.{e}.up_proj.weight"] = f.up[e].T
                out[f"{q}experts.{e}.down_proj.weight"] = f.down[e].T
        s = q + "shared_expert."
        out.update({s + "gate_proj.weight": f.shared.gate.T, s + "up_proj.weight": f.shared.up.T,
                    s + "down_proj.weight": f.shared.down.T, q + "shared_expert_gate.weight": f.shared_gate.T})
    else:
        out.update({q + "gate_proj.weight": f.gate.T, q + "up_proj.weight": f.up.T, q + "down_proj.weight": f.down.T})
    return out


def weights_to_tensors(weights: Weights, cfg: ModelConfig, dtype=np.float32, experts: str = "per-expert") -> dict:
    """HF tensor name -> numpy array ([out, in] matrices), for a qwen3_5_text / qwen3_5_moe_text config;
    `experts`: the MoE layout, one of EXPERT_LAYOUTS."""
    if cfg.model_type not in ("qwen3_5_text", "qwen3_5_moe_text"):
        raise ArgumentError("cfg.model_type", "'qwen3_5_text' or 'qwen3_5_moe_text'", repr(cfg.model_type))
    if experts not in EXPERT_LAYOUTS:
        raise ArgumentError("experts", f"one of {EXPERT_LAYOUTS}", repr(experts))
    P = "model."
    t = {P + "embed_tokens.weight": weights.embed, P + "norm.weight": weights.final_norm}
    for i, lw in enumerate(weights.layers):
        t.update(_layer_tensors(lw, f"{P}layers.{i}.", experts))
    if weights.lm_head is not None:
        t["lm_head.weight"] = weights.lm_head.T
    if weights.mtp is not None:
        m = weights.mtp
        t.update({"mtp.fc.weight": m.fc.T, "mtp.pre_fc_norm_embedding.weight": m.pre_fc_norm_embedding,
                  "mtp.pre_fc_norm_hidden.weight": m.pre_fc_norm_hidden, "mtp.norm.weight": m.norm})
        t.update(_layer_tensors(m.layer, "mtp.layers.0.", experts))
    return {k: _np(v, dtype) for k, v in t.items()}


def save_checkpoint(folder, weights: Weights, cfg: ModelConfig, config_json: dict, dtype=np.float32,
                    experts: str = "per-expert"):
    """Write config.json and model.safetensors into folder (created if needed), each atomically."""
    tensors = weights_to_tensors(weights, cfg, dtype, experts)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    os.replace(tmp, folder / "model.safetensors")
    tmp = folder / "config.json.tmp"
    tmp.write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, folder / "config.json")
