"""Pre-quantized FP8 checkpoints (Qwen's block-wise "fp8" and FP8 "compressed-tensors") load as they are and
stay FP8 in memory.

The checkpoints are built here (tests/hf_fp8.py) from tiny randomised transformers models (tests/hf_tiny.py),
each beside its dequantized twin. The oracle is transformers run in float64 on the dequantized weights; our
model computes in float32 with the FP8 weights. Loader-level tests (no compile) check every loaded weight,
dequantized, against the twin exactly, and which tensors stay FP8; the typed errors come last.
"""

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from hf_fp8 import dequantize, load_into, save_tensors, write_fp8
from hf_tiny import add_mtp, as_oracle, assert_close, make_hf_model, rel_err, save_hf, to_fused_experts

import qwen_mtp
from qwen_mtp import ArgumentError, CheckpointError, ConfigError, QuantArray, QuantPolicy
from qwen_mtp.loading.hf_layout import ba_rows, qkvz_rows
from qwen_mtp.loading.safetensors import load_weights
from qwen_mtp.loading.safetensors_files import rows_keep_blocks
from qwen_mtp.tools.real_shapes import config as real_config
from qwen_mtp.trunk.config import load_config, parse_config

T = 24  # one prompt length for every compiled test (the MTP path reuses the trunk's compile)
# one layer per model (a GDN layer costs ~5 s of compile): attention for the dense and the MoE model (their GDN
# projections are plain matrices like the others), GDN with an MoE MLP for Qwen3-Next (its fused projections)
LAYERS = {"dense": ["full_attention"], "moe": ["full_attention"], "next": ["linear_attention"]}
BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def _kept(name):
    """Tensors every checkpoint here keeps in float: embeddings, norms, A_log, dt_bias, 1-D tensors."""
    return name.endswith(("embed_tokens.weight", "norm.weight", "A_log", "dt_bias", "norm_embedding.weight",
                          "norm_hidden.weight"))


def _block(name, w):
    return "block" if w.ndim >= 2 and not _kept(name) else None


def _pick_dense(name, w):  # every matrix, except one projection left in float
    return None if name == "model.layers.0.self_attn.v_proj.weight" else _block(name, w)


def _pick_ct(name, w):  # compressed-tensors: per channel, per tensor for o_proj / shared down, routers in float
    if w.ndim < 2 or _kept(name) or "conv1d" in name or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
        return None
    return "tensor" if name.endswith(("o_proj.weight", "shared_expert.down_proj.weight")) else "channel"


def _pick_ct_block(name, w):
    if w.ndim < 2 or _kept(name) or "conv1d" in name:
        return None
    return "block" if name.endswith("q_proj.weight") else _pick_ct(name, w) or "channel"


# name -> (source, write_fp8 arguments)
CHECKPOINTS = {
    # dense trunk + MTP head, Qwen's layout with [24, 32] blocks (several blocks, partial edge blocks on K = 48
    # and N = 32, 128), tied embeddings, unquantized tensors in bf16 as Qwen ships them
    "dense_block": ("dense", dict(layout="fp8", block=(24, 32), pick=_pick_dense, plain_dtype=BF16)),
    # MoE with per-expert tensors, compressed-tensors per channel / per tensor, input scales, lm_head in FP8
    "moe_ct": ("moe", dict(layout="compressed-tensors", pick=_pick_ct, input_scale=lambda n: "self_attn" in n)),
    # the same model with fused experts.gate_up_proj / down_proj
    "moe_ct_fused": ("moe_fused", dict(layout="compressed-tensors", pick=_pick_ct, input_scale=lambda n: "mlp" in n)),
    # Qwen3-Next (fused in_proj_qkvz / ba) at the real block size [128, 128]; routers in FP8, MTP head in bf16
    "next_128": ("next", dict(layout="fp8", block=(128, 128), plain_dtype=BF16,
                              pick=lambda n, w: None if n.startswith("mtp.") or "conv1d" in n else _block(n, w))),
    # loader level only:
    # Qwen3-Next with [16, 32]: the qkvz split cuts blocks (in_proj_qkv dequantized), z, b, a stay FP8; MTP in
    # FP8; conv taps in FP8 (not multiplied through linear: loaded dequantized)
    "next_split": ("next", dict(layout="fp8", block=(16, 32), pick=_block)),
    # fused experts with [24, 16]: gate (rows 0..15) inside block 0 stays FP8, up (16..31) spans two: dequantized
    "moe_fused_split": ("moe_fused", dict(layout="fp8", block=(24, 16), pick=_block)),
    # per-expert, one expert's gate_proj left in float: the stacked gate is dequantized, up stays FP8
    "moe_mixed_experts": ("moe", dict(layout="fp8", block=(16, 16), plain_dtype=BF16, pick=lambda n, w: None
                                      if n == "model.layers.0.mlp.experts.1.gate_proj.weight" else _block(n, w))),
    # compressed-tensors with a block strategy ([16, 16] for q_proj) beside channel and tensor ones
    "dense_ct_block": ("dense", dict(layout="compressed-tensors", ct_block=(16, 16), pick=_pick_ct_block)),
}

