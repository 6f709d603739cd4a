"""Property-based tests (hypothesis) over public inputs: config.json fields, a checkpoint's safetensors bytes and
index, saved orbax folders (metadata, config.json, the array files), generate's / SpecConfig's arguments and the
CLI's flags. Every case ends in a typed error of this package (QwenMTPError) naming
what was wrong, or in a correct result; never another exception from deep inside a library."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import qwen_mtp
from qwen_mtp import QwenMTPError
from qwen_mtp.loading.folder import default_model_path
from qwen_mtp.trunk.config import parse_config

SHIPPED_CONFIG = json.loads((default_model_path() / "config.json").read_text())
WEIRD = st.one_of(st.none(), st.booleans(), st.integers(-10 ** 12, 10 ** 12), st.floats(allow_nan=True),
                  st.text(max_size=8), st.lists(st.integers(-3, 300), max_size=5),
                  st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                           HealthCheck.too_slow])
COUNTS = {}


def _count(kind):
    COUNTS[kind] = COUNTS.get(kind, 0) + 1


@pytest.fixture(scope="module", autouse=True)
def _report_counts(request):
    yield
    request.config._fuzz_counts = dict(COUNTS)  # (read by nothing but a debugger; the note lists the settings)


# ------------------------------------------------------------------------------------------------- config.json
@FUZZ
@given(st.lists(st.tuples(st.sampled_from(sorted(SHIPPED_CONFIG) + ["rope_parameters.rope_theta",
                                                                   "rope_parameters.partial_rotary_factor"]),
                          st.one_of(st.just("<delete>"), WEIRD)), min_size=1, max_size=3))
def test_config_fields(edits):
    _count("config.json fields")
    raw = json.loads(json.dumps(SHIPPED_CONFIG))
    for field, value in edits:
        where, key = (raw, field) if "." not in field else (raw.setdefault("rope_parameters", {}), field.split(".")[1])
        if not isinstance(where, dict):
            continue
        if value == "<delete>":
            where.pop(key, None)
        else:
            where[key] = value
    try:
        cfg = parse_config(raw, "fuzz/config.json")
    except QwenMTPError as e:
        assert "fuzz/config.json" in str(e)
        return
    # accepted: a config every part of which is consistent
    assert cfg.num_heads % cfg.num_kv_heads == 0 and cfg.vocab_size > 0 and cfg.hidden_size > 0
    assert len(cfg.layer_types) >= 1 and cfg.gdn_num_v_heads % cfg.gdn_num_k_heads == 0


@FUZZ
@given(st.lists(st.integers(0, 2 ** 31), max_size=40), st.integers(1, 8))
def test_head_counts(values, nkv):
    """Inconsistent head counts (heads not a multiple of kv heads, value heads not a multiple of key heads, zeros)."""
    _count("config.json head counts")
    raw = dict(SHIPPED_CONFIG)
    names = ["num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads",
             "head_dim", "linear_key_head_dim"]
    for name, v in zip(names, values):
        raw[name] = v % 9
    raw["num_key_value_heads"] = nkv
    try:
        cfg = parse_config(raw, "fuzz/config.json")
    except QwenMTPError:
        return
    assert cfg.num_heads >= 1 and cfg.num_heads % cfg.num_kv_heads == 0
    assert cfg.gdn_num_k_heads >= 1 and cfg.gdn_num_v_heads % cfg.gdn_num_k_heads == 0


# ------------------------------------------------------------------------------------ safetensors and the index
@pytest.fixture(scope="module")
def tiny_folder(ckpt, tmp_path_factory):
    return ckpt("dense")[1]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["truncate", "flip", "header_len", "dtype", "offsets", "json"]), st.integers(0, 2 ** 31),
       st.integers(0, 255))
def test_safetensors_bytes(tiny_folder, tmp_path_factory, how, where, byte):
    _count("safetensors bytes")
    folder = tmp_path_factory.mktemp("st")
    for f in tiny_folder.iterdir():
        shutil.copy(f, folder / f.name)
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    if how == "truncate":
        data = data[:where % len(data)]
    elif how == "flip":
        data[where % len(data)] = byte
    elif how == "header_len":
        data[:8] = (where % (2 * len(data))).to_bytes(8, "little")
    else:
        names = [k for k in header if k != "__metadata__"]
        name = names[where % len(names)]
        if how == "dtype":
            header[name]["dtype"] = ["I32", "U8", "F64", "BOOL", "X9", "F8_E4M3"][byte % 6]
        elif how == "offsets":
            a, b = header[name]["data_offsets"]
            header[name]["data_offsets"] = [[b, a], [a, b + 1 + byte], [a + 4, b], [0, 2 ** 40]][byte % 4]
        else:
            header[name]["shape"] = [[], [byte], [-1, 3], "x"][byte % 4]
        text = json.dumps(header).encode()
        data = bytearray(len(text).to_bytes(8, "little")) + text + data[8 + n:]
    path.write_bytes(bytes(data))
    try:
        qwen_mtp.load(folder)
    except QwenMTPError as e:
        assert "model.safetensors" in str(e) or "config.json" in str(e), str(e)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(WEIRD, st.sampled_from(["weight_map", "root", "entry"]))
@example(value="\x00", how="entry")  # found by this test (2026-12-07): pathlib's untyped "embedded null byte"
def test_safetensors_index(tiny_folder, tmp_path_factory, value, how):
    _count("model.safetensors.index.json")
    folder = tmp_path_factory.mktemp("idx")
    for f in tiny_folder.iterdir():
        shutil.copy(f, folder / f.name)
    from safetensors.numpy import load_file
    names = sorted(load_file(folder / "model.safetensors"))
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in names}}
    if how == "weight_map":
        index["weight_map"] = value
    elif how == "root":
        index = value
    else:
        index["weight_map"][names[0]] = value
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    try:
        qwen_mtp.load(folder)
    except QwenMTPError as e:
        assert "index" in str(e) or "safetensors" in str(e), str(e)


# -------------------------------------------------------------------------------------------- orbax folders
@pytest.fixture(scope="module")
def orbax_saved(ckpt, tmp_path_factory):
    """A saved folder (qwen_mtp.save) of the tiny dense MTP model with int4 weights (groups of 64) and an int8
    lm_head, so the metadata has quantized leaves as well as plain ones; and the model it must restore to."""
    model = qwen_mtp.load(ckpt("dense_mtp")[1], quant="int4", group_size=64, quant_lm_head=True)
    return model, qwen_mtp.save(model, tmp_path_factory.mktemp("orbax") / "saved")


def _json_paths(x, prefix=()):
    """Every path (tuple of keys / indices) into a JSON value, the value's own included."""
    out = [prefix]
    if isinstance(x, dict):
        for k, v in x.items():
            out += _json_paths(v, prefix + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            out += _json_paths(v, prefix + (i,))
    return out


def _set(root, path, value):
    for key in path[:-1]:
        root = root[key]
    if value == "<delete>":
        del root[path[-1]]
    else:
        root[path[-1]] = value


def _same_weights(a, b):
    from qwen_mtp.trunk.quant import QuantArray
    la, ta = jax.tree_util.tree_flatten(a, is_leaf=lambda x: isinstance(x, QuantArray))
    lb, tb = jax.tree_util.tree_flatten(b, is_leaf=lambda x: isinstance(x, QuantArray))
    if ta != tb:
        return False
    for x, y in zip(la, lb):
        pairs = [(x.q, y.q), (x.scale, y.scale)] if isinstance(x, QuantArray) else [(x, y)]
        for u, v in pairs:
            u, v = np.asarray(u), np.asarray(v)
            if u.dtype != v.dtype or u.shape != v.shape or not np.array_equal(u.view(np.uint8), v.view(np.uint8)):
                return False
    return True


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["meta", "meta_text", "config", "truncate", "flip", "delete"]), st.integers(0, 2 ** 31),
       st.integers(0, 2 ** 31), st.one_of(st.just("<delete>"), WEIRD), st.integers(0, 255))
