"""FP8 test checkpoints in the two published layouts, written from a saved tiny checkpoint (tests/hf_tiny.py).

    write_fp8(src, fp8_dir, deq_dir, layout=..., pick=..., block=...)

reads src's model.safetensors (HF names, HF's [out, in] orientation), quantizes the tensors `pick` chooses to
e4m3 with their scales and writes two checkpoints:
  fp8_dir  the FP8 checkpoint: F8_E4M3 values with their scales (layout "fp8": `<w>_scale_inv` per block of
           weight_block_size; layout "compressed-tensors": `<w>_scale` per channel [out, 1], per tensor [1] or
           [E, 1, 1], or per block), the other tensors in `plain_dtype`, config.json with a quantization_config;
  deq_dir  the same weights dequantized, every tensor float32 (value * scale, one float32 rounding), config.json
           without quantization_config: the weights the oracle (transformers) and our plain loader read.
Each scale is max|block| / 448 times a random factor in [1, 3), so a scale applied to the wrong block, or not at
all, changes the weight by up to 3x. numpy and ml_dtypes only: no qwen_mtp code on this side of the tests.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = 448.0


def cdiv(a, b):
    return -(-a // b)


def expand(scale, rows, cols, r, c):
    """scale [..., ceil(rows / r), ceil(cols / c)] -> [..., rows, cols], one entry per weight."""
    return np.repeat(np.repeat(scale, r, axis=-2), c, axis=-1)[..., :rows, :cols]


def quantize(w, r, c, rng):
    """w [..., R, C] float -> (e4m3 values [..., R, C], float32 scales [..., ceil(R / r), ceil(C / c)])."""
    w = np.asarray(w, np.float32)
    *lead, R, C = w.shape
    gr, gc = cdiv(R, r), cdiv(C, c)
    padded = np.zeros((*lead, gr * r, gc * c), np.float32)
    padded[..., :R, :C] = w
    amax = np.abs(padded.reshape(*lead, gr, r, gc, c)).max(axis=(-3, -1))
    scale = (np.where(amax > 0, amax / E4M3_MAX, 1.0) * rng.uniform(1.0, 3.0, amax.shape)).astype(np.float32)
    return (w / expand(scale, R, C, r, c)).astype(E4M3), scale


def dequantize(q, scale, r, c):
    R, C = q.shape[-2:]
    return q.astype(np.float32) * expand(scale.astype(np.float32), R, C, r, c)


def quantization_config(layout, block=None, ct_block=None):
    if layout == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block)}
    w = lambda strategy, **kw: {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
                                "dynamic": False, **kw}
    act = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
    groups = {"group_0": {"targets": ["Linear"], "weights": w("channel"), "input_activations": act},
              "group_1": {"targets": ["re:.*o_proj$"], "weights": w("tensor"), "input_activations": act}}
    if ct_block is not None:
        groups["group_2"] = {"targets": ["re:.*q_proj$"], "weights": w("block", block_structure=list(ct_block)),
                             "input_activations": act}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": groups,
            "ignore": ["lm_head"], "quantization_status": "compressed"}


def write_fp8(src, fp8_dir, deq_dir, *, layout, pick, block=None, ct_block=None, plain_dtype=np.float32,
              input_scale=lambda name: False, seed=0):
    """pick(name, array) -> None (kept as is), or how to quantize: "block" (layout "fp8": weight_block_size
    `block` = (rows, cols); compressed-tensors: `ct_block`), "channel" or "tensor" (compressed-tensors).
    input_scale(name) -> whether to add an (unused) `<layer>.input_scale` beside a quantized `<layer>.weight`.
    Returns (fp8 tensors, dequantized tensors, {name: strategy} of the quantized ones)."""
    src, fp8_dir, deq_dir = Path(src), Path(fp8_dir), Path(deq_dir)
    rng = np.random.RandomState(seed)
    fp8, deq, chosen = {}, {}, {}
    suffix = "_scale_inv" if layout == "fp8" else "_scale"
    for name, w in sorted(load_file(src / "model.safetensors").items()):
        how = pick(name, w)
        if how is None:
            fp8[name] = w.astype(plain_dtype)
            deq[name] = fp8[name].astype(np.float32)
            continue
        *lead, R, C = w.shape
        r, c = {"block": block if layout == "fp8" else ct_block, "channel": (1, C), "tensor": (R, C)}[how]
        assert layout == "compressed-tensors" or how == "block", (layout, how)
        q, scale = quantize(w, r, c, rng)
        deq[name] = dequantize(q, scale, r, c)
        if how == "tensor" and not lead:
            scale = scale.reshape(1)  # compressed-tensors writes a per-tensor scale as [1]
        fp8[name], fp8[name + suffix] = q, scale
        if input_scale(name) and name.endswith(".weight"):
            fp8[name[:-len("weight")] + "input_scale"] = np.array([rng.uniform(0.01, 0.1)], np.float32)
        chosen[name] = how
    cfg = json.loads((src / "config.json").read_text())
    for d, tensors, c in ((fp8_dir, fp8, dict(cfg, quantization_config=quantization_config(layout, block, ct_block))),
                          (deq_dir, deq, cfg)):
        d.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name not in ("model.safetensors", "config.json") and f.is_file():
                shutil.copy(f, d / f.name)
        save_file(tensors, d / "model.safetensors")
        (d / "config.json").write_text(json.dumps(c, indent=1))
    return fp8, deq, chosen


def save_tensors(folder, tensors, config=None):
    """Rewrite a checkpoint folder's model.safetensors (and config.json) with these tensors (F8 included)."""
    folder = Path(folder)
    save_file(tensors, folder / "model.safetensors")
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config, indent=1))


def load_into(model, tensors):
    """transformers `model` with every parameter taken from `tensors` (HF checkpoint names; per-expert tensors
    stacked into the fused experts.gate_up_proj / down_proj the module holds), in the model's own dtype.
    Every tensor except mtp.* must be used and every parameter set."""
    import torch

    sd = model.state_dict()
    used, new = set(), {}
    for pname, p in sd.items():
        if pname in tensors:
            v = tensors[pname]
            used.add(pname)
        elif pname.endswith("mlp.experts.gate_up_proj") or pname.endswith("mlp.experts.down_proj"):
            pre = pname[:-len("gate_up_proj")] if pname.endswith("gate_up_proj") else pname[:-len("down_proj")]
            E = p.shape[0]
            names = {n: [f"{pre}{e}.{n}_proj.weight" for e in range(E)] for n in ("gate", "up", "down")}
            if pname.endswith("gate_up_proj"):
                v = np.stack([np.concatenate([tensors[g], tensors[u]]) for g, u in zip(names["gate"], names["up"])])
                used.update(names["gate"] + names["up"])
            else:
                v = np.stack([tensors[d] for d in names["down"]])
                used.update(names["down"])
        elif pname == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        else:
            raise KeyError(f"no tensor for parameter {pname}")
        assert tuple(v.shape) == tuple(p.shape), (pname, v.shape, p.shape)
        new[pname] = torch.from_numpy(np.asarray(v, np.float64)).to(p.dtype)
    left = {n for n in tensors if n not in used and not n.startswith("mtp.")}
    assert not left, f"tensors the oracle did not take: {sorted(left)}"
    missing, unexpected = model.load_state_dict(new, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model
