"""The program cache (qwen_mtp/compiling/program_cache.py): generate's programs kept as serialized jax.export modules give
the same tokens as the programs traced afresh; a process that finds them on disk traces and exports nothing; an
edit of the code (a new fingerprint) or a damaged entry is a miss, never a stale or broken program; programs it
must not keep (a lambda, a mesh) run as before."""

from __future__ import annotations

import numpy as np
import pytest

import qwen_mtp
from qwen_mtp.compiling import program_cache
from qwen_mtp.loading.folder import default_model_path

# shapes no other test compiles: two ragged rows, a 20-token budget
ROWS = [np.arange(11, 44), np.arange(200, 219)]


@pytest.fixture(scope="module")
def model():
    return qwen_mtp.load(default_model_path())


@pytest.fixture
def fresh(monkeypatch):
    """An empty in-process memo for the test (a new process, as far as the cache can tell)."""
    monkeypatch.setattr(program_cache, "_memo", {})
    monkeypatch.setattr(program_cache, "_refused", set())


def _exports(monkeypatch):
    seen = []
    real = program_cache._export

    def counting(fn, *a):
        seen.append(program_cache._name(fn))
        return real(fn, *a)

    monkeypatch.setattr(program_cache, "_export", counting)
    return seen


@pytest.mark.parametrize("spec", [None, qwen_mtp.SpecConfig(k=2)], ids=["plain", "spec"])
def test_same_tokens_and_a_second_process_exports_nothing(model, spec, tmp_path, monkeypatch, fresh):
    want = qwen_mtp.generate(model, ROWS, 20, spec=spec, eos_token_id=[])
    exported = _exports(monkeypatch)
    with program_cache.enabled(tmp_path):
        first = qwen_mtp.generate(model, ROWS, 20, spec=spec, eos_token_id=[])
        entries = sorted(tmp_path.glob("*.pkl"))
        loop = "qwen_mtp.decoding.speculative.spec_decode" if spec else "qwen_mtp.decoding.plain.plain_decode"
        assert loop in exported and "qwen_mtp.decoding.prefill.trunk_chunk" in exported, exported
        assert len(entries) == len(exported) >= 6  # the probe: each program a call runs was exported once
        n = len(exported)
        qwen_mtp.generate(model, ROWS, 20, spec=spec, eos_token_id=[])
        assert len(exported) == n  # this process: from memory
        monkeypatch.setattr(program_cache, "_memo", {})  # another process: from disk
        got = []
        second = qwen_mtp.generate(model, ROWS, 20, spec=spec, eos_token_id=[],
                                   stream=lambda rows: got.append([r.tolist() for r in rows]))
        assert len(exported) == n, exported[n:]  # nothing traced or exported again
    np.testing.assert_array_equal(first.tokens, want.tokens)
    np.testing.assert_array_equal(second.tokens, want.tokens)
    streamed = [sum((seg[b] for seg in got), []) for b in range(len(ROWS))]
    assert streamed == [list(r) for r in want.tokens]
    assert program_cache.active() is None  # `enabled` restores the state before it


def test_precompile_from_the_cache_then_generate_compiles_nothing(model, tmp_path, fresh):
    from test_startup import counting_compiles

    spec = qwen_mtp.SpecConfig(k=3)
    with program_cache.enabled(tmp_path):
        qwen_mtp.precompile(model, ROWS, 20, spec=spec, eos_token_id=[])
        program_cache._memo.clear()
        qwen_mtp.precompile(model, ROWS, 20, spec=spec, eos_token_id=[])  # read back from disk
        with counting_compiles() as seen:
            out = qwen_mtp.generate(model, ROWS, 20, spec=spec, eos_token_id=[])
        assert seen == [], f"generate compiled {len(seen)} program(s) after precompile"
    np.testing.assert_array_equal(out.tokens, qwen_mtp.generate(model, ROWS, 20, spec=spec, eos_token_id=[]).tokens)


def test_an_edited_source_or_a_damaged_entry_is_a_miss(model, tmp_path, monkeypatch, fresh):
    exported = _exports(monkeypatch)
    with program_cache.enabled(tmp_path):
        want = qwen_mtp.generate(model, ROWS[:1], 20, eos_token_id=[]).tokens
        n = len(exported)
        assert n >= 5 and len(list(tmp_path.glob("*.pkl"))) == n
        # the code changed: every key is new, every program is exported again beside the old entries
        monkeypatch.setattr(program_cache, "_memo", {})
        monkeypatch.setattr(program_cache, "fingerprint", lambda: "another version of the code")
        np.testing.assert_array_equal(qwen_mtp.generate(model, ROWS[:1], 20, eos_token_id=[]).tokens, want)
        assert len(exported) == 2 * n and len(list(tmp_path.glob("*.pkl"))) == 2 * n
        # damaged entries (cut short, or not ours) are misses, written again: no crash, the same tokens
        for i, path in enumerate(sorted(tmp_path.glob("*.pkl"))):
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2] if i % 2 else b"not a pickle")
        monkeypatch.setattr(program_cache, "_memo", {})
        np.testing.assert_array_equal(qwen_mtp.generate(model, ROWS[:1], 20, eos_token_id=[]).tokens, want)
        assert len(exported) == 3 * n
    assert not list(tmp_path.glob(".tmp-*"))  # atomic writes leave no temporary file


def test_programs_it_does_not_keep():
    import jax
    import jax.numpy as jnp

    from qwen_mtp.decoding.placement import state_program
    from qwen_mtp.decoding.prefill import trunk_chunk

    assert program_cache._name(jax.jit(lambda x: x)) is None  # lambdas have no unique name

    def inner(x):
        return x

    assert program_cache._name(jax.jit(inner)) is None  # nor do nested functions
    assert program_cache._name(trunk_chunk) == "qwen_mtp.decoding.prefill.trunk_chunk"
    cfg = qwen_mtp.load(default_model_path()).config
    a, b = (program_cache._name(state_program(cfg, 1, n, jnp.float32, None, False, None, 0, 0, None))
            for n in (128, 256))
    assert a.startswith("qwen_mtp.trunk.state.init_state(") and a != b  # a partial's bound arguments are in its name
    with program_cache.enabled(None):
        assert program_cache.program(trunk_chunk, (), {}) is None  # off


def test_library_opt_in(tmp_path):
    from qwen_mtp.compiling import compile_cache

    with program_cache.enabled(None):
        try:
            assert compile_cache.enable_compile_cache(tmp_path) == tmp_path and program_cache.active() is None
            compile_cache.enable_compile_cache(tmp_path, programs=True)
            assert program_cache.active() == tmp_path / program_cache.SUBDIR
            compile_cache.disable_compile_cache()
            assert program_cache.active() is None
        finally:
            compile_cache.enable_compile_cache()  # the session's cache, as conftest set it
