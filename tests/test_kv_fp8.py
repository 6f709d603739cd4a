"""The fp8 KV cache (generate(..., kv_dtype="float8_e4m3fn")): the trunk's and the MTP head's caches are stored in
float8_e4m3fn, speculative decoding stays lossless against plain decoding with the same fp8 cache (native head
and a Wind-MTP ring that wraps many times), fp8 perturbs the logits by a small stated amount against an f32 cache,
and the fp8 ring's kernel lowers for cuda.

Why the lossless proof has two parts: greedy tokens are a coarse witness. On the tiny checkpoint an fp8 cache
and an f32 cache pick the same tokens, so token equality alone could not see a verify path that reads its own
new rows unrounded (a perturbation far smaller than fp8 against f32). The property the tokens rest on is
checked directly and tightly: the verify forward of k+1 rows, run as spec_decode runs it, reproduces the
logits the fp8 plain decode chose its tokens from (to f32 reassociation: 4e-6 relative measured, bound 2e-5);
with the rounding of the new rows skipped in the verify path (the trunk's attention layer patched), the same
check fails by 3e-4 (required: > 1e-4).
"""

import importlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qwen_mtp
from kernels_pallas.masked_attention import attend
from kernels_pallas.windowed_attention import unsupported_reason, windowed_attend
from qwen_mtp.decoding.memory import kv_cache_bytes
from qwen_mtp.decoding.prefill import prefill
from qwen_mtp.head.mtp import init_mtp_cache, mtp_forward
from qwen_mtp.tools.lowering import export_for, kernel_calls, triton_kernels
from qwen_mtp.trunk import attention
from qwen_mtp.trunk.forward import forward, lm_logits
from qwen_mtp.trunk.state import FP8_KV, GDNState, KVCache, init_state, to_cache
from tests.hf_tiny import rel_err

gen = importlib.import_module("qwen_mtp.decoding.generate")  # the package's `generate` is the function
F8 = "float8_e4m3fn"
PROMPT = np.random.RandomState(2).randint(0, 97, size=40)
NEW = 24
K = 3
WINDOWED = qwen_mtp.SpecConfig(k=K, window=8, sinks=2)  # a ring of 2 + 8 + 3 slots against 64 positions


@pytest.fixture(scope="module")
def model(ckpt):
    return qwen_mtp.load(ckpt("dense_mtp")[1])


@pytest.fixture(scope="module")
def seen(model):
    """The caches generate hands its decode loops, recorded by wrapping them (the jitted programs are the same)."""
    got = {}
    wrap = lambda name, fn: lambda *a, **kw: (got.setdefault(name, []).append(a[2:4]), fn(*a, **kw))[1]
    mp = pytest.MonkeyPatch()
    # patched where generate's driver (_run) looks them up: plain.py's and speculative.py's own names are not read
    for name in ("plain_decode", "plain_decode_few_rows"):  # (weights, cfg, state, carry, ...)
        mp.setattr(gen, name, wrap("plain", getattr(gen, name)))
    for name in ("spec_decode", "spec_decode_few_rows"):  # (weights, cfg, state, mcache, ...)
        mp.setattr(gen, name, wrap("spec", getattr(gen, name)))
    yield got
    mp.undo()


@pytest.fixture(scope="module")
def plain(model, seen):
    return qwen_mtp.generate(model, [PROMPT], NEW, eos_token_id=[], return_logits=True, kv_dtype=F8)


def _kv_dtypes(state):
    return {str(x.dtype) for s in (state if isinstance(state, tuple) else (state,)) if isinstance(s, KVCache)
            for x in (s.k, s.v)}


