"""The Pallas windowed draft-attention kernel (interpret mode on CPU) against its pure-JAX reference.

Shapes: window larger and smaller than the context, the ring wrapped many times, S = 0, GQA ratios 1 / 2 / 6 / 16,
query length 1 and k + 1, more query rows than one row tile (G 16 x k+1 9 = 144), the ring streamed by one
program or split over several (flash-decoding parts, some of which see no visible key), f32 and bf16. The ring
holds arbitrary stale values (as in real use): only the mask may keep them out.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.windowed_attention import (
    plan,
    unsupported_reason,
    windowed_attend,
    windowed_attend_pallas,
    windowed_attend_reference,
)
from tests.hf_tiny import rel_err

pytest.register_assert_rewrite("kernel_contract")  # its asserts explain their failures as a test file's do
from kernel_contract import KernelContract  # noqa: E402  (tests/ is on sys.path, as for conftest.py)

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


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of the kernel: a CASES entry, its inputs' seed, the launch (None: the automatic plan), q's dtype
    (the ring's too unless fp8_ring: float8_e4m3fn ring and new rows)."""
    case: tuple
    seed: int
    block_k: int | None = None
    splits: int | None = None
    dtype: object = jnp.float32
    fp8_ring: bool = False


def _fp8(x):
    return (3 * x).astype(jnp.float8_e4m3fn)  # values up to ~12: fp8's normal range, rounded


