"""orbax model checkpoints (qwen_mtp.save / load of a saved folder, python -m qwen_mtp convert): HF -> load(quant=)
-> save -> load gives bit-identical arrays with the same static metadata and the same greedy tokens; convert
equals load(quant=...) bit for bit; broken folders and contradicting arguments get typed errors; an interrupted
save leaves nothing that loads, and an existing folder is never half-replaced.

The generate calls use the programs tests/test_spec_lossless.py (unquantized dense_mtp, the "short" prompt, 40
tokens) and tests/test_quant.py (the mixed int8/int4/fp8 model, its two prompts, 32 tokens, k=3) compile: run
in one session, the restored models reuse those compiles (a compile costs seconds; the round trip adds none).
"""

import json
import shutil
import sys
import time
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from hf_fp8 import write_fp8
from quant_models import mixed_model

import qwen_mtp
from qwen_mtp import ArgumentError, CheckpointError
from qwen_mtp.loading import orbax_io, publish
from qwen_mtp.loading.convert import convert
from qwen_mtp.loading.folder import CARRIED_FILES, default_model_path
from qwen_mtp.tools.cli import main
from qwen_mtp.trunk.quant import QuantArray


def _leaves(weights):
    return jax.tree_util.tree_flatten_with_path(weights, is_leaf=lambda x: isinstance(x, QuantArray))


def assert_identical(a, b):
    """Every leaf bit-exact with the same dtype; QuantArrays with the same kind / shape / block; same tree."""
    (la, ta), (lb, tb) = _leaves(a), _leaves(b)
    assert ta == tb  # the treedef includes QuantArray's static fields
    for (path, x), (_, y) in zip(la, lb):
        name = jax.tree_util.keystr(path)
        assert type(x) is type(y), name
        pairs = [(x.q, y.q), (x.scale, y.scale)] if isinstance(x, QuantArray) else [(x, y)]
        if isinstance(x, QuantArray):
            assert (x.kind, x.shape, x.block) == (y.kind, y.shape, y.block), name
        for u, v in pairs:
            u, v = np.asarray(u), np.asarray(v)
            assert u.dtype == v.dtype and u.shape == v.shape, name
            assert np.array_equal(u.view(np.uint8), v.view(np.uint8)), name


@pytest.fixture(scope="module")
def hf(ckpt):
    return ckpt("dense_mtp")[1]


@pytest.fixture(scope="module")
def saved(hf, tmp_path_factory):
    """{name: (model from the HF folder, its saved folder)}: unquantized, each kind (int4 in groups of 64: every
    K of the tiny model, 32 / 48 / 64, is padded or exact), lm_head / MTP choices, bf16, and the mixed model."""
    root = tmp_path_factory.mktemp("orbax")
    models = {
        "none": qwen_mtp.load(hf),
        "int8": qwen_mtp.load(hf, quant="int8", quant_lm_head=True),
        "int4": qwen_mtp.load(hf, quant="int4", group_size=64, quant_mtp=False),
        "fp8": qwen_mtp.load(hf, quant="fp8"),
        "int4_bf16": qwen_mtp.load(hf, dtype="bfloat16", quant="int4", group_size=64, quant_lm_head=True),
        "mixed": mixed_model(hf),
    }
    return {n: (m, qwen_mtp.save(m, root / n)) for n, m in models.items()}


@pytest.mark.parametrize("name", ["none", "int8", "int4", "fp8", "int4_bf16", "mixed"])
def test_round_trip_is_bit_exact(saved, name):
    model, folder = saved[name]
    back = qwen_mtp.load(folder, dtype=model.dtype)
    assert_identical(model.weights, back.weights)
    assert (back.dtype, back.quant, back.config) == (model.dtype, model.quant, model.config)
    assert back.weight_bytes() == model.weight_bytes() and back.describe_quant() == model.describe_quant()
    assert (folder / "config.json").read_bytes() == (Path(model.path) / "config.json").read_bytes()
    if name == "int4":  # K = 32 and 48 in groups of 64: padded to one group, not refused
        q = back.weights.layers[0].mlp.down
        assert q.shape == (48, 32) and q.q.shape == (32, 32) and q.block == (64, 1)
        assert back.weights.mtp.fc.dtype == np.float32  # quant_mtp=False
    if name == "mixed":
        held = {leaf.format for _, leaf in _leaves(back.weights)[0] if isinstance(leaf, QuantArray)}
        assert {"int8 per channel", "int4 g32", "fp8 block 128x128"} <= held, held


