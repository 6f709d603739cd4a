"""The attention queries' kernel (kernels_pallas/attention_q.py, interpret mode on CPU) against its reference (the
trunk's q | gate split, q_norm and RoPE) and a float64 oracle. Its programs are also the new rows' kernel's,
which the trunk runs (tests/test_kernel_attention_rows.py).

Rows: one decode row and a verify's 4, a batch of 2 and 3; S = 1 (the product itself) and S > 1 float32 K
partials; rotary dims a power of two and not, one the whole head; RoPE positions up to 1M with the MTP head's
offset; f32 and bf16; every tensor random.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import causal_attention as ca
from kernels_pallas.attention_q import (
    queries_grouped,
    queries_grouped_pallas,
    queries_grouped_reference,
    rows_at,
    unsupported_reason,
)
from tests.hf_tiny import rel_err

pytest.register_assert_rewrite("kernel_contract")
from kernel_contract import KernelContract, compiles_for_sm90  # noqa: E402  (tests/ is on sys.path, as for conftest.py)

EPS, THETA = 1e-6, 10_000_000.0


@dataclasses.dataclass(frozen=True)
class Run:
    """One attention call: B rows of T queries, nh query / nkv kv heads of hd (rd rotary), S partials of the
    product, a cache of `slots`, RoPE offset."""
    B: int = 1
    T: int = 1
    nh: int = 4
    nkv: int = 2
    hd: int = 32
    rd: int = 8
    S: int = 1
    slots: int = 64
    offset: int = 0
    seed: int = 0
    dtype: object = jnp.float32
    far: bool = False  # positions up to 1M (a cache of `slots` slots: only the RoPE sees them)


def _product(run):
    """parts [S, B T, nh 2 hd] (f32 partials, or the product in dtype for S = 1), w [hd], start [B]."""
    rng = np.random.default_rng(run.seed)
    shape = (run.S, run.B * run.T, run.nh * 2 * run.hd)
    parts = jnp.asarray(rng.standard_normal(shape) * rng.uniform(0.5, 4) / np.sqrt(run.S), jnp.float32)
    parts = parts if run.S > 1 else parts.astype(run.dtype)
    w = jnp.asarray(0.3 * rng.standard_normal(run.hd), jnp.float32).astype(run.dtype)
    top = (1 << 20) - run.T if run.far else run.slots - run.T
    return parts, w, jnp.asarray(rng.integers(0, top + 1, run.B), jnp.int32)


def _grouped_kw(run, rows):
    return dict(offset=run.offset, num_kv_heads=run.nkv, rows=rows, rotary_dim=run.rd, theta=THETA, eps=EPS,
                dtype=run.dtype)


ROWS = 32  # the attention kernel's rows for every case below (T G <= 32)


class TestAttentionQueriesContract(KernelContract):
    """The kernel contract (tests/kernel_contract.py) for the queries' kernel alone (queries_grouped): the
    queries in the attention kernel's rows against queries_grouped_reference (their positions: the test below).
    attention_rows.py's kernel runs the same programs and writes the keys and values too
    (tests/test_kernel_attention_rows.py)."""

    F32_TOL = (1e-6, 1e-6)  # (max_rel, max_abs): the partials and the squares summed in another order

    def f32_cases(self):
        return [Run(), Run(B=2, T=4, S=3, seed=1, offset=1), Run(B=3, T=1, nh=6, nkv=2, hd=64, rd=16, S=5, seed=2),
                Run(T=4, nh=8, nkv=1, hd=16, rd=16, seed=3), Run(B=2, T=3, hd=32, rd=10, S=2, seed=4, offset=1)]

    def low_precision_cases(self):
        return [Run(dtype=jnp.bfloat16, S=4, seed=5), Run(B=2, T=4, dtype=jnp.bfloat16, seed=6, offset=1)]

    def case_id(self, run):
        return (f"B{run.B}T{run.T}-h{run.nh}/{run.nkv}x{run.hd}-rd{run.rd}-S{run.S}-off{run.offset}-"
                f"{jnp.dtype(run.dtype).name}")

    def inputs(self, run):
        return _product(run)

    def kernel(self, run, *args):
        return queries_grouped_pallas(*args, interpret=True, **_grouped_kw(run, ROWS))[0]

    def reference(self, run, *args):
        return queries_grouped_reference(*args, **_grouped_kw(run, ROWS))[0]

    def dispatching(self, run, *args, **kw):
        return queries_grouped(*args, **_grouped_kw(run, ROWS), **kw)[0]

    def reason(self, run, *args):
        return unsupported_reason(*args)

    def error(self, got, want):
        return rel_err(got.astype(jnp.float32), want.astype(jnp.float32))

    def tolerance(self, run):
        return (2e-2,)  # bf16 rounding of the queries

    def out_dtype(self, run, args):
        return jnp.dtype(run.dtype)

    def check_more(self, run, args, got, ref, report):
        real = run.T * run.nh // run.nkv
        out = np.asarray(got, np.float32)
        assert (np.abs(out[:, :, :real]).max(axis=-1) > 0).all() and not out[:, :, real:].any()
        report(f"attention queries {self.case_id(run)}: max_rel={self.error(got, ref)[0]:.1e}")

    def unsupported_case(self):
        return Run(hd=2048, rd=8, nh=2, nkv=1, slots=16), "head_dim 2048"

    def more_unsupported_reasons(self):
        parts, w, start = jnp.zeros((1, 1, 128)), jnp.zeros((32,)), jnp.zeros((1,), jnp.int32)
        return [(unsupported_reason(parts.astype(jnp.int8), w, start), "q | gate product of dtype int8"),
                (unsupported_reason(parts, w, start.astype(jnp.float32)), "positions of dtype float32")]

    def lowering_case(self):
        return Run(B=2, T=4, S=2, seed=7)

    def auto(self, run):
        return lambda *a: queries_grouped(*a, **_grouped_kw(run, ROWS))[0]

    def custom_call(self, run):
        return "attention_queries"


def test_bad_shapes_are_refused_naming_them():
    """A product that is not [S, B T, nh 2 hd] for the weight's hd, or heads that do not divide over the kv heads,
    is a ValueError naming the shapes, not a wrong answer."""
    kw = _grouped_kw(Run(), ROWS)
    with pytest.raises(ValueError, match=r"parts \[S, B T, nh 2 hd\].*found parts \[1, 1, 100\], w \[32\]"):
        queries_grouped(jnp.zeros((1, 1, 100)), jnp.zeros((32,)), jnp.zeros((1,), jnp.int32), **kw)
    with pytest.raises(ValueError, match=r"3 query heads over 2 kv heads"):
        queries_grouped(jnp.zeros((1, 1, 192)), jnp.zeros((32,)), jnp.zeros((1,), jnp.int32), **kw)


@pytest.mark.parametrize("run", [Run(), Run(B=2, T=4, S=3, seed=1, offset=1, far=True),
                                 Run(B=3, nh=24, nkv=4, hd=256, rd=64, S=14, seed=2, far=True),  # 27B's heads
                                 Run(T=2, hd=32, rd=32, seed=3), Run(B=2, T=4, dtype=jnp.bfloat16, S=8, seed=4)],
                         ids=lambda r: f"B{r.B}T{r.T}-h{r.nh}/{r.nkv}x{r.hd}-rd{r.rd}-S{r.S}-{jnp.dtype(r.dtype).name}")
def test_queries_kernel_writes_the_attention_rows(run):
    """The kernel alone (interpret mode) against its reference: the queries in the attention kernel's rows (f32 to
    a few units of rounding, bf16 at its rounding) and their positions bit for bit (row t G + g at start + t,
    padding rows -1), padding rows zeros, every real row written; at RoPE positions up to 1M (the angles are the
    same f32 numbers: the reference's inverse frequencies)."""
    parts, w, start = _product(run)
    plan = ca.kernel_plan((run.B, run.T, run.nh, run.hd), run.dtype, jnp.zeros((run.B, 64, run.nkv, run.hd)))
    rows = plan.row_tile * plan.row_tiles
    qg, qpos = queries_grouped_pallas(parts, w, start, interpret=True, **_grouped_kw(run, rows))
    want, want_pos = queries_grouped_reference(parts, w, start, **_grouped_kw(run, rows))
    assert qg.shape == want.shape == (run.B, run.nkv, rows, run.hd) and qg.dtype == run.dtype
    np.testing.assert_array_equal(np.asarray(qpos), np.asarray(want_pos))
    real = run.T * run.nh // run.nkv
    assert (np.asarray(qpos)[:, real:] == -1).all() and (np.asarray(qpos)[:, :real] >= 0).all()
    got = np.asarray(qg, np.float32)
    assert not got[:, :, real:].any() and (np.abs(got[:, :, :real]).max(axis=-1) > 0).all()
    tol = 1e-6 if run.dtype == jnp.float32 else 2e-2
    assert rel_err(qg.astype(jnp.float32), want.astype(jnp.float32))[0] < tol


def _oracle(parts, w, positions, hd, rd):
    """float64 numpy: the product's per-head query values, (1 + w) RMSNorm, rotate-half RoPE at theta^(-2i/rd)."""
    B, T = positions.shape
    x = np.asarray(parts, np.float64).sum(0).reshape(B, T, -1, 2 * hd)[..., :hd]
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * (1 + np.asarray(w, np.float64))
    angle = np.asarray(positions, np.float64)[..., None, None] * THETA ** (-np.arange(0, rd, 2) / rd)
    c, s = np.cos(angle), np.sin(angle)
    y1, y2 = y[..., :rd // 2], y[..., rd // 2:rd]
    return np.concatenate([y1 * c - y2 * s, y2 * c + y1 * s, y[..., rd:]], axis=-1)


def test_queries_match_a_float64_oracle_and_fail_without_the_offset():
    """An oracle that is not the reference (float64 numpy of the norm and the rotation) for the kernel's queries,
    at the MTP head's offset; the same kernel with the offset left out (the head's rows rotated to their cache
    slots) is far from it: the check reads the rotation."""
    run = Run(B=2, T=3, nh=4, nkv=2, hd=64, rd=16, S=3, seed=9, offset=1)
    parts, w, start = _product(run)
    pos = rows_at(start, run.T)
    want = _oracle(parts, w, pos + 1, run.hd, run.rd)
    grouped = lambda off: queries_grouped_pallas(parts, w, start, interpret=True, **{**_grouped_kw(run, 16),
                                                                                      "offset": off})[0]
    G = run.nh // run.nkv
    as_trunk = lambda qg: np.asarray(qg[:, :, :run.T * G].reshape(run.B, run.nkv, run.T, G, run.hd).transpose(
        0, 2, 1, 3, 4).reshape(run.B, run.T, run.nh, run.hd), np.float64)
    np.testing.assert_allclose(as_trunk(grouped(1)), want, rtol=1e-4, atol=1e-5)
    assert np.abs(as_trunk(grouped(0)) - want).max() > 0.1


# (label, B, T, nh, nkv, S): the real models' attention (hd 256, rotary 64) at a decode step (the FMA kernel's 14
# K parts at 27B's q_proj) and a k = 3 verify (the tensor-core kernel's 8)
REAL = [("27B decode", 1, 1, 24, 4, 14), ("27B verify k3", 1, 4, 24, 4, 8), ("35B-A3B decode", 1, 1, 16, 2, 4),
        ("122B-A10B / 397B-A17B decode", 1, 1, 32, 2, 6), ("27B decode batch 4", 4, 1, 24, 4, 14)]


def test_kernel_lowers_and_compiles_for_sm90_at_real_shapes(report):
    """At the real models' heads (bf16 queries from f32 partials; 27B also from an f32 product): the program
    lowered for cuda holds the kernel, the one lowered for cpu none, and its Triton IR compiles to sm_90 machine
    code within shared memory and with no register spilled (kernel_contract.compiles_for_sm90)."""
    S_ = jax.ShapeDtypeStruct
    cases = []
    for label, B, T, nh, nkv, S in REAL + [("27B decode f32", 1, 1, 24, 4, 1)]:
        dtype = jnp.float32 if label.endswith("f32") else jnp.bfloat16
        args = (S_((S, B * T, nh * 512), jnp.float32), S_((256,), dtype), S_((B,), jnp.int32))
        assert unsupported_reason(*args) is None
        rows = ca.kernel_plan((B, T, nh, 256), dtype, S_((B, 4096, nkv, 256), dtype))
        kw = dict(offset=0, num_kv_heads=nkv, rows=rows.row_tile * rows.row_tiles, rotary_dim=64, theta=THETA,
                  eps=EPS, dtype=dtype)
        cases.append((label, lambda p, w, s, kw=kw: queries_grouped(p, w, s, **kw)[0], args))
    compiles_for_sm90(cases, "attention_queries", "attention queries", report)
