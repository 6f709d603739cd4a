"""Bad input is refused with the right typed error, and the message says where, what was expected and what
was found: a broken checkpoint / config for `qwen_mtp.load`, bad arguments to `generate` and `prefill_logits`.

Every checkpoint test works on a copy of the session's tiny "dense" checkpoint (never the shared folder).
"Nothing half-written": each failing call raises, so it returns nothing a caller could use by mistake;
`_refused` checks that no value came back besides checking the exception type exactly (not a subclass or a
parent class).
"""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from hf_tiny import shard
from safetensors.numpy import load_file, save_file

import qwen_mtp
from qwen_mtp import ArgumentError, CheckpointError, ConfigError

VOCAB = 97  # tiny config's vocab_size
MAX_POS = 512  # tiny config's max_position_embeddings
ST = "model.safetensors"


def _refused(cls, fn, *args, **kwargs):
    """Call fn; it must raise exactly `cls` (not a subclass, not a parent) and return nothing."""
    result = sentinel = object()
    with pytest.raises(Exception) as info:
        result = fn(*args, **kwargs)
    assert result is sentinel, "the call returned a value although it raised"
    assert type(info.value) is cls, f"expected {cls.__name__}, got {type(info.value).__name__}: {info.value}"
    return info.value


def _msg_has(err, *parts):
    msg = str(err)
    for p in parts:
        assert str(p) in msg, f"{p!r} not in message {msg!r}"
    return msg


def _load_refused(folder, file, tensor, expected, found):
    """qwen_mtp.load(folder) raises exactly CheckpointError naming file and tensor, with these expected and
    found values, all four in its message."""
    e = _refused(CheckpointError, qwen_mtp.load, folder)
    assert (e.file, e.tensor) == (str(file), tensor)
    assert e.expected == expected and e.found == found
    _msg_has(e, file, tensor, expected, found)
    return e


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture
def dense_copy(ckpt, tmp_path):
    """A private copy of the tiny dense checkpoint folder, free to break."""
    _, folder = ckpt("dense")
    dst = tmp_path / "ckpt"
    shutil.copytree(folder, dst)
    return dst


@pytest.fixture(scope="module")
def model(ckpt):
    _, folder = ckpt("dense")
    m = qwen_mtp.load(folder)
    assert m.config.vocab_size == VOCAB and m.config.max_position_embeddings == MAX_POS
    return m


def _rewrite(folder, edit):
    """Load model.safetensors, let edit(tensors) change the dict, save it back."""
    f = Path(folder) / ST
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f)
    return f


# ------------------------------------------------------------------------------------------------ checkpoint
def test_control_copy_loads(dense_copy):
    """The untouched copy loads: every failure below is due to the one thing each test breaks."""
    m = qwen_mtp.load(dense_copy)
    assert m.config.model_type == "qwen3_5_text"


def test_missing_tensor(dense_copy):
    name = "model.layers.3.self_attn.k_norm.weight"
    f = _rewrite(dense_copy, lambda t: t.pop(name))
    e = _refused(CheckpointError, qwen_mtp.load, dense_copy)
    assert e.tensor == name
    assert str(f) in e.file
    assert e.expected == "a tensor of shape [16]" and e.found == "no such tensor"
    _msg_has(e, f, name, "shape [16]", "no such tensor")


def test_wrong_shape(dense_copy):
    name = "model.layers.0.mlp.up_proj.weight"  # [intermediate 48, hidden 32]

    def edit(t):
        t[name] = np.ones((48, 31), np.float32)

    f = _rewrite(dense_copy, edit)
    _load_refused(dense_copy, f, name, "shape [48, 32]", "shape [48, 31]")