@pytest.mark.parametrize("spec", [qwen_mtp.SpecConfig(k=K), WINDOWED], ids=["native", "windowed"])
def test_fp8_speculative_greedy_equals_fp8_plain_greedy(model, plain, seen, spec, report):
    res = qwen_mtp.generate(model, [PROMPT], NEW, eos_token_id=[], spec=spec, kv_dtype=F8)
    np.testing.assert_array_equal(res.tokens, plain.tokens)
    hist = res.stats.accept_hist
    assert hist[1:].sum() > 0 and hist[:K].sum() > 0  # drafts were both accepted and rejected
    if spec.window is not None:  # the ring wrapped: more head rows than ring slots
        assert len(PROMPT) + NEW > 2 * (spec.sinks + spec.window + spec.k)
    # generate really decoded over fp8 caches: the trunk's KV and the head's (its ring with a window)
    state, mcache = seen["spec"][-1]
    assert _kv_dtypes(state) == _kv_dtypes(mcache) == {F8}
    slots = mcache.k.shape[1]
    assert slots == spec.sinks + spec.window + spec.k if spec.window else slots >= len(PROMPT) + NEW
    report(f"fp8 KV lossless {'windowed W=8 S=2' if spec.window else 'native'} k={K}: equal to fp8 plain; "
           f"H[n]={hist.tolist()}")


def test_fp8_caches_are_fp8_and_gdn_state_is_not(model, plain, seen):
    (state, _), = seen["plain"]
    assert _kv_dtypes(state) == {F8}
    gdn = [s for s in state if isinstance(s, GDNState)]
    assert gdn and all(s.conv.dtype == jnp.float32 and s.rec.dtype == jnp.float32 for s in gdn)
    # bytes: fp8 is a quarter of f32, trunk and head alike
    f32, fp8 = (kv_cache_bytes(model, 4096, kv_dtype=kv, spec=WINDOWED) for kv in (None, F8))
    assert fp8["trunk"] * 4 == f32["trunk"] and fp8["mtp"] * 4 == f32["mtp"] > 0


def test_fp8_plain_logits_close_to_f32(model, plain, report):
    """Sanity bound of fp8 against an f32 cache: the fp8 plain decode's logits against f32-cache logits of the
    same tokens, teacher-forced (prefill_logits over prompt + generated tokens)."""
    ids = np.concatenate([PROMPT, plain.tokens[0, :-1]])
    ref = qwen_mtp.prefill_logits(model, ids)[len(PROMPT) - 1:]  # the logits each new token was chosen from
    rel, abs_ = rel_err(plain.logits[0], ref)
    assert 1e-4 < rel < 3e-2, (rel, abs_)  # fp8 changes something, and not much
    top1 = float(np.mean(np.argmax(ref, axis=-1) == plain.tokens[0]))
    report(f"fp8 KV vs f32 KV plain decode ({NEW} steps, same tokens): logits max_rel={rel:.2e} "
           f"(max_abs={abs_:.2e}); the f32 cache picks the same token at {top1:.0%} of the steps")


def _unrounded_attention_layer(x, w, cfg, cache, pos, rope_offset: int = 0, two=None, out_parts=False):
    """attention.attention_layer with one bug: the call's own new rows are read in the compute dtype instead of
    as the cache holds them (the cache itself is still written rounded)."""
    T = x.shape[1]
    positions = pos[:, None] + jnp.arange(T, dtype=pos.dtype)[None]
    q, k, v, gate = attention.project_qkv(x, w, cfg, positions + rope_offset, two)
    cache = attention.write_kv(cache, k, v, pos)
    view = attention.write_kv(KVCache(cache.k.astype(q.dtype), cache.v.astype(q.dtype)), k, v, pos)
    key_ok = jnp.arange(cache.k.shape[1], dtype=pos.dtype)[None, None, :] <= positions[:, :, None]
    return attention.output(attend(q, view.k, view.v, key_ok), gate, w, out_parts), cache


@pytest.fixture(scope="module")
def prefilled(model, plain):
    """The trunk state after the prompt with an fp8 cache: generate's own prefill (same program, compiled)."""
    return prefill(model, [PROMPT], 128, kv_dtype=FP8_KV)[0]


