"""The blocked causal attention (kernels_pallas/causal_attention.py) against the dense masked form it replaces:
block boundaries, ragged batches, chunks that do not divide the cache, positions past one block, GQA groups,
bf16 and an fp8 cache; it never reads a block wholly in the future; its scratch memory does not grow with the
cache; and the shipped model's greedy output, plain and speculative (native and windowed), is the same as with
the dense form at a context many blocks long."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas.causal_attention as ca
from kernels_pallas.masked_attention import attend

pytest.register_assert_rewrite("kernel_contract")  # its asserts explain their failures as a test file's do
from kernel_contract import KernelContract  # noqa: E402  (tests/ is on sys.path, as for conftest.py)


def _dense(q, k, v, q_pos):
    S = k.shape[1]
    key_ok = jnp.arange(S)[None, None, :] <= q_pos[:, :, None]
    return attend(q, k.astype(q.dtype), v.astype(q.dtype), key_ok)


def _case(seed, B, T, S, nkv, G, hd, starts, dtype=jnp.float32, kv_dtype=None):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.standard_normal((B, T, nkv * G, hd)) * 1.5, dtype)
    k = jnp.asarray(r.standard_normal((B, S, nkv, hd)), dtype)
    v = jnp.asarray(r.standard_normal((B, S, nkv, hd)), dtype)
    if kv_dtype is not None:
        k, v = k.astype(kv_dtype), v.astype(kv_dtype)
    q_pos = jnp.asarray(np.asarray(starts)[:, None] + np.arange(T)[None], jnp.int32)
    return q, k, v, q_pos


def _err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b))), float(np.max(np.abs(a - b) / (np.abs(b) + 1e-6)))


CASES = [  # (B, T, S, nkv, G, hd, starts, block, split)
    (1, 1, 64, 2, 2, 16, [40], 8, 1),         # decode, one block per part
    (2, 1, 100, 1, 4, 16, [7, 8], 8, 3),      # decode at a block boundary (slot 7 / 8), S not a multiple
    (3, 4, 100, 2, 1, 8, [15, 16, 95], 8, 2),  # verify rows across boundaries, ragged, up to the last slot
    (2, 37, 96, 2, 2, 16, [0, 50], 16, 1),    # a prefill chunk that does not divide S, ragged
    (1, 37, 200, 1, 3, 16, [161], 16, 1),     # the tail part overlaps the one before it
    (2, 5, 300, 2, 2, 32, [0, 290], 32, 4),   # the batch's rows far apart: one walks past what the other sees
]


@pytest.mark.parametrize("B,T,S,nkv,G,hd,starts,block,split", CASES)
def test_blocked_equals_dense_f32(B, T, S, nkv, G, hd, starts, block, split):
    q, k, v, q_pos = _case(1, B, T, S, nkv, G, hd, starts)
    with jax.default_matmul_precision("highest"):
        want = _dense(q, k, v, q_pos)
        got = ca.causal_attend_reference(q, k, v, q_pos, block=block, split=split)
    abs_err, rel_err = _err(got, want)
    assert rel_err < 1e-4 or abs_err < 1e-5, (abs_err, rel_err)
    assert float(jnp.std(want)) > 0.1  # real values


@pytest.mark.parametrize("dtype,kv_dtype,tol", [(jnp.bfloat16, None, 2e-2), (jnp.float32, jnp.float8_e4m3fn, 1e-5)])
def test_blocked_equals_dense_bf16_and_fp8_cache(dtype, kv_dtype, tol):
    q, k, v, q_pos = _case(2, 2, 9, 260, 2, 2, 16, [100, 251], dtype, kv_dtype)
    want = _dense(q, k, v, q_pos)
    got = ca.causal_attend_reference(q, k, v, q_pos, block=32, split=2)
    assert got.dtype == q.dtype
    abs_err, _ = _err(got, want)
    assert abs_err < tol * 4, abs_err


@pytest.mark.parametrize("dtype,kv_dtype,B,T,starts", [
    (jnp.float32, None, 3, 1, [0, 9, 63]),          # decode: a row at slot 0 (sees its own row only), the last slot
    (jnp.float32, None, 2, 4, [5, 60]),             # a verify: 4 rows, ragged
    (jnp.bfloat16, None, 2, 9, [0, 31]),            # the most rows the CPU path takes
    (jnp.float32, jnp.float8_e4m3fn, 2, 3, [2, 40]),  # an fp8 cache: the new rows held apart in fp8
])
def test_read_before_write_equals_write_then_read(dtype, kv_dtype, B, T, starts):
    """causal_attend_before_write over the cache as it was, then the write, gives what the write followed by
    the dense causal form gives: the same output (up to f32 sums) and the same cache. The slots at and past each
    row's position hold random values (stale rows, as after a rejected draft) that would change the output if
    either form let a query see them."""
    from qwen_mtp.trunk.attention import write_kv
    from qwen_mtp.trunk.state import KVCache, to_cache
    S, nkv, G, hd = 64 + T, 2, 2, 16
    q, k, v, q_pos = _case(3, B, T, S, nkv, G, hd, starts, dtype, kv_dtype)
    r = np.random.default_rng(4)
    k_new = to_cache(jnp.asarray(r.standard_normal((B, T, nkv, hd)) * 2, dtype), k.dtype)
    v_new = to_cache(jnp.asarray(r.standard_normal((B, T, nkv, hd)) * 2, dtype), v.dtype)
    pos = q_pos[:, 0]
    with jax.default_matmul_precision("highest"):
        written = jax.jit(write_kv)(KVCache(k, v), k_new, v_new, pos)
        want = _dense(q, written.k, written.v, q_pos)
        got = jax.jit(ca.causal_attend_before_write)(q, k, v, k_new, v_new, q_pos)
        # control: a query that also saw the stale slot at its row's position (the old cache's) differs
        stale = ca.causal_attend_before_write(q, k, v, k_new, v_new, q_pos + 1)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)))) < tol
    assert float(np.max(np.abs(np.asarray(stale, np.float64) - np.asarray(want, np.float64)))) > 10 * tol
    assert float(jnp.std(want.astype(jnp.float32))) > 0.1
    # the write itself: the CPU's per-row update (as bits or not) and the GPU's scatter write the same cache
    from qwen_mtp.trunk.attention import write_rows_per_row, write_rows_scatter
    for as_bits in (False, True):
        for a, b in ((k, k_new), (v, v_new)):
            per_row = jax.jit(lambda c, u, p: write_rows_per_row(c, u, p, as_bits=as_bits))(a, b, pos)
            same = np.asarray(per_row).view(np.uint8) == np.asarray(jax.jit(write_rows_scatter)(a, b, pos)).view(
                np.uint8)
            assert same.all()
    assert not np.array_equal(np.asarray(written.k, np.float32), np.asarray(k, np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn])
def test_per_row_write_equals_the_scatter_at_every_batch(dtype):
    """write_rows_per_row writes the cache the GPU's scatter writes, byte for byte, as values or as bits, both
    unrolled (B <= UNROLL_ROWS) and as a loop over the rows (more rows: unrolled, the speculative sampling
    tests' 2000-row batch made XLA's CPU compiler crash), a row clamped at the cache's end included."""
    from qwen_mtp.trunk import attention
    from qwen_mtp.trunk.state import to_cache
    S, T, nkv, hd = 16, 3, 2, 4
    for B in (1, attention.UNROLL_ROWS, attention.UNROLL_ROWS + 1, 20):
        r = np.random.default_rng(B)
        cache = to_cache(jnp.asarray(r.standard_normal((B, S, nkv, hd)), jnp.float32), dtype)
        new = to_cache(jnp.asarray(r.standard_normal((B, T, nkv, hd)) + 3, jnp.float32), dtype)
        pos = jnp.asarray(r.integers(0, S - T + 1, B).tolist()[:-1] + [S - 1], jnp.int32)  # the last is clamped
        want = np.asarray(jax.jit(attention.write_rows_scatter)(cache, new, pos)).view(np.uint8)
        assert not np.array_equal(want, np.asarray(cache).view(np.uint8))
        for as_bits in (False, True):
            got = jax.jit(lambda c, u, p: attention.write_rows_per_row(c, u, p, as_bits=as_bits))(cache, new, pos)
            assert got.dtype == cache.dtype and np.array_equal(np.asarray(got).view(np.uint8), want), (B, as_bits)


