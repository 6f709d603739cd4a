"""Start-up: `precompile` compiles every program `generate` runs, running nothing, so the call that follows
compiles nothing (streamed or not, plain and speculative); and jax's persistent compilation cache hands a second
process the programs the first one compiled (the CLI, in two fresh processes)."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xla_flags
from jax import monitoring

import qwen_mtp
from qwen_mtp.loading.folder import default_model_path

REPO = Path(__file__).resolve().parents[1]
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # recorded by every XLA compile (jax/_src/dispatch.py)


@contextlib.contextmanager
def counting_compiles():
    seen = []
    listener = lambda event, duration, **kw: seen.append(event) if event == COMPILE_EVENT else None
    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        monitoring.unregister_event_duration_listener(listener)


@pytest.fixture(scope="module")
def model():
    return qwen_mtp.load(default_model_path())


# a batch of three ragged rows and a 40-token budget (buffer 64): shapes no other test compiles
ROWS = [np.arange(3, 40), np.arange(100, 120), np.arange(7, 36)]


@pytest.mark.parametrize("spec", [None, qwen_mtp.SpecConfig(k=2)], ids=["plain", "spec"])
def test_precompile_then_generate_compiles_nothing(model, spec):
    with counting_compiles() as seen:
        seconds = qwen_mtp.precompile(model, ROWS, 40, spec=spec, eos_token_id=[])
    assert len(seen) >= 5 and seconds > 0  # the probe sees real compiles: prefill, head, first token, loops
    got = [[] for _ in ROWS]
    sink = lambda rows: [g.extend(r.tolist()) for g, r in zip(got, rows)]
    with counting_compiles() as seen:
        streamed = qwen_mtp.generate(model, ROWS, 40, spec=spec, eos_token_id=[], stream=sink)
        whole = qwen_mtp.generate(model, ROWS, 40, spec=spec, eos_token_id=[])
    assert seen == [], f"generate compiled {len(seen)} program(s) after precompile"
    np.testing.assert_array_equal(streamed.tokens, whole.tokens)
    # the stop ids are an argument of the programs, not part of their shape (generate.eos_slots): the config's
    # eos ids and one id chosen here run the same programs, and stop where the tokens say
    stop = int(whole.tokens[1, 5])
    with counting_compiles() as seen:
        default_eos = qwen_mtp.generate(model, ROWS, 40, spec=spec)
        stopped = qwen_mtp.generate(model, ROWS, 40, spec=spec, eos_token_id=stop)
    assert seen == [], f"a change of eos_token_id compiled {len(seen)} program(s)"
    assert model.config.eos_token_ids and default_eos.tokens.shape == (3, 40)
    n = whole.tokens[1].tolist().index(stop) + 1  # the row stops at the id's first appearance, which it emits
    assert stopped.lengths[1] == n < 40 and stopped.tokens[1, n - 1] == stop, (n, stopped.lengths)
    np.testing.assert_array_equal(stopped.tokens[1, :n], whole.tokens[1, :n])
    assert [list(r) for r in whole.tokens] == got  # the stream delivered every id, in order, between segments
    assert whole.tokens.shape == (3, 40)


def test_without_precompile_generate_compiles(model):
    """The negative control: the same kind of call at a shape nothing precompiled compiles its programs."""
    with counting_compiles() as seen:
        qwen_mtp.generate(model, [np.arange(5, 26)], 24, eos_token_id=[], top_k=3, temperature=0.5)
    assert len(seen) >= 3


def _cli(cache, *extra):
    env = xla_flags.defaults_env(QWEN_MTP_COMPILE_CACHE=str(cache), JAX_LOG_COMPILES="1",
                                 JAX_EXPLAIN_CACHE_MISSES="1")  # (these make jax log each persistent-cache hit and miss)
    # (XLA's default flags, not the session's: the README's command as a user runs it, tests/xla_flags.py)
    r = subprocess.run([sys.executable, "-m", "qwen_mtp", "generate", "def fibonacci(n):", "--max-new-tokens", "24",
                        "--k", "3", *extra], capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_cli_second_process_reads_its_programs_from_the_compile_cache(tmp_path):
    """The README's first command, twice in fresh processes sharing a cache folder (QWEN_MTP_COMPILE_CACHE): the
    second reads every program back (its decode loop included: no host callback keeps it out), lowered
    (program_cache.py) and compiled (jax's cache), and prints the same text; the first wrote them."""
    cache = tmp_path / "jax_cache"
    first = _cli(cache)
    assert list(cache.glob("jit_spec_decode-*")), sorted(p.name for p in cache.iterdir())
    programs = cache / "qwen_mtp_programs"
    kept = sorted(programs.glob("*.pkl"))
    mtimes = {p: p.stat().st_mtime_ns for p in kept}
    second = _cli(cache)
    lines = first.stdout.strip().splitlines()
    assert lines[0].startswith("def fibonacci(n):")
    assert "tok/s" in lines[-1] and "AL" in lines[-1] and "alpha_j" in lines[-1]
    assert second.stdout.splitlines()[:-1] == first.stdout.splitlines()[:-1]  # same text, stats line aside
    assert "Persistent compilation cache hit for 'jit_spec_decode'" in second.stderr
    assert "Persistent compilation cache hit for 'jit_trunk_chunk'" in second.stderr
    assert "because it uses host callbacks" not in first.stderr
    assert "PERSISTENT COMPILATION CACHE MISS" in first.stderr  # the probe: a cold folder misses
    missed = re.findall(r"PERSISTENT COMPILATION CACHE MISS for '([^']+)'", second.stderr)
    assert missed == [], missed  # every program of the second process came from the cache
    t1, t2 = (float(re.search(r"warm-up ([0-9.]+)s", r.stdout).group(1)) for r in (first, second))
    assert t2 < t1
    # the stats line names what the second warm-up did: load the cached executables, compile none
    assert re.search(r"warm-up [0-9.]+s, compiling [0-9]+ programs?, not counted", first.stdout), first.stdout
    assert re.search(r"warm-up [0-9.]+s, loading [0-9]+ cached executables?, not counted", second.stdout), second.stdout
    # and traced nothing: the first process kept each program it lowered (program_cache.py), the second read them
    assert len(kept) >= 8 and sorted(programs.glob("*.pkl")) == kept
    assert all(p.stat().st_mtime_ns == mtimes[p] for p in kept)  # none written again


def test_compile_cache_off_and_bad_folder(tmp_path):
    from qwen_mtp.compiling import compile_cache

    assert compile_cache.resolve("off") is None and compile_cache.resolve("OFF") is None
    assert compile_cache.resolve(str(tmp_path)) == tmp_path
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(qwen_mtp.ArgumentError, match="a_file"):
        compile_cache.enable_compile_cache(str(blocker / "cache"))
