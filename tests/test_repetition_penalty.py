"""The repetition penalty (penalty.py): transformers' RepetitionPenaltyLogitsProcessor is the oracle for the rule
and for greedy decoding under it; speculative decoding under it (native, Wind-MTP, draft vocabulary) equals plain
decoding under it, greedy token for token and sampled in distribution; a verify that forgets the drafts it
verifies is caught; bad values and bad generation_config.json files are refused by name."""

import json

import jax
import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

import qwen_mtp
from qwen_mtp.decoding import penalty
from qwen_mtp.decoding.sampling import Sampling
from qwen_mtp.errors import ArgumentError, ConfigError
from qwen_mtp.loading.folder import generation_repetition_penalty
from qwen_mtp.tools.cli import main

R = 1.3


@pytest.mark.parametrize("r", [R, 0.7])
def test_rule_equals_transformers_processor(r):
    rng = np.random.default_rng(0)
    B, T, V = 4, 12, 97
    logits = rng.normal(size=(B, V)).astype(np.float32) * 3
    ids = rng.integers(0, 20, size=(B, T))  # repeats within a row: counted once, as transformers does
    lens = np.array([12, 5, 1, 9])
    ref = []
    for b in range(B):
        proc = RepetitionPenaltyLogitsProcessor(penalty=r)
        ref.append(proc(torch.tensor(ids[b:b + 1, :lens[b]]), torch.tensor(logits[b:b + 1]))[0].numpy())
    s = Sampling(repetition_penalty=r)
    seen = penalty.prompt_seen(jax.numpy.asarray(ids), jax.numpy.asarray(lens), V, s)
    ours = np.asarray(penalty.apply(jax.numpy.asarray(logits), seen, s))
    changed = ~np.isclose(np.stack(ref), logits)
    assert changed.sum() > 10 and (~changed).sum() > 100  # both kinds of entry are checked
    np.testing.assert_allclose(ours, np.stack(ref), rtol=1e-6, atol=0)  # XLA may divide as a multiply: 1 ulp
    # the padding after a row's length is not in its context (such ids exist, so the equality above saw them)
    pad_only = set(ids[1, 5:].tolist()) - set(ids[1, :5].tolist())
    assert pad_only and not np.asarray(seen)[1, sorted(pad_only)].any()


def test_verify_rows_see_the_drafts_before_them():
    s = Sampling(repetition_penalty=R)
    seen = np.zeros((2, 10), bool)
    seen[0, 1] = seen[1, 7] = True
    D = np.array([[3, 4, 3], [7, 9, 2]])
    rows = np.asarray(penalty.verify_seen(jax.numpy.asarray(seen), jax.numpy.asarray(D), s))
    for b in range(2):
        for i in range(4):
            want = seen[b].copy()
            want[D[b, :i]] = True
            np.testing.assert_array_equal(rows[b, i], want, err_msg=f"row {b}, verify row {i}")


def _hf_greedy_penalised(model, ids, n, r):
    """Greedy decoding by the oracle, a full forward per step, its logits through transformers' processor."""
    proc = RepetitionPenaltyLogitsProcessor(penalty=r)
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq])).logits[:, -1].double()
            seq.append(int(proc(torch.tensor([seq]), logits)[0].argmax()))
    return np.array(seq[len(ids):])


@pytest.mark.parametrize("r", [4.0, 0.25])  # the random model's margins are wide: a strong penalty changes tokens
def test_greedy_under_penalty_matches_transformers(ckpt, r, report):
    hf, folder = ckpt("dense")
    model = qwen_mtp.load(folder)
    prompt = np.random.RandomState(3).randint(0, 97, size=24)
    ref = _hf_greedy_penalised(hf, prompt, 16, r)
    ours = qwen_mtp.generate(model, prompt, 16, eos_token_id=[], repetition_penalty=r)
    off = qwen_mtp.generate(model, prompt, 16, eos_token_id=[])
    np.testing.assert_array_equal(ours.tokens[0], ref)
    assert not np.array_equal(off.tokens[0], ref), "the penalty changed nothing: the test could not fail"
    report(f"repetition penalty {r}: 16 greedy tokens equal transformers' RepetitionPenaltyLogitsProcessor "
           f"({int((off.tokens[0] != ref).sum())} differ from unpenalised greedy)")


PROMPTS = [[5, 17, 42, 8, 5, 17], [3, 3, 3], [60, 61, 62, 63, 64, 65, 66, 67, 68, 5]]
SPECS = {"native k1": qwen_mtp.SpecConfig(k=1), "native k3": qwen_mtp.SpecConfig(k=3),
         "window k2 W4 S2": qwen_mtp.SpecConfig(k=2, window=4, sinks=2)}


@pytest.fixture(scope="module")
def dense_mtp(ckpt):
    return qwen_mtp.load(ckpt("dense_mtp")[1])


def test_greedy_speculative_under_penalty_equals_plain(dense_mtp, report):
    plain = qwen_mtp.generate(dense_mtp, PROMPTS, 24, eos_token_id=[], repetition_penalty=R).tokens
    off = qwen_mtp.generate(dense_mtp, PROMPTS, 24, eos_token_id=[]).tokens
    assert (plain != off).sum() > 10, "the penalty changed nothing: the test could not fail"
    hist = 0
    for name, spec in SPECS.items():
        r = qwen_mtp.generate(dense_mtp, PROMPTS, 24, eos_token_id=[], repetition_penalty=R, spec=spec)
        np.testing.assert_array_equal(r.tokens, plain, err_msg=name)
        hist = hist + r.stats.accept_hist[:2]
    assert hist[0] > 5 and hist[1] > 5, hist  # drafts were both rejected and accepted
    report(f"repetition penalty {R}: greedy spec == plain ({', '.join(SPECS)}), 3 ragged rows x 24 tokens")


