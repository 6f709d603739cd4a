"""Random weights (qwen_mtp/trunk/random_weights.py): every tensor randomised (no tensor constant, none at a norm's
default), the shapes of weight_shapes, the same weights for the same key, QuantArrays where the quantization
policy says, finite logits from a forward on a tiny config, and the training init's rules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen_mtp.errors import ArgumentError
from qwen_mtp.trunk import quant
from qwen_mtp.trunk.config import parse_config
from qwen_mtp.trunk.forward import forward, lm_logits
from qwen_mtp.trunk.random_weights import random_weights
from qwen_mtp.trunk.state import init_state
from qwen_mtp.trunk.weights import weight_shapes

BASE = {"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "vocab_size": 97, "rms_norm_eps": 1e-6,
        "mtp_num_hidden_layers": 1, "max_position_embeddings": 4096, "eos_token_id": 0,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}
CONFIGS = {
    "dense-tied": {**BASE, "model_type": "qwen3_5_text", "intermediate_size": 48, "tie_word_embeddings": True},
    "moe-untied": {**BASE, "model_type": "qwen3_5_moe_text", "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24, "tie_word_embeddings": False},
}
NORMS = ("input_norm", "post_norm", "q_norm", "k_norm", "final_norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden")


def _cfg(name):
    return parse_config(CONFIGS[name], name)


def _leaves(w):
    is_q = lambda x: isinstance(x, quant.QuantArray)
    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(w, is_leaf=is_q)[0]]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_tensor_is_random_with_the_shapes_of_weight_shapes(name):
    cfg = _cfg(name)
    w = random_weights(cfg, 0)
    want = jax.tree.map(lambda s: (s.shape, s.dtype), weight_shapes(cfg, "float32"))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), w) == want
    names = set()
    for path, x in _leaves(w):
        x = np.asarray(x)
        names.add(path.split(".")[-1])
        assert np.all(np.isfinite(x)), path
        assert np.unique(x).size > min(x.size - 1, x.size // 2), path  # no constant tensor, no repeated values
        assert not np.all(x == 0) and not np.all(x == 1), path
        if path.split(".")[-1] in NORMS or path.endswith(".norm"):  # norms off their defaults (0 for 1 + w, 1)
            assert np.abs(x).max() > 0.05 and np.abs(x - 1).max() > 0.05, path
    assert {"A_log", "dt_bias", "conv", "norm", "q_norm", "fc"} <= names
    if cfg.tie_word_embeddings:
        assert w.lm_head is None
    assert random_weights(cfg, 0, mtp=False).mtp is None


def test_the_same_key_gives_the_same_weights_and_another_key_others():
    cfg = _cfg("dense-tied")
    a, b = random_weights(cfg, 3), random_weights(cfg, jax.random.PRNGKey(3))
    c = random_weights(cfg, 4)
    for (path, x), (_, y), (_, z) in zip(_leaves(a), _leaves(b), _leaves(c)):
        assert np.array_equal(np.asarray(x), np.asarray(y)), path
        assert not np.array_equal(np.asarray(x), np.asarray(z)), path
    bf = random_weights(cfg, 3, "bfloat16")
    assert all(x.dtype == jnp.bfloat16 for _, x in _leaves(bf))
    np.testing.assert_array_equal(np.asarray(bf.embed), np.asarray(a.embed.astype(jnp.bfloat16)))


def test_passthrough_leans_the_head_on_the_trunk_hidden():
    cfg = _cfg("dense-tied")
    H = cfg.hidden_size
    a, b = random_weights(cfg, 1), random_weights(cfg, 1, passthrough=3.0)
    diff = np.asarray(b.mtp.fc) - np.asarray(a.mtp.fc)
    np.testing.assert_allclose(diff[H:], 3.0 * np.eye(H), atol=1e-6)
    assert np.all(diff[:H] == 0)


@pytest.mark.parametrize("policy", ["int4", quant.QuantPolicy("int8", lm_head=True, mtp=False),
                                    quant.QuantPolicy("fp8", lm_head=True)], ids=["int4", "int8-lm", "fp8-lm"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_quant_gives_quant_arrays_where_the_policy_says(name, policy):
    cfg = _cfg(name)
    pol = quant.QuantPolicy(policy) if isinstance(policy, str) else policy
    w = random_weights(cfg, 2, quant=policy)
    plain = random_weights(cfg, 2)
    want = quant.abstract(weight_shapes(cfg, "float32"), pol, tied=cfg.tie_word_embeddings)
    is_q = lambda x: isinstance(x, quant.QuantArray)
    kinds = jax.tree.map(lambda x: x.kind if is_q(x) else "plain", want, is_leaf=is_q)
    assert jax.tree.map(lambda x: x.kind if is_q(x) else "plain", w, is_leaf=is_q) == kinds
    assert (w.lm_head is not None) == (pol.lm_head or not cfg.tie_word_embeddings)
    got = dict(_leaves(w))
    for path, x in _leaves(plain):
        if is_q(got[path]):  # quantized from the drawn values, as load(quant=...) quantizes a checkpoint's
            ref = quant.quantize(np.asarray(x), pol.method, pol.group_size)
            assert np.array_equal(np.asarray(got[path].q), np.asarray(ref.q)), path
        else:
            assert np.array_equal(np.asarray(got[path]), np.asarray(x)), path
    if pol.lm_head and cfg.tie_word_embeddings:
        ref = quant.quantize(np.asarray(plain.embed).T, pol.method, pol.group_size)
        assert np.array_equal(np.asarray(w.lm_head.q), np.asarray(ref.q))
    assert pol.mtp == is_q(w.mtp.fc)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_forward_gives_finite_spread_logits(name):
    cfg = _cfg(name)
    w = random_weights(cfg, 5)
    B, T = 2, 12
    ids = jax.random.randint(jax.random.PRNGKey(0), (B, T), 1, cfg.vocab_size)
    hidden, _ = forward(w, cfg, ids, init_state(cfg, B, T, jnp.float32), jnp.zeros((B,), jnp.int32),
                        jnp.full((B,), T, jnp.int32))
    logits = np.asarray(lm_logits(w, hidden))
    assert logits.shape == (B, T, cfg.vocab_size) and np.all(np.isfinite(logits))
    assert 0.1 < logits.std() < 100  # activations kept sane: neither vanishing nor exploding


def test_the_training_init_rules():
    cfg = _cfg("dense-tied")
    w = random_weights(cfg, 0, init="training")
    assert all(np.all(np.asarray(n) == 0) for n in (w.final_norm, w.layers[0].input_norm, w.mtp.norm))
    gdn = w.layers[0].mixer
    assert np.all(np.asarray(gdn.norm) == 1)
    A = np.exp(np.asarray(gdn.A_log))
    dt = np.log1p(np.exp(np.asarray(gdn.dt_bias)))  # softplus
    assert np.all((A >= 1) & (A <= 16)) and np.all((dt >= 1e-3 * 0.999) & (dt <= 0.1 * 1.001))
    np.testing.assert_allclose(np.asarray(w.embed).std(), 0.02, rtol=0.1)
    out_std = 0.02 / np.sqrt(2 * (cfg.num_layers + 1))
    np.testing.assert_allclose(np.asarray(w.layers[1].mixer.o_proj).std(), out_std, rtol=0.15)
    with pytest.raises(ArgumentError, match="init"):
        random_weights(cfg, 0, init="xavier")


def _same(a, b):
    """Bit for bit: the same leaves, QuantArrays with the same layout, values and scales."""
    la, lb = _leaves(a), _leaves(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        if isinstance(x, quant.QuantArray):
            assert isinstance(y, quant.QuantArray) and (x.kind, x.shape, x.block) == (y.kind, y.shape, y.block), path
            assert x.q.dtype == y.q.dtype and x.q.shape == y.q.shape, path
            assert np.array_equal(np.asarray(x.q).view(np.uint8), np.asarray(y.q).view(np.uint8)), path
            assert np.array_equal(np.asarray(x.scale), np.asarray(y.scale)), path
        else:
            assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)), path


def _matrix(shape, seed=7):
    w = (2 * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)
    w[..., :, 0] = 0  # an all-zero column: scale 1
    return w


@pytest.mark.parametrize("kind", quant.KINDS)
def test_quantize_traced_is_quantize_bit_for_bit(kind):
    """quant.quantize_traced (jax.numpy, traceable) gives quant.quantize's layout and values, eagerly and under a
    jit, including a K the int4 group / fp8 block does not divide (padding) and a partial fp8 column block."""
    from functools import partial

    for shape, group in (((256, 130), 128), ((2, 200, 96), 64)):
        w = _matrix(shape)
        want = quant.quantize(w, kind, group)
        jitted = jax.jit(partial(quant.quantize_traced, kind=kind, group_size=group))
        for got in (quant.quantize_traced(w, kind, group), jitted(w)):
            _same(want, got)


def test_quantize_traced_control_a_plain_division_under_jit_is_not_quantize():
    """Why quantize_traced holds its divisors behind a barrier: the plain `max|w| / 127` under a jit becomes a
    product with 1 / 127 in XLA, which misses numpy's float32 quotient for some columns (the bit-equality above
    would then fail)."""
    w = _matrix((64, 512))
    naive = jax.jit(lambda w: jnp.abs(w).max(axis=0) / 127.0)(w)
    assert not np.array_equal(np.asarray(naive), np.asarray(quant.quantize(w, "int8").scale[0]))


def test_the_device_paths_give_the_host_weights():
    """random_weights traced under one jit, and on_device=True (a program per unit), give the eager host path's
    weights bit for bit (int4 with an "rbg" key, as the benchmarks use; a tied model's quantized lm_head
    included)."""
    cfg, policy = _cfg("dense-tied"), quant.QuantPolicy("int4", lm_head=True)
    key = jax.random.key(4, impl="rbg")
    make = lambda k, **kw: random_weights(cfg, k, "bfloat16", quant=policy, passthrough=3.0, **kw)
    host = make(key)
    _same(host, jax.jit(make)(key))
    _same(host, make(key, on_device=True))


def test_eager_draws_are_jax_randoms_bit_for_bit():
    """random_weights draws a small tensor eagerly as the head of a flat draw of a power-of-two size (one compiled
    draw program for many shapes): the values are jax.random's for the shape asked, normal and uniform, and a
    tensor over the bucketing limit is drawn as asked. The control: the head of a draw from another key differs."""
    from qwen_mtp.trunk import random_weights as rw

    key = jax.random.PRNGKey(11)
    for shape in [(1,), (3,), (7, 5), (4, 33, 2), (64,), (65,)]:
        np.testing.assert_array_equal(np.asarray(rw._normal(key, shape)),
                                      np.asarray(jax.random.normal(key, shape, jnp.float32)))
        np.testing.assert_array_equal(np.asarray(rw._uniform(key, shape, 0.1, 1.0)),
                                      np.asarray(jax.random.uniform(key, shape, jnp.float32, 0.1, 1.0)))
    big = (rw._BUCKETED_DRAW + 3,)
    np.testing.assert_array_equal(np.asarray(rw._normal(key, big)), np.asarray(jax.random.normal(key, big)))
    assert not np.array_equal(np.asarray(rw._normal(jax.random.PRNGKey(12), (7, 5))),
                              np.asarray(jax.random.normal(key, (7, 5))))