def test_wrong_dtype_int32(dense_copy):
    name = "model.norm.weight"

    def edit(t):
        t[name] = np.arange(32, dtype=np.int32)  # the right shape, an integer dtype

    f = _rewrite(dense_copy, edit)
    e = _refused(CheckpointError, qwen_mtp.load, dense_copy)
    assert (e.file, e.tensor) == (str(f), name)
    assert "floating dtype" in e.expected and e.found == "I32"
    _msg_has(e, f, name, "floating dtype", "I32")


@pytest.mark.parametrize("keep", [0.5, 0.999, 100], ids=["half", "last-bytes", "inside-header"])
def test_truncated_safetensors(dense_copy, keep):
    f = dense_copy / ST
    size = os.path.getsize(f)
    os.truncate(f, int(size * keep) if keep < 1 else keep)
    assert os.path.getsize(f) < size
    e = _refused(CheckpointError, qwen_mtp.load, dense_copy)
    assert e.file == str(f) and e.tensor is None
    assert e.expected == "a readable safetensors file"
    assert "SafetensorError" in e.found
    _msg_has(e, f, "a readable safetensors file", e.found)


def test_unknown_model_type(dense_copy):
    cfg_file = dense_copy / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["model_type"] = "qwen9_text"
    cfg_file.write_text(json.dumps(cfg))
    e = _refused(ConfigError, qwen_mtp.load, dense_copy)
    assert e.file == str(cfg_file) and e.field == "model_type"
    assert "qwen3_5_text" in e.expected and e.found == "'qwen9_text'"
    _msg_has(e, cfg_file, "model_type", "qwen3_5_text", "qwen9_text")


def test_missing_config_json(dense_copy):
    cfg_file = dense_copy / "config.json"
    cfg_file.unlink()
    e = _refused(ConfigError, qwen_mtp.load, dense_copy)
    assert e.file == str(cfg_file)
    assert e.expected == "an existing config.json" and e.found == "no such file"
    _msg_has(e, cfg_file, "an existing config.json", "no such file")


def _move_to_shard(folder, shard_ref, shard_file):
    """Shard the checkpoint, then point the index entry of one tensor at shard_file (holding that exact
    tensor, valid) named in the index as shard_ref. Returns (index file, tensor name)."""
    shard(folder, 3)
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    name = "model.layers.3.self_attn.k_norm.weight"
    src = folder / data["weight_map"][name]
    save_file({name: load_file(src)[name]}, shard_file)
    data["weight_map"][name] = shard_ref
    index.write_text(json.dumps(data))
    return index, name


def test_control_moved_shard_inside_folder_loads(dense_copy):
    """The same rewiring as the escape test, with the shard inside the folder, loads: only the escape check
    can be what rejects the next test."""
    _move_to_shard(dense_copy, "./moved.safetensors", dense_copy / "moved.safetensors")
    qwen_mtp.load(dense_copy)


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_shard_path_escaping_folder(dense_copy, tmp_path, how):
    outside = tmp_path / "outside.safetensors"  # dense_copy is tmp_path/ckpt: this is just outside it
    if how == "dotdot":
        ref = "../outside.safetensors"
    elif how == "absolute":
        ref = str(outside)
    else:
        ref = "link.safetensors"
    index, name = _move_to_shard(dense_copy, ref, outside)
    if how == "symlink":
        (dense_copy / ref).symlink_to(outside)
    assert outside.is_file() and (dense_copy / ref).is_file()  # exists: only the escape check can reject it
    _load_refused(dense_copy, index, name, f"a shard path inside {dense_copy.resolve()}", repr(ref))


def test_unexpected_extra_tensor(dense_copy):
    name = "model.layers.9.mlp.gate_proj.weight"  # the config has 4 layers

    def edit(t):
        t[name] = np.ones((48, 32), np.float32)

    f = _rewrite(dense_copy, edit)
    _load_refused(dense_copy, f, name, "only tensors the config accounts for", "an unexpected tensor")