# what stays FP8: leaf path -> QuantArray block (bk, bn) in our [K, N] orientation, or None for a plain array
EXPECT = {
    "dense_block": {".layers[0].mixer.q_proj": (32, 24), ".layers[0].mixer.v_proj": None, ".embed": None,
                    ".layers[0].mixer.q_norm": None, ".layers[0].mlp.down": (32, 24), ".mtp.fc": (32, 24),
                    ".mtp.layer.mixer.o_proj": (32, 24), ".mtp.layer.mlp.gate": (32, 24), ".mtp.norm": None},
    "moe_ct": {".layers[0].mlp.gate": (32, 1), ".layers[0].mlp.down": (16, 1), ".layers[0].mlp.router": None,
               ".layers[0].mlp.shared.down": (24, 32), ".layers[0].mlp.shared_gate": None,
               ".layers[0].mixer.o_proj": (64, 32), ".layers[0].mixer.q_proj": (32, 1), ".lm_head": (32, 1)},
    "moe_ct_fused": {".layers[0].mlp.gate": (32, 1), ".layers[0].mlp.up": (32, 1), ".layers[0].mlp.down": (16, 1),
                     ".lm_head": (32, 1)},
    "next_128": {".layers[0].mixer.in_proj_qkv": (128, 128), ".layers[0].mixer.in_proj_z": (128, 128),
                 ".layers[0].mixer.in_proj_b": (128, 128), ".layers[0].mlp.router": (128, 128),
                 ".layers[0].mlp.gate": (128, 128), ".layers[0].mlp.shared_gate": (128, 128),
                 ".lm_head": (128, 128), ".mtp.fc": None, ".mtp.layer.mlp.gate": None},
    "next_split": {".layers[0].mixer.in_proj_qkv": None, ".layers[0].mixer.in_proj_z": (32, 16),
                   ".layers[0].mixer.conv": None,
                   ".layers[0].mixer.in_proj_b": (32, 16), ".layers[0].mixer.in_proj_a": (32, 16),
                   ".mtp.layer.mlp.gate": (32, 16), ".mtp.layer.mlp.up": (32, 16)},
    "moe_fused_split": {".layers[0].mlp.gate": (16, 24), ".layers[0].mlp.up": None, ".layers[0].mlp.down": (16, 24)},
    "moe_mixed_experts": {".layers[0].mlp.gate": None, ".layers[0].mlp.up": (16, 16), ".layers[0].mlp.down": (16, 16)},
    "dense_ct_block": {".layers[0].mixer.q_proj": (16, 16), ".layers[0].mixer.o_proj": (64, 32),
                       ".layers[0].mixer.k_proj": (32, 1), ".mtp.layer.mixer.q_proj": (16, 16)},
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{"hf": {kind: transformers model in float64}, "orig": {kind: its logits before quantization}, name:
    {"fp8": folder, "deq": folder, "tensors": FP8 checkpoint tensors, "kind": model kind}}; built once."""
    root = tmp_path_factory.mktemp("fp8")
    ids = _ids()
    hf, orig = {}, {}
    for kind, seed, extra in (("dense", 31, dict(tie_word_embeddings=True)), ("moe", 32, {}),
                              ("next", 33, dict(decoder_sparse_step=1))):
        model = make_hf_model(kind, seed, num_hidden_layers=len(LAYERS[kind]), layer_types=LAYERS[kind], **extra)
        save_hf(model, root / kind)
        if kind != "moe":
            add_mtp(root / kind, seed)
        hf[kind] = as_oracle(model)
        orig[kind] = _hf_logits(hf[kind], ids)
    shutil.copytree(root / "moe", root / "moe_fused")
    to_fused_experts(root / "moe_fused")
    out = {"hf": hf, "orig": orig}
    for i, (name, (src, kw)) in enumerate(CHECKPOINTS.items()):
        tensors, _, _ = write_fp8(root / src, root / name, root / (name + "_deq"), seed=i, **kw)
        out[name] = {"fp8": root / name, "deq": root / (name + "_deq"), "tensors": tensors,
                     "kind": src.split("_")[0]}
    return out


def _ids():
    return np.random.RandomState(5).randint(0, 97, size=T)


@torch.no_grad()
def _hf_logits(model, ids):
    """transformers' full forward; without a cache, which a model of GDN layers only cannot build."""
    return model(torch.tensor([list(ids)]), use_cache=False).logits[0].double().numpy()


def _leaves(weights):
    is_q = lambda x: isinstance(x, QuantArray)
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(weights, is_leaf=is_q)}


