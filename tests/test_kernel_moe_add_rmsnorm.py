"""The MoE combine, residual add and RMSNorm kernel (kernels_pallas/moe_add_rmsnorm.py, interpret mode on CPU)
against its reference (trunk/mlp.moe's combine, the add, the trunk's RMSNorm) and a float64 oracle. Where the trunk
uses it (a MoE block handing its output to the next norm at one row) is tests/test_kernel_add_rmsnorm.py's
test_an_mlp_block_hands_its_output_to_the_next_norm.

Rows: one decode row and a few, k 1 to 10 pairs a row, down's partials S = 1 (the rows in x's dtype) and more,
router weights renormalised or not, widths a power of two and not; f32, bf16 and f16 rows with f32 and bf16 norm
weights; pad_row; every tensor random.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.add_rmsnorm import MAX_ROWS
from kernels_pallas.moe_add_rmsnorm import (
    moe_add_rmsnorm_reference,
    moe_add_rmsnorm_rows,
    moe_add_rmsnorm_rows_pallas,
    unsupported_reason,
)
from kernels_pallas.rmsnorm import MAX_HIDDEN
from tests.hf_tiny import rel_err

pytest.register_assert_rewrite("kernel_contract")
from kernel_contract import KernelContract, compiles_for_sm90  # noqa: E402  (tests/ is on sys.path, as for conftest.py)

EPS = 1e-6
# (rows, H, k pairs a row, S partials of down, norm_topk)
CASES = [(1, 2048, 8, 2, True), (1, 1000, 3, 1, True), (4, 640, 8, 4, False), (2, 96, 10, 2, True),
         (1, 4096, 10, 3, False)]


@dataclasses.dataclass(frozen=True)
class Run:
    case: tuple
    seed: int
    dtype: object = jnp.float32
    w_dtype: object = jnp.float32


def _inputs(case, seed, dtype, w_dtype):
    R, H, k, S, norm = case
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((R, H)) * rng.uniform(0.5, 4), jnp.float32).astype(dtype)
    parts = jnp.asarray(rng.standard_normal((S, R * k + R, H)) * rng.uniform(0.5, 4) / np.sqrt(S), jnp.float32)
    parts = parts if S > 1 else parts.astype(dtype)
    top_v = jnp.asarray(rng.uniform(0.01, 0.3, (R, k)), jnp.float32)  # the top-k of a softmax: below 1, unnormed
    h = jnp.asarray(rng.standard_normal((R, H)), jnp.float32).astype(dtype)  # the block's input rows
    if R == 1:  # as the experts read one row: the row and a zero row (mlp.moe's `rows`)
        h = jnp.concatenate([h, jnp.zeros_like(h)])
    wg = jnp.asarray(rng.standard_normal((H, 1)) * 2 / np.sqrt(H), jnp.float32).astype(w_dtype)  # the gate's weight
    logit = jnp.einsum("rh,ho->ro", h[:R], wg.astype(dtype), preferred_element_type=jnp.float32,
                       precision=jax.lax.Precision.HIGHEST)  # f32 as mlp.moe hands it (ops.linear_wide) ...
    logit = logit if norm else logit.astype(dtype)  # ... or in x's dtype
    return x, parts, top_v, (logit, h, wg), jnp.asarray(0.3 * rng.standard_normal(H), jnp.float32).astype(w_dtype)


def _oracle(x, parts, top_v, gate, w, norm_topk):
    """float64 numpy of the same roundings: down's partials summed and rounded to x's dtype, the router's weights
    (renormalised where norm_topk), the gate's logit (its weight in x's dtype) and its sigmoid rounded, each pair
    times its weight and the shared row times its gate rounded, the pairs' sum rounded, the combine rounded, then x
    + it and its (1 + w) RMSNorm."""
    R, k = top_v.shape
    rnd = lambda a: np.asarray(jnp.asarray(a, jnp.float32).astype(x.dtype), np.float64)
    f = lambda a: np.asarray(a, np.float64)
    both = rnd(f(parts).sum(0))
    v = f(top_v)
    p = rnd(v / v.sum(1, keepdims=True) if norm_topk else v)
    h, wg = f(gate[1])[:R], f(rnd(f(gate[2])))
    gate = rnd(1 / (1 + np.exp(-rnd(h @ wg))))  # the kernel's own logit, from the rows and the weight
    pairs = rnd(both[:R * k].reshape(R, k, -1) * p[..., None])
    moe = rnd(rnd(pairs.sum(1)) + rnd(both[R * k:] * gate))
    s = rnd(f(x) + moe)
    return s, s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + EPS) * (1 + f(w))


class TestMoeAddRmsnormContract(KernelContract):
    """The kernel contract (tests/kernel_contract.py): the output checked is the norm's; check_more checks the new
    residual rows and a float64 oracle."""

    F32_TOL = (1e-6, 1e-6)  # (max_rel, max_abs): the pairs and the squares summed in another order
    FALLBACK_EXACT = True
    _kept: dict = {}

    def f32_cases(self):
        return [Run(c, seed=i) for i, c in enumerate(CASES)]

    def low_precision_cases(self):
        return [Run(CASES[0], seed=7, dtype=jnp.bfloat16, w_dtype=jnp.bfloat16),
                Run(CASES[2], seed=8, dtype=jnp.bfloat16), Run(CASES[1], seed=9, dtype=jnp.float16)]

    def case_id(self, run):
        R, H, k, S, norm = run.case
        return f"R{R}H{H}k{k}S{S}{'-norm' * norm}-{jnp.dtype(run.dtype).name}-w{jnp.dtype(run.w_dtype).name}"

    def inputs(self, run):
        return _inputs(run.case, run.seed, run.dtype, run.w_dtype)

    def kernel(self, run, *args):
        self._kept[("kernel", run)], y = moe_add_rmsnorm_rows_pallas(*args, eps=EPS, norm_topk=run.case[4],
                                                                     interpret=True)
        return y

    def reference(self, run, *args):
        self._kept[("reference", run)], y = moe_add_rmsnorm_reference(*args, eps=EPS, norm_topk=run.case[4])
        return y

    def dispatching(self, run, *args, **kw):
        return moe_add_rmsnorm_rows(*args, eps=EPS, norm_topk=run.case[4], **kw)[1]

    def reason(self, run, *args):
        return unsupported_reason(*args)

    def error(self, got, want):
        return rel_err(got.astype(jnp.float32), want.astype(jnp.float32))

    def tolerance(self, run):
        return (2e-2,)  # a unit of bf16 / f16 rounding where the f32 values straddle a rounding boundary

    def check_more(self, run, args, got, ref, report):
        x = args[0]
        new, want = self._kept.pop(("kernel", run)), self._kept.pop(("reference", run))
        assert new.dtype == x.dtype and new.shape == x.shape
        tol = 1e-6 if run.dtype == jnp.float32 else 2e-2
        assert rel_err(new.astype(jnp.float32), want.astype(jnp.float32))[0] < tol
        s64, y64 = _oracle(*args, run.case[4])
        assert rel_err(np.asarray(new, np.float64), s64)[0] < tol
        assert rel_err(np.asarray(got, np.float64), y64)[0] < (1e-5 if run.dtype == jnp.float32 else 2e-2)
        # the probe reads real values: every row moved by the block's output, every row normed
        assert (np.abs(np.asarray(new, np.float32) - np.asarray(x, np.float32)).max(axis=1) > 0).all()
        assert (np.abs(np.asarray(got, np.float32)).max(axis=1) > 0).all()
        report(f"moe add + rmsnorm kernel {self.case_id(run)}: y max_rel={self.error(got, ref)[0]:.1e}, x_new "
               f"max_rel={rel_err(new.astype(jnp.float32), want.astype(jnp.float32))[0]:.1e}")

    def unsupported_case(self):
        return Run((1, MAX_HIDDEN + 16, 2, 2, True), seed=0), f"rows of {MAX_HIDDEN + 16}"

    def more_unsupported_reasons(self):
        x, parts, v, g, w = _inputs((1, 64, 2, 2, True), 0, jnp.bfloat16, jnp.float32)
        many = _inputs((MAX_ROWS + 1, 64, 1, 2, True), 0, jnp.float32, jnp.float32)
        return [(unsupported_reason(x.astype(jnp.int8), parts, v, g, w), "rows of dtype int8"),
                (unsupported_reason(x, parts.astype(jnp.float16), v, g, w), "parts of dtype float16"),
                (unsupported_reason(x, parts, v.astype(jnp.bfloat16), g, w), "probabilities of dtype bfloat16"),
                (unsupported_reason(x, parts, v, (g[0].astype(jnp.float16), *g[1:]), w), "a logit of float16"),
                (unsupported_reason(*many), f"{MAX_ROWS + 1} rows")]

    def lowering_case(self):
        return Run(CASES[2], seed=1)

    def auto(self, run):
        return lambda *a: moe_add_rmsnorm_rows(*a, eps=EPS, norm_topk=run.case[4])[1]

    def custom_call(self, run):
        return "moe_add_rmsnorm_rows"


def test_the_kernel_rounds_as_the_program_says():
    """In bf16 the kernel's new residual rows equal the float64 oracle of the program's roundings (down's partials'
    sum, the router's weights, the gate, each pair's weighted row, the pairs' sum, the shared row, the combine, the
    add: each op's result in bf16, as the jaxpr says) at every value but where an f32 sum or the sigmoid straddles
    a rounding boundary (here: none). XLA may keep an op's result in f32 inside a fusion (it drops a bf16 round
    trip), so the reference, XLA's ops on this CPU, is within a unit of bf16 rounding of it, not equal."""
    for case, seed in (((3, 512, 1, 1, False), 3), ((3, 512, 8, 2, True), 4), ((2, 640, 10, 3, False), 5)):
        args = _inputs(case, seed, jnp.bfloat16, jnp.bfloat16)
        new = np.asarray(moe_add_rmsnorm_rows_pallas(*args, eps=EPS, norm_topk=case[4], interpret=True)[0], np.float64)
        ref = np.asarray(moe_add_rmsnorm_reference(*args, eps=EPS, norm_topk=case[4])[0], np.float64)
        s64 = _oracle(*args, case[4])[0]
        assert (new != s64).mean() < 0.01, (case, (new != s64).mean())
        assert rel_err(ref, s64)[0] < 2e-2, (case, rel_err(ref, s64))


