"""Write `Weights` as a Hugging Face Qwen3.5 safetensors checkpoint (the inverse of safetensors.py).

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

import jax
import numpy as np
from safetensors.numpy import save_file

from qwen_mtp.errors import ArgumentError
from qwen_mtp.loading.hf_layout import to_hf
from qwen_mtp.trunk.config import ModelConfig
from qwen_mtp.trunk.weights import Weights, lm_head_info, weight_info


def _np(x, dtype):
    return np.ascontiguousarray(np.asarray(x, np.float32).astype(dtype))


EXPERT_LAYOUTS = ("per-expert", "fused")


def weights_to_tensors(weights: Weights, cfg: ModelConfig, dtype=np.float32, experts: str = "per-expert") -> dict:
    """HF tensor name -> numpy array ([out, in] matrices), for a qwen3_5_text / qwen3_5_moe_text config;
    `experts`: the MoE layout, one of EXPERT_LAYOUTS. Every name and orientation is the leaf's own
    (weight_info in qwen_mtp/trunk/weights.py; hf_layout.to_hf)."""
    if cfg.model_type not in ("qwen3_5_text", "qwen3_5_moe_text"):
        raise ArgumentError("cfg.model_type", "'qwen3_5_text' or 'qwen3_5_moe_text'", repr(cfg.model_type))
    if experts not in EXPERT_LAYOUTS:
        raise ArgumentError("experts", f"one of {EXPERT_LAYOUTS}", repr(experts))
    P = "model."
    info = weight_info(cfg, mtp=weights.mtp is not None)
    if weights.lm_head is not None:
        info = info.replace(lm_head=lm_head_info(cfg))
    leaves = jax.tree.structure(info).flatten_up_to(weights.replace(draft_vocab=None))  # structures must match
    t, fused = {}, {}
    for i, w in zip(jax.tree.leaves(info), leaves):
        if "{e}" not in i.hf:
            t[i.hf_name(P)] = to_hf(w, i)
        elif experts == "fused":  # gate and up: rows of gate_up_proj [E, 2I, H] (gate first); down: down_proj
            fused.setdefault(i.hf_fused.format(P=P), []).append(to_hf(w, i))
        else:
            for e in range(w.shape[0]):
                t[i.hf_name(P, e)] = to_hf(w[e], i)
    t.update({name: np.concatenate(parts, axis=-2) for name, parts in fused.items()})
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