# ------------------------------------------------------------------------------------------ loader level
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_loaded_weights_equal_the_dequantized_checkpoint(built, name):
    """Every tensor, dequantized, equals the dequantized twin's bit for bit (one float32 rounding on each side);
    quantized ones stay e4m3 QuantArrays with the expected blocks, the rest are plain arrays."""
    c = built[name]
    cfg = load_config(c["fp8"])
    ours, twin = _leaves(load_weights(c["fp8"], cfg)), _leaves(load_weights(c["deq"], cfg))
    assert ours.keys() == twin.keys()
    n_q = 0
    for path, x in ours.items():
        ref = np.asarray(twin[path])
        if isinstance(x, QuantArray):
            n_q += 1
            assert x.q.dtype == E4M3 and x.scale.dtype == np.float32 and x.kind == "fp8", path
            assert x.shape == ref.shape, path
            got = dequantize(np.asarray(x.q).astype(np.float32), np.asarray(x.scale), *x.block)
        else:
            assert x.dtype == np.float32, path
            got = np.asarray(x)
        np.testing.assert_array_equal(got, ref, err_msg=f"{name} {path}")
    for path, block in EXPECT[name].items():
        if block is None:
            assert not isinstance(ours[path], QuantArray), f"{name} {path}: expected a plain array"
        else:
            assert isinstance(ours[path], QuantArray) and ours[path].block == block, \
                f"{name} {path}: expected FP8 block {block}, found {getattr(ours[path], 'block', 'a plain array')}"
    assert n_q >= 10


def test_bfloat16_load_keeps_fp8_and_casts_the_rest(built):
    c = built["dense_block"]
    cfg = load_config(c["fp8"])
    ours, twin = _leaves(load_weights(c["fp8"], cfg, "bfloat16")), _leaves(load_weights(c["deq"], cfg, "bfloat16"))
    for path, x in ours.items():
        if isinstance(x, QuantArray):
            assert x.q.dtype == E4M3
        else:
            assert x.dtype == BF16, path
            np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(twin[path], np.float32))