def test_draft_vocab_under_penalty_equals_plain(dense_mtp):
    model = qwen_mtp.with_draft_vocab(dense_mtp, 48, counts=np.arange(97, 0, -1))
    plain = qwen_mtp.generate(dense_mtp, PROMPTS, 24, eos_token_id=[], repetition_penalty=R).tokens
    r = qwen_mtp.generate(model, PROMPTS, 24, eos_token_id=[], repetition_penalty=R, spec=qwen_mtp.SpecConfig(k=2))
    np.testing.assert_array_equal(r.tokens, plain)


def test_lossless_test_catches_a_verify_that_forgets_the_drafts(dense_mtp, monkeypatch):
    """The pitfall: penalise every verify row with the context before the round only (not d_1..d_i). The
    equality test above fails on it."""
    plain = qwen_mtp.generate(dense_mtp, PROMPTS, 24, eos_token_id=[], repetition_penalty=R).tokens
    jax.clear_caches()  # spec_decode must be traced again with the wrong rule
    monkeypatch.setattr(penalty, "verify_seen", lambda seen, drafts, sampling: seen[:, None])
    try:
        bad = qwen_mtp.generate(dense_mtp, PROMPTS, 24, eos_token_id=[], repetition_penalty=R,
                                spec=qwen_mtp.SpecConfig(k=3)).tokens
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert not np.array_equal(bad, plain)


def _pvalue(a, b):
    table = np.stack([a, b])
    return chi2_contingency(table[:, table.sum(0) > 0])[1]


def test_sampled_speculative_under_penalty_has_plain_distribution(dense_mtp, report):
    B, prompt, kw = 2000, [5, 17, 42, 8], dict(temperature=1.0, eos_token_id=[])
    counts = lambda t, j: np.bincount(t[:, j], minlength=97)
    plain = qwen_mtp.generate(dense_mtp, [prompt] * B, 4, seed=1, repetition_penalty=2.0, **kw).tokens
    spec = qwen_mtp.generate(dense_mtp, [prompt] * B, 4, seed=2, repetition_penalty=2.0,
                             spec=qwen_mtp.SpecConfig(k=2), **kw)
    off = qwen_mtp.generate(dense_mtp, [prompt] * B, 4, seed=3, **kw).tokens
    pvals = [_pvalue(counts(plain, j), counts(spec.tokens, j)) for j in range(4)]
    power = [_pvalue(counts(plain, j), counts(off, j)) for j in range(4)]
    report(f"sampling under repetition penalty 2: spec vs plain chi-square p {[f'{p:.3f}' for p in pvals]}; "
           f"penalised vs not p {[f'{p:.1e}' for p in power]}; H[n]={spec.stats.accept_hist.tolist()}")
    assert spec.stats.accept_hist[0] > 100 and spec.stats.accept_hist[1:].sum() > 100
    assert min(pvals) > 1e-3, pvals
    assert min(power[1:]) < 1e-6, power  # the comparison can tell a penalty from none


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "1.3"])
def test_bad_penalty_is_refused_by_name(dense_mtp, bad):
    with pytest.raises(ArgumentError, match="repetition_penalty"):
        qwen_mtp.generate(dense_mtp, [1, 2, 3], 4, repetition_penalty=bad)


def test_generation_config_file(tmp_path, capsys):
    assert generation_repetition_penalty(tmp_path) is None  # no file
    f = tmp_path / "generation_config.json"
    f.write_text(json.dumps({"do_sample": False}))
    assert generation_repetition_penalty(tmp_path) is None  # no key
    f.write_text(json.dumps({"repetition_penalty": 1.25, "temperature": 0.6}))
    assert generation_repetition_penalty(tmp_path) == 1.25
    for text, what in [("{not json", "unreadable JSON"), ("[1.2]", "list"),
                       (json.dumps({"repetition_penalty": 0}), "repetition_penalty"),
                       (json.dumps({"repetition_penalty": "high"}), "repetition_penalty")]:
        f.write_text(text)
        with pytest.raises(ConfigError, match=what) as e:
            generation_repetition_penalty(tmp_path)
        assert str(f) in str(e.value)
    # the CLI refuses the bad file before it loads anything, and a bad flag
    assert main(["generate", "x", "--model", str(tmp_path)]) == 2
    assert "generation_config.json" in capsys.readouterr().err
    for bad in ("0", "-2", "nan", "x"):
        with pytest.raises(SystemExit) as e:
            main(["generate", "x", "--repetition-penalty", bad])
        assert e.value.code == 2
        capsys.readouterr()


def test_memory_check_counts_the_context(dense_mtp):
    from qwen_mtp.decoding.request import make_request, request_bytes

    args = lambda r: (dense_mtp, PROMPTS, 24, qwen_mtp.SpecConfig(k=3), 0.0, 0, 1.0, 0, None, 256, False, None, r)
    off, on = request_bytes(dense_mtp, make_request(*args(1.0))), request_bytes(dense_mtp, make_request(*args(R)))
    assert "repetition penalty context" not in off
    assert on["repetition penalty context"] == 3 * 97 * 5 and on["total"] == off["total"] + 3 * 97 * 5
