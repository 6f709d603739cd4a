"""The low-precision weight products and the embedding gather as XLA compiles them for a CPU (qwen_mtp/trunk/ops.py:
contract, embed_rows; model._tied_logits): same values as the plain einsum / gather, and, in the decode loops
generate runs, no program that casts or re-lays-out the whole embedding table.

At the Qwen3.5-0.8B shape (bf16) those table-sized ops cost more than a decode step: a bf16 gather became a cast
of the 248320 x 1024 table to f32 hoisted out of the loop (430 ms), and the 4-row verify's lm_head got a
transposed copy of the table (343 ms); benchmarks/bench_0p8b.py measures the loop.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qwen_mtp.head.mtp as mtp_mod
import qwen_mtp.trunk.forward as model_mod
from qwen_mtp.decoding.plain import plain_decode_few_rows, plain_start
from qwen_mtp.decoding.sampling import Sampling
from qwen_mtp.decoding.speculative import SpecConfig, spec_decode_few_rows
from qwen_mtp.tools.lowering import spec_decode_args
from qwen_mtp.trunk.config import load_config
from qwen_mtp.trunk.forward import lm_logits
from qwen_mtp.trunk.ops import contract, embed_rows, linear
from qwen_mtp.trunk.state import init_state
from qwen_mtp.trunk.weights import Weights, weight_shapes

HIGHEST = jax.lax.Precision.HIGHEST
SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "qwen3_5_small"


def _rand(key, shape, dtype, scale=1.0):
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("lead", [(1,), (1, 1), (3,), (2, 4)], ids=["1", "1x1", "3", "2x4"])
def test_contract_and_linear_match_the_einsum(dtype, lead):
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x, w = _rand(kx, lead + (64,), dtype), _rand(kw, (64, 48), dtype, 0.1)
    want = jnp.einsum("...i,io->...o", x.astype(jnp.float32), w.astype(jnp.float32), precision=HIGHEST)
    got = jax.jit(lambda x, w: contract("...i,io->...o", x, w))(x, w)
    assert got.shape == want.shape and got.dtype == jnp.float32
    tol = 1e-5 if dtype == jnp.float32 else 1e-4  # f32 accumulation of exact low-precision products
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)
    # linear rounds once to x's dtype: the plain einsum's value to within one rounding of that dtype
    lin = jax.jit(linear)(x, w)
    ref = jnp.einsum("...i,io->...o", x, w, precision=HIGHEST if dtype == jnp.float32 else None)
    assert lin.dtype == dtype and lin.shape == ref.shape
    ulp = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(np.asarray(lin, np.float32), np.asarray(ref, np.float32),
                               rtol=2 * ulp, atol=2 * ulp * float(jnp.abs(want).max()))
    # the weight-first form: w [V, H] as the left operand, x's rows last in the output
    e = _rand(kw, (48, 64), dtype, 0.1)
    x2 = x.reshape(-1, 64)
    got = jax.jit(lambda x, e: contract("vh,mh->vm", x, e, weight_first=True))(x2, e)
    want = jnp.einsum("vh,mh->vm", e.astype(jnp.float32), x2.astype(jnp.float32), precision=HIGHEST)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_embed_rows_is_the_gather(dtype):
    table = _rand(jax.random.PRNGKey(1), (300, 16), dtype)
    tokens = jnp.asarray([[0, 299, 7], [7, 150, 1]], jnp.int32)
    got = jax.jit(embed_rows)(table, tokens)
    assert got.dtype == dtype and got.shape == (2, 3, 16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(table[tokens], np.float32))
    assert np.abs(np.asarray(got, np.float32)).min() > 0  # real rows read, not a zero fill


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("lead", [(1,), (1, 1), (4,), (2, 3)], ids=["1", "1x1", "4", "2x3"])
def test_tied_logits_match_the_einsum(dtype, lead):
    kh, ke = jax.random.split(jax.random.PRNGKey(2))
    hidden, embed = _rand(kh, lead + (32,), dtype), _rand(ke, (200, 32), dtype, 0.1)
    w = Weights(embed=embed, layers=(), final_norm=None, lm_head=None, mtp=None)
    got = jax.jit(lm_logits)(w, hidden)
    want = jnp.einsum("...h,vh->...v", hidden.astype(jnp.float32), embed.astype(jnp.float32), precision=HIGHEST)
    assert got.shape == lead + (200,) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def _argmax_cases():
    r = np.random.default_rng(3)
    x = r.standard_normal((6, 4099)).astype(np.float32)
    x[1, [5, 900, 4000]] = 9.0  # ties: the first wins
    x[2, 17], x[2, 3000] = np.nan, np.nan  # NaN: the first NaN
    x[3] = -np.inf  # all -inf: index 0
    x[4, 4098] = np.inf
    x[5] = 0.0
    x[5, 7] = -0.0  # -0 == 0: index 0 still
    return x


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_argmax_is_jnp_argmax(dtype):
    """sampling.argmax (a max, then the first index holding it) against jnp.argmax on ties, NaNs, infinities and
    random rows; and draw (its Gumbel argmax) against jax.random.categorical, draw for draw."""
    from qwen_mtp.decoding.sampling import argmax, draw

    x = jnp.asarray(_argmax_cases()).astype(dtype)
    got = np.asarray(jax.jit(argmax)(x))
    want = np.asarray(jnp.argmax(x, axis=-1))
    np.testing.assert_array_equal(got, want)
    assert list(got[:5]) != [0] * 5 and got[1] == 5 and got[2] == 17 and got[4] == 4098  # the probe is live
    p = jax.nn.softmax(jnp.asarray(_argmax_cases()[:1].repeat(64, 0)) * 2, axis=-1)
    p = jnp.where(p < 1e-4, 0.0, p)  # zeros: log p = -inf is never drawn
    key = jax.random.PRNGKey(9)
    d = np.asarray(jax.jit(draw)(key, p))
    np.testing.assert_array_equal(d, np.asarray(jax.random.categorical(key, jnp.log(p), axis=-1)))
    assert len(set(d.tolist())) > 1 and np.all(np.asarray(p)[np.arange(64), d] > 0)


# --------------------------------------------------------------------- the compiled decode loop holds the table
def table_sized_ops(hlo: str, shapes) -> list:
    """Instructions of an optimized HLO module, outside fusion bodies, whose result shape is one of `shapes`
    (e.g. "f32[4096,256]"; or a predicate on that text) and which produce new data: parameters, tuple elements
    and bitcasts (no data) are left out. A fusion's body computes only what its consumer reads, so a
    table-shaped op there is fine."""
    wanted = shapes if callable(shapes) else shapes.__contains__
    fused = set(re.findall(r"calls=%([\w.\-]+)", hlo))
    found, current = [], None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(", line)
        if head:
            current = head.group(1)
            continue
        if current is None or current in fused:
            continue
        m = re.match(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+\[[\d,]*\])\{[^}]*\} (\S+?)\(", line)
        if m and wanted(m.group(2)) and m.group(3) not in ("parameter", "get-tuple-element", "bitcast", "tuple"):
            found.append(f"{current}: %{m.group(1)} = {m.group(2)} {m.group(3)}")
    return found


def _spec_loop_hlo(cfg, batch):
    spec = SpecConfig(k=3)
    args = spec_decode_args(cfg, jnp.bfloat16, spec, batch=batch, cache_len=128, cap=32)
    lowered = spec_decode_few_rows.lower(args[0], cfg, *args[1:], spec=spec, sampling=Sampling())
    return lowered.compile().as_text()


def _plain_loop_hlo(cfg, batch, dtype=jnp.bfloat16):
    SDS, i32 = jax.ShapeDtypeStruct, jnp.int32
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    carry = jax.eval_shape(lambda *a: plain_start(*a, cap=32, keep_logits=False), SDS((batch,), i32),
                           SDS((batch, cfg.vocab_size), jnp.float32), SDS((batch,), i32), key, SDS((1,), i32),
                           SDS((), i32))
    state = jax.eval_shape(lambda: init_state(cfg, batch, 128, dtype, None))
    lowered = plain_decode_few_rows.lower(weight_shapes(cfg, dtype), cfg, state, carry, SDS((1,), i32),
                                          SDS((), i32), SDS((), i32), SDS((), i32), keep_logits=False,
                                          sampling=Sampling())
    return lowered.compile().as_text()


def test_bf16_decode_loops_keep_the_embedding_in_place(monkeypatch):
    cfg = load_config(SHIPPED)
    V, H = cfg.vocab_size, cfg.hidden_size
    table = {f"f32[{V},{H}]", f"f32[{H},{V}]", f"bf16[{H},{V}]", f"bf16[{V},{H}]"}
    assert table_sized_ops(_spec_loop_hlo(cfg, 1), table) == []
    assert table_sized_ops(_plain_loop_hlo(cfg, 1), table) == []
    # the detector sees the copies the loop had before: the plain gather and the plain tied product (batch 2,
    # a program of its own: the patched functions are traced anew)
    monkeypatch.setattr(model_mod, "embed_rows", lambda e, t: e[t])
    monkeypatch.setattr(mtp_mod, "embed_rows", lambda e, t: e[t])
    monkeypatch.setattr(model_mod, "_tied_logits",
                        lambda h, e: jnp.einsum("...h,vh->...v", h, e, preferred_element_type=jnp.float32))
    found = table_sized_ops(_spec_loop_hlo(cfg, 2), table)
    assert any(f" f32[{V},{H}] " in s for s in found), found


def _kv_cache_ops(text, cfg, batch):
    """(copies, widened): the instructions outside fusion bodies that copy a KV cache whole ([batch, 128, nkv, hd]
    in any dtype), and the updates of a whole cache in f32 anywhere, fusion bodies included."""
    dims = f"{batch},128,{cfg.num_kv_heads},{cfg.head_dim}"
    copies = [op for op in table_sized_ops(text, lambda shape: shape.endswith(f"[{dims}]")) if op.endswith(" copy")]
    return copies, re.findall(rf"%[\w.\-]+ = f32\[{dims}\]\S* dynamic-update-slice\(", text)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_decode_loop_updates_the_kv_caches_in_place(dtype, monkeypatch):
    """The compiled plain decode loop neither copies a KV cache nor (bf16) updates one in f32: the attention reads
    the cache before the step's row is written, and the row is written in place (attention.attention_layer,
    write_rows_per_row; ops.LOOP_COMPILER_OPTIONS). The probe sees the updates: in f32, one per cache. Controls:
    written first and read back (what prefill chunks and GPUs do), f32 gets whole-cache copies; written as bf16
    values rather than as bits, bf16 is updated in f32."""
    import qwen_mtp.trunk.attention as attention_mod

    cfg = load_config(SHIPPED)
    n_caches = 2 * cfg.layer_types.count("full_attention")
    copies, in_f32 = _kv_cache_ops(_plain_loop_hlo(cfg, 1, dtype), cfg, 1)
    assert copies == [], copies
    assert len(in_f32) == (n_caches if dtype == jnp.float32 else 0), in_f32
    if dtype == jnp.float32:
        monkeypatch.setattr(attention_mod, "BLOCK_DIAGONAL_ROWS", 0)  # every call writes first
        copies, _ = _kv_cache_ops(_plain_loop_hlo(cfg, 2, dtype), cfg, 2)
        assert len(copies) >= n_caches, copies
    else:
        values = attention_mod.write_rows_per_row
        monkeypatch.setattr(attention_mod, "write_rows_per_row", lambda c, u, p, as_bits: values(c, u, p))
        _, in_f32 = _kv_cache_ops(_plain_loop_hlo(cfg, 2, dtype), cfg, 2)
        assert len(in_f32) >= n_caches, in_f32  # batch 2: one update per row