def test_sharded_fp8_checkpoint(built, tmp_path):
    """Shards with an index, weights and their scales in different files: the same weights as one file."""
    c = built["dense_block"]
    dst = tmp_path / "sharded"
    shutil.copytree(c["fp8"], dst)
    (dst / "model.safetensors").unlink()
    names = sorted(c["tensors"])
    weight_map = {}
    for i in range(3):
        part = {n: c["tensors"][n] for n in names[i::3]}
        save_tensors(dst, part)
        (dst / "model.safetensors").rename(dst / f"model-{i + 1}-of-3.safetensors")
        weight_map.update({n: f"model-{i + 1}-of-3.safetensors" for n in part})
    assert any(weight_map[n] != weight_map.get(n + "_scale_inv", weight_map[n]) for n in names)
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = load_config(dst)
    one, sharded = _leaves(load_weights(c["fp8"], cfg)), _leaves(load_weights(dst, cfg))
    for path, x in one.items():
        y = sharded[path]
        assert type(x) is type(y), path
        for a, b in ([(x.q, y.q), (x.scale, y.scale)] if isinstance(x, QuantArray) else [(x, y)]):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8), err_msg=path)


def test_splits_keep_128_blocks_at_real_shapes():
    """The loader's splits fall on 128-row block boundaries at the real shapes (as its docstring states), and
    do not at our tiny [16, ...] blocks (where the dequantize fallback is exercised above)."""
    nxt = parse_config(dict(model_type="qwen3_next", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                            num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                            linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                            num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                            shared_expert_intermediate_size=512, intermediate_size=5120), "<Qwen3-Next-80B-A3B>")
    for rows in (*qkvz_rows(nxt), *ba_rows(nxt)):
        assert rows_keep_blocks(rows, 128)
    assert len(ba_rows(nxt)[0]) == 32 and max(max(r) for r in ba_rows(nxt)) < 128  # all inside one block
    for cfg in (nxt, real_config("Qwen3.5-35B-A3B", 4), real_config("Qwen3.5-122B-A10B", 4),
                real_config("Qwen3.5-397B-A17B", 4)):
        I = cfg.moe_intermediate_size
        assert rows_keep_blocks(np.arange(I), 128) and rows_keep_blocks(np.arange(I, 2 * I), 128), cfg.model_type
    # the tiny Qwen3-Next of next_split: qkv cuts [16]-row blocks (dequantized there), z does not
    small = parse_config(dict(model_type="qwen3_next", vocab_size=97, hidden_size=32, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                              intermediate_size=48))
    qkv, z = qkvz_rows(small)
    assert not rows_keep_blocks(qkv, 16) and rows_keep_blocks(z, 16) and rows_keep_blocks(qkv, 8)


# ------------------------------------------------------------------------------------------ against transformers
def _oracle(built, name):
    c = built[name]
    from safetensors.numpy import load_file
    hf = load_into(built["hf"][c["kind"]], load_file(c["deq"] / "model.safetensors"))
    ref = _hf_logits(hf, _ids())
    assert ref.std() > 0.1 and len(set(ref.argmax(-1))) > 5, "degenerate oracle: the test could not fail"
    # the FP8 weights are not the original ones: a loader that dropped or misplaced scales could not pass
    assert rel_err(ref, built["orig"][c["kind"]])[0] > 1e-3
    return ref


def test_dense_block_fp8_with_mtp_head(built, report):
    c = built["dense_block"]
    model = qwen_mtp.load(c["fp8"], dtype="float32")
    assert model.quant == QuantPolicy("fp8", lm_head=False, mtp=True, source="checkpoint")
    assert isinstance(model.weights.mtp.fc, QuantArray) and model.weights.mtp.fc.q.dtype == E4M3
    ours = qwen_mtp.prefill_logits(model, _ids())
    pre = assert_close(ours, _oracle(built, "dense_block"), "dense_block prefill logits")
    # the MTP head in FP8 against our own model loaded from the dequantized checkpoint, its head fed the same
    # trunk hidden (the trunks are checked above and bit-equal weights below; this saves the twin's trunk compile)
    twin = qwen_mtp.load(c["deq"])
    assert twin.quant is None and not isinstance(twin.weights.mtp.fc, QuantArray)
    got = qwen_mtp.mtp_logits(model, _ids())
    from qwen_mtp.decoding.prefill import mtp_prefill, prefill
    from qwen_mtp.trunk.forward import lm_logits

    ids = _ids()
    _, _, hidden = prefill(model, [ids], 32, keep_hidden=True)
    out, _ = mtp_prefill(twin, jnp.asarray(ids[None, 1:]), hidden[:, :T - 1], T)
    ref = np.asarray(lm_logits(twin.weights, out[0]))
    assert got.shape == ref.shape == (T - 1, 97) and ref.std() > 0.1
    mtp = assert_close(got, ref, "dense_block mtp logits")
    report(f"fp8 ckpt dense_block  prefill T={T} max_rel={pre[0]:.2e} max_abs={pre[1]:.2e} | "
           f"mtp_logits vs dequantized twin max_rel={mtp[0]:.2e}")