# found by this test (2026-12-07): the metadata's 'quant' deleted, or null, loaded the int4 folder with no policy;
# its lm_head flag null, as lm_head False (bool(None)); also pinned: lm_head false and another int4 group size
@example(how="meta", which=3, where=0, value="<delete>", byte=0)
@example(how="meta", which=3, where=0, value=None, byte=0)
@example(how="meta", which=6, where=0, value=None, byte=0)
@example(how="meta", which=6, where=0, value=False, byte=0)
@example(how="meta", which=5, where=0, value=32, byte=0)
# an int4 leaf's block [null, 1]: the policy check sorted the groups with None among them (TypeError)
@example(how="meta", which=7026697, where=0, value=None, byte=0)
def test_orbax_folders(orbax_saved, tmp_path_factory, how, which, where, value, byte):
    """A saved folder with one thing wrong in it: a metadata or config.json field replaced or deleted, the
    metadata's text cut, a file under weights/ truncated, a byte flipped or the file deleted. qwen_mtp.load
    ends in a typed error naming the folder's file or tensor, or gives back exactly the saved weights."""
    from qwen_mtp.loading import orbax_io
    _count("orbax folders")
    model, saved = orbax_saved
    folder = tmp_path_factory.mktemp("orbax_fuzz") / "m"
    shutil.copytree(saved, folder)
    if how in ("meta", "config"):
        f = folder / (orbax_io.META if how == "meta" else "config.json")
        raw = json.loads(f.read_text())
        paths = [p for p in _json_paths(raw) if p]
        _set(raw, paths[which % len(paths)], value)
        f.write_text(json.dumps(raw))
    elif how == "meta_text":
        f = folder / orbax_io.META
        text = f.read_bytes()
        f.write_bytes(text[:which % len(text)])
    else:
        files = sorted(p for p in (folder / orbax_io.WEIGHTS).rglob("*") if p.is_file())
        f = files[which % len(files)]
        data = bytearray(f.read_bytes())
        if how == "delete":
            f.unlink()
        elif how == "truncate":
            f.write_bytes(bytes(data[:where % max(1, len(data))]))
        elif data:
            data[where % len(data)] ^= byte or 1
            f.write_bytes(bytes(data))
    try:
        restored = qwen_mtp.load(folder)
    except QwenMTPError as e:
        event(f"{how}: {type(e).__name__}")
        assert str(folder) in str(e) or orbax_io.META in str(e) or "config.json" in str(e), str(e)
        return
    event(f"{how}: loaded")
    assert restored.quant == model.quant and _same_weights(restored.weights, model.weights), (how, str(f))