def _verify_vs_steps(model, plain, state):
    """One verify forward (as spec_decode runs it) over the first k+1 tokens plain decode emitted, against the
    logits plain decode chose the next tokens from: k+1 sequential steps. Traced afresh on each call (a new
    jit), so a patched attention layer is seen."""
    cfg, w = model.config, model.weights
    toks = jnp.asarray(plain.tokens[:, :K + 1], jnp.int32)
    pos = jnp.asarray([len(PROMPT)], jnp.int32)
    verify = jax.jit(lambda st: lm_logits(w, forward(w, cfg, toks, st, pos, jnp.asarray([K + 1]),
                                                      gdn_mode="verify")[0]))
    return rel_err(verify(state), plain.logits[:, 1:K + 2])[0]


VERIFY_BOUND = 2e-5  # f32 reassociation between a (k+1)-row forward and the plain loop's steps: 4e-6 measured


def test_fp8_verify_forward_equals_sequential_steps(model, plain, prefilled, report):
    err = _verify_vs_steps(model, plain, prefilled)
    assert err < VERIFY_BOUND, err
    report(f"fp8 KV verify forward (k+1={K + 1} rows) vs {K + 1} plain steps: logits max_rel={err:.1e}")


def test_negative_control_unrounded_new_rows_break_verify(model, plain, prefilled, monkeypatch, report):
    """The check above can fail: skip the rounding of the new rows in the verify path only (the trunk's
    attention layer patched for this one trace) and the verify no longer equals the plain steps."""
    monkeypatch.setattr(importlib.import_module("qwen_mtp.trunk.forward"), "attention_layer", _unrounded_attention_layer)
    err = _verify_vs_steps(model, plain, prefilled)
    assert err > 5 * VERIFY_BOUND, err  # 3e-4 measured
    report(f"fp8 KV negative control (new rows read unrounded): verify vs steps max_rel={err:.1e}")


def test_fp8_ring_refill_equals_single_rows(model):
    """The draft head over an fp8 Wind-MTP ring (the path that rounds its new rows itself, draft_ring.py): k+1
    rows in one call (the refill) equal k+1 one-row calls (drafting), on a ring that has wrapped (row 26 of a
    1 + 4 + k slot ring, holding arbitrary fp8 values)."""
    cfg, w = model.config, model.weights
    rng = np.random.default_rng(0)
    hid = jnp.asarray(rng.standard_normal((1, 4, cfg.hidden_size)), jnp.float32)
    toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 4)), jnp.int32)
    ring = init_mtp_cache(cfg, 1, 64, FP8_KV, window=4, sinks=1, k=K)
    assert ring.k.dtype == ring.v.dtype == FP8_KV and ring.k.shape[1] == 1 + 4 + K
    fill = lambda: to_cache(jnp.asarray(rng.standard_normal(ring.k.shape), jnp.float32), FP8_KV)
    ring = KVCache(fill(), fill())

    @jax.jit
    def both(cache):
        run = lambda t, h, c, s: mtp_forward(w, cfg, t, h, c, s[None], window=4, sinks=1)[:2]
        many, _ = run(toks, hid, cache, jnp.int32(26))

        def one(cache, i):
            out, cache = run(toks[:, i, None], hid[:, i, None], cache, 26 + i)
            return cache, out[:, 0]

        _, ones = jax.lax.scan(one, cache, jnp.arange(4))
        return many, jnp.moveaxis(ones, 0, 1)

    err = rel_err(*both(ring))[0]
    assert err < VERIFY_BOUND, err


def test_to_cache_saturates_instead_of_nan():
    x = jnp.asarray([-1e6, -500.0, -448.0, 0.3, 460.0, 1e6], jnp.float32)
    got = np.asarray(to_cache(x, FP8_KV).astype(jnp.float32))
    np.testing.assert_array_equal(got, [-448, -448, -448, np.float32(jnp.asarray(0.3, FP8_KV)), 448, 448])
    assert np.isnan(np.asarray(x.astype(FP8_KV).astype(jnp.float32))[-1])  # what the clip prevents
    assert to_cache(x, jnp.float32) is x


@pytest.mark.parametrize("bad", ["fp8", "float16", "float8_e5m2", jnp.float16, 8, True])
def test_bad_kv_dtype(model, bad):
    for call in (lambda: qwen_mtp.generate(model, [1, 2, 3], 2, kv_dtype=bad),
                 lambda: qwen_mtp.prefill_logits(model, [1, 2, 3], kv_dtype=bad),
                 lambda: qwen_mtp.mtp_logits(model, [1, 2, 3], kv_dtype=bad),
                 lambda: kv_cache_bytes(model, 16, kv_dtype=bad)):
        with pytest.raises(qwen_mtp.ArgumentError, match="kv_dtype"):
            call()


