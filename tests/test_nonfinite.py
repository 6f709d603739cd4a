"""Failures during generation are loud: NaN / Inf logits stop generate with NonFiniteError naming the row, the new
token and the first non-finite stage, and nothing is emitted from them (streamed or not, plain or speculative);
a stream callback that raises ends the call with its exception and leaves the model usable."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import qwen_mtp
from qwen_mtp.loading.folder import default_model_path

PROMPT = np.arange(40, 75)


@pytest.fixture(scope="module")
def model():
    return qwen_mtp.load(default_model_path())


def _with(model, fn):
    """A copy of the model whose weights pass through fn (numpy in, numpy out)."""
    w = fn(model.weights)
    return dataclasses.replace(model, weights=w)


def _nan_layer(model, i):
    import jax.numpy as jnp

    def fn(w):
        layers = list(w.layers)
        mixer = layers[i].mixer
        layers[i] = dataclasses.replace(layers[i], mixer=dataclasses.replace(
            mixer, out_proj=jnp.full_like(mixer.out_proj, jnp.nan)))
        return dataclasses.replace(w, layers=tuple(layers))
    return _with(model, fn)


def test_nan_weights_name_the_layer(model):
    broken = _nan_layer(model, 2)
    assert model.config.layer_types[2] == "linear_attention"
    for spec in (None, qwen_mtp.SpecConfig(k=2)):
        with pytest.raises(qwen_mtp.NonFiniteError, match=r"layer 2 \(linear_attention\)") as e:
            qwen_mtp.generate(broken, PROMPT, 8, spec=spec, eos_token_id=[])
        assert e.value.row == 0 and e.value.step == 0  # the prompt's own logits: not one token emitted
    # the clean model is unaffected (no false alarm)
    assert qwen_mtp.generate(model, PROMPT, 8, eos_token_id=[]).tokens.shape == (1, 8)


def test_nan_met_during_decode_stops_before_emitting(model):
    """The input embedding of one new token of row 0 (the first, from the 3rd on, that neither prompt nor any
    earlier token of either row holds) is NaN, on an untied copy of the model, so its lm_head column stays finite:
    the tokens before it are chosen from finite logits and delivered; the logits after feeding it are not, and the
    call stops there."""
    import jax.numpy as jnp

    untied = _with(model, lambda w: dataclasses.replace(w, lm_head=jnp.asarray(w.embed.T)))
    # a prompt whose greedy continuation brings new ids early (after ids 40..74 the shipped model loops on ids
    # it has already written: no token qualifies)
    prompt = np.arange(1000, 1035)
    clean = qwen_mtp.generate(untied, [prompt, prompt[:20]], 12, eos_token_id=[]).tokens
    j = next(j for j in range(2, 10) if int(clean[0, j]) not in set(prompt.tolist()) | set(clean[0, :j].tolist())
             | set(clean[1].tolist()))
    x = int(clean[0, j])
    broken = _with(untied, lambda w: dataclasses.replace(w, embed=w.embed.at[x].set(jnp.nan)))
    got = []
    with pytest.raises(qwen_mtp.NonFiniteError, match="embedding") as e:
        qwen_mtp.generate(broken, [prompt, prompt[:20]], 12, eos_token_id=[],
                          stream=lambda rows: got.append([r.tolist() for r in rows]))
    assert (e.value.row, e.value.step) == (0, j + 1)
    row0 = sum((seg[0] for seg in got), [])
    assert row0 == clean[0, :j + 1].tolist()  # every token up to the bad one (chosen from finite logits), none after
    with pytest.raises(qwen_mtp.NonFiniteError) as e:
        qwen_mtp.generate(broken, [prompt, prompt[:20]], 12, eos_token_id=[], spec=qwen_mtp.SpecConfig(k=3))
    assert e.value.row == 0 and 1 <= e.value.step <= j + 1


def test_a_raising_stream_callback_ends_the_call_and_the_model_stays_usable(model):
    want = qwen_mtp.generate(model, PROMPT, 20, eos_token_id=[], spec=qwen_mtp.SpecConfig(k=2)).tokens
    calls = []

    def sink(rows):
        calls.append(rows)
        if len(calls) == 3:
            raise KeyError("the consumer went away")

    with pytest.raises(KeyError, match="the consumer went away"):
        qwen_mtp.generate(model, PROMPT, 20, eos_token_id=[], spec=qwen_mtp.SpecConfig(k=2), stream=sink)
    assert len(calls) == 3
    again = qwen_mtp.generate(model, PROMPT, 20, eos_token_id=[], spec=qwen_mtp.SpecConfig(k=2)).tokens
    np.testing.assert_array_equal(again, want)


def test_ctrl_c_ends_the_cli_cleanly(tmp_path):
    """SIGINT while the CLI streams a long answer: exit status 130, a one-word message, no traceback."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "QWEN_MTP_COMPILE_CACHE": str(tmp_path / "cache")}
    p = subprocess.Popen([sys.executable, "-m", "qwen_mtp", "generate", "def f(x):", "--max-new-tokens", "100000",
                          "--no-spec"], cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = p.stdout.readline()  # the prompt and the first streamed text: generation is under way
        assert first, p.stderr.read()[-2000:]
        time.sleep(1.0)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err[-2000:]
    assert "interrupted" in err and "Traceback" not in err