# ------------------------------------------------------------------------------------- generate's arguments
@pytest.fixture(scope="module")
def shipped():
    return qwen_mtp.load(default_model_path())


PROMPTS = st.one_of(st.lists(st.integers(-5, 5000), max_size=6), st.lists(st.lists(st.integers(0, 4100), max_size=4),
                                                                              max_size=3),
                    WEIRD, st.just(np.zeros((2, 2, 2), np.int32)), st.just(np.array([1.5, 2.0])),
                    st.just(np.array([], np.int64)))


@FUZZ
@given(PROMPTS, WEIRD, st.one_of(st.none(), st.builds(dict, k=WEIRD), st.builds(dict, k=st.integers(1, 16),
                                                                                   window=WEIRD, sinks=WEIRD)),
       st.dictionaries(st.sampled_from(["temperature", "top_k", "top_p", "seed", "eos_token_id", "prefill_chunk",
                                        "kv_dtype", "return_logits"]), WEIRD, max_size=3))
def test_generate_arguments(shipped, prompt, max_new, spec_kw, kw):
    """Validation only (generate's own checks, run by make_request before any program): a typed error or an
    accepted request, never another exception."""
    from qwen_mtp.decoding.request import make_request
    _count("generate / SpecConfig arguments")
    try:
        spec = None if spec_kw is None else qwen_mtp.SpecConfig(**spec_kw)
        args = dict(temperature=0.0, top_k=0, top_p=1.0, seed=0, eos_token_id=None, prefill_chunk=256,
                    return_logits=False, kv_dtype=None)
        args.update(kw)
        req = make_request(shipped, prompt, max_new, spec, args["temperature"], args["top_k"], args["top_p"],
                           args["seed"], args["eos_token_id"], args["prefill_chunk"], args["return_logits"],
                           args["kv_dtype"])
    except QwenMTPError as e:
        assert "argument" in str(e) or "prompt" in str(e) or "SpecConfig" in str(e) or "ids" in str(e), str(e)
        return
    assert req.max_new >= 1 and all(len(r) >= 1 for r in req.rows)
    assert all(0 <= int(t) < shipped.config.vocab_size for r in req.rows for t in r)