def test_pad_row_and_bad_shapes():
    """pad_row (one row, before a plain in-projection ops.linear pads): (x_new, y, y2), y2 the row again and a row of
    zeros; y and x_new the kernel's own without pad_row, bit for bit. Bad shapes are refused, naming them."""
    args = _inputs((1, 2048, 8, 2, True), 3, jnp.bfloat16, jnp.bfloat16)
    x_new, y, y2 = moe_add_rmsnorm_rows_pallas(*args, eps=EPS, norm_topk=True, pad_row=True, interpret=True)
    plain = moe_add_rmsnorm_rows_pallas(*args, eps=EPS, norm_topk=True, interpret=True)
    np.testing.assert_array_equal(np.asarray(x_new), np.asarray(plain[0]))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(plain[1]))
    assert y2.shape == (2, 2048)
    np.testing.assert_array_equal(np.asarray(y2[:1]), np.asarray(y))
    assert not np.asarray(y2[1], np.float32).any()
    x, parts, v, g, w = _inputs((2, 64, 4, 2, True), 0, jnp.float32, jnp.float32)
    with pytest.raises(ValueError, match=r"parts \[S, R k \+ R, H\].*found x \[2, 64\], parts \[2, 8, 64\]"):
        moe_add_rmsnorm_rows(x, parts[:, :8], v, g, w, eps=EPS, norm_topk=True)
    with pytest.raises(ValueError, match=r"logit \[R, 1\].*logit \[1, 1\]"):
        moe_add_rmsnorm_rows(x, parts, v, (g[0][:1], *g[1:]), w, eps=EPS, norm_topk=True)
    with pytest.raises(ValueError, match=r"wg \[H, 1\].*wg \[64\]"):
        moe_add_rmsnorm_rows(x, parts, v, (*g[:2], g[2][:, 0]), w, eps=EPS, norm_topk=True)
    with pytest.raises(ValueError, match=r"pad_row=True\) takes one row.*found x \[2, 64\]"):
        moe_add_rmsnorm_rows(x, parts, v, g, w, eps=EPS, norm_topk=True, pad_row=True)