def test_future_blocks_are_never_read():
    """NaN in every block wholly after the furthest query: the blocked form is finite and exact; the dense form,
    which reads them (0 x NaN), is not."""
    q, k, v, q_pos = _case(3, 2, 6, 256, 1, 2, 16, [10, 40])
    block = 16
    first_unseen = (int(q_pos.max()) // block + 1) * block
    k = k.at[:, first_unseen:].set(jnp.nan)
    v = v.at[:, first_unseen:].set(jnp.nan)
    got = ca.causal_attend_reference(q, k, v, q_pos, block=block, split=1)
    assert bool(jnp.all(jnp.isfinite(got)))
    assert not bool(jnp.all(jnp.isfinite(_dense(q, k, v, q_pos))))  # the probe: the NaNs are really there
    clean_k, clean_v = k.at[:, first_unseen:].set(0.0), v.at[:, first_unseen:].set(0.0)
    with jax.default_matmul_precision("highest"):
        abs_err, rel_err = _err(got, _dense(q, clean_k, clean_v, q_pos))
    assert rel_err < 1e-4 or abs_err < 1e-5


def test_scratch_memory_does_not_grow_with_the_cache():
    """A 256-row chunk against 8K and 64K slots: the compiled program's temporaries stay the size of one part
    (the dense form's grow with the cache)."""
    def temp(fn, S):
        q = jax.ShapeDtypeStruct((1, 256, 8, 64), jnp.float32)
        kv = jax.ShapeDtypeStruct((1, S, 2, 64), jnp.float32)
        pos = jax.ShapeDtypeStruct((1, 256), jnp.int32)
        return jax.jit(fn).lower(q, kv, kv, pos).compile().memory_analysis().temp_size_in_bytes

    small, big = temp(ca.causal_attend_reference, 8192), temp(ca.causal_attend_reference, 65536)
    dense_small, dense_big = temp(_dense, 8192), temp(_dense, 65536)
    assert big <= 1.1 * small + 2 ** 20, (small, big)
    assert dense_big > 4 * dense_small  # the probe: the dense form's scores grow with S
    assert big < dense_big / 8, (big, dense_big)


def test_short_caches_keep_the_dense_program():
    q, k, v, q_pos = _case(4, 1, 3, 64, 1, 2, 16, [20])
    got = ca.causal_attend_reference(q, k, v, q_pos)  # 64 slots <= one part: the dense form itself
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_dense(q, k, v, q_pos)))