def test_round_trip_moe_experts(ckpt, tmp_path):
    """3-D QuantArrays (a leading expert axis), fused experts."""
    m = qwen_mtp.load(ckpt("moe_mtp")[1], quant="int4", group_size=16)
    assert_identical(m.weights, qwen_mtp.load(qwen_mtp.save(m, tmp_path / "moe")).weights)


def _pick_fp8(name, w):
    """compressed-tensors FP8: q_proj in 16 x 16 blocks, o_proj per tensor, the other matrices per channel."""
    if w.ndim < 2 or "norm" in name or "embed" in name or "conv1d" in name:
        return None
    return "block" if name.endswith("q_proj.weight") else "tensor" if name.endswith("o_proj.weight") else "channel"


def test_round_trip_fp8_checkpoint(hf, tmp_path):
    """A pre-quantized FP8 checkpoint keeps its own blocks per tensor (recorded per leaf, not derived from a
    policy) through save -> load, and through convert without --quant; convert --quant on it is refused."""
    write_fp8(hf, tmp_path / "fp8", tmp_path / "deq", layout="compressed-tensors", ct_block=(16, 16),
              pick=_pick_fp8, plain_dtype=ml_dtypes.bfloat16)
    m = qwen_mtp.load(tmp_path / "fp8", dtype="bfloat16")
    blocks = {leaf.block for _, leaf in _leaves(m.weights)[0] if isinstance(leaf, QuantArray)}
    assert {(16, 16), (32, 1)} <= blocks and m.quant.source == "checkpoint", blocks
    back = qwen_mtp.load(qwen_mtp.save(m, tmp_path / "saved"), dtype="bfloat16")
    assert_identical(back.weights, m.weights)
    assert back.quant == m.quant
    convert(tmp_path / "fp8", tmp_path / "conv", dtype="bfloat16")
    assert_identical(qwen_mtp.load(tmp_path / "conv", dtype="bfloat16").weights, m.weights)
    with pytest.raises(ArgumentError, match="quantized already"):
        convert(tmp_path / "fp8", tmp_path / "x", quant="int4")


def test_restored_models_generate_the_same_tokens(saved):
    none, mixed = qwen_mtp.load(saved["none"][1]), qwen_mtp.load(saved["mixed"][1])
    short = [np.random.RandomState(1).randint(0, 97, size=7)]  # test_spec_lossless.py's "short" case
    spec3 = qwen_mtp.SpecConfig(k=3)
    for a, b, prompts, n in ((saved["none"][0], none, short, 40),
                             (saved["mixed"][0], mixed, [np.arange(1, 14) % 97, (np.arange(5, 30) * 7) % 97], 32)):
        for spec in (None, spec3):
            x = qwen_mtp.generate(a, prompts, n, eos_token_id=[], spec=spec)
            y = qwen_mtp.generate(b, prompts, n, eos_token_id=[], spec=spec)
            np.testing.assert_array_equal(x.tokens, y.tokens)
            if spec is not None:  # drafts were accepted and rejected: the spec path really ran on the weights
                assert 1.0 < y.stats.acceptance_length < spec.k + 1