class TestWindowedContract(KernelContract):
    """The kernel contract (tests/kernel_contract.py) for the windowed draft attention: every CASES shape under
    every PLANS launch in f32; GQA 6 with 4 queries over a wrapped ring in bf16 (2 ring parts), and with an fp8
    ring under f32 and bf16 queries (3 parts: test_fp8_ring_plan checks the automatic plan of an fp8 ring)."""

    CUSTOM_CALL = "windowed_draft_attention"
    F32_TOL = (1e-5, 1e-6)  # (max_rel, max_abs)

    def f32_cases(self):
        return [Run(c, seed=len(c[8]) + c[1], block_k=b, splits=s) for c in CASES for b, s in PLANS]

    def low_precision_cases(self):
        return [Run(CASES[2], seed=5, block_k=8, splits=2, dtype=jnp.bfloat16),
                Run(CASES[2], seed=11, block_k=8, splits=3, fp8_ring=True),
                Run(CASES[2], seed=11, block_k=8, splits=3, dtype=jnp.bfloat16, fp8_ring=True)]

    def case_id(self, run):
        B, T, nkv, G, hd, sinks, window = run.case[:7]
        ring = "-fp8ring" if run.fp8_ring else ""
        return (f"B{B}T{T}kv{nkv}G{G}hd{hd}S{sinks}W{window}-{run.block_k}-{run.splits}-"
                f"{jnp.dtype(run.dtype).name}{ring}")

    def inputs(self, run):
        q, rk, rv, nk, nv, start = _inputs(*run.case, seed=run.seed)
        if run.fp8_ring:
            return q.astype(run.dtype), _fp8(rk), _fp8(rv), _fp8(nk), _fp8(nv), start
        return (*(x.astype(run.dtype) for x in (q, rk, rv, nk, nv)), start)

    def kernel(self, run, *args):
        return windowed_attend_pallas(*args, run.case[6], run.case[5], block_k=run.block_k, num_splits=run.splits,
                                      interpret=True)

    def reference(self, run, *args):
        return windowed_attend_reference(*args, run.case[6], run.case[5])

    def dispatching(self, run, *args, **kw):
        return windowed_attend(*args, run.case[6], run.case[5], **kw)

    def reason(self, run, q, rk, rv, nk, nv, start):
        return unsupported_reason(q, rk, nk, run.case[5])

    def error(self, got, want):
        return rel_err(got.astype(jnp.float32), want.astype(jnp.float32))

    def tolerance(self, run):
        # bf16 outputs: a few units of bf16 rounding (2^-8); f32 queries over an fp8 ring: f32's
        return self.F32_TOL if run.dtype == jnp.float32 else (2e-2,)

    def check_more(self, run, args, got, ref, report):
        B, T, nkv, G, hd, sinks, window, k, starts = run.case
        q, rk, rv, nk, nv, start = args
        err = self.error(got, ref)
        if run.fp8_ring:
            # the reference over the fp8 values upcast beforehand is the same computation: the ring's dtype
            # changes nothing but the stored values
            up = lambda x: x.astype(run.dtype)
            np.testing.assert_array_equal(np.asarray(ref.astype(jnp.float32)), np.asarray(
                windowed_attend_reference(q, up(rk), up(rv), up(nk), up(nv), start, window, sinks).astype(
                    jnp.float32)))
            report(f"windowed kernel, fp8 ring, q {jnp.dtype(run.dtype).name} {run.case[:7]} block_k={run.block_k} "
                   f"parts={run.splits}: max_rel={err[0]:.1e}")
        elif run.dtype == jnp.float32:
            if run.splits is not None:  # the plan really cuts the ring into that many parts
                assert plan(B, T, nkv * G, nkv, hd, rk.shape[1], 4, run.block_k, run.splits).splits == min(
                    run.splits, -(-rk.shape[1] // run.block_k))
            assert float(jnp.abs(ref).min(axis=-1).max()) > 0  # every query row read real values
            report(f"windowed kernel {run.case[:7]} starts={starts} block_k={run.block_k} parts={run.splits}: "
                   f"max_rel={err[0]:.1e}")

    def unsupported_case(self):
        return Run((1, 3, 1, 1, 24, 0, 4, 2, [10]), seed=0), "head_dim 24"

    def more_unsupported_reasons(self):
        q8, r8, n8 = jnp.zeros((1, 2, 4, 8)), jnp.zeros((1, 10, 2, 8)), jnp.zeros((1, 2, 2, 8))
        q16, r16, n16 = jnp.zeros((1, 2, 4, 16)), jnp.zeros((1, 10, 2, 16)), jnp.zeros((1, 2, 2, 16))
        return [(unsupported_reason(q8, r8, n8, 0), "head_dim 8"),  # Triton dots need dimensions >= 16
                (unsupported_reason(q16, r16.astype(jnp.bfloat16), n16, 0), "dtypes"),
                (unsupported_reason(q16, r16, n16, 10), "no room"),
                (unsupported_reason(q16, r16, n16[:, :1], 0), "rows for")]

    def lowering_case(self):
        return Run(CASES[1], seed=1)

    def auto(self, run):
        return lambda *args: windowed_attend(*args, run.case[6], run.case[5])

    def custom_call(self, run):
        return self.CUSTOM_CALL


def test_row_tiles_and_parts_in_the_plan():
    p = plan(1, 9, 16, 1, 256, 4 + 24 + 8)
    assert (p.row_tile, p.row_tiles) == (64, 3)  # 144 rows at head_dim 256: 3 tiles of 64
    assert plan(1, 1, 24, 4, 256, 64 + 4032 + 7).splits > 1  # a batch-1 draft step splits its 4100-slot ring
    p = plan(8, 9, 32, 2, 256, 128 + 8192 + 8)
    assert p.splits * p.blocks_per_split * p.block_k >= 128 + 8192 + 8  # the parts cover the ring


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


def test_fp8_ring_plan():
    """An fp8 ring under bf16 queries takes 16-slot blocks at head_dim 256 when the row tile is large (the
    loaded and the upcast block share the registers; sm_90 compiles then spill nothing), f32 queries one
    pipeline stage; a ring in q's dtype keeps the plan it had."""
    assert plan(1, 9, 24, 4, 256, 64 + 4032 + 8, 2, kv_itemsize=1).block_k == 16
    assert plan(1, 9, 24, 4, 256, 64 + 4032 + 8, 2).block_k == 32
    assert plan(1, 1, 24, 4, 256, 64 + 4032 + 1, 2, kv_itemsize=1).block_k == 64  # a draft step: row tile 16
    assert plan(1, 1, 24, 4, 256, 64 + 4032 + 1, 4, kv_itemsize=1).num_stages == 1
    assert plan(1, 1, 24, 4, 256, 64 + 4032 + 1, 4).num_stages == 2
