"""The Pallas windowed draft-attention kernel (interpret mode on CPU) against its pure-JAX reference.

Shapes: window larger and smaller than the context, the ring wrapped many times, S = 0, GQA ratios 1 / 2 / 6,
query length 1 and k + 1, f32. The ring holds arbitrary stale values (as in real use): only the mask may keep
them out.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.windowed_attention import (unsupported_reason, windowed_attend, windowed_attend_pallas,
                                               windowed_attend_reference)
from tests.hf_tiny import rel_err

# (B, T, nkv, G, hd, sinks, window, k, start per row)
CASES = [
    (1, 1, 2, 1, 16, 0, 4, 1, [3]),             # context shorter than the window
    (2, 1, 1, 2, 32, 2, 8, 3, [500, 7]),        # ring wrapped ~40 times; a row still inside its window
    (2, 4, 2, 6, 16, 4, 16, 3, [1000, 19]),     # k + 1 = 4 queries, GQA 6
    (1, 7, 1, 1, 64, 0, 5, 6, [77]),            # S = 0, k + 1 = 7, window < query span
    (3, 3, 2, 2, 16, 1, 70, 2, [0, 64, 300]),   # ring bigger than one block, start 0
    (1, 2, 3, 2, 8, 3, 2, 1, [9]),              # window 2
]


def _inputs(B, T, nkv, G, hd, sinks, window, k, starts, seed):
    rng = np.random.default_rng(seed)
    L = sinks + window + k
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    return (f(B, T, nkv * G, hd), f(B, L, nkv, hd), f(B, L, nkv, hd), f(B, T, nkv, hd), f(B, T, nkv, hd),
            jnp.asarray(starts, jnp.int32))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}T{c[1]}kv{c[2]}G{c[3]}hd{c[4]}S{c[5]}W{c[6]}")
@pytest.mark.parametrize("block_k", [8, 64])
def test_kernel_matches_reference(case, block_k, report):
    B, T, nkv, G, hd, sinks, window, k, starts = case
    q, rk, rv, nk, nv, start = _inputs(*case, seed=len(starts) + T)
    assert unsupported_reason(q, rk, nk, sinks) is None
    got = windowed_attend_pallas(q, rk, rv, nk, nv, start, window, sinks, block_k=block_k, interpret=True)
    ref = windowed_attend_reference(q, rk, rv, nk, nv, start, window, sinks)
    err = rel_err(got, ref)
    assert err[0] < 1e-5 or err[1] < 1e-6, err
    assert float(jnp.abs(ref).min(axis=-1).max()) > 0  # every query row read real values
    report(f"windowed kernel {case[:7]} starts={starts} block_k={block_k}: max_rel={err[0]:.1e}")


def test_kernel_ignores_stale_ring_values():
    """Slots the window excludes may hold anything: changing them must not change the output."""
    case = CASES[2]
    q, rk, rv, nk, nv, start = _inputs(*case, seed=3)
    a = windowed_attend_pallas(q, rk, rv, nk, nv, start, case[6], case[5], block_k=8, interpret=True)
    # row 1 (start 19): all 4 + 16 + 3 slots are in use, but slots holding rows < 19 - 16 + 1 beyond the sinks
    # are hidden; poison every slot with huge values where the reference mask says "hidden" for all queries
    from qwen_mtp.draft_ring import window_mask
    ok = np.asarray(window_mask(start, q.shape[1], case[6], case[5], rk.shape[1] - case[5]))[:, :, :rk.shape[1]]
    hidden = ~ok.any(axis=1)  # [B, L]
    assert hidden.any()
    poison = jnp.where(jnp.asarray(hidden)[:, :, None, None], 1e4, rk)
    b = windowed_attend_pallas(q, poison, jnp.where(jnp.asarray(hidden)[:, :, None, None], 1e4, rv), nk, nv, start,
                               case[6], case[5], block_k=8, interpret=True)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_unsupported_shapes_fall_back_with_reason():
    q, rk, rv, nk, nv, start = _inputs(1, 3, 1, 1, 24, 0, 4, 2, [10], seed=0)  # head_dim 24
    assert "head_dim 24" in unsupported_reason(q, rk, nk, 0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = windowed_attend(q, rk, rv, nk, nv, start, 4, 0, backend="pallas", interpret=True)
    assert any("head_dim 24" in str(x.message) for x in w)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(windowed_attend_reference(q, rk, rv, nk, nv, start, 4, 0)))
    q2 = jnp.zeros((1, 40, 8, 16))
    assert "rows" in unsupported_reason(q2, jnp.zeros((1, 10, 2, 16)), jnp.zeros((1, 40, 2, 16)), 0)


def test_cpu_default_is_reference():
    assert jax.default_backend() == "cpu"
    q, rk, rv, nk, nv, start = _inputs(*CASES[1], seed=1)
    np.testing.assert_array_equal(np.asarray(windowed_attend(q, rk, rv, nk, nv, start, 8, 2)),
                                  np.asarray(windowed_attend_reference(q, rk, rv, nk, nv, start, 8, 2)))
