"""A reduced draft vocabulary (qwen_mtp/head/draft_vocab.py) changes only the drafts: greedy speculative output is
still plain greedy output, drafts stay inside the set, the draft distribution is zero outside it, and the
sampling accept keeps the target distribution exactly."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare

import qwen_mtp
from qwen_mtp.decoding import speculative
from qwen_mtp.decoding.sampling import Sampling, probs
from qwen_mtp.decoding.speculative import draft_vocab_pick
from qwen_mtp.head import draft_vocab as dvm
from qwen_mtp.head.mtp import init_mtp_cache
from qwen_mtp.trunk.quant import quantize

V = 97  # the tiny checkpoints' vocabulary


def _ids(n, seed):
    return np.random.RandomState(seed).randint(0, V, size=n)


@pytest.fixture(scope="module")
def model(ckpt):
    return qwen_mtp.load(ckpt("dense_mtp")[1])


def _counts(seed=0):
    """Zipf-like counts over the tiny vocabulary, EOS given no count (it must be added anyway)."""
    return np.random.RandomState(seed).zipf(1.5, size=V).astype(np.int64)


# ---------------------------------------------------------------------------------------- (a) greedy exact
def test_greedy_speculative_with_draft_vocab_equals_plain_greedy(model, report):
    prompts = [_ids(5, 3), _ids(40, 4)]
    plain = qwen_mtp.generate(model, prompts, 24, eos_token_id=[])
    # counts from the model's own output (a corpus like the text it writes), the set only half of its distinct
    # tokens: drafts are accepted where the set covers the output and rejected where it cannot
    size = len(np.unique(plain.tokens)) // 2
    small = qwen_mtp.with_draft_vocab(model, size, counts=dvm.token_counts(plain.tokens, V))
    dv = small.weights.draft_vocab
    res = qwen_mtp.generate(small, prompts, 24, eos_token_id=[], spec=qwen_mtp.SpecConfig(k=3))
    np.testing.assert_array_equal(res.tokens, plain.tokens)
    np.testing.assert_array_equal(res.lengths, [24] * 2)
    h = res.stats.accept_hist
    assert h[0] > 0 and h[1:].sum() > 0, h  # drafts were both rejected and accepted: not vacuous
    outside = ~np.isin(plain.tokens, np.asarray(dv.ids))
    assert outside.any()  # the output has tokens the draft vocabulary cannot propose
    report(f"draft vocab {size}/{V}: greedy spec == plain, H[n]={h.tolist()}, AL {res.stats.acceptance_length:.2f}; "
           f"{outside.mean():.2f} of the output outside the draft set")


def _untied_int8(model):
    """The tiny model with an untied int8 lm_head (a quantized copy of embed^T)."""
    head = quantize(np.asarray(model.weights.embed).T, "int8")
    return dataclasses.replace(model, weights=model.weights.replace(lm_head=head))


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_sliced_quantized_columns_dequantize_to_the_originals(kind):
    w = np.random.RandomState(0).randn(200, 300).astype(np.float32)
    qa = quantize(w, kind, 64)
    ids = np.array([0, 5, 127, 128, 131, 299])
    sl = dvm.slice_columns(qa, ids)
    assert sl.shape == (200, len(ids))
    np.testing.assert_array_equal(np.asarray(sl.dequantize()), np.asarray(qa.dequantize())[:, ids])


# ---------------------------------------------------------------------------------------- (b) drafts in the set
_draft = jax.jit(speculative._draft, static_argnames=("cfg", "spec", "sampling"))


def _run_draft(m, sampling, B=4, k=3, seed=0):
    """speculative._draft run directly (a zero head cache, a random bridge): (m1, D [B, k], Q [B, k, V])."""
    w, cfg = m.weights, m.config
    mcache = init_mtp_cache(cfg, B, 32, w.embed.dtype)
    m1 = jax.random.normal(jax.random.PRNGKey(seed), (B, cfg.hidden_size), w.embed.dtype)
    pos = jnp.full((B,), 4, jnp.int32)
    D, Q, _ = _draft(w, cfg, mcache, m1, pos, spec=qwen_mtp.SpecConfig(k=k), sampling=sampling,
                 key=jax.random.PRNGKey(seed + 1))
    return m1, np.asarray(D), None if Q is None else np.asarray(Q)


@pytest.mark.parametrize("head", ["tied", "int8"])
def test_drafts_inside_the_set_and_q_zero_outside(model, head):
    base = model if head == "tied" else _untied_int8(model)
    small = qwen_mtp.with_draft_vocab(base, 16, counts=_counts(2))
    ids = np.asarray(small.weights.draft_vocab.ids)
    assert isinstance(small.weights.draft_vocab.lm_head, qwen_mtp.QuantArray) == (head == "int8")
    outside = np.setdiff1d(np.arange(V), ids)
    # greedy: the first draft is the full head logits' argmax restricted to the set
    m1, D, Q = _run_draft(small, Sampling())
    assert Q is None and np.isin(D, ids).all()
    full = np.asarray(qwen_mtp.trunk.forward.lm_logits(base.weights, m1))
    np.testing.assert_array_equal(D[:, 0], ids[np.argmax(full[:, ids], axis=1)])
    if head != "tied":
        return
    # sampling (temperature, top-k over the subset, top-p): every draft in the set, drawn where q > 0
    s = Sampling(temperature=0.7, top_k=5, top_p=0.9)
    for seed in range(3):
        _, D, Q = _run_draft(small, s, seed=seed)
        assert np.isin(D, ids).all()
        assert (Q[..., outside] == 0).all()
        np.testing.assert_allclose(Q.sum(-1), 1.0, atol=1e-5)
        assert (np.take_along_axis(Q, D[..., None], -1) > 0).all()


# ---------------------------------------------------------------------------------------- (c) exact sampling
N = 20_000  # independent rows, each its own draft and accept


def _chisquare_pvalue(tokens, p):
    """Goodness of fit of the tokens' counts to p, tokens expected fewer than 5 times pooled into one cell
    (a chi-square cell with a tiny expected count is dominated by chance)."""
    obs, expect = np.bincount(tokens, minlength=len(p)), len(tokens) * p / p.sum()
    big = expect >= 5
    obs, expect = np.append(obs[big], obs[~big].sum()), np.append(expect[big], expect[~big].sum())
    if expect[-1] == 0:  # nothing outside the big cells (e.g. top-k / top-p): no pooled cell (p = 0 there)
        assert obs[-1] == 0
        obs, expect = obs[:-1], expect[:-1]
    return chisquare(obs, expect)[1]


def _emit_first(dv, m0, logits0, s, key, q_accept=None):
    """N rows: a draft from the draft vocabulary, then _accept (k = 1) against the verify logits; returns the
    emitted first token (the draft if it passed, else the residual draw) and n. q_accept replaces the draft
    distribution handed to the accept (the power check)."""
    def run(dv, m0, logits0, q_accept, key):
        k_d, k_a = jax.random.split(key)
        d, q = draft_vocab_pick(dv, jnp.tile(m0[None], (N, 1)), s, k_d, V)
        if q_accept is not None:
            q = jnp.tile(q_accept[None], (N, 1))
        logits = jnp.tile(logits0[None, None], (N, 2, 1))
        n, bonus, _ = speculative._accept(d[:, None], q[:, None], logits, s, k_a)
        return jnp.where(n == 1, d, bonus), n

    out = jax.jit(run)(dv, m0, logits0, q_accept, key)
    return tuple(np.asarray(x) for x in out)


@pytest.mark.parametrize("s", [Sampling(temperature=1.0), Sampling(temperature=0.8, top_k=30, top_p=0.9)],
                         ids=["t1", "t0.8-topk30-topp0.9"])
def test_sampling_accept_with_draft_vocab_is_exact(model, s, report):
    """The first emitted token of a round (draft accepted, else the residual draw) has the target
    distribution p exactly: P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum min(p, q)) residual(x) = p(x), with q
    the draft vocabulary's distribution (zero outside the set). Checked analytically on the q that `pick`
    returns and empirically over N independent rows of draft + _accept."""
    rng = np.random.RandomState(4)
    m0 = jnp.asarray(rng.randn(model.config.hidden_size).astype(np.float32))
    head = np.asarray(qwen_mtp.trunk.forward.lm_logits(model.weights, m0))
    small = qwen_mtp.with_draft_vocab(model, 4, counts=np.argsort(np.argsort(head)))  # the head's top 4
    dv = small.weights.draft_vocab
    logits0 = jnp.asarray(head + rng.randn(V).astype(np.float32))  # the verify's (target) logits: near the head's
    p = np.asarray(probs(logits0, s), np.float64)
    # analytic: the output distribution of the accept rule for the q pick hands it
    _, q = draft_vocab_pick(dv, m0[None], s, jax.random.PRNGKey(0), V)
    q = np.asarray(q[0], np.float64)
    accepted = np.minimum(p, q)
    residual = np.maximum(p - q, 0.0)
    out = accepted + (1.0 - accepted.sum()) * residual / residual.sum()
    np.testing.assert_allclose(out, p, atol=1e-6)
    # empirical
    emitted, n = _emit_first(dv, m0, logits0, s, jax.random.PRNGKey(5))
    assert 0.05 < n.mean() < 0.95, n.mean()  # both the accept and the residual paths ran often
    support = p > 0
    assert np.isin(emitted, np.flatnonzero(support)).all()
    pval = _chisquare_pvalue(emitted, p)
    line = f"draft vocab 4/{V} sampling {s}: first-token chi-square p {pval:.3f} (accept rate {n.mean():.2f})"
    assert pval > 1e-3, pval
    if s.top_p == 1.0:
        # power: handing the accept the full-vocabulary q (not the one the drafts were drawn from) is told
        # apart (under top-p 0.9 the head's full q already lies inside these 4 ids: no difference to find)
        bad, _ = _emit_first(dv, m0, logits0, s, jax.random.PRNGKey(5), q_accept=probs(jnp.asarray(head), s))
        bad_p = _chisquare_pvalue(bad, p)
        line += f"; with the wrong q: p {bad_p:.1e}"
        assert bad_p < 1e-6, bad_p
    report(line)


# ---------------------------------------------------------------------------------------- selection, errors
def test_selection_keeps_eos_and_the_most_frequent():
    counts = np.arange(V, dtype=np.int64)  # id V-1 most frequent; EOS (id 5 here) the 6th least
    ids = dvm.select_ids(counts, 4, V, eos_ids=(5,))
    assert ids.tolist() == [5, V - 3, V - 2, V - 1]
    assert dvm.select_ids(counts, V, V, eos_ids=(5,)).tolist() == list(range(V))
    assert dvm.token_counts([np.array([1, 1, 3]), np.array([3, 3])], 5).tolist() == [0, 2, 0, 3, 0]


def test_every_eos_id_is_in_the_draft_vocab(model):
    """EOS ids never seen in the counts are still drafted (a row must be able to stop)."""
    eos = (7, 90)
    m = dataclasses.replace(model, config=dataclasses.replace(model.config, eos_token_ids=eos))
    counts = np.ones(V, np.int64)
    counts[list(eos)] = 0
    ids = np.asarray(qwen_mtp.with_draft_vocab(m, 5, counts=counts).weights.draft_vocab.ids)
    assert ids.tolist() == [0, 1, 2, 7, 90]
    assert set(eos) <= set(np.asarray(dvm.attach(m, [3, 4]).weights.draft_vocab.ids).tolist())


def test_typed_errors(model, tmp_path):
    AE = qwen_mtp.ArgumentError
    c = _counts()
    for size in (0, -1, V + 1, 2.5, True, "8"):
        with pytest.raises(AE, match="draft_vocab|size"):
            qwen_mtp.with_draft_vocab(model, size, counts=c)
    with pytest.raises(AE, match="size"):
        dvm.select_ids(c, 1, V, eos_ids=(0, 1))  # fewer slots than EOS ids
    with pytest.raises(AE, match="counts"):
        qwen_mtp.with_draft_vocab(model, 8, counts=c[:-1])
    with pytest.raises(AE, match="counts"):
        qwen_mtp.with_draft_vocab(model, 8, counts=-c)
    with pytest.raises(AE, match=r"ids.*\[0, 97\)"):
        dvm.attach(model, [3, 97])
    with pytest.raises(AE, match="ids"):
        dvm.attach(model, [-1, 3])
    with pytest.raises(AE, match="corpus_ids"):
        dvm.token_counts(np.array([0, 5, 97]), V)
    with pytest.raises(AE, match=dvm.COUNTS_FILE):  # no counts file beside the tiny checkpoint
        qwen_mtp.with_draft_vocab(model, 8)
    with pytest.raises(AE, match=dvm.COUNTS_FILE):
        qwen_mtp.load(model.path, draft_vocab=8)
    with pytest.raises(AE, match="draft_vocab"):
        qwen_mtp.load(model.path, draft_vocab=0)


def test_load_reads_the_counts_file_and_save_drops_the_draft_vocab(model, tmp_path):
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(model.path, folder)
    np.save(folder / dvm.COUNTS_FILE, _counts())
    loaded = qwen_mtp.load(folder, draft_vocab=20)
    expect = dvm.select_ids(_counts(), 20, V, model.config.eos_token_ids)
    np.testing.assert_array_equal(np.asarray(loaded.weights.draft_vocab.ids), expect)
    # tied: the draft head is the embedding rows of the ids, transposed
    np.testing.assert_array_equal(np.asarray(loaded.weights.draft_vocab.lm_head),
                                  np.asarray(model.weights.embed)[expect].T)
    assert qwen_mtp.with_draft_vocab(loaded, None).weights.draft_vocab is None
    saved = qwen_mtp.load(qwen_mtp.save(loaded, tmp_path / "saved"))
    assert saved.weights.draft_vocab is None


def test_sharding_plan_covers_the_draft_vocab(model):
    from qwen_mtp.parallel import sharding

    small = qwen_mtp.with_draft_vocab(model, 24, counts=_counts())
    specs, _ = sharding.weight_plan(small.weights, small.config, sharding.abstract_mesh(1, 2))
    assert specs.draft_vocab.ids == jax.sharding.PartitionSpec(None)
    assert specs.draft_vocab.lm_head == jax.sharding.PartitionSpec(None, "model")  # split like lm_head
    assert dataclasses.is_dataclass(small.weights.draft_vocab)
