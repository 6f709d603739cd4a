"""Wind-MTP end to end: the windowed head equals a brute-force masked head, and windowed speculative greedy
output equals plain greedy output token for token while the ring wraps many times."""

import jax.numpy as jnp
import numpy as np
import pytest

import qwen_mtp
from kernels_pallas.masked_attention import attend
from qwen_mtp.decoding.prefill import prefill
from qwen_mtp.head.mtp import init_mtp_cache, mtp_forward
from qwen_mtp.trunk.attention import output, project_qkv
from qwen_mtp.trunk.forward import lm_logits
from qwen_mtp.trunk.mlp import feed_forward
from qwen_mtp.trunk.ops import rmsnorm_1pw
from tests.hf_tiny import rel_err


def _ids(n, seed):
    return np.random.RandomState(seed).randint(0, 97, size=n)


@pytest.fixture(scope="module")
def model(ckpt):
    return qwen_mtp.load(ckpt("dense_mtp")[1])


def _brute_force_mtp_logits(model, ids, W, S, chunk):
    """The head over the whole prompt at once with an explicit numpy mask: row i sees rows j <= i with
    j < S or j > i - W. No ring, no chunks, no slot arithmetic in the head. The trunk's hidden comes from the
    same chunked prefill as mtp_logits uses, so only the head's attention differs between the two."""
    cfg, w = model.config, model.weights
    T = len(ids)
    _, _, hidden = prefill(model, [np.asarray(ids)], 256, prefill_chunk=chunk, keep_hidden=True)
    toks = jnp.asarray(ids[None, 1:])
    hid = hidden[:, :T - 1]
    _, _, st = mtp_forward(w, cfg, toks, hid, init_mtp_cache(cfg, 1, T - 1, jnp.float32), jnp.zeros((1,), jnp.int32),
                           trace=True)
    ah, x = st["ah"], st["fc"]
    rows = np.arange(T - 1)
    q, k, v, gate = project_qkv(ah, w.mtp.layer.mixer, cfg, jnp.asarray(rows[None] + 1))
    i, j = rows[:, None], rows[None, :]
    mask = (j <= i) & ((j < S) | (j > i - W))
    res1 = x + output(attend(q, k, v, jnp.asarray(mask[None])), gate, w.mtp.layer.mixer)
    res2 = res1 + feed_forward(rmsnorm_1pw(res1, w.mtp.layer.post_norm, cfg.rms_norm_eps), w.mtp.layer.mlp, cfg)
    return np.asarray(lm_logits(w, rmsnorm_1pw(res2, w.mtp.norm, cfg.rms_norm_eps)))[0]


@pytest.mark.parametrize("W,S,chunk", [(4, 0, 16), (6, 2, 16), (16, 3, 64), (1, 1, 16)])
def test_windowed_head_equals_brute_force(model, W, S, chunk, report):
    ids = _ids(90, 7)
    got = qwen_mtp.mtp_logits(model, ids, window=W, sinks=S, prefill_chunk=chunk)
    ref = _brute_force_mtp_logits(model, ids, W, S, chunk)
    native = qwen_mtp.mtp_logits(model, ids)
    err = rel_err(got, ref)[0]
    late_err = rel_err(got[W + S + 1:], native[W + S + 1:])[0]
    assert err < 1e-5, err
    # the window does something: rows past sinks + window differ from the native head
    assert late_err > 1e-3
    assert rel_err(got[:W], native[:W])[0] < 1e-4  # rows < W see everything anyway
    report(f"Wind-MTP head W={W} S={S} chunk={chunk}: vs brute-force mask max_rel={err:.2e}; "
           f"vs native (late rows) {late_err:.2e}")


def test_window_wider_than_context_is_native(model):
    ids = _ids(50, 8)
    assert rel_err(qwen_mtp.mtp_logits(model, ids, window=64, sinks=4), qwen_mtp.mtp_logits(model, ids))[0] < 1e-4


@pytest.fixture(scope="module")
def plain(model):
    return {"long": qwen_mtp.generate(model, [_ids(150, 2)], 48, eos_token_id=[]),
            "batch": qwen_mtp.generate(model, [_ids(5, 3), _ids(90, 4), _ids(31, 5)], 48, eos_token_id=[])}


@pytest.mark.parametrize("k", [1, 3, 6])
def test_windowed_greedy_equals_plain_greedy(model, plain, k, report):
    spec = qwen_mtp.SpecConfig(k=k, window=8, sinks=2)  # a ring of 10 + k slots against ~200 positions
    res = qwen_mtp.generate(model, [_ids(150, 2)], 48, eos_token_id=[], spec=spec)
    np.testing.assert_array_equal(res.tokens, plain["long"].tokens)
    st = res.stats
    assert st.accept_hist[1:].sum() > 0 and st.accept_hist[:k].sum() > 0  # accepted and rejected drafts
    report(f"Wind-MTP lossless k={k} W=8 S=2 (ring {10 + k} slots, 198 positions): equal; "
           f"H[n]={st.accept_hist.tolist()} AL={st.acceptance_length:.2f}")


def test_windowed_batch_no_sinks(model, plain):
    spec = qwen_mtp.SpecConfig(k=3, window=5)
    res = qwen_mtp.generate(model, [_ids(5, 3), _ids(90, 4), _ids(31, 5)], 48, eos_token_id=[], spec=spec)
    np.testing.assert_array_equal(res.tokens, plain["batch"].tokens)


@pytest.mark.parametrize("kw,field", [(dict(window=0), "SpecConfig.window"), (dict(window=2.5), "SpecConfig.window"),
                                      (dict(window=8, sinks=-1), "SpecConfig.sinks"),
                                      (dict(sinks=4), "SpecConfig.sinks")])
def test_bad_window_arguments(kw, field):
    with pytest.raises(qwen_mtp.ArgumentError, match=field):
        qwen_mtp.SpecConfig(k=2, **kw)