# ------------------------------------------------------------------------------------------ the shipped model
@pytest.fixture(scope="module")
def long_prompt():
    from checkpoints.corpus import held_out_ids
    from qwen_mtp.loading.folder import default_model_path, load_tokenizer

    path = default_model_path()
    ids = held_out_ids(load_tokenizer(path))
    return path, [ids[1000:1000 + 2600], ids[20000:20000 + 1900]]


def test_greedy_output_is_unchanged_at_a_long_context(long_prompt, monkeypatch, report):
    """Prompts of 2600 and 1900 held-out tokens (many blocks of 512 and parts of 4096 slots at smaller block
    sizes below): plain greedy, speculative native and Wind-MTP give the same tokens as the dense form's plain
    greedy (greedy speculation is lossless, so one dense run is the reference for all three)."""
    import qwen_mtp

    path, rows = long_prompt
    model = qwen_mtp.load(path)
    specs = [None, qwen_mtp.SpecConfig(k=3), qwen_mtp.SpecConfig(k=3, window=64, sinks=4)]

    def run(specs):
        return [np.asarray(qwen_mtp.generate(model, rows, 40, spec=s).tokens) for s in specs]

    # blocks small enough that prefill chunks and every decode step walk several of them
    monkeypatch.setattr(ca, "PREFILL_BLOCK", 128)
    monkeypatch.setattr(ca, "DECODE_BLOCK", 256)
    monkeypatch.setattr(ca, "DENSE_FEW_QUERY_BYTES", 0)  # decode and verify blocked too
    jax.clear_caches()
    blocked = run(specs)
    monkeypatch.setattr(ca, "PREFILL_BLOCK", 1 << 20)  # one part holds the cache: the dense form
    monkeypatch.setattr(ca, "DECODE_BLOCK", 1 << 20)
    jax.clear_caches()
    (dense,) = run([None])
    monkeypatch.undo()
    jax.clear_caches()
    for name, a in zip(("plain", "native k3", "W64 k3"), blocked):
        np.testing.assert_array_equal(a, dense, err_msg=name)
    assert len(set(dense[0].tolist())) > 5  # real text, not one repeated id
    report(f"long context (2600 / 1900 tokens, blocks 128 / 256): plain, native and W64 identical to dense plain")


