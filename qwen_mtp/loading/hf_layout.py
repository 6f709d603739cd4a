"""How a weight leaf sits in Hugging Face tensors beyond its name (the names themselves: weight_info in
qwen_mtp/trunk/weights.py, one per leaf): the orientation of each form (`to_hf`), and the fused tensors whose
rows several leaves share: Qwen3-Next's in_proj_qkvz and in_proj_ba (grouped per key head: `qkvz_rows`,
`ba_rows`) and the fused MoE experts' gate_up_proj (gate rows first: `gate_up_rows`). The reader
(safetensors.py) gathers these rows; the writer (hf_write.py) lays leaves out with `to_hf`.
"""

from __future__ import annotations

import numpy as np

from qwen_mtp.trunk.config import ModelConfig
from qwen_mtp.trunk.weights import LeafInfo


def to_hf(w, info: LeafInfo) -> np.ndarray:
    """A leaf's value (ours; one expert's [..] for an "{e}" pattern) in the orientation of its HF tensor."""
    w = np.asarray(w)
    if info.hf_form == "T":
        return np.swapaxes(w, -1, -2)
    if info.hf_form == "conv":  # taps [K, C] -> HF's depthwise conv1d weight [C, 1, K]
        return w.T[:, None, :]
    return w


def qkvz_rows(cfg: ModelConfig):
    """Qwen3-Next's in_proj_qkvz rows [per key head: q(dk) k(dk) v(r dv) z(r dv)] -> (rows of our
    in_proj_qkv [all q | all k | all v], rows of in_proj_z)."""
    nk, dk, dv = cfg.gdn_num_k_heads, cfg.gdn_k_head_dim, cfg.gdn_v_head_dim
    rep = cfg.gdn_num_v_heads // nk
    g = np.arange(nk * (2 * dk + 2 * rep * dv)).reshape(nk, -1)
    q, k, v, z = np.split(g, [dk, 2 * dk, 2 * dk + rep * dv], axis=1)
    return np.concatenate([q.ravel(), k.ravel(), v.ravel()]), z.ravel()


def ba_rows(cfg: ModelConfig):
    """Qwen3-Next's in_proj_ba rows [per key head: b(r) a(r)] -> (rows of in_proj_b, rows of in_proj_a)."""
    rep = cfg.gdn_num_v_heads // cfg.gdn_num_k_heads
    g = np.arange(2 * cfg.gdn_num_v_heads).reshape(cfg.gdn_num_k_heads, 2 * rep)
    return g[:, :rep].ravel(), g[:, rep:].ravel()


def gate_up_rows(cfg: ModelConfig):
    """The fused experts.gate_up_proj [E, 2I, H] rows -> (rows of gate, rows of up): gate first."""
    inter = cfg.moe_intermediate_size
    return np.arange(inter), np.arange(inter, 2 * inter)