def test_dtype_is_honoured_and_quant_must_match(saved):
    for (src, saved_in), dtype in ((saved["int8"], "bfloat16"), (saved["int4_bf16"], "float32")):
        cast = qwen_mtp.load(saved_in, dtype=dtype)  # plain arrays cast, QuantArrays as stored
        assert cast.dtype == dtype and cast.quant == src.quant
        for (_, x), (_, y) in zip(_leaves(src.weights)[0], _leaves(cast.weights)[0]):
            if isinstance(x, QuantArray):
                assert np.array_equal(np.asarray(x.q), np.asarray(y.q)) and y.q.dtype == x.q.dtype
            else:
                assert y.dtype == np.dtype(dtype) != x.dtype
                assert np.array_equal(np.asarray(y), np.asarray(x).astype(y.dtype))
    model, folder = saved["int8"]
    assert qwen_mtp.load(folder, quant="int8", quant_lm_head=True).quant == model.quant  # the saved policy: fine
    for kw in ({"quant": "int4"}, {"quant": "int8"}, {"quant": "int8", "quant_lm_head": True, "quant_mtp": False}):
        with pytest.raises(ArgumentError, match="quant"):
            qwen_mtp.load(folder, **kw)
    with pytest.raises(ArgumentError, match="quant"):
        qwen_mtp.load(saved["none"][1], quant="int8")
    with pytest.raises(ArgumentError, match="dtype"):
        qwen_mtp.load(folder, dtype="float16")


@pytest.mark.parametrize("where", ["hf", "orbax"])
def test_bad_quant_arguments(hf, saved, where):
    folder = hf if where == "hf" else saved["int4"][1]
    with pytest.raises(ArgumentError, match="quant"):
        qwen_mtp.load(folder, quant="int3")
    with pytest.raises(ArgumentError, match="group_size"):
        qwen_mtp.load(folder, quant="int4", group_size=48)


def _copy(saved, tmp_path, name="int4"):
    dst = tmp_path / "copy"
    shutil.copytree(saved[name][1], dst)
    return dst


def _refused(folder, file_part, *msg):
    with pytest.raises(CheckpointError) as info:
        qwen_mtp.load(folder)
    assert file_part in info.value.file, info.value
    for m in msg:
        assert m in str(info.value), info.value
    return info.value


