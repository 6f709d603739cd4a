"""Quantized test models shared by the test files (one builder, so the jit compiles they cause are shared too)."""

import qwen_mtp

KINDS = ("int8", "int4", "fp8")


def mixed_model(folder):
    """One model holding every format (each compile of a generate loop costs seconds): trunk layer i in
    KINDS[i % 3] (int4 in groups of 32 along K), the MTP head in int8 (its MoE experts, if any: the grouped dot on
    raw values scaled per row) and the lm_head in fp8 (tied: a quantized copy of embed^T). Its blocks differ per
    leaf, which only per-leaf metadata can describe."""
    by = {k: qwen_mtp.load(folder, quant=k, group_size=32, quant_lm_head=True) for k in KINDS}
    w = by["int8"].weights
    layers = tuple(by[KINDS[i % 3]].weights.layers[i] for i in range(len(w.layers)))
    w = w.replace(layers=layers, lm_head=by["fp8"].weights.lm_head)
    m = by["int8"]
    return qwen_mtp.Model(config=m.config, weights=w, path=m.path, dtype=m.dtype, quant=m.quant)