def test_kv_dtype_names_accepted(model):
    f32 = init_state(model.config, 1, 4, jnp.float32)
    for name in (None, "float32", jnp.float32, np.dtype("float32")):
        assert kv_cache_bytes(model, 4, kv_dtype=name)["trunk"] == sum(
            x.nbytes for s in f32 if isinstance(s, KVCache) for x in (s.k, s.v))
    assert kv_cache_bytes(model, 4, kv_dtype="bfloat16")["trunk"] * 2 == kv_cache_bytes(model, 4)["trunk"]


def test_shipped_model_cache_bytes_at_4096(report):
    from pathlib import Path

    shipped = qwen_mtp.load(Path(__file__).resolve().parents[1] / "checkpoints" / "qwen3_5_small", dtype="bfloat16")
    rows = {}
    for label, spec in (("trunk only", None), ("+ native head", qwen_mtp.SpecConfig(k=4)),
                        ("+ Wind-MTP ring W64 S4", qwen_mtp.SpecConfig(k=4, window=64, sinks=4))):
        bf16, fp8 = (kv_cache_bytes(shipped, 4096, kv_dtype=kv, spec=spec)["total"] for kv in (None, F8))
        assert fp8 * 2 == bf16
        rows[label] = (bf16, fp8)
        report(f"shipped model KV caches at 4096 positions, {label}: bf16 {bf16 / 2**20:.3f} MiB, "
               f"fp8 {fp8 / 2**20:.3f} MiB")
    cfg = shipped.config
    attn_layers = cfg.layer_types.count("full_attention")
    assert rows["trunk only"][1] == attn_layers * 2 * 4096 * cfg.num_kv_heads * cfg.head_dim  # 1 byte a value


# ------------------------------------------------------------------------------ the fp8 ring's kernel, for cuda
def test_fp8_ring_kernel_lowers_for_cuda_at_a_real_shape():
    """27B's head (24 q heads, 4 kv heads, head_dim 256), a k=4 refill over a 4032 + 64 window, bf16 queries
    over an fp8 ring: the Pallas kernel (not the fallback) is in the cuda program, it loads fp8 blocks and
    converts them to bf16 in registers, and its dots stay bf16 x bf16 -> f32."""
    SDS, T, L = jax.ShapeDtypeStruct, 5, 64 + 4032 + 4
    q = SDS((1, T, 24, 256), jnp.bfloat16)
    ring, new = SDS((1, L, 4, 256), FP8_KV), SDS((1, T, 4, 256), FP8_KV)
    assert unsupported_reason(q, ring, new, 64) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        exported = export_for(lambda *a: windowed_attend(*a, 4032, 64), q, ring, ring, new, new,
                              SDS((1,), jnp.int32))
    assert kernel_calls(exported) == ["windowed_draft_attention"]
    (kernel,) = triton_kernels(exported)
    lines = kernel.ir.splitlines()
    assert any("tt.load" in x and "f8E4M3FN" in x for x in lines)
    assert any("tt.fp_to_fp" in x and "f8E4M3FN> -> tensor" in x and x.rstrip().endswith("xbf16>") for x in lines)
    dots = [x for x in lines if "tt.dot" in x]
    assert len(dots) == 4 and all(x.split(":")[-1].split("->")[0].count("xbf16>") == 2 for x in dots), dots
    # the ring in another dtype than q and than fp8, or new rows not rounded to the ring's dtype: reference
    assert "dtypes" in unsupported_reason(SDS((1, T, 24, 256), jnp.float32), SDS((1, L, 4, 256), jnp.bfloat16),
                                          SDS((1, T, 4, 256), jnp.bfloat16), 64)
    assert "dtypes" in unsupported_reason(q, ring, SDS((1, T, 4, 256), jnp.bfloat16), 64)

