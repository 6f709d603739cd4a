"""Quantized weights (load(quant=...)): the quantizer's rules, a quantized model against the same architecture
loaded from a checkpoint holding the dequantized weights, and lossless speculative decoding on quantized weights."""

import json

import jax
import numpy as np
import pytest
from quant_models import KINDS, mixed_model

import qwen_mtp
from kernels_pallas import quant_layout
from qwen_mtp.loading.hf_write import save_checkpoint
from qwen_mtp.trunk import quant
from qwen_mtp.trunk.weights import weight_shapes


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("kind", KINDS)
def test_quantizer_rules(kind):
    rng = np.random.default_rng(0)
    K, N, g = 48, 40, 32  # K not a multiple of the group: padded
    w = rng.standard_normal((K, N)).astype(np.float32)
    w[:, 3] = 0.0  # an all-zero column: scale 1, values 0
    qa = quant.quantize(w, kind, g)
    qs, ss, block = quant.layout_of(kind, (K, N), g)
    assert (qa.q.shape, qa.scale.shape, qa.block) == (qs, ss, block)
    v = np.asarray(quant_layout.values(np.asarray(qa.q), kind, block)).astype(np.float32)
    s = quant_layout.expand_scale(np.asarray(qa.scale), v.shape[0], N, block)  # padded rows of int4 included
    deq = np.asarray(qa.dequantize())
    assert np.all(deq[:, 3] == 0)
    if kind == "fp8":
        assert qa.q.dtype == np.dtype("float8_e4m3fn") and np.abs(v).max() <= 448
        # e4m3: 3 mantissa bits, relative rounding error <= 2^-4 away from the subnormals
        big = np.abs(w) > 2.0 ** -6 * s[:K]
        assert np.all(np.abs(deq - w)[big] <= 2.0 ** -4 * np.abs(w)[big] + 1e-7)
    else:
        qmax = quant_layout.QMAX[kind]
        assert np.abs(v).max() == qmax and np.all(v == np.rint(v))
        assert np.all(np.abs(deq - w) <= s[:K] / 2 + 1e-6)  # round to nearest
        if kind == "int4":
            assert qa.q.dtype == np.uint8 and qa.q.shape == (32, N)  # 48 rows -> 2 groups of 32 -> 32 bytes
            assert np.all(v[K:] == 0)  # the padded rows add nothing
            # the packed bytes really are two nibbles: unpack(pack(v)) == v for every value in [-8, 7]
            ints = np.arange(-8, 8, dtype=np.int8).repeat(4).reshape(64, 1)
            assert np.array_equal(quant_layout.unpack_int4(quant_layout.pack_int4(ints, 32), 32), ints)


def _dequantized_checkpoint(model, folder, tmp_path):
    """The model's weights, every QuantArray dequantized to f32, written as a HF checkpoint (untied when the
    lm_head was quantized: the quantized copy of embed^T is then a separate matrix)."""
    w = jax.tree.map(lambda x: np.asarray(quant.dequantize(x)), model.weights,
                     is_leaf=lambda x: isinstance(x, quant.QuantArray))
    cfg_json = json.loads((folder / "config.json").read_text())
    if model.config.tie_word_embeddings and w.lm_head is not None:
        cfg_json["tie_word_embeddings"] = False
    out = tmp_path / "dequantized"
    save_checkpoint(out, w, model.config, cfg_json)
    return qwen_mtp.load(out)


@pytest.mark.parametrize("name", ["dense_mtp", "moe_mtp"])
def test_quantized_model_equals_dequantized_checkpoint(ckpt, tmp_path, report, name):
    _, folder = ckpt(name)
    for kind in KINDS:  # the loader builds exactly the tree quant.abstract describes (export and restore rely on it)
        m = qwen_mtp.load(folder, quant=kind, group_size=32, quant_lm_head=kind == "fp8", quant_mtp=kind != "int4")
        want = jax.tree.map(lambda x: (x.shape, x.dtype), quant.abstract(weight_shapes(m.config, "float32"), m.quant))
        assert jax.tree.map(lambda x: (x.shape, x.dtype), m.weights) == want
    m = mixed_model(folder)
    held = quant.formats(m.weights)
    assert all(any(f.startswith(k) for f in held) for k in KINDS), held
    deq = _dequantized_checkpoint(m, folder, tmp_path)
    ids = np.random.default_rng(1).integers(1, m.config.vocab_size, 24)
    a, b = qwen_mtp.prefill_logits(m, ids), qwen_mtp.prefill_logits(deq, ids)
    ma, mb = qwen_mtp.mtp_logits(m, ids), qwen_mtp.mtp_logits(deq, ids)
    ref = qwen_mtp.prefill_logits(qwen_mtp.load(folder), ids)
    report(f"quant int8/int4/fp8 {name:9s} vs its dequantized ckpt: trunk max_rel={_rel(a, b):.1e}, "
           f"MTP max_rel={_rel(ma, mb):.1e}; quantization moved the logits by max_rel={_rel(a, ref):.1e}")
    assert _rel(a, b) < 1e-4 and _rel(ma, mb) < 1e-4
    assert _rel(a, ref) > 1e-3  # the probe sees the quantization: the comparison above is not vacuous


def test_speculative_is_lossless_on_quantized_weights(ckpt, report):
    _, folder = ckpt("dense_mtp")
    m = mixed_model(folder)
    prompts = [np.arange(1, 14) % 97, (np.arange(5, 30) * 7) % 97]
    plain = qwen_mtp.generate(m, prompts, 32, eos_token_id=[])
    spec = qwen_mtp.generate(m, prompts, 32, eos_token_id=[], spec=qwen_mtp.SpecConfig(k=3))
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    st = spec.stats
    report(f"quant int8/int4/fp8 lossless: 2 rows x 32 tokens equal to plain greedy, AL {st.acceptance_length:.2f}")
    # drafts were both accepted and rejected, so equality exercised the accept and rollback paths
    assert 1.0 < st.acceptance_length < 4.0
