"""Speculative decoding is lossless: greedy speculative output equals plain greedy output token for token."""

import numpy as np
import pytest

import qwen_mtp


def _ids(n, seed):
    return np.random.RandomState(seed).randint(0, 97, size=n)


@pytest.fixture(scope="module")
def model(ckpt):
    return qwen_mtp.load(ckpt("dense_mtp")[1])


CASES = {"short": [_ids(7, 1)], "long": [_ids(150, 2)], "batch3": [_ids(5, 3), _ids(90, 4), _ids(31, 5)]}


@pytest.fixture(scope="module")
def plain(model):
    return {name: qwen_mtp.generate(model, p, 40, eos_token_id=[]) for name, p in CASES.items()}


_seen = {"accepted": 0, "rejected": 0, "cases": 0}


# the batch of 3 runs k = 1, 2, 4, 6, 8; the single-row short prompt k = 3, the long one k = 1, 5 (CI time: each k is
# a compile; the certificate sweep covers the rest)
PARAMS = [("batch3", k) for k in (1, 2, 4, 6, 8)] + [("short", 3), ("long", 1), ("long", 5)]


@pytest.mark.parametrize("case,k", PARAMS)
def test_greedy_speculative_equals_plain_greedy(model, plain, case, k, report):
    res = qwen_mtp.generate(model, CASES[case], 40, eos_token_id=[], spec=qwen_mtp.SpecConfig(k=k))
    np.testing.assert_array_equal(res.tokens, plain[case].tokens)
    np.testing.assert_array_equal(res.lengths, [40] * len(CASES[case]))
    st = res.stats
    assert st.rounds == int(st.accept_hist.sum()) > 0
    # tokens emitted by rounds: one per round plus the accepted drafts (the last round may be cut short)
    accepted = int((np.arange(k + 1) * st.accept_hist).sum())
    assert st.new_tokens - len(CASES[case]) <= st.rounds + accepted
    _seen["cases"] += 1
    _seen["accepted"] += int(st.accept_hist[1:].sum() > 0)
    _seen["rejected"] += int(st.accept_hist[:k].sum() > 0)
    report(f"lossless greedy {case:6s} k={k}: equal; H[n]={st.accept_hist.tolist()} AL={st.acceptance_length:.2f}")


def test_lossless_cases_saw_acceptance_and_rejection():
    """The comparisons above could not pass vacuously: across them drafts were both accepted and rejected."""
    assert _seen["cases"] > 0 and _seen["accepted"] == _seen["cases"] and _seen["rejected"] == _seen["cases"]


def test_eos_and_max_new_tokens_exact_with_spec(model, plain):
    """An eos id stops each row exactly where plain decoding stops it (k = 2 and 4: the programs the batch3 cases
    above compiled), and max_new_tokens 1, 2, 13 end every row exactly there (k = 5, more drafts than the first two
    leave room for: one compile, the 16-token bucket all three share)."""
    prompts = CASES["batch3"]
    free = plain["batch3"]
    eos = int(free.tokens[1, 6])
    ref = qwen_mtp.generate(model, prompts, 40, eos_token_id=eos)
    assert ref.lengths[1] <= 7 and ref.lengths.max() > 7, ref.lengths  # eos met early in one row, not in all
    for k in (2, 4):
        res = qwen_mtp.generate(model, prompts, 40, eos_token_id=eos, spec=qwen_mtp.SpecConfig(k=k))
        np.testing.assert_array_equal(res.tokens, ref.tokens)
        np.testing.assert_array_equal(res.lengths, ref.lengths)
    for n in (1, 2, 13):
        short = qwen_mtp.generate(model, prompts, n, eos_token_id=[], spec=qwen_mtp.SpecConfig(k=5))
        np.testing.assert_array_equal(short.tokens, free.tokens[:, :n])
        assert short.lengths.tolist() == [n] * 3


def test_head_missing_gives_clear_error(ckpt):
    m = qwen_mtp.load(ckpt("dense")[1])
    with pytest.raises(qwen_mtp.MissingMTPHeadError, match="mtp"):
        qwen_mtp.generate(m, [1, 2, 3], 4, spec=qwen_mtp.SpecConfig(k=2))
    with pytest.raises(qwen_mtp.MissingMTPHeadError, match="mtp"):
        qwen_mtp.mtp_logits(m, [1, 2, 3])


def test_draft_steps_unrolled_for_a_gpu_draft_the_same(model, monkeypatch):
    """speculative.DRAFT_UNROLLED: a program lowered for cuda runs the k - 1 draft steps unrolled (a loop there
    runs on the host: gpu_scale --compile-for). Made to apply to cpu here, the unrolled steps give the same drafts,
    draft distributions and head cache as the loop, and the program holds one loop fewer."""
    import jax
    import jax.numpy as jnp

    from qwen_mtp.decoding import speculative
    from qwen_mtp.decoding.sampling import Sampling
    from qwen_mtp.head.mtp import init_mtp_cache

    cfg, B, k = model.config, 2, 4
    m1 = jax.random.normal(jax.random.PRNGKey(0), (B, cfg.hidden_size), jnp.float32)
    mcache = init_mtp_cache(cfg, B, 32, jnp.float32)
    pos = jnp.array([5, 9], jnp.int32)
    spec, sampling = speculative.SpecConfig(k=k), Sampling(temperature=0.8, top_k=20)

    def run():  # a new function each time: traced with DRAFT_UNROLLED as it is now
        fn = jax.jit(lambda w, c, m, p, key: speculative._draft(w, cfg, c, m, p, spec, sampling, key))
        args = (model.weights, mcache, m1, pos, jax.random.PRNGKey(1))
        return fn(*args), fn.lower(*args).as_text()

    (D, Q, cache), looped = run()
    monkeypatch.setattr(speculative, "DRAFT_UNROLLED", ("cuda", "cpu"))
    (D2, Q2, cache2), unrolled = run()
    # the draft loop is gone (the sampler's own loops stay in both)
    assert looped.count("stablehlo.while") - unrolled.count("stablehlo.while") == 1, (looped, unrolled)
    np.testing.assert_array_equal(D2, D)
    assert len(set(np.asarray(D).ravel().tolist())) > 2  # real drafts, not one id repeated
    # the two programs are fused and contracted apart by XLA's CPU compiler: on a CPU with other vector units a
    # draft probability came out 1.8e-6 apart (2.5e-7 at 0.14), f32 rounding through the softmax; the drafts,
    # sampled from them, are equal above
    np.testing.assert_allclose(Q2, Q, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(cache2), jax.tree.leaves(cache)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