def test_truncated_or_corrupted_arrays(saved, tmp_path, monkeypatch):
    stray = []  # what reaches the interpreter's unraisable hook: orbax's callbacks into its closed loop must not
    monkeypatch.setattr(sys, "unraisablehook", stray.append)
    folder = _copy(saved, tmp_path)
    data = sorted((folder / "weights" / "ocdbt.process_0" / "d").iterdir(), key=lambda f: -f.stat().st_size)
    big = data[0]
    raw = bytearray(big.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte in the array data: orbax itself would load it
    big.write_bytes(bytes(raw))
    _refused(folder, "weights", "CRC-32")
    big.write_bytes(bytes(raw[: len(raw) // 2]))  # truncated
    _refused(folder, "weights", "complete orbax checkpoint")
    big.unlink()  # deleted
    _refused(folder, "weights", "complete orbax checkpoint")
    shutil.rmtree(folder / "weights")
    _refused(folder, "weights", "complete orbax checkpoint")
    time.sleep(0.2)
    assert not stray, [str(u.exc_value) for u in stray]


def test_config_that_does_not_match_the_arrays(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 64
    (folder / "config.json").write_text(json.dumps(cfg))
    _refused(folder, "config.json", "layers.0.mlp.gate", "[32, 64]", "[32, 48]")
    cfg["intermediate_size"], cfg["hidden_size"] = 48, 64
    (folder / "config.json").write_text(json.dumps(cfg))
    _refused(folder, "config.json", "embed", "[97, 64]", "[97, 32]")


def test_metadata_missing_or_wrong(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    meta_file = folder / orbax_io.META
    meta = json.loads(meta_file.read_text())
    bad = json.loads(json.dumps(meta))
    bad["quantized"]["layers.0.mlp.down"]["kind"] = "int3"
    meta_file.write_text(json.dumps(bad))
    _refused(folder, orbax_io.META, "layers.0.mlp.down", "int3")
    bad = json.loads(json.dumps(meta))
    bad["quant"]["method"] = "int3"
    meta_file.write_text(json.dumps(bad))
    _refused(folder, orbax_io.META, "int3")
    bad = json.loads(json.dumps(meta))
    bad["quantized"]["layers.0.mlp.down"]["block"] = [32, 1]  # does not match the stored scales
    meta_file.write_text(json.dumps(bad))
    _refused(folder, orbax_io.META, "layers.0.mlp.down", "scales")
    meta_file.write_text("{not json")
    _refused(folder, orbax_io.META, "JSON")
    meta_file.unlink()
    assert orbax_io.is_orbax_folder(folder)  # still recognised by its weights/, then refused
    _refused(folder, orbax_io.META, "no such file")


def _siblings(path):
    return sorted(p.name for p in path.parent.iterdir())


def test_interrupted_save_leaves_nothing_that_loads(saved, tmp_path, monkeypatch):
    model = saved["int4"][0]
    dst = tmp_path / "out" / "model"
    dst.parent.mkdir()
    real = orbax_io._write_arrays

    def write_then_fail(path, arrays):
        real(path, arrays)
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(orbax_io, "_write_arrays", write_then_fail)
    with pytest.raises(OSError, match="simulated"):
        qwen_mtp.save(model, dst)
    assert _siblings(dst) == [] and not dst.exists()
    # a process killed at that point leaves its temporary folder behind: it is not a loadable checkpoint
    monkeypatch.setattr(publish, "discard", lambda tmp: None)
    with pytest.raises(OSError, match="simulated"):
        qwen_mtp.save(model, dst)
    (left,) = dst.parent.iterdir()
    assert left.name.startswith(".model.tmp-") and not dst.exists()
    _refused(left, orbax_io.META, "no such file")


def test_existing_folder_is_never_half_replaced(saved, tmp_path, monkeypatch):
    old_model, new_model = saved["int8"][0], saved["int4"][0]
    dst = tmp_path / "model"
    qwen_mtp.save(old_model, dst)
    with pytest.raises(ArgumentError, match="overwrite"):
        qwen_mtp.save(new_model, dst)
    with pytest.raises(ArgumentError, match="not one"):  # never replaces what save did not write
        qwen_mtp.save(new_model, Path(new_model.path), overwrite=True)
    real = publish.rename

    def fail_second(src, target):
        if ".tmp-" in src.name:
            raise OSError("rename failed (simulated)")
        real(src, target)

    monkeypatch.setattr(publish, "rename", fail_second)
    with pytest.raises(OSError, match="simulated"):
        qwen_mtp.save(new_model, dst, overwrite=True)
    assert _siblings(dst) == ["model"]
    assert_identical(qwen_mtp.load(dst).weights, old_model.weights)  # the old one, intact
    monkeypatch.setattr(publish, "rename", real)
    qwen_mtp.save(new_model, dst, overwrite=True)
    assert _siblings(dst) == ["model"]
    assert_identical(qwen_mtp.load(dst).weights, new_model.weights)


def test_convert_cli_equals_load_with_quant(hf, tmp_path, capsys):
    """The f32 tiny checkpoint to bf16 + int4 g64 with the lm_head quantized and the MTP head kept: bit for bit
    what load(quant=...) builds (convert quantizes tensor by tensor behind its progress bar)."""
    dst = tmp_path / "int4"
    assert main(["convert", str(hf), str(dst), "--quant", "int4", "--group-size", "64", "--quant-lm-head",
                 "--keep-mtp-bf16", "--no-progress"]) == 0
    out = capsys.readouterr().out
    want = qwen_mtp.load(hf, dtype="bfloat16", quant="int4", group_size=64, quant_lm_head=True, quant_mtp=False)
    got = qwen_mtp.load(dst, dtype="bfloat16")
    assert_identical(got.weights, want.weights)
    assert got.quant == want.quant and got.weights.mtp.fc.dtype == np.dtype("bfloat16")
    assert want.describe_quant() in out
    before = sum(int(np.prod(x.shape)) * 2 for x in jax.tree.leaves(qwen_mtp.load(hf, dtype="bfloat16").weights))
    assert f"{before / 2**20:.2f} MiB in bfloat16 -> {want.weight_bytes()['total'] / 2**20:.2f} MiB" in out
    # re-converting a converted folder without --quant keeps its quantization; --quant on it is refused
    assert main(["convert", str(dst), str(tmp_path / "again"), "--no-progress"]) == 0
    assert_identical(qwen_mtp.load(tmp_path / "again", dtype="bfloat16").weights, want.weights)
    capsys.readouterr()
    assert main(["convert", str(dst), str(tmp_path / "x"), "--quant", "int8", "--no-progress"]) == 2
    assert "quantized already" in capsys.readouterr().err


def test_convert_cli_errors(tmp_path, capsys):
    """One line each, naming the flag as typed (SRC, --group-size, DST, --overwrite), exit 2, nothing written."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    for args, part in ((["convert", str(tmp_path / "missing"), str(tmp_path / "dst"), "--quant", "int4"],
                        "SRC: " + str(tmp_path / "missing") + ": no such folder"),
                       (["convert", str(tmp_path), str(tmp_path / "dst"), "--quant", "int4", "--group-size", "48"],
                        "--group-size: expected a power of two"),
                       (["convert", str(default_model_path()), str(tmp_path / "full")],
                        "DST: expected a path that does not exist yet, an empty folder, or --overwrite")):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("qwen_mtp convert: error: ") and part in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1 and "overwrite=True" not in err and "usage:" not in err
    assert not (tmp_path / "dst").exists()


def test_generate_cli_runs_a_converted_folder(tmp_path, capsys):
    """convert the shipped model to f32: DST holds, byte for byte, every file of the source the model uses
    (draft_vocab_counts.npy, generation_config.json, the tokenizer, ...; folder.CARRIED_FILES), convert says which
    it copied and which it left behind, and generate --model DST prints the source's own text with the same draft
    vocabulary and repetition penalty (the same programs as test_shipped_model.py's CLI runs: no compile of its
    own in one session). Before the counts were carried, DST ran without a draft vocabulary: the stats line check
    fails then."""
    dst = tmp_path / "shipped"
    src = default_model_path()
    assert main(["convert", str(src), str(dst), "--dtype", "float32", "--no-progress"]) == 0
    out = capsys.readouterr().out
    used = ["config.json", *(f for f in CARRIED_FILES if (src / f).is_file())]
    assert {"draft_vocab_counts.npy", "generation_config.json", "tokenizer.json"} <= set(used)
    for f in used:
        assert (dst / f).read_bytes() == (src / f).read_bytes(), f
    assert f"copied beside the weights: {', '.join(used)}" in out
    left = sorted(p.name for p in src.iterdir() if p.name not in used and not p.name.endswith(".safetensors"))
    assert left and f"left behind (not read by qwen_mtp): {', '.join(left)}" in out  # eval.json, train_log.json
    assert not any((dst / f).exists() for f in left)
    ids = lambda folder: np.asarray(qwen_mtp.load(folder, draft_vocab=1024).weights.draft_vocab.ids)
    np.testing.assert_array_equal(ids(dst), ids(src))
    prompt = "def fibonacci(n):"
    args = [prompt, "--max-new-tokens", "48", "--k", "3", "--stats-to-stderr"]
    runs = []
    for model in (dst, src):
        assert main(["generate", "--model", str(model), *args]) == 0
        runs.append(capsys.readouterr())
    (got, want) = runs
    assert got.out.startswith(prompt) and len(got.out) > len(prompt) + 20 and got.out == want.out
    for r in runs:
        assert "draft vocab 1024" in r.err and "repetition penalty 1.3 (generation_config.json)" in r.err, r.err
    assert "[shipped]" in got.err
    # a folder that lost its counts runs without a draft vocabulary, same text, and its stats line says why
    (dst / "draft_vocab_counts.npy").unlink()
    assert main(["generate", "--model", str(dst), *args]) == 0
    lost = capsys.readouterr()
    assert lost.out == want.out and "draft vocab off (no draft_vocab_counts.npy in the folder)" in lost.err, lost.err


@pytest.mark.parametrize("dtype", [[], {"a": 1}, "float16", None])
def test_meta_dtype_not_a_name_is_a_checkpoint_error(tmp_path, dtype):
    """A metadata file whose dtype is a list or an object (unhashable: it once raised TypeError from the set
    lookup, found by test_fuzz), a wrong name or missing: a CheckpointError naming the file, what was expected
    and what was found."""
    meta = {"format": orbax_io.FORMAT, "version": orbax_io.VERSION, "dtype": dtype}
    (tmp_path / orbax_io.META).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"dtype one of \['bfloat16', 'float32'\]"):
        orbax_io.read_meta(tmp_path)