@pytest.mark.parametrize("dtype", ["float16", "fp32", "", None, np.float32])
def test_bad_dtype_argument(ckpt, dtype):
    _, folder = ckpt("dense")  # a good checkpoint: only the argument is wrong (and nothing is written)
    e = _refused(ArgumentError, qwen_mtp.load, folder, dtype=dtype)
    assert e.argument == "dtype"
    assert e.found == repr(dtype)
    assert "float32" in e.expected and "bfloat16" in e.expected
    _msg_has(e, "'dtype'", "float32", "bfloat16", repr(dtype))


def test_bad_dtype_argument_unhashable(ckpt):
    _, folder = ckpt("dense")
    with pytest.raises(ArgumentError) as info:
        qwen_mtp.load(folder, dtype=["float32"])
    assert info.value.argument == "dtype"


# ------------------------------------------------------------------------------------------------ generate
def _gen(model, ids, n=4, **kw):
    return qwen_mtp.generate(model, ids, n, **kw)


def _pre(model, ids, **kw):
    return qwen_mtp.prefill_logits(model, ids, **kw)


@pytest.mark.parametrize("fn,arg", [(_gen, "prompt_ids"), (_pre, "ids")], ids=["generate", "prefill_logits"])
@pytest.mark.parametrize("ids", [[], (), np.array([], np.int32)], ids=["list", "tuple", "array"])
def test_empty_prompt(model, fn, arg, ids):
    e = _refused(ArgumentError, fn, model, ids)
    assert (e.argument, e.expected, e.found) == (arg, "a non-empty prompt", "an empty prompt")
    _msg_has(e, repr(arg), "a non-empty prompt", "an empty prompt")


@pytest.mark.parametrize("fn,arg", [(_gen, "prompt_ids"), (_pre, "ids")], ids=["generate", "prefill_logits"])
@pytest.mark.parametrize("bad", [VOCAB, -1, 10**6])
def test_token_id_outside_vocab(model, fn, arg, bad):
    ids = np.array([5, 7, bad, 3])
    e = _refused(ArgumentError, fn, model, ids)
    assert e.argument == arg
    assert e.expected == f"token ids in [0, {VOCAB})" and e.found == f"id {bad} at index 2"
    _msg_has(e, repr(arg), f"[0, {VOCAB})", f"id {bad} at index 2")


def test_prompt_longer_than_max_positions_generate(model):
    ids = np.arange(510) % VOCAB
    e = _refused(ArgumentError, qwen_mtp.generate, model, ids, 16)
    assert e.argument == "prompt_ids"
    assert str(MAX_POS) in e.expected and "max_position_embeddings" in e.expected
    assert e.found == "510 + 16"
    _msg_has(e, "'prompt_ids'", f"max_position_embeddings ({MAX_POS})", "510 + 16")


def test_prompt_longer_than_max_positions_prefill_logits(model):
    ids = np.arange(MAX_POS + 1) % VOCAB
    e = _refused(ArgumentError, qwen_mtp.prefill_logits, model, ids)
    assert e.argument == "ids"
    assert str(MAX_POS) in e.expected and e.found == f"{MAX_POS + 1} + 0"
    _msg_has(e, "'ids'", f"max_position_embeddings ({MAX_POS})", f"{MAX_POS + 1} + 0")


@pytest.mark.parametrize("n", [0, -3, 2.5, True, "4", None, np.float64(4.0)])
def test_bad_max_new_tokens(model, n):
    e = _refused(ArgumentError, qwen_mtp.generate, model, [1, 2, 3], n)
    assert e.argument == "max_new_tokens"
    assert e.expected == "an integer >= 1" and e.found == repr(n)
    _msg_has(e, "'max_new_tokens'", "an integer >= 1", repr(n))


@pytest.mark.parametrize("fn,arg", [(_gen, "prompt_ids"), (_pre, "ids")], ids=["generate", "prefill_logits"])
@pytest.mark.parametrize("ids,dtype", [([1.0, 2.0, 3.0], "float64"),
                                       (np.array([1, 2, 3], np.float32), "float32"),
                                       (np.array([True, False]), "bool")],
                         ids=["float-list", "float32-array", "bool-array"])
