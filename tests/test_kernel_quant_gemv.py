"""The decode-rows quantized-matmul kernel (kernels_pallas/quant_gemv.py, interpret mode on CPU) against its XLA
reference (quant_matmul_reference) and the float64 oracle of test_kernel_quant_matmul.py.

Cases: int4 groups (K padded to whole groups, the padded rows' nibbles garbage), int8 per channel (K not a
multiple of a load: rows past K), fp8 with K blocks and column blocks cut at both edges, per channel and per
tensor; M = 1 .. 4 (decode and verify rows); K in parts (the last one shorter); x in f32, bf16 and f16. Values
random over each format's whole range (every nibble and byte, fp8 subnormals): the kernel builds each value
from its bits with integer logic, so every bit pattern is exercised. `rows` < 16 keeps each interpret-mode
program small (the sub-step loop runs more times; the arithmetic is the same).
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import quant_gemv as gemv
from kernels_pallas import quant_mma as mma
from kernels_pallas.quant_matmul import quant_gemv, quant_matmul
from qwen_mtp.tools.lowering import export_for, kernel_calls, triton_kernels
from tests.hf_tiny import rel_err
from tests.test_kernel_quant_matmul import ORACLE_BOUND, QuantHooks, _inputs, _oracle

pytest.register_assert_rewrite("kernel_contract")
from kernel_contract import KernelContract

# (kind, "channel" | "tensor" | int4 group | fp8 block, M, K, N, x dtype, forced launch parameters)
CASES = [
    ("int4", 32, 1, 100, 24, "f32", {"rows": 4, "splits": 2}),     # K 100 -> 4 groups, parts of 2
    ("int8", "channel", 2, 42, 24, "f32", {"rows": 4, "splits": 3}),  # rows past K in the last load
    ("fp8", (16, 16), 3, 40, 40, "f32", {"rows": 4}),              # partial blocks at the K and N edges
    ("fp8", "tensor", 1, 24, 8, "f32", {"rows": 8}),
    ("int4", 16, 4, 48, 24, "bf16", {"rows": 4}),
    ("fp8", "channel", 2, 40, 24, "f16", {"rows": 8, "splits": 2}),
]


@dataclasses.dataclass(frozen=True)
class Run:
    case: tuple

    @property
    def block(self):
        kind, fmt, _, K, N = self.case[:5]
        if fmt == "channel":
            return (K, 1)
        if fmt == "tensor":
            return (K, N)
        return (fmt, 1) if kind == "int4" else tuple(fmt)


class GemvCases:
    """The contract's case hooks over CASES-shaped tuples (this file's, quant_gate_up's): f32 cases tight, the
    others at their rounding; RUN wraps a case."""

    CASES, RUN = CASES, Run
    F32_TOL = (1e-5,)

    def f32_cases(self):
        return [self.RUN(c) for c in self.CASES if c[5] == "f32"]

    def low_precision_cases(self):
        return [self.RUN(c) for c in self.CASES if c[5] != "f32"]

    def case_id(self, run):
        c = run.case
        return f"{c[0]}-{c[1]}-M{c[2]}K{c[3]}N{c[4]}-{c[5]}".replace(" ", "")


class TestQuantGemvContract(GemvCases, QuantHooks, KernelContract):
    """The kernel contract for the decode kernel; each case also against the float64 oracle (check_more)."""

    def inputs(self, run):
        kind, fmt, M, K, N, dtype = run.case[:6]
        return _inputs(kind, fmt, M, K, N, dtype, seed=M + K + N)[:3]

    def kernel(self, run, x, q, scale):
        kind, K, tiling = run.case[0], run.case[3], run.case[6]
        return gemv.quant_gemv_pallas(x, q, scale, kind=kind, k=K, block=run.block, interpret=True, **tiling)

    def dispatching(self, run, x, q, scale, **kw):
        return quant_gemv(x, q, scale, kind=run.case[0], k=run.case[3], block=run.block, **kw)

    def reason(self, run, x, q, scale):
        return gemv.unsupported_reason(x, q, scale, kind=run.case[0], k=run.case[3], block=run.block)

    def check_more(self, run, args, got, ref, report):
        kind, fmt, M, K, N, dtype, tiling = run.case
        p = gemv.plan(M, K, N, kind, run.block, **tiling)
        if "splits" in tiling:
            assert p.splits == tiling["splits"], p
        vs_oracle = rel_err(got, _oracle(*args, kind, K, run.block))[0]
        assert vs_oracle < ORACLE_BOUND[dtype], (vs_oracle, ORACLE_BOUND[dtype])
        report(f"quant_gemv kernel {kind} {fmt} M{M} K{K} N{N} {dtype} grid ({p.col_tiles},{p.splits}) "
               f"{p.cols} stored columns x {p.rows} rows per load: max_rel vs float64 {vs_oracle:.1e}")

    def unsupported_case(self):
        return Run(("int8", "channel", 2, 40, 22, "f32", {})), "multiple of 4"

    def check_fallback(self, run, args, out):
        assert rel_err(out, _oracle(*args, "int8", 40, run.block))[0] < 1e-5

    def more_unsupported_reasons(self):
        x, q, s, _ = _inputs("int8", "channel", 17, 40, 24, "f32", seed=1)
        reasons = [(gemv.unsupported_reason(x, q, s, kind="int8", k=40, block=(40, 1)), "17 rows")]
        x, q, s, _ = _inputs("fp8", (24, 16), 2, 60, 40, "f32", seed=1)
        reasons.append((gemv.unsupported_reason(x, q, s, kind="fp8", k=60, block=(24, 16)), "K blocks of 24"))
        return reasons

    def lowering_case(self):
        return Run(("int4", 32, 2, 100, 24, "f32", {}))

    def auto(self, run):
        kind, K, block = run.case[0], run.case[3], run.block
        return jax.jit(lambda x, q, s: quant_gemv(x, q, s, kind=kind, k=K, block=block))

    def custom_call(self, run):
        return f"quant_matmul_{run.case[0]}"


SDS = jax.ShapeDtypeStruct
# Qwen3.5-27B's MLP and lm_head, and the 35B-A3B expert matrices (hidden 2048, expert intermediate 512)
REAL = {"gate/up": (5120, 17408), "down": (17408, 5120), "lm_head": (5120, 248320),
        "expert gate/up": (2048, 512), "expert down": (512, 2048)}
FORMATS = {"int4": ((128, 1), "uint8"), "int8": (None, "int8"), "fp8": ((128, 128), "float8_e4m3fn")}


def _real_args(kind, M, K, N):
    block, storage = FORMATS[kind]
    block = block or (K, 1)
    kq = -(-K // block[0]) * block[0] // 2 if kind == "int4" else K
    scale = (-(-K // block[0]), -(-N // block[1]))
    return (SDS((M, K), jnp.bfloat16), SDS((kq, N), jnp.dtype(storage)), SDS(scale, jnp.float32)), block


def test_decode_rows_lower_the_decode_kernel_for_cuda_at_real_shapes():
    """backend "auto" in a program lowered for cuda: the decode kernel at M <= ROWS_FMA[kind] for every real
    matrix and format (its Triton IR reads int32 words / fp8 bytes: no tt.dot, no dequantized matrix; int4 from
    2 rows and int8 from 4: the tensor-core decode kernel), the tiled kernel or XLA above; lowered for cpu, the
    reference."""
    for kind in FORMATS:
        for name, (K, N) in REAL.items():
            for M in sorted({1, gemv.ROWS_FMA[kind]}):
                args, block = _real_args(kind, M, K, N)
                assert gemv.unsupported_reason(*args, kind=kind, k=K, block=block) is None, (kind, name)
                fn = jax.jit(lambda x, q, s, kind=kind, K=K, block=block: quant_matmul(x, q, s, kind=kind, k=K,
                                                                                       block=block))
                exported = export_for(fn, *args)
                tensor_cores = M >= mma.MIN_ROWS.get(kind, 17)  # int4 from 2 rows, int8 from 4: quant_mma.py
                assert kernel_calls(exported) == [f"quant_matmul_{kind}" + "_mma" * tensor_cores], (kind, name, M)
                assert f"tensor<{K}x{N}xbf16>" not in exported.mlir_module(), (kind, name, M)
                if M == 1 and name == "lm_head":
                    (kernel,) = triton_kernels(exported)
                    assert "tt.dot" not in kernel.ir and "tt.load" in kernel.ir, kind
                assert kernel_calls(export_for(fn, *args, platform="cpu")) == []
    args, block = _real_args("int4", gemv.ROWS_FMA["int4"] + 1, 5120, 17408)  # above: the tiled kernel
    fn = jax.jit(lambda x, q, s: quant_matmul(x, q, s, kind="int4", k=5120, block=block, backend="pallas"))
    assert kernel_calls(export_for(fn, *args)) == ["quant_matmul_int4"]
    assert gemv.plan(1, 5120, 248320, "int4", (128, 1)).programs >= 132  # lm_head at M = 1: every SM busy
    assert gemv.plan(1, 17408, 5120, "int4", (128, 1)).splits > 1  # down: K in parts


def test_plan_fills_the_gpu_at_m1():
    """Every real matrix at M = 1 runs at least 2 CTAs per SM of an H200 (132 SMs), splitting K where the
    columns alone are too few, as far as parts of MIN_STEPS_PER_SPLIT steps allow (a 35B-A3B expert matrix
    is 0.5 - 1 MB: it cannot fill the GPU alone)."""
    for kind in FORMATS:
        for name, (K, N) in REAL.items():
            block = FORMATS[kind][0] or (K, 1)
            p = gemv.plan(1, K, N, kind, block)
            if name.startswith("expert"):  # too small to fill the GPU: K parts only while their partials stay small
                assert p.splits > 1 or p.steps < 2 * gemv.MIN_STEPS_PER_SPLIT or K < N, (kind, name, p)
            else:
                assert p.programs >= 264, (kind, name, p)


def test_plan_words_override():
    """`words` (a lane's 4-byte words per row, the plan alternative gpu_check times) sets the column tile; a value
    the kernel has no load for is refused by name."""
    for words in gemv.WORDS:
        p = gemv.plan(1, 2048, 512, "int4", (128, 1), words=words, pairs=8)
        assert (p.cols, p.col_tiles) == (32 * words, 128 // (32 * words)), p
    assert gemv.plan(1, 2048, 512, "int4", (128, 1), pairs=8).cols == 32  # 8 pairs x 512 columns: one word a lane
    with pytest.raises(ValueError, match="words .* must be one of \\(1, 2, 4\\), found 3"):
        gemv.plan(1, 2048, 512, "int4", (128, 1), words=3)
    with pytest.raises(ValueError, match="splits are plan, half, double, most or a number, found 'lots'"):
        gemv.alternatives(1, 2048, 512, "int4", (128, 1), splits=("lots",))


# (label, kind, M, K, N): the most registers (int4 at 2 rows), the widest grid (lm_head), fp8 at its row limit
# (sm_90 compiles cost CPU seconds: three; quant_gemv.py's module doc lists more)
SM90_CASES = [("int4 lm_head M1", "int4", 1, 5120, 248320), ("int4 gate/up M2", "int4", 2, 5120, 17408),
              ("fp8 lm_head M8", "fp8", 8, 5120, 248320)]


def test_decode_kernel_compiles_for_sm90(report):
    """The decode kernel's Triton IR at real shapes (bf16 x) compiled to sm_90 machine code with the `triton`
    package: shared memory within one block's 227 KiB, no register spill (no stack, no local memory); the
    report line gives the registers and how many of its one-warp CTAs an SM holds against the grid's."""
    import importlib.util

    from qwen_mtp.tools.lowering import SM90_SHARED_LIMIT, compile_sm90

    if importlib.util.find_spec("triton") is None:
        why = "the sm_90 compile needs the `triton` package: pip install -e '.[sm90]'"
        if os.environ.get("QWEN_MTP_REQUIRE_SM90") == "1":  # CI installs it and requires the test to run
            pytest.fail(why)
        pytest.skip(why)
    kernels = []
    for _, kind, M, K, N in SM90_CASES:
        args, block = _real_args(kind, M, K, N)
        fn = jax.jit(lambda x, q, s, kind=kind, K=K, block=block: quant_gemv(x, q, s, kind=kind, k=K, block=block))
        (kernel,) = triton_kernels(export_for(fn, *args))
        kernels.append(kernel)
    for (label, kind, M, K, N), kernel, r in zip(SM90_CASES, kernels, compile_sm90(kernels)):
        assert r["error"] is None, (label, r["error"])
        p = gemv.plan(M, K, N, kind, _real_args(kind, M, K, N)[1])
        assert kernel.grid == (p.col_tiles, p.splits, 1), (label, kernel.grid, p)
        per_sm = min(32, 65536 // (32 * max(r["registers"], 1)))
        report(f"sm_90 compile, quant_gemv {label}: grid {kernel.grid} ({p.programs} CTAs of {kernel.num_warps} "
               f"warp, {p.programs / 132:.1f} per SM of 132; {per_sm} fit an SM), {r['registers']} registers, "
               f"shared {r['shared']} B, {r['stack']} B stack, {r['local']} B local")
        assert r["shared"] <= SM90_SHARED_LIMIT and r["stack"] == 0 and r["local"] == 0, (label, r)


def test_k_parts_are_summed_in_chunks_xla_fuses():
    """split_k.sum_parts: K's partials [parts, M, N] summed in chunks of at most ELEMENTAL_ROWS (31) parts, each a
    reduce XLA's GPU emitter runs inside the fusion that reads it (tests/test_gpu_compile.py counts the kernels: 27B
    int4's down, 46 parts). The same sum as one reduce to f32 rounding; the program holds one reduce a chunk."""
    import numpy as np

    from kernels_pallas.split_k import ELEMENTAL_ROWS, sum_parts

    rng = np.random.default_rng(0)
    for parts in (1, 31, 32, 46, 93):
        out = jnp.asarray(rng.standard_normal((parts, 2, 40)), jnp.float32)
        want = np.asarray(out, np.float64).sum(axis=0)
        np.testing.assert_allclose(np.asarray(sum_parts(out)), want, rtol=1e-5, atol=1e-5)
        reduces = str(jax.make_jaxpr(sum_parts)(out)).count("reduce_sum")
        assert reduces == -(-parts // ELEMENTAL_ROWS), (parts, reduces)


@pytest.mark.parametrize("kind,fmt,M", [("int4", 128, 1), ("int8", "channel", 1), ("fp8", (128, 128), 1),
                                        ("int4", 128, 4), ("int8", "channel", 4), ("fp8", (128, 128), 4)])
def test_k_partials_for_a_consumer(kind, fmt, M):
    """quant_decode.quant_decode_parts (quant.linear_parts: the GDN conv and step kernels and the attention queries'
    kernel sum a quantized product's K partials as they load them), at one row (the FMA decode kernel) and at 4
    (the tensor-core one): the kernel's partials unsummed (interpret mode), their f32 sum rounded to x's dtype the
    kernel's own product bit for bit and near the float64 oracle; lowered for cpu, the reference's product in part
    0 and zeros after it, so the consumer's sum is the product bit for bit."""
    from kernels_pallas import quant_decode
    from kernels_pallas.split_k import sum_parts

    x, q, scale, block = _inputs(kind, fmt, M, 1024, 128, "bf16", seed=21)
    kw = dict(kind=kind, k=1024, block=block)
    chosen = quant_decode.decode_kernel(x, q, scale, kind, 1024, block)
    assert chosen is (quant_decode.quant_gemv if M == 1 else quant_decode.quant_mma), chosen
    fn = gemv.quant_gemv_pallas if M == 1 else quant_decode.tensor_core_kernel(kind)
    S = quant_decode.decode_parts(x, q, scale, **kw)
    assert S > 1, S  # the plan cuts K: there are partials to hand on
    parts = fn(x, q, scale, **kw, unsummed=True, interpret=True)
    assert parts.shape == (S, M, 128) and parts.dtype == jnp.float32, parts.shape
    assert (np.abs(np.asarray(parts)).max(axis=(1, 2)) > 0).all()  # every part holds real products
    whole = fn(x, q, scale, **kw, interpret=True)
    np.testing.assert_array_equal(np.asarray(sum_parts(parts).astype(x.dtype)), np.asarray(whole))
    assert rel_err(whole, _oracle(x, q, scale, kind, 1024, block))[0] < 2 ** -7
    on_cpu = jax.jit(lambda *a: quant_decode.quant_decode_parts(*a, **kw))(x, q, scale)
    assert on_cpu.shape == (S, M, 128) and not np.asarray(on_cpu[1:]).any()
    np.testing.assert_array_equal(np.asarray(sum_parts(on_cpu).astype(x.dtype)),
                                  np.asarray(quant_matmul(x, q, scale, **kw)))
    if kind == "int4" and M == 1:  # a plan of one part has no partials to hand on: refused, naming the shapes
        x, q, scale, block = _inputs(kind, fmt, 1, 512, 64, "bf16", seed=22)
        with pytest.raises(ValueError, match=r"\[512, 64\] at 1 rows into 1 part"):
            quant_decode.quant_decode_parts(x, q, scale, kind=kind, k=512, block=block)