def test_kernel_lowers_and_compiles_for_sm90_at_real_shapes(report):
    """At the MoE models' hidden sizes and top-k (35B-A3B and 122B-A10B: 8 pairs, 397B-A17B: 10), one bf16 decode
    row from down's 2 partials (35B-A3B also with pad_row, and in f32 from 4): the program lowered for cuda holds
    the kernel, the one lowered for cpu none, and its Triton IR compiles to sm_90 machine code within shared
    memory and with no register spilled."""
    S_ = jax.ShapeDtypeStruct
    cases = []
    for model, H, k, S, dtype, pad in [("35B-A3B", 2048, 8, 2, jnp.bfloat16, False),
                                       ("35B-A3B", 2048, 8, 2, jnp.bfloat16, True),
                                       ("35B-A3B", 2048, 8, 4, jnp.float32, False),
                                       ("122B-A10B", 3072, 8, 2, jnp.bfloat16, False),
                                       ("397B-A17B", 4096, 10, 2, jnp.bfloat16, False)]:
        gate = (S_((1, 1), jnp.float32), S_((2, H), dtype), S_((H, 1), dtype))
        args = (S_((1, H), dtype), S_((S, k + 1, H), jnp.float32), S_((1, k), jnp.float32), gate, S_((H,), dtype))
        assert unsupported_reason(*args) is None
        label = f"{model} H{H} k{k} S{S} {jnp.dtype(dtype).name}" + (" pad_row" if pad else "")
        cases.append((label, lambda *a, pad=pad: moe_add_rmsnorm_rows(*a, eps=EPS, norm_topk=True, pad_row=pad)[1],
                      args))
    compiles_for_sm90(cases, "moe_add_rmsnorm_rows", "MoE combine + residual add + RMSNorm", report)