# ----------------------------------------------------------------------- the Pallas kernel (interpret mode)
KERNEL_CASES = [  # (B, T, S, nkv, G, hd, starts, block_k, splits)
    (1, 1, 64, 2, 2, 16, [40], 16, 1),
    (2, 5, 100, 2, 2, 16, [7, 90], 16, 2),  # ragged verify rows, S not a multiple of the block, two parts
    (2, 37, 96, 2, 2, 16, [0, 50], 16, 1),  # a prefill chunk: several row tiles
    (1, 3, 300, 1, 4, 32, [290], 32, 3),    # the last part runs past the cache (masked loads)
]
# (q dtype, cache dtype, tolerance): bf16, bf16 over an fp8 cache, f32 over an fp8 cache
LOW_PRECISION = [(jnp.bfloat16, None, 2e-2), (jnp.bfloat16, jnp.float8_e4m3fn, 2e-2),
                 (jnp.float32, jnp.float8_e4m3fn, 1e-5)]


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of the kernel: _case's shape (B, T, S, nkv, G, hd, starts) and seed, the launch, the dtypes and
    (low precision) the tolerance of the test it came from."""
    shape: tuple
    seed: int
    block_k: int | None = None
    splits: int | None = None
    dtype: object = jnp.float32
    kv_dtype: object = None
    tol: float | None = None


class TestCausalContract(KernelContract):
    """The kernel contract (tests/kernel_contract.py) for the causal attention kernel: KERNEL_CASES in f32, one
    ragged verify in bf16 and over an fp8 cache; each case also against the dense masked form (check_more)."""

    F32_TOL = (1e-5, 1e-4)  # (max_abs, max_rel)

    def f32_cases(self):
        return [Run(tuple(c[:7]), seed=5, block_k=c[7], splits=c[8]) for c in KERNEL_CASES]

    def low_precision_cases(self):
        return [Run((2, 4, 130, 2, 2, 16, [3, 120]), seed=6, block_k=16, splits=2, dtype=d, kv_dtype=kv, tol=tol)
                for d, kv, tol in LOW_PRECISION]

    def case_id(self, run):
        B, T, S, nkv, G, hd, starts = run.shape
        kv = f"-{jnp.dtype(run.kv_dtype).name}cache" if run.kv_dtype is not None else ""
        return f"B{B}T{T}S{S}kv{nkv}G{G}hd{hd}-{run.block_k}-{run.splits}-{jnp.dtype(run.dtype).name}{kv}"

    def inputs(self, run):
        return _case(run.seed, *run.shape, run.dtype, run.kv_dtype)

    def kernel(self, run, *args):
        return ca.causal_attend_pallas(*args, block_k=run.block_k, num_splits=run.splits, interpret=True)

    def reference(self, run, *args):
        return ca.causal_attend_reference(*args)

    def dispatching(self, run, *args, **kw):
        return ca.causal_attend(*args, **kw)

    def reason(self, run, q, k, v, q_pos):
        return ca.unsupported_reason(q, k, q_pos)

    def error(self, got, want):
        return _err(got, want)

    def tolerance(self, run):
        return (run.tol * 4,)  # max_abs

    def check_more(self, run, args, got, ref, report):
        """The dense masked form the blocked forms replace: the kernel matches it as it matches the reference."""
        if run.tol is None:
            with jax.default_matmul_precision("highest"):
                want = _dense(*args)
            abs_err, rel_err = _err(got, want)
            assert rel_err < 1e-4 or abs_err < 1e-5, (abs_err, rel_err)
        else:
            assert _err(got, _dense(*args))[0] < run.tol * 4

    FALLBACK_EXACT = False

    def unsupported_case(self):
        return Run((1, 2, 40, 1, 2, 24, [30]), seed=8), "head_dim 24"

    def lowering_case(self):
        return self.f32_cases()[1]

    def auto(self, run):
        return lambda *args: ca.causal_attend(*args)

    def custom_call(self, run):
        return "causal_attention"


def test_kernel_never_reads_future_blocks():
    q, k, v, q_pos = _case(7, 1, 2, 256, 1, 2, 16, [20])
    k = k.at[:, 48:].set(jnp.nan)  # wholly after slot 21, in blocks of 16
    v = v.at[:, 48:].set(jnp.nan)
    got = ca.causal_attend_pallas(q, k, v, q_pos, block_k=16, num_splits=1, interpret=True)
    assert bool(jnp.all(jnp.isfinite(got)))


def test_gradients_are_the_dense_forms():
    """Training differentiates the trunk through causal_attend: its gradient is the dense form's (the kernel and
    the blocked loop are never differentiated)."""
    q, k, v, q_pos = _case(9, 2, 6, 40, 1, 2, 16, [3, 30])
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, q_pos)))
    with jax.default_matmul_precision("highest"):
        got = jax.grad(loss(ca.causal_attend), argnums=(0, 1, 2))(q, k, v)
        want = jax.grad(loss(_dense), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(want[1]).max()) > 1e-3
