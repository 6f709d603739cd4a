"""The Pallas quantized-matmul kernel (interpret mode on CPU) against its XLA reference, and the reference against
an independent float64 numpy dequantize-then-matmul.

Cases: int8 per channel, int4 groups of 32 / 64 / 128, fp8 with 128 x 128 block scales, per channel and per
tensor; M = 1, 2, 5 (decode and verify rows, padded to a 16-row tile), 64 and 300 (prefill: several row tiles);
K and N that are not multiples of the tiles, the groups or the fp8 blocks (partial blocks at both edges); K
split into parts (the partial products summed after the call, a part running past the end); x in f32, bf16
and f16. The stored values are random over the
whole range of their format (int4: every nibble; fp8: subnormals up to 448; int4's padded rows hold garbage
that the kernel must not read into the result), not just what the quantizer produces.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels_pallas.quant_layout import cdiv, pack_int4, padded_k
from kernels_pallas.quant_matmul import (
    plan,
    quant_matmul,
    quant_matmul_pallas,
    quant_matmul_reference,
    unsupported_reason,
)
from tests.hf_tiny import rel_err

pytest.register_assert_rewrite("kernel_contract")  # its asserts explain their failures as a test file's do
from kernel_contract import KernelContract  # noqa: E402  (tests/ is on sys.path, as for conftest.py)

DT = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def _block(kind, fmt, K, N):
    if fmt == "channel":
        return (K, 1)
    if fmt == "tensor":
        return (K, N)
    return (fmt, 1) if kind == "int4" else tuple(fmt)


def _inputs(kind, fmt, M, K, N, dtype, seed):
    """x [M, K] in dtype; q, scale in quant_layout's format with random values over the format's range."""
    rng = np.random.default_rng(seed)
    block = _block(kind, fmt, K, N)
    bk, bn = block
    if kind == "int8":
        q = rng.integers(-127, 128, (K, N)).astype(np.int8)
    elif kind == "int4":
        q = pack_int4(rng.integers(-8, 8, (padded_k(kind, K, bk), N)), bk)  # padded rows: garbage, not zeros
    else:  # magnitudes 2^-12 .. 2^8.8 (e4m3's subnormals lie below 2^-6, its largest value is 448), signs, zeros
        v = rng.choice([-1.0, 1.0], (K, N)) * 2.0 ** rng.uniform(-12, 8.8, (K, N)) * (rng.random((K, N)) > 0.05)
        q = v.astype(ml_dtypes.float8_e4m3fn)
    scale = (rng.uniform(0.5, 2.0, (cdiv(K, bk), cdiv(N, bn))) * 1e-2).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32).astype(DT[dtype])
    return x, jnp.asarray(q), jnp.asarray(scale), block


def _oracle(x, q, scale, kind, K, block):
    """float64 numpy: unpack the values (written from the layout's description, not with quant_layout's code),
    multiply each weight by its block's scale, one matmul."""
    bk, bn = block
    q = np.asarray(q)
    if kind == "int4":
        h = bk // 2
        signed = lambda n: np.where(n >= 8, n.astype(np.float64) - 16, n)
        rows = np.arange(q.shape[0])
        first = rows // h * bk + rows % h  # byte j of group G: row G*g + j (low nibble), row G*g + g/2 + j (high)
        v = np.zeros((2 * q.shape[0], q.shape[1]))
        v[first] = signed(q & 0xF)
        v[first + h] = signed(q >> 4)
    else:
        v = q.astype(np.float64)
    v = v[:K]
    w = v * np.asarray(scale, np.float64)[np.arange(K)[:, None] // bk, np.arange(v.shape[1])[None, :] // bn]
    return np.asarray(x.astype(jnp.float32), np.float64) @ w


# (kind, "channel" | int4 group | fp8 block, M, K, N, x dtype, forced tiling): each case is one compile
CASES = [
    ("int8", "channel", 1, 300, 72, "f32", {"splits": 2}),    # K in 2 parts of 3 steps: the last one partial,
                                                              # one past the end; N past one tile
    ("int8", "channel", 300, 130, 40, "f32", {}),             # prefill: 19 row tiles of 16 (f32)
    ("int4", 32, 2, 300, 40, "f32", {}),                      # K 300 padded to 10 groups
    ("int4", 64, 64, 200, 72, "f32", {}),
    ("int4", 128, 5, 300, 136, "f32", {"splits": 2}),         # 3 groups in 2 parts (one past the end), dots of K 32
    ("fp8", (128, 128), 5, 300, 200, "f32", {"dot_k": 64}),   # partial blocks at the K and the N edge
    ("fp8", "channel", 1, 200, 40, "f16", {}),                # compressed-tensors fp8; decode: one dot of K 256
    ("fp8", "tensor", 2, 100, 24, "f32", {}),                 # one scale for the whole matrix
    ("int4", 128, 5, 600, 200, "bf16", {}),                   # decode: 2 groups per step of 256 rows
    ("int4", 128, 300, 300, 136, "bf16", {}),                 # prefill: 5 row tiles of 64
    ("fp8", (128, 128), 64, 300, 200, "bf16", {}),
]


def _case_id(c):
    return f"{c[0]}-{c[1]}-M{c[2]}K{c[3]}N{c[4]}-{c[5]}".replace(" ", "")


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of the kernel: a CASES entry and its inputs' seed."""
    case: tuple
    seed: int

    @property
    def block(self):
        kind, fmt, M, K, N = self.case[:5]
        return _block(kind, fmt, K, N)


def _run(case):
    return Run(case, seed=sum(case[2:5]))  # seed M + K + N


# a kernel's max_rel against the float64 oracle: f32 x, the values exact and the sums f32; bf16 / f16 x, only the
# output's rounding
ORACLE_BOUND = {"f32": 1e-5, "bf16": 2.0 ** -8, "f16": 2.0 ** -11}


class QuantHooks:
    """The contract hooks the quantized-matmul kernels' tests share (the tiled kernel here, quant_gemv's and
    quant_mma's in their files): a case's [0] is the format, its [3] K, its .block the scale block."""

    def reference(self, run, x, q, scale):
        return quant_matmul_reference(x, q, scale, kind=run.case[0], k=run.case[3], block=run.block)

    def error(self, got, want):
        return rel_err(got, want)[:1]

    def tolerance(self, run):
        return (1e-2,)  # the reference rounds each dequantized weight to x's dtype (2^-9 in bf16); the kernels'
        # bound against the oracle is tighter (ORACLE_BOUND, in check_more)


class TestQuantMatmulContract(QuantHooks, KernelContract):
    """The kernel contract (tests/kernel_contract.py) for the quantized matmul: the CASES with x in f32 (int8,
    int4 and fp8 stored values) tightly, those with x in bf16 / f16 at the output's rounding; each case also
    against the float64 oracle (check_more)."""

    F32_TOL = (1e-5,)  # max_rel

    def f32_cases(self):
        return [_run(c) for c in CASES if c[5] == "f32"]

    def low_precision_cases(self):
        return [_run(c) for c in CASES if c[5] != "f32"]

    def case_id(self, run):
        return _case_id(run.case)

    def inputs(self, run):
        kind, fmt, M, K, N, dtype = run.case[:6]
        return _inputs(kind, fmt, M, K, N, dtype, seed=run.seed)[:3]

    def kernel(self, run, x, q, scale):
        kind, K, tiling = run.case[0], run.case[3], run.case[6]
        if tiling:
            return quant_matmul_pallas(x, q, scale, kind=kind, k=K, block=run.block, interpret=True, **tiling)
        # through the dispatch, as the model calls it
        return quant_matmul(x, q, scale, kind=kind, k=K, block=run.block, backend="pallas", interpret=True)

    def dispatching(self, run, x, q, scale, **kw):
        return quant_matmul(x, q, scale, kind=run.case[0], k=run.case[3], block=run.block, **kw)

    def reason(self, run, x, q, scale):
        return unsupported_reason(x, q, scale, kind=run.case[0], k=run.case[3], block=run.block)

    def check_more(self, run, args, got, ref, report):
        kind, fmt, M, K, N, dtype, tiling = run.case
        x, q, scale = args
        block = run.block
        p = plan(M, K, N, kind, block, jnp.dtype(x.dtype).itemsize, **tiling)
        if "splits" in tiling:  # the plan really cuts K into that many parts, the last one running past the end
            assert p.splits == tiling["splits"] and p.splits * p.steps_per_split > p.steps, p
        assert got.shape == (M, N)
        want = _oracle(x, q, scale, kind, K, block)
        kernel_vs_ref, kernel_vs_oracle, ref_vs_oracle = rel_err(got, ref)[0], rel_err(got, want)[0], rel_err(ref,
                                                                                                              want)[0]
        if dtype == "f32":
            assert max(kernel_vs_ref, kernel_vs_oracle, ref_vs_oracle) < 1e-5, (kernel_vs_ref, kernel_vs_oracle,
                                                                                 ref_vs_oracle)
        else:
            # The kernel's dots run on the exact values with f32 accumulation and apply the f32 scales to the f32
            # products: its only rounding is the output's, half a unit in the last place of bf16 (2^-9 of the
            # value) or f16 (2^-12). The reference first rounds every dequantized weight to x's dtype (2^-9 of
            # each weight in bf16), then rounds its output: within 1e-2 of the oracle and of the kernel.
            assert kernel_vs_oracle < ORACLE_BOUND[dtype], kernel_vs_oracle
            assert ref_vs_oracle < 1e-2 and kernel_vs_ref < 1e-2, (ref_vs_oracle, kernel_vs_ref)
        report(f"quant_matmul kernel {kind} {fmt} M{M} K{K} N{N} {dtype} grid ({p.row_tiles},{p.col_tiles},"
               f"{p.splits}) tile {p.block_m}x{p.block_n} step {p.block_k} dot_k {p.dot_k}: max_rel vs reference "
               f"{kernel_vs_ref:.1e}, vs float64 {kernel_vs_oracle:.1e} (reference vs float64 {ref_vs_oracle:.1e})")

    def unsupported_case(self):
        return Run(("int4", 16, 3, 40, 24, "f32", {}), seed=0), "int4 group of 16"  # half a group is 8 rows

    def check_fallback(self, run, args, out):
        assert rel_err(out, _oracle(*args, "int4", 40, run.block))[0] < 1e-5

    def more_unsupported_reasons(self):
        x8, q8, s8, _ = _inputs("fp8", (96, 16), 2, 200, 40, "f32", seed=1)
        reasons = [(unsupported_reason(x8, q8, s8, kind="fp8", k=200, block=(96, 16)), "K blocks of 96")]
        x8, q8, s8, _ = _inputs("fp8", (128, 24), 2, 200, 40, "f32", seed=1)
        reasons.append((unsupported_reason(x8, q8, s8, kind="fp8", k=200, block=(128, 24)),
                        "scale blocks of 24 columns"))
        xi, qi, si, bi = _inputs("int8", "channel", 2, 40, 24, "f32", seed=2)
        reasons.append((unsupported_reason(xi.astype(jnp.int32), qi, si, kind="int8", k=40, block=bi), "dtype int32"))
        reasons.append((unsupported_reason(xi[:0], qi, si, kind="int8", k=40, block=bi), "empty"))
        SDS = jax.ShapeDtypeStruct  # shapes only: a weight of 2^31 int8 values
        huge = (SDS((1, 8192), jnp.bfloat16), SDS((8192, 1 << 18), jnp.int8), SDS((1, 1 << 18), jnp.float32))
        reasons.append((unsupported_reason(*huge, kind="int8", k=8192, block=(8192, 1)), "2^31"))
        return reasons

    def lowering_case(self):
        return Run(("int4", 32, 2, 300, 40, "f32", {}), seed=4)

    def auto(self, run):
        kind, K, block = run.case[0], run.case[3], run.block
        return jax.jit(lambda x, q, s: quant_matmul(x, q, s, kind=kind, k=K, block=block))

    def custom_call(self, run):
        return f"quant_matmul_{run.case[0]}"


def test_plan_gives_a_gpu_enough_programs_at_real_shapes():
    """The 27B decode shapes (M = 1 .. 9, bf16): every matmul runs at least TARGET_PROGRAMS programs, one
    16-row tile, and K split only where the columns alone are too few (down: N = 5120)."""
    for kind, block in (("int8", (5120, 1)), ("int4", (128, 1)), ("fp8", (128, 128))):
        for M in (1, 9):
            up = plan(M, 5120, 17408, kind, block)
            down = plan(M, 17408, 5120, kind, (17408, 1) if kind == "int8" else block)
            head = plan(M, 5120, 248320, kind, block)
            assert (up.block_m, up.splits, down.splits, head.splits) == (16, 1, 4, 1), (up, down, head)
            assert min(up.programs, down.programs, head.programs) >= 264
        pre = plan(512, 5120, 17408, kind, block)
        assert pre.block_m in (64, 128) and pre.splits == 1 and pre.programs >= 264, pre


def test_inputs_that_break_the_layout_raise():
    x, q, scale, block = _inputs("int8", "channel", 2, 40, 24, "f32", seed=3)
    with pytest.raises(ValueError, match=r"x of shape \[M, 48\]"):
        quant_matmul(x, q, scale, kind="int8", k=48, block=(48, 1))
    with pytest.raises(ValueError, match="int8 values stored as int8, found uint8"):
        quant_matmul(x, q.astype(jnp.uint8), scale, kind="int8", k=40, block=block)
    with pytest.raises(ValueError, match="scales of shape"):
        quant_matmul(x, q, scale[:, :5], kind="int8", k=40, block=block)
    with pytest.raises(ValueError, match="block_n a power of two"):
        plan(2, 40, 24, "int8", block, block_n=24)