def test_moe_compressed_tensors_per_expert_and_fused(built, report):
    errs = []
    for name in ("moe_ct", "moe_ct_fused"):  # same model and layout: one compile serves both
        model = qwen_mtp.load(built[name]["fp8"])
        assert model.quant == QuantPolicy("fp8", lm_head=True, mtp=False, source="checkpoint")
        errs.append(assert_close(qwen_mtp.prefill_logits(model, _ids()), _oracle(built, name), f"{name} logits"))
    report(f"fp8 ckpt moe_ct (per expert / fused) prefill T={T} max_rel={errs[0][0]:.2e} / {errs[1][0]:.2e}")


def test_next_block128(built, report):
    model = qwen_mtp.load(built["next_128"]["fp8"])
    assert model.quant == QuantPolicy("fp8", lm_head=True, mtp=False, source="checkpoint")
    err = assert_close(qwen_mtp.prefill_logits(model, _ids()), _oracle(built, "next_128"), "next_128 logits")
    report(f"fp8 ckpt next_128     prefill T={T} max_rel={err[0]:.2e} max_abs={err[1]:.2e}")


# ------------------------------------------------------------------------------------------ typed errors
@pytest.fixture
def broken(built, tmp_path):
    """break(edit_tensors, edit_config=None) -> a copy of the dense_block FP8 checkpoint with the edits made."""
    c = built["dense_block"]

    def make(edit=None, edit_config=None, source="fp8"):
        dst = tmp_path / "ckpt"
        shutil.copytree(c[source], dst)
        tensors = dict(c["tensors"])
        if edit is not None:
            edit(tensors)
            save_tensors(dst, tensors)
        if edit_config is not None:
            cfg = json.loads((dst / "config.json").read_text())
            edit_config(cfg)
            (dst / "config.json").write_text(json.dumps(cfg))
        return dst

    return make


def _refused(err, folder, **kw):
    with pytest.raises(err) as info:
        qwen_mtp.load(folder, **kw)
    return info.value


Q = "model.layers.0.self_attn.q_proj.weight"  # [128, 32] in blocks of [24, 32]: scales [6, 1]
UP = "model.layers.0.mlp.up_proj.weight"


def _set(name, value):
    def edit(t):
        t[name] = value(t) if callable(value) else value
    return edit


CHECKPOINT_ERRORS = {
    "wrong_scale_shape": (_set(Q + "_scale_inv", np.ones((6, 2), np.float32)), Q + "_scale_inv",
                          f"shape [6, 1] (scales of '{Q}' of shape [128, 32])", "shape [6, 2]"),
    "scale_without_weight": (_set("model.layers.0.self_attn.x_proj.weight_scale_inv", np.ones((1, 1), np.float32)),
                             "model.layers.0.self_attn.x_proj.weight_scale_inv",
                             "the weight 'model.layers.0.self_attn.x_proj.weight' this scale belongs to",
                             "no such tensor"),
    "input_scale_without_weight": (_set("model.layers.0.self_attn.x_proj.input_scale", np.ones(1, np.float32)),
                                   "model.layers.0.self_attn.x_proj.input_scale",
                                   "the weight 'model.layers.0.self_attn.x_proj.weight' this input scale belongs to",
                                   "no such tensor"),
    "fp8_weight_without_scale": (lambda t: t.pop(UP + "_scale_inv"), UP,
                                 f"its scale '{UP}_scale_inv' beside this F8_E4M3 weight", "no such tensor"),
    "integer_scale": (_set(UP + "_scale_inv", lambda t: np.ones(t[UP + "_scale_inv"].shape, np.int32)),
                      UP + "_scale_inv", "a floating scale dtype (BF16/F16/F32)", "I32"),
    "e5m2_weight": (_set(UP, lambda t: t[UP].astype(np.float32).astype(ml_dtypes.float8_e5m2)), UP,
                    "a floating dtype (BF16/F16/F32) or F8_E4M3 with its scale", "F8_E5M2"),
    "scale_beside_float_weight": (_set(UP, lambda t: t[UP].astype(np.float32)), UP + "_scale_inv",
                                  "a scale only beside an F8_E4M3 weight", f"beside '{UP}' of dtype F32"),
    "nan_scale": (_set(UP + "_scale_inv", lambda t: np.full(t[UP + "_scale_inv"].shape, np.nan, np.float32)),
                  UP + "_scale_inv", "finite scales", "non-finite entries"),
}


