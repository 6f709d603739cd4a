"""The Pallas MoE router top-k kernel (interpret mode on CPU) against its reference, lax.top_k: the same values and
ids bit for bit.

Rows: the real routers (256 experts top-8: 35B-A3B, 122B-A10B; 512 top-10: 397B-A17B), a width that is not a power
of two, top-k of every expert, the softmax of random logits with runs of equal probabilities (ties go to the
lower expert), bf16 / f16 rows (many more ties), and a row of NaNs of both signs, infinities and signed zeros
(XLA's TopK order: -NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.moe_router import (
    MAX_EXPERTS,
    router_topk,
    router_topk_pallas,
    router_topk_reference,
    unsupported_reason,
)

pytest.register_assert_rewrite("kernel_contract")
from kernel_contract import KernelContract, compiles_for_sm90  # noqa: E402  (tests/ is on sys.path, as for conftest.py)

# (rows, experts, top k)
CASES = [(1, 256, 8), (4, 256, 8), (3, 512, 10), (2, 60, 4), (5, 8, 8)]
SPECIAL = "special"  # the row of non-finite values and signed zeros


@dataclasses.dataclass(frozen=True)
class Run:
    case: tuple
    seed: int
    dtype: object = jnp.float32


def _special_row():
    """16 experts: +NaN, -NaN, +-inf, +-0, equal values, negatives (as bits: NaN's sign survives)."""
    row = np.array([1, np.nan, 2, np.nan, -0.0, 0.0, np.inf, -np.inf, 0.5, 0.5, -1, 3, 0, 0, 0.5, -0.0], np.float32)
    row.view(np.uint32)[3] = 0xFFC00000  # -NaN
    return row[None]


def _inputs(case, seed, dtype):
    if case == SPECIAL:
        return (jnp.asarray(_special_row()).astype(dtype),)
    n, E, _ = case
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((n, E)).astype(np.float32) * 2
    logits[0, : E // 4] = logits[0, E // 4]  # a run of equal probabilities across the top
    logits[-1, 1::2] = logits[-1, ::2][: E // 2]  # neighbours equal
    return (jax.nn.softmax(jnp.asarray(logits), axis=-1).astype(dtype),)


def _k(case):
    return 16 if case == SPECIAL else case[2]


def _bits(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


class TestRouterTopkContract(KernelContract):
    """The kernel contract (tests/kernel_contract.py) for the router's top-k: the values compared bit for bit
    (error: how many differ), the ids in check_more."""

    F32_TOL = (1,)  # no value may differ in a single bit
    _kept: dict = {}

    def f32_cases(self):
        return [Run(c, seed=i) for i, c in enumerate(CASES)] + [Run(SPECIAL, seed=0)]

    def low_precision_cases(self):
        return [Run(CASES[0], seed=7, dtype=jnp.bfloat16), Run(CASES[2], seed=8, dtype=jnp.bfloat16),
                Run(CASES[3], seed=9, dtype=jnp.float16), Run(SPECIAL, seed=0, dtype=jnp.bfloat16)]

    def case_id(self, run):
        name = SPECIAL if run.case == SPECIAL else "n{}E{}k{}".format(*run.case)
        return f"{name}-{jnp.dtype(run.dtype).name}"

    def inputs(self, run):
        return _inputs(run.case, run.seed, run.dtype)

    def kernel(self, run, probs):
        top, self._kept[("kernel", run)] = router_topk_pallas(probs, k=_k(run.case), interpret=True)
        return top

    def reference(self, run, probs):
        top, self._kept[("reference", run)] = router_topk_reference(probs, k=_k(run.case))
        return top

    def dispatching(self, run, probs, **kw):
        return router_topk(probs, k=_k(run.case), **kw)[0]

    def reason(self, run, probs):
        return unsupported_reason(probs, _k(run.case))

    def error(self, got, want):
        return (int(np.sum(_bits(got) != _bits(want))),)

    def tolerance(self, run):
        return (1,)

    def check_more(self, run, args, got, ref, report):
        ids, want = self._kept.pop(("kernel", run)), self._kept.pop(("reference", run))
        assert ids.dtype == jnp.int32 and ids.shape == want.shape
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want))
        probs = np.asarray(args[0], np.float32)
        k = _k(run.case)
        assert all(len(set(r)) == k and max(r) < probs.shape[1] for r in np.asarray(ids).tolist())  # k experts
        if run.case != SPECIAL:  # the probes read real rows: every value a row's probability, the first its max
            np.testing.assert_array_equal(np.asarray(got, np.float32)[:, 0], probs.max(axis=1))
            ties = int(np.sum(np.diff(np.asarray(got, np.float32), axis=1) == 0))
            assert ties > 0, "no equal probabilities among the top k: the tie order went untested"
        report(f"router top-k {self.case_id(run)}: values and ids bit for bit as lax.top_k")

    def unsupported_case(self):
        return Run((1, MAX_EXPERTS + 8, 8), seed=0), f"{MAX_EXPERTS + 8} experts"

    def more_unsupported_reasons(self):
        return [(unsupported_reason(jnp.zeros((2, 64)), 40), "top 40"),
                (unsupported_reason(jnp.zeros((0, 64)), 8), "no rows")]

    def lowering_case(self):
        return Run(CASES[1], seed=1)

    def auto(self, run):
        return lambda probs: router_topk(probs, k=_k(run.case))[0]

    def custom_call(self, run):
        return "moe_router_topk"


def test_bad_arguments_name_what_they_found():
    with pytest.raises(ValueError, match=r"probs \[n, E\], found shape \[256\]"):
        router_topk(jnp.zeros((256,)), k=8)
    with pytest.raises(ValueError, match="float32 / bfloat16 / float16, found int32"):
        router_topk(jnp.zeros((1, 256), jnp.int32), k=8)
    with pytest.raises(ValueError, match=r"k in \[1, 8\] \(the experts\), found 9"):
        router_topk(jnp.zeros((1, 8)), k=9)


# (experts, top k) of the real routers
REAL_ROUTERS = {"35B-A3B / 122B-A10B": (256, 8), "397B-A17B": (512, 10)}


def test_kernel_lowers_and_compiles_for_sm90_at_real_shapes(report):
    """At the real routers (a decode row, batch 8, a k = 3 verify's 4 rows; f32 and bf16 rows): the program lowered
    for cuda holds the kernel, the one lowered for cpu none, and its Triton IR compiles to sm_90 machine code
    within shared memory and with no register spilled (kernel_contract.compiles_for_sm90)."""
    cases = []
    for model, n, dtype in [("35B-A3B / 122B-A10B", 1, jnp.float32), ("35B-A3B / 122B-A10B", 4, jnp.float32),
                            ("397B-A17B", 8, jnp.float32), ("397B-A17B", 1, jnp.bfloat16)]:
        E, k = REAL_ROUTERS[model]
        probs = jax.ShapeDtypeStruct((n, E), dtype)
        assert unsupported_reason(probs, k) is None
        cases.append((f"{model} n{n} {jnp.dtype(dtype).name}", lambda p, k=k: router_topk(p, k=k), (probs,)))
    compiles_for_sm90(cases, "moe_router_topk", "router top-k", report)