def test_non_integer_prompt_ids(model, fn, arg, ids, dtype):
    e = _refused(ArgumentError, fn, model, ids)
    assert e.argument == arg
    assert e.expected == "integer token ids" and e.found == f"dtype {dtype}"
    _msg_has(e, repr(arg), "integer token ids", f"dtype {dtype}")


def test_float_row_inside_batch(model):
    e = _refused(ArgumentError, qwen_mtp.generate, model, [[1, 2, 3], [4.0, 5.0]], 4)
    assert e.argument == "prompt_ids[1]" and e.found == "dtype float64"
    _msg_has(e, "'prompt_ids[1]'", "integer token ids", "dtype float64")


@pytest.mark.parametrize("batch", [[[1, 2, 3], []], [np.array([1, 2]), np.array([], np.int64), [3]]],
                         ids=["lists", "arrays"])
def test_empty_row_inside_batch(model, batch):
    e = _refused(ArgumentError, qwen_mtp.generate, model, batch, 4)
    assert (e.argument, e.expected, e.found) == ("prompt_ids[1]", "a non-empty prompt", "an empty prompt")
    _msg_has(e, "'prompt_ids[1]'", "a non-empty prompt", "an empty prompt")


def test_empty_row_inside_batch_prefill_logits(model):
    e = _refused(ArgumentError, qwen_mtp.prefill_logits, model, [[1, 2, 3], []])
    assert (e.argument, e.found) == ("ids[1]", "an empty prompt")
    _msg_has(e, "'ids[1]'", "a non-empty prompt", "an empty prompt")


def test_out_of_vocab_id_in_second_row(model):
    e = _refused(ArgumentError, qwen_mtp.generate, model, [[1, 2, 3], [4, VOCAB]], 4)
    assert e.argument == "prompt_ids[1]" and e.found == f"id {VOCAB} at index 1"
    _msg_has(e, "'prompt_ids[1]'", f"[0, {VOCAB})", f"id {VOCAB} at index 1")


@pytest.mark.parametrize("eos,bad", [(VOCAB, VOCAB), (-1, -1), ([3, VOCAB], VOCAB), ((0, -1), -1),
                                     (np.int64(VOCAB), np.int64(VOCAB)), (True, True), (["3"], "3")],
                         ids=["97", "-1", "list-97", "tuple--1", "np-97", "bool", "str"])
def test_eos_token_id_out_of_vocab(model, eos, bad):
    e = _refused(ArgumentError, qwen_mtp.generate, model, [1, 2, 3], 4, eos_token_id=eos)
    assert e.argument == "eos_token_id"
    assert "token id" in e.expected and e.found == repr(bad)
    _msg_has(e, "'eos_token_id'", f"[0, {VOCAB})", repr(bad))


def test_prefill_logits_refuses_a_batch(model):
    e = _refused(ArgumentError, qwen_mtp.prefill_logits, model, [[1, 2], [3]])
    assert e.argument == "ids" and e.expected == "a 1-D prompt" and e.found == "2 rows"


# Once bugs, now fixed: each must raise the typed error.
def test_eos_token_id_float(model):
    with pytest.raises(ArgumentError) as info:
        qwen_mtp.generate(model, [1, 2, 3], 4, eos_token_id=5.0)
    assert info.value.argument == "eos_token_id"


def test_prompt_mixing_ids_and_rows(model):
    with pytest.raises(ArgumentError) as info:
        qwen_mtp.generate(model, [1, [2, 3]], 4)
    assert info.value.argument == "prompt_ids"


def test_prefill_logits_bad_prefill_chunk(model):
    with pytest.raises(ArgumentError) as info:
        qwen_mtp.prefill_logits(model, [1, 2, 3], prefill_chunk=0)
    assert info.value.argument == "prefill_chunk"
