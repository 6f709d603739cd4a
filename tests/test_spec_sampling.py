"""Speculative sampling (rejection with the residual distribution) has plain sampling's distribution."""

import numpy as np
import pytest
from scipy.stats import chi2_contingency

import qwen_mtp

B = 2000  # independent samples per run: one batch of identical prompts, each row its own randomness
PROMPT = [5, 17, 42, 8]


def _counts(tokens, pos, vocab=97):
    return np.bincount(tokens[:, pos], minlength=vocab)


def _pvalue(a, b):
    table = np.stack([a, b])
    table = table[:, table.sum(0) > 0]
    return chi2_contingency(table)[1]


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.8, top_k=30, top_p=0.9)],
                         ids=["t1", "t0.8-topk30-topp0.9"])
def test_speculative_sampling_distribution_equals_plain(ckpt, kw, report):
    model = qwen_mtp.load(ckpt("dense_mtp")[1])
    prompts = [PROMPT] * B
    plain = qwen_mtp.generate(model, prompts, 4, eos_token_id=[], seed=1, **kw).tokens
    spec = qwen_mtp.generate(model, prompts, 4, eos_token_id=[], seed=2, spec=qwen_mtp.SpecConfig(k=2), **kw)
    st = spec.stats
    # both outcomes of the draft test happened many times, so the residual path was exercised
    assert st.accept_hist[0] > 100 and st.accept_hist[1:].sum() > 100, st.accept_hist
    pvals = [_pvalue(_counts(plain, j), _counts(spec.tokens, j)) for j in range(4)]
    report(f"spec sampling {kw}: chi-square p-values per position {[f'{p:.3f}' for p in pvals]}, "
           f"H[n]={st.accept_hist.tolist()}")
    assert min(pvals) > 1e-3, pvals
    # the test has power: plain sampling at a different temperature is told apart
    other = qwen_mtp.generate(model, prompts, 4, eos_token_id=[], seed=3,
                              **dict(kw, temperature=kw["temperature"] * 1.6)).tokens
    assert min(_pvalue(_counts(plain, j), _counts(other, j)) for j in range(1, 4)) < 1e-6


def test_sampling_is_reproducible_by_seed(ckpt):
    model = qwen_mtp.load(ckpt("dense_mtp")[1])
    a = qwen_mtp.generate(model, PROMPT, 12, temperature=1.0, seed=7, spec=qwen_mtp.SpecConfig(k=3)).tokens
    b = qwen_mtp.generate(model, PROMPT, 12, temperature=1.0, seed=7, spec=qwen_mtp.SpecConfig(k=3)).tokens
    c = qwen_mtp.generate(model, [PROMPT] * 8, 12, temperature=1.0, seed=8).tokens
    np.testing.assert_array_equal(a, b)
    assert len({tuple(r) for r in c}) > 1  # rows of one batch draw independently


def test_distribution_test_catches_a_wrong_residual(ckpt, monkeypatch, report):
    """The classic bug: after a rejection, draw from p instead of the residual norm(max(p - q, 0)). The same
    chi-square comparison, with the same seeds and the same 1e-3 threshold, rejects it: the test above could
    fail."""
    import jax

    from qwen_mtp.decoding import speculative

    real = speculative._accept

    def accept_drawing_from_p(D, Q, logits, sampling, key):
        n, _, passed = real(D, Q, logits, sampling, key)  # the same accept decisions ...
        P = speculative.probs(logits, sampling)
        _, k_res = jax.random.split(key)
        return n, speculative.draw(k_res, P[jax.numpy.arange(D.shape[0]), n]), passed  # ... but p, not residual

    model = qwen_mtp.load(ckpt("dense_mtp")[1])
    prompts = [PROMPT] * B
    plain = qwen_mtp.generate(model, prompts, 4, eos_token_id=[], seed=1, temperature=1.0).tokens
    jax.clear_caches()  # spec_decode must be traced again with the wrong _accept
    monkeypatch.setattr(speculative, "_accept", accept_drawing_from_p)
    try:
        bad = qwen_mtp.generate(model, prompts, 4, eos_token_id=[], seed=2, temperature=1.0,
                                spec=qwen_mtp.SpecConfig(k=2)).tokens
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    pvals = [_pvalue(_counts(plain, j), _counts(bad, j)) for j in range(4)]
    report(f"spec sampling with the wrong residual (p after a rejection): p-values "
           f"{[f'{p:.1e}' for p in pvals]} (the real test requires all > 1e-3)")
    assert min(pvals) < 1e-3, pvals
