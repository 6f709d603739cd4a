"""The Pallas windowed draft-attention kernel (interpret mode on CPU) against its pure-JAX reference.

Shapes: window larger and smaller than the context, the ring wrapped many times, S = 0, GQA ratios 1 / 2 / 6 / 16,
query length 1 and k + 1, more query rows than one row tile (G 16 x k+1 9 = 144), the ring streamed by one
program or split over several (flash-decoding parts, some of which see no visible key), f32 and bf16. The ring
holds arbitrary stale values (as in real use): only the mask may keep them out.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import dispatch
from kernels_pallas.windowed_attention import (
    plan,
    unsupported_reason,
    windowed_attend,
    windowed_attend_pallas,
    windowed_attend_reference,
)
from tests.hf_tiny import rel_err

# (B, T, nkv, G, hd, sinks, window, k, start per row)
CASES = [
    (1, 1, 2, 1, 16, 0, 4, 1, [3]),             # context shorter than the window
    (2, 1, 1, 2, 32, 2, 8, 3, [500, 7]),        # ring wrapped ~40 times; a row still inside its window
    (2, 4, 2, 6, 16, 4, 16, 3, [1000, 19]),     # k + 1 = 4 queries, GQA 6
    (1, 7, 1, 1, 64, 0, 5, 6, [77]),            # S = 0, k + 1 = 7, window < query span
    (3, 3, 2, 2, 16, 1, 70, 2, [0, 64, 300]),   # ring bigger than one block, start 0
    (1, 2, 3, 2, 16, 3, 2, 1, [9]),             # window 2
    (1, 9, 1, 16, 256, 4, 24, 8, [100]),        # 144 query rows: three row tiles of 64 at head_dim 256
]
# (block_k, ring parts): one program streaming the whole ring, three parts, and the automatic plan
PLANS = [(8, 1), (8, 3), (None, None)]


def _inputs(B, T, nkv, G, hd, sinks, window, k, starts, seed):
    rng = np.random.default_rng(seed)
    L = sinks + window + k
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    return (f(B, T, nkv * G, hd), f(B, L, nkv, hd), f(B, L, nkv, hd), f(B, T, nkv, hd), f(B, T, nkv, hd),
            jnp.asarray(starts, jnp.int32))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}T{c[1]}kv{c[2]}G{c[3]}hd{c[4]}S{c[5]}W{c[6]}")
@pytest.mark.parametrize("block_k,splits", PLANS, ids=lambda p: str(p))
def test_kernel_matches_reference(case, block_k, splits, report):
    B, T, nkv, G, hd, sinks, window, k, starts = case
    q, rk, rv, nk, nv, start = _inputs(*case, seed=len(starts) + T)
    assert unsupported_reason(q, rk, nk, sinks) is None
    if splits is not None:  # the plan really cuts the ring into that many parts
        assert plan(B, T, nkv * G, nkv, hd, rk.shape[1], 4, block_k, splits).splits == min(splits, -(-rk.shape[1] // block_k))
    got = windowed_attend_pallas(q, rk, rv, nk, nv, start, window, sinks, block_k=block_k, num_splits=splits,
                                 interpret=True)
    ref = windowed_attend_reference(q, rk, rv, nk, nv, start, window, sinks)
    err = rel_err(got, ref)
    assert err[0] < 1e-5 or err[1] < 1e-6, err
    assert float(jnp.abs(ref).min(axis=-1).max()) > 0  # every query row read real values
    report(f"windowed kernel {case[:7]} starts={starts} block_k={block_k} parts={splits}: max_rel={err[0]:.1e}")


def test_row_tiles_and_parts_in_the_plan():
    p = plan(1, 9, 16, 1, 256, 4 + 24 + 8)
    assert (p.row_tile, p.row_tiles) == (64, 3)  # 144 rows at head_dim 256: 3 tiles of 64
    assert plan(1, 1, 24, 4, 256, 64 + 4032 + 7).splits > 1  # a batch-1 draft step splits its 4100-slot ring
    p = plan(8, 9, 32, 2, 256, 128 + 8192 + 8)
    assert p.splits * p.blocks_per_split * p.block_k >= 128 + 8192 + 8  # the parts cover the ring


def test_kernel_bf16_matches_reference():
    case = CASES[2]
    q, rk, rv, nk, nv, start = (x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x
                                for x in _inputs(*case, seed=5))
    got = windowed_attend_pallas(q, rk, rv, nk, nv, start, case[6], case[5], block_k=8, num_splits=2, interpret=True)
    ref = windowed_attend_reference(q, rk, rv, nk, nv, start, case[6], case[5])
    assert got.dtype == jnp.bfloat16
    err = rel_err(got.astype(jnp.float32), ref.astype(jnp.float32))
    assert err[0] < 2e-2, err  # bf16 outputs: a few units of bf16 rounding (2^-8)


def test_kernel_ignores_stale_ring_values():
    """Slots the window excludes may hold anything: changing them must not change the output."""
    case = CASES[2]
    q, rk, rv, nk, nv, start = _inputs(*case, seed=3)
    a = windowed_attend_pallas(q, rk, rv, nk, nv, start, case[6], case[5], block_k=8, num_splits=3, interpret=True)
    # row 1 (start 19): all 4 + 16 + 3 slots are in use, but slots holding rows < 19 - 16 + 1 beyond the sinks
    # are hidden; poison every slot with huge values where the reference mask says "hidden" for all queries
    from kernels_pallas.ring_layout import window_mask
    ok = np.asarray(window_mask(start, q.shape[1], case[6], case[5], rk.shape[1] - case[5]))[:, :, :rk.shape[1]]
    hidden = ~ok.any(axis=1)  # [B, L]
    assert hidden.any()
    poison = jnp.where(jnp.asarray(hidden)[:, :, None, None], 1e4, rk)
    b = windowed_attend_pallas(q, poison, jnp.where(jnp.asarray(hidden)[:, :, None, None], 1e4, rv), nk, nv, start,
                               case[6], case[5], block_k=8, num_splits=3, interpret=True)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_unsupported_shapes_fall_back_with_reason(monkeypatch):
    monkeypatch.setattr(dispatch, "_warned", set())  # the warning is once per process: start afresh
    q, rk, rv, nk, nv, start = _inputs(1, 3, 1, 1, 24, 0, 4, 2, [10], seed=0)  # head_dim 24
    assert "head_dim 24" in unsupported_reason(q, rk, nk, 0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = windowed_attend(q, rk, rv, nk, nv, start, 4, 0, backend="pallas", interpret=True)
    assert any("head_dim 24" in str(x.message) for x in w)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(windowed_attend_reference(q, rk, rv, nk, nv, start, 4, 0)))
    q8, r8, n8 = jnp.zeros((1, 2, 4, 8)), jnp.zeros((1, 10, 2, 8)), jnp.zeros((1, 2, 2, 8))
    assert "head_dim 8" in unsupported_reason(q8, r8, n8, 0)  # Triton dots need dimensions >= 16
    q16, r16, n16 = jnp.zeros((1, 2, 4, 16)), jnp.zeros((1, 10, 2, 16)), jnp.zeros((1, 2, 2, 16))
    assert "dtypes" in unsupported_reason(q16, r16.astype(jnp.bfloat16), n16, 0)
    assert "no room" in unsupported_reason(q16, r16, n16, 10)
    assert "rows for" in unsupported_reason(q16, r16, n16[:, :1], 0)


def test_cpu_default_is_reference():
    assert jax.default_backend() == "cpu"
    q, rk, rv, nk, nv, start = _inputs(*CASES[1], seed=1)
    np.testing.assert_array_equal(np.asarray(windowed_attend(q, rk, rv, nk, nv, start, 8, 2)),
                                  np.asarray(windowed_attend_reference(q, rk, rv, nk, nv, start, 8, 2)))


# (case, q dtype, block_k, ring parts): GQA 6 with 4 queries over a wrapped ring streamed in three parts, under
# f32 and bf16 queries (test_fp8_ring_plan checks the automatic plan of an fp8 ring)
FP8_CASES = [(CASES[2], jnp.float32, 8, 3), (CASES[2], jnp.bfloat16, 8, 3)]


@pytest.mark.parametrize("case,qdtype,block_k,splits", FP8_CASES, ids=["T4G6-wrapped-f32", "T4G6-wrapped-bf16"])
def test_kernel_fp8_ring_matches_reference(case, qdtype, block_k, splits, report):
    """The fp8 KV ring (float8_e4m3fn ring and new rows, q in the compute dtype): the kernel loads fp8 blocks
    and upcasts them in registers, the reference upcasts before its dots; both read the same values."""
    q, rk, rv, nk, nv, start = _inputs(*case, seed=11)
    fp8 = lambda x: (3 * x).astype(jnp.float8_e4m3fn)  # values up to ~12: fp8's normal range, rounded
    q, rk, rv, nk, nv = q.astype(qdtype), fp8(rk), fp8(rv), fp8(nk), fp8(nv)
    assert unsupported_reason(q, rk, nk, case[5]) is None
    got = windowed_attend_pallas(q, rk, rv, nk, nv, start, case[6], case[5], block_k=block_k, num_splits=splits,
                                 interpret=True)
    ref = windowed_attend_reference(q, rk, rv, nk, nv, start, case[6], case[5])
    # the reference over the fp8 values upcast beforehand is the same computation: the ring's dtype changes
    # nothing but the stored values
    up = lambda x: x.astype(qdtype)
    np.testing.assert_array_equal(np.asarray(ref.astype(jnp.float32)), np.asarray(
        windowed_attend_reference(q, up(rk), up(rv), up(nk), up(nv), start, case[6], case[5]).astype(jnp.float32)))
    assert got.dtype == qdtype
    err = rel_err(got.astype(jnp.float32), ref.astype(jnp.float32))
    assert (err[0] < 1e-5 or err[1] < 1e-6) if qdtype == jnp.float32 else err[0] < 2e-2, err
    report(f"windowed kernel, fp8 ring, q {jnp.dtype(qdtype).name} {case[:7]} block_k={block_k} parts={splits}: "
           f"max_rel={err[0]:.1e}")


def test_fp8_ring_plan():
    """An fp8 ring under bf16 queries takes 16-slot blocks at head_dim 256 when the row tile is large (the
    loaded and the upcast block share the registers; sm_90 compiles then spill nothing), f32 queries one
    pipeline stage; a ring in q's dtype keeps the plan it had."""
    assert plan(1, 9, 24, 4, 256, 64 + 4032 + 8, 2, kv_itemsize=1).block_k == 16
    assert plan(1, 9, 24, 4, 256, 64 + 4032 + 8, 2).block_k == 32
    assert plan(1, 1, 24, 4, 256, 64 + 4032 + 1, 2, kv_itemsize=1).block_k == 64  # a draft step: row tile 16
    assert plan(1, 1, 24, 4, 256, 64 + 4032 + 1, 4, kv_itemsize=1).num_stages == 1
    assert plan(1, 1, 24, 4, 256, 64 + 4032 + 1, 4).num_stages == 2
