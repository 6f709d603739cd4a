"""The dense masked attention (kernels_pallas/masked_attention.py), both of its forms, against attention written
out in float64 numpy head by head: the block-diagonal form that decode and verify calls take
(T <= BLOCK_DIAGONAL_ROWS) and the batched form of longer calls; GQA groups from 1 to 4 query heads per kv head,
ragged masks, bf16. And the reason for the block-diagonal form: its compiled CPU program reads the cache in
place, where the batched one copies it whole first."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas.masked_attention as ma
from tests.test_cpu_fast_paths import table_sized_ops


def _numpy_attention(q, k, v, key_ok):
    """float64, one (row, query, head) at a time: query head h reads kv head h // G."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    key_ok = np.asarray(key_ok)
    B, T, nh, hd = q.shape
    G = nh // k.shape[2]
    out = np.zeros_like(q)
    for b in range(B):
        for t in range(T):
            seen = np.flatnonzero(key_ok[b, t])
            for h in range(nh):
                s = k[b, seen, h // G] @ q[b, t, h] / np.sqrt(hd)
                p = np.exp(s - s.max())
                out[b, t, h] = (p / p.sum()) @ v[b, seen, h // G]
    return out


def _case(seed, B, T, S, nkv, G, hd, dtype=jnp.float32):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.standard_normal((B, T, nkv * G, hd)) * 1.5, dtype)
    k = jnp.asarray(r.standard_normal((B, S, nkv, hd)), dtype)
    v = jnp.asarray(r.standard_normal((B, S, nkv, hd)), dtype)
    # ragged: row b's query t sees slots <= start_b + t, the first row exactly one slot at t = 0
    starts = np.array([0] + list(r.integers(1, S - T, size=B - 1)))
    key_ok = np.arange(S)[None, None, :] <= (starts[:, None] + np.arange(T)[None])[:, :, None]
    return q, k, v, jnp.asarray(key_ok)


CASES = [  # (B, T, S, nkv, G, hd): T <= BLOCK_DIAGONAL_ROWS takes the block-diagonal form
    (1, 1, 40, 2, 2, 16),
    (3, 1, 70, 1, 4, 8),   # one kv head: the block-diagonal matrix is the queries themselves
    (2, 4, 50, 4, 1, 16),  # no grouping: every query head its own kv head
    (2, 9, 64, 4, 3, 8),   # the most rows the form takes (a verify at k = 8)
    (2, 12, 64, 2, 3, 8),  # past BLOCK_DIAGONAL_ROWS: the batched form
]


@pytest.mark.parametrize("B,T,S,nkv,G,hd", CASES)
def test_attend_matches_float64_head_by_head(B, T, S, nkv, G, hd):
    q, k, v, key_ok = _case(B * 10 + T, B, T, S, nkv, G, hd)
    want = _numpy_attention(q, k, v, key_ok)
    got = np.asarray(jax.jit(ma.attend)(q, k, v, key_ok), np.float64)
    few = jax.jit(lambda q, k, v, ok: ma._attend_block_diagonal(q, ((k, v, ok),)))
    assert T > ma.BLOCK_DIAGONAL_ROWS or np.array_equal(got, np.asarray(few(q, k, v, key_ok)))
    abs_err = float(np.max(np.abs(got - want)))
    rel_err = float(np.max(np.abs(got - want) / (np.abs(want) + 1e-6)))
    assert rel_err < 1e-4 or abs_err < 1e-5, (abs_err, rel_err)
    assert float(np.std(want)) > 0.1  # real values
    if nkv > 1:  # the comparison tells kv heads apart: the same queries over the heads swapped differ
        swapped = _numpy_attention(q, k[:, :, ::-1], v[:, :, ::-1], key_ok)
        assert float(np.max(np.abs(swapped - want))) > 0.1


@pytest.mark.parametrize("B,T,S,nkv,G,hd", CASES[:4])
def test_attend_with_new_rows_apart_is_attend_over_both(B, T, S, nkv, G, hd):
    """attend_with_new(cache, new rows) is attend over the cache and the new rows concatenated along the slots
    (float64 numpy head by head), with the two masks each doing their part: the new rows' causal one, the cache's
    ragged one."""
    q, k, v, key_ok = _case(B * 7 + T, B, T, S, nkv, G, hd)
    r = np.random.default_rng(T)
    k_new = jnp.asarray(r.standard_normal((B, T, nkv, hd)) * 2, jnp.float32)
    v_new = jnp.asarray(r.standard_normal((B, T, nkv, hd)) * 2, jnp.float32)
    new_ok = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    want = _numpy_attention(q, jnp.concatenate([k, k_new], 1), jnp.concatenate([v, v_new], 1),
                            jnp.concatenate([key_ok, new_ok], -1))
    got = np.asarray(jax.jit(ma.attend_with_new)(q, k, v, key_ok, k_new, v_new, new_ok), np.float64)
    abs_err = float(np.max(np.abs(got - want)))
    rel_err = float(np.max(np.abs(got - want) / (np.abs(want) + 1e-6)))
    assert rel_err < 1e-4 or abs_err < 1e-5, (abs_err, rel_err)
    # the new rows count: without them (the cache alone) the answer differs
    assert float(np.max(np.abs(_numpy_attention(q, k, v, key_ok) - want))) > 0.1
    too_many = jnp.zeros((B, ma.BLOCK_DIAGONAL_ROWS + 1, nkv * G, hd))
    with pytest.raises(ValueError, match="at most 9 query rows, found 10"):
        ma.attend_with_new(too_many, k, v, key_ok, k_new, v_new, new_ok)


@pytest.mark.parametrize("T", [1, 4])
def test_block_diagonal_equals_batched_form_in_bf16(T, monkeypatch):
    q, k, v, key_ok = _case(7, 3, T, 300, 2, 4, 32, jnp.bfloat16)
    want = _numpy_attention(q, k, v, key_ok)
    few = np.asarray(ma._attend_block_diagonal(q, ((k, v, key_ok),)), np.float64)
    monkeypatch.setattr(ma, "BLOCK_DIAGONAL_ROWS", 0)  # the batched form, forced (eager: no jit cache)
    batched = np.asarray(ma.attend(q, k, v, key_ok), np.float64)
    # both within bf16 rounding of the exact value, and of each other
    assert float(np.max(np.abs(few - want))) < 2e-2
    assert float(np.max(np.abs(batched - want))) < 2e-2
    assert float(np.max(np.abs(few - batched))) < 2e-2


def _cache_copies(T):
    """Instructions of attend's compiled CPU program (bf16, 8192 slots, 2 kv heads), outside fusion bodies, that
    write an array holding the whole cache (8192 x 2 x 64 elements, in any order or dtype) other than as a
    bitcast of it (test_cpu_fast_paths.table_sized_ops)."""
    B, S, nh, nkv, hd = 1, 8192, 4, 2, 64
    q = jax.ShapeDtypeStruct((B, T, nh, hd), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, S, nkv, hd), jnp.bfloat16)
    ok = jax.ShapeDtypeStruct((B, T, S), jnp.bool_)
    text = jax.jit(ma.attend).lower(q, kv, kv, ok).compile().as_text()

    def cache_sized(shape):  # "bf16[1,8192,2,64]"
        dims = [int(d) for d in shape[shape.index("[") + 1:-1].split(",") if d]
        return bool(dims) and int(np.prod(dims)) == S * nkv * hd

    return table_sized_ops(text, cache_sized)


def test_decode_reads_the_cache_in_place(monkeypatch):
    assert _cache_copies(1) == [] and _cache_copies(ma.BLOCK_DIAGONAL_ROWS) == []
    # negative control: the batched form (what T > BLOCK_DIAGONAL_ROWS takes) copies k and v whole on every call
    monkeypatch.setattr(ma, "BLOCK_DIAGONAL_ROWS", 0)
    jax.clear_caches()
    try:
        assert len(_cache_copies(1)) >= 2, _cache_copies(1)
    finally:
        jax.clear_caches()