def test_a_few_accepted_requests_really_run(shipped):
    """Examples the property above accepts at its edges run end to end (first id, last id, one token)."""
    V = shipped.config.vocab_size
    out = qwen_mtp.generate(shipped, [[0], [V - 1, 0, V - 1]], 1, spec=qwen_mtp.SpecConfig(k=16, window=1, sinks=0),
                            top_k=V, temperature=1e-3, top_p=1.0, eos_token_id=[], prefill_chunk=1)
    assert out.tokens.shape == (2, 1)


# ------------------------------------------------------------------------------------------------ the CLI's flags
FLAG_VALUES = st.one_of(st.sampled_from(["0", "-1", "1", "2", "auto", "off", "1e9", "nan", "inf", "x", "", "3.5",
                                         "int4", "data=1,model=1", "model=0", "float8_e4m3fn", "bfloat16"]),
                        st.text(alphabet="0123456789-.,=ab", max_size=6))
FLAGS = ["--k", "--window", "--sinks", "--temperature", "--top-p", "--top-k", "--seed", "--quant", "--group-size",
         "--kv-dtype", "--mesh", "--draft-vocab"]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(FLAGS), FLAG_VALUES), min_size=1, max_size=2))
def test_cli_flags(flags):
    """generate with weird flag values (2 new tokens): exit 0, or a one-line error with status 2 (argparse's or
    ours); never a traceback."""
    import contextlib
    import io

    from qwen_mtp.tools.cli import main
    _count("CLI flags")
    argv = ["generate", "def f():", "--max-new-tokens", "2"]  # the session's compile cache (conftest)
    for flag, value in flags:
        argv += [flag, value]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse: usage line and the error
            rc = e.code
    assert rc in (0, 2), (argv, rc, err.getvalue()[-500:])
    assert "Traceback" not in err.getvalue()
    if rc == 2:
        assert "error" in err.getvalue()


@pytest.mark.parametrize("field,value", [("shape", None), ("shape", [48, "x"]), ("kind", ["int4"])])
def test_orbax_quantized_entry_of_the_wrong_type(orbax_saved, tmp_path, field, value):
    """The cases the fuzzer found (a quantized leaf's shape None: TypeError from deep inside restore)."""
    from qwen_mtp.loading import orbax_io
    _, saved = orbax_saved
    folder = tmp_path / "m"
    shutil.copytree(saved, folder)
    f = folder / orbax_io.META
    meta = json.loads(f.read_text())
    name = sorted(meta["quantized"])[0]
    meta["quantized"][name][field] = value
    f.write_text(json.dumps(meta))
    with pytest.raises(qwen_mtp.CheckpointError, match=name):
        qwen_mtp.load(folder)
