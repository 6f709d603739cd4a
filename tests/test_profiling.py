"""The profiling path (qwen_mtp/tools/profiling.py, `python -m qwen_mtp profile`, the profiling notebook): a trace of
speculative generate holds events of every phase of a round (draft, verify, accept, commit, rollback, refill)
and of prefill, with the trunk's and the MTP head's stages inside them, read back through the programs' named
scopes; each traced call sits in a step marker; the phase times are real (they add up to the decode time)."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

import qwen_mtp
from qwen_mtp.loading.folder import default_model_path, load_tokenizer
from qwen_mtp.tools.cli import main
from qwen_mtp.tools.profiling import (
    ROUND_PHASES,
    format_phase_table,
    op_scopes,
    phase_of,
    phase_shares,
    profile_generate,
    top_ops,
    trace_files,
)

NEW = 24


@pytest.fixture(scope="module")
def shipped():
    path = default_model_path()
    return qwen_mtp.load(path), np.asarray(load_tokenizer(path).encode("import os\nimport sys\n\n\ndef main(argv):\n").ids)


@pytest.fixture(scope="module")
def spec_trace(shipped, tmp_path_factory):
    model, ids = shipped
    logdir = tmp_path_factory.mktemp("trace")
    r, texts, rows, calls = profile_generate(model, ids, NEW, logdir, repeats=2, spec=qwen_mtp.SpecConfig(k=3))
    return logdir, r, texts, rows, calls


def _stages(rows, module, phase):
    return {st for m, ph, st, ms, _, _ in rows if m == module and ph == phase and ms > 0}


def test_every_phase_of_a_round_and_of_prefill_is_in_the_trace(spec_trace, report):
    logdir, r, texts, rows, calls = spec_trace
    assert r.stats.rounds > 3 and r.stats.acceptance_length > 1.2  # drafts were accepted: every phase had work
    shares = phase_shares(rows, "jit_spec_decode")
    for phase in ROUND_PHASES:
        assert shares.get(phase, 0) > 0, (phase, shares)
    assert {"mtp_attention", "mtp_mlp", "pick"} <= _stages(rows, "jit_spec_decode", "draft")
    assert {"gdn", "attention", "mlp", "lm_head"} <= _stages(rows, "jit_spec_decode", "verify")
    assert {"mtp_embed", "mtp_fc", "mtp_attention", "mtp_mlp"} <= _stages(rows, "jit_spec_decode", "refill")
    assert {"gdn", "attention", "mlp"} <= _stages(rows, "jit_trunk_chunk", "prefill")
    assert _stages(rows, "jit_mtp_chunk", "mtp_prefill")
    # every op of the round is charged to a phase: nothing lost for want of metadata
    unnamed = sum(s for m, ph, _, _, s, _ in rows if m == "jit_spec_decode" and ph in ("(no metadata)", "?"))
    assert unnamed < 0.01, unnamed
    report("profile k=3, shipped model: " + ", ".join(f"{p} {shares[p]:.0%}" for p in ROUND_PHASES))
    text = format_phase_table(rows, calls)
    assert "jit_spec_decode" in text and "ms each" in text


def test_phase_times_are_real(spec_trace):
    """The probe reads real durations: the round's self times add up to most of the decode time generate
    measured (the rest is the host loop between segments), not to zero or to a double count."""
    logdir, r, texts, rows, calls = spec_trace
    traced_ms = sum(ms for m, _, _, ms, _, _ in rows if m == "jit_spec_decode")
    decode_ms = 1e3 * r.stats.decode_s  # the last call; the two traced calls are alike
    assert 0.3 * 2 * decode_ms < traced_ms < 1.5 * 2 * decode_ms, (traced_ms, decode_ms)


def test_calls_sit_in_step_markers(spec_trace):
    logdir = spec_trace[0]
    (f,) = trace_files(logdir)["trace_json"]
    with gzip.open(f) as fh:
        events = json.load(fh)["traceEvents"]
    steps = [e for e in events if e.get("ph") == "X" and e.get("name") == "generate"]
    assert len(steps) == 2, [e.get("name") for e in events if e.get("ph") == "X"][:20]


def test_top_ops_carry_their_phase(spec_trace):
    logdir, _, texts, _, _ = spec_trace
    # generate's own programs (texts); eager helpers outside them (jax.random's key split, a device_put's
    # staging) carry no phase, and on a loaded host one preempted mid-op can outlast a real op of the round
    rows = [r for r in top_ops(logdir, 40, texts) if r[0] in texts][:10]
    assert len(rows) == 10 and all(ph not in ("?", "(no metadata)") for *_, ph, _ in rows), rows
    assert all(ms >= 0 for _, _, ms, *_ in rows)
    assert all(ph == "?" for *_, ph, _ in top_ops(logdir, 5))  # without the programs' texts: no phases


def test_op_scopes_reads_metadata_and_fills_the_gaps():
    hlo = """HloModule jit_f, entry_computation_layout={(f32[4]{0})->f32[4]{0}}
  %p = f32[4]{0} parameter(0), metadata={op_name="x"}
  %dot.1 = f32[4]{0} dot(%p, %p), lhs_contracting_dims={0}
  %neg.2 = f32[4]{0} negate(%dot.1), metadata={op_name="jit(f)/while/body/draft/pick/neg" stack_frame_id=3}
  ROOT %copy.3 = f32[4]{0} copy(%p)
"""
    scopes = op_scopes(hlo)
    assert scopes["neg.2"] == "jit(f)/while/body/draft/pick/neg"
    assert scopes["dot.1"] == scopes["neg.2"]  # no metadata: its consumer's
    assert scopes["copy.3"] == "x"  # no consumer: its operand's
    assert phase_of(scopes["dot.1"]) == ("draft", "pick")
    assert phase_of("jit(f)/while/body/verify/gdn/while/body/mul") == ("verify", "gdn")
    assert phase_of("jit(f)/while/body/add") == ("(loop)", "")
    assert phase_of(None) == ("(no metadata)", "")


def test_cli_profile_plain(tmp_path, capsys):
    assert main(["profile", "--no-spec", "--max-new-tokens", str(NEW), "--repeats", "1", "--logdir",
                 str(tmp_path / "tr")]) == 0
    out = capsys.readouterr().out
    assert "jit_plain_decode" in out and "ms each" in out
    for phase in ("step", "pick", "commit", "prefill"):
        assert f"  {phase} " in out, phase
    assert f"xprof --logdir {tmp_path / 'tr'} --port 8791" in out and "SSH tunnel" in out
    assert out.startswith(f"tracing 1 generate call(s) into {(tmp_path / 'tr').resolve()} (--logdir; ")  # said first
    assert list((tmp_path / "tr").rglob("*.xplane.pb"))