@pytest.mark.parametrize("case", list(CHECKPOINT_ERRORS))
def test_mismatched_scales_are_checkpoint_errors(broken, case):
    edit, tensor, expected, found = CHECKPOINT_ERRORS[case]
    folder = broken(edit)
    e = _refused(CheckpointError, folder)
    assert (e.file, e.tensor, e.expected, e.found) == (str(folder / "model.safetensors"), tensor, expected, found)
    for part in (e.file, tensor, expected, found):
        assert part in str(e)


def test_fp8_weights_without_quantization_config(broken):
    folder = broken(edit_config=lambda c: c.pop("quantization_config"))
    e = _refused(CheckpointError, folder)
    assert e.tensor == Q and e.found == "F8_E4M3"
    assert "quantization_config" in e.expected


def test_quantization_config_without_quantized_tensors(broken, built):
    qc = json.loads((built["dense_block"]["fp8"] / "config.json").read_text())["quantization_config"]
    folder = broken(source="deq", edit_config=lambda c: c.update(quantization_config=qc))
    e = _refused(CheckpointError, folder)
    assert e.file == str(folder) and e.tensor is None and e.found == "no quantized tensor"


def _groups(c):
    return c["quantization_config"].setdefault("config_groups", {"g": {"weights": {"num_bits": 8, "type": "float",
                                                                                  "strategy": "channel"}}})


CONFIG_ERRORS = {
    "unknown_method": (lambda c: c["quantization_config"].update(quant_method="awq"),
                       "quantization_config.quant_method", "'awq'"),
    "no_block_size": (lambda c: c["quantization_config"].pop("weight_block_size"),
                      "quantization_config.weight_block_size", "None"),
    "bad_block_size": (lambda c: c["quantization_config"].update(weight_block_size=[128]),
                       "quantization_config.weight_block_size", "[128]"),
    "e5m2_fmt": (lambda c: c["quantization_config"].update(fmt="e5m2"), "quantization_config.fmt", "'e5m2'"),
    "ct_int4": (lambda c: (c["quantization_config"].update(quant_method="compressed-tensors"),
                           _groups(c)["g"]["weights"].update(type="int", num_bits=4)),
                "quantization_config.config_groups.g.weights", "type 'int', num_bits 4"),
    "ct_group_strategy": (lambda c: (c["quantization_config"].update(quant_method="compressed-tensors"),
                                     _groups(c)["g"]["weights"].update(strategy="group")),
                          "quantization_config.config_groups.g.weights.strategy", "'group'"),
}


@pytest.mark.parametrize("case", list(CONFIG_ERRORS))
def test_bad_quantization_config(broken, case):
    edit, field, found = CONFIG_ERRORS[case]
    folder = broken(edit_config=edit)
    e = _refused(ConfigError, folder)
    assert e.file == str(folder / "config.json") and e.field == field and e.found == found


@pytest.mark.parametrize("quant", ["int8", "fp8"])
def test_requantizing_an_fp8_checkpoint_is_refused(built, quant):
    e = _refused(ArgumentError, built["dense_block"]["fp8"], quant=quant)
    assert e.argument == "quant" and e.found == repr(quant) and "already quantized" in e.expected
