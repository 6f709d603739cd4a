"""The tensor-core decode kernels (kernels_pallas/quant_mma.py for int4 and int8, quant_mma_fp8.py for fp8; interpret
mode on CPU) against their XLA
reference (quant_matmul_reference) and the float64 oracle of test_kernel_quant_matmul.py; its cuda lowering at
real shapes; its sm_90 machine code (registers, spills, and the instruction count per stored value that the
module's estimate rests on).

Cases: groups of 32 (one 16-row load per half group), 128 (64 rows) and 256 (two loads per half group: the
prefetch crosses a sub-step), K padded to whole groups (the padded nibbles garbage, x zero there), columns
ragged inside a tile and across two tiles, K in parts with a shorter last part, M 2 .. 16, x in bf16 and f16;
int8 per channel (bf16 x) with K a whole number of loads and not (rows past K masked), in parts; fp8 with K
blocks of 64, 128 and 256 rows (one to four loads; K ending inside a block, or loads past K though K is a
whole number of loads), column blocks of 32 and 128 cut at N, per channel and per tensor, in bf16 and f16, and
rows of x far outside f16's range. Every nibble and byte value occurs (random over the format's range, fp8
subnormals included): the kernels build each value from its bits.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import quant_mma as mma
from kernels_pallas import quant_mma_fp8 as mma_fp8
from kernels_pallas.quant_decode import tensor_core_kernel, tensor_core_module
from kernels_pallas.quant_matmul import (
    decode_kernel,
    quant_matmul,
    quant_mma,
)
from qwen_mtp.tools.lowering import export_for, kernel_calls, triton_kernels
from tests.hf_tiny import rel_err
from tests.test_kernel_quant_gemv import REAL, _real_args
from tests.test_kernel_quant_matmul import ORACLE_BOUND as BOUND
from tests.test_kernel_quant_matmul import QuantHooks, _block, _inputs, _oracle

pytest.register_assert_rewrite("kernel_contract")
from kernel_contract import KernelContract

# (kind, int4 group | "channel", M, K, N, x dtype, splits[, stages]): stages 1 is the next step's loads prefetched in
# registers (across sub-steps and parts: the cases marked 1 hold those crossings; fp8's default at 16 rows), more
# Triton's pipeline (the default elsewhere)
CASES = [
    ("int4", 32, 2, 150, 24, "bf16", 2, 1),  # K 150 -> 5 groups (padded), parts of 3 and 2; 6 words: a ragged tile
    ("int4", 32, 2, 150, 24, "bf16", 2),
    ("int4", 128, 5, 300, 136, "bf16", None),  # 3 groups; 34 words: a full tile and a ragged one
    ("int4", 256, 16, 512, 516, "f16", 2, 1),  # two loads per half group; 16 rows; 129 words
    ("int4", 256, 16, 512, 516, "f16", 2),
    ("int4", 64, 3, 192, 128, "f16", 3),
    ("int8", "channel", 4, 300, 136, "bf16", 2, 1),  # 5 loads of 64 rows, the last past K; parts of 3 and 2
    ("int8", "channel", 4, 300, 136, "bf16", 2),
    ("int8", "channel", 16, 256, 128, "bf16", None),  # one whole tile: scales and output unmasked
    ("int4", 32, 20, 150, 136, "bf16", 2),   # a batch's verify rows: one 64-row tile, 20 real
    ("int8", "channel", 64, 200, 136, "bf16", 2, 1),
    ("fp8", (128, 128), 4, 300, 200, "bf16", 2),  # K ends inside the third block; two column tiles
    ("fp8", (128, 128), 4, 300, 200, "bf16", 2, 3),
    ("fp8", (64, 32), 5, 320, 136, "bf16", None),  # four scale columns per tile, the last cut at N
    ("fp8", (256, 128), 3, 320, 40, "f16", None, 1),  # four loads a block; the second block's last loads past K
    ("fp8", "channel", 16, 256, 136, "bf16", None),
    ("fp8", "tensor", 6, 200, 24, "f16", 2),
    ("fp8", (128, 128), 40, 300, 200, "bf16", 2),  # a batch's verify rows: one 64-row tile, 40 real
    ("fp8", "channel", 64, 256, 136, "f16", None),
]


_module = tensor_core_module


def _plan(kind, M, K, N, block, splits=None, stages=None):
    return tensor_core_module(kind).plan(M, K, N, block, kind=kind, splits=splits, stages=stages)


@dataclasses.dataclass(frozen=True)
class Run:
    case: tuple

    @property
    def block(self):
        kind, fmt, _, K, N = self.case[:5]
        return _block(kind, fmt, K, N)

    @property
    def stages(self):
        return self.case[7] if len(self.case) > 7 else None


class TestQuantMmaContract(QuantHooks, KernelContract):
    """The kernel contract for the tensor-core decode kernel (bf16 / f16 x only: f32 x is refused, below)."""

    def f32_cases(self):
        return []

    def low_precision_cases(self):
        return [Run(c) for c in CASES]

    def case_id(self, run):
        kind, fmt, M, K, N, dt, splits = run.case[:7]
        return f"{kind}-{fmt}-M{M}K{K}N{N}-{dt}-splits{splits}-stages{run.stages}"

    def inputs(self, run):
        kind, fmt, M, K, N, dt = run.case[:6]
        return _inputs(kind, fmt, M, K, N, dt, seed=M + K + N)[:3]

    def kernel(self, run, x, q, scale):
        kind, _, _, K, _, _, splits = run.case[:7]
        return tensor_core_kernel(kind)(x, q, scale, kind=kind, k=K, block=run.block, splits=splits,
                                        stages=run.stages, interpret=True)

    def dispatching(self, run, x, q, scale, **kw):
        return quant_mma(x, q, scale, kind=run.case[0], k=run.case[3], block=run.block, **kw)

    def reason(self, run, x, q, scale):
        return _module(run.case[0]).unsupported_reason(x, q, scale, kind=run.case[0], k=run.case[3], block=run.block)

    def check_more(self, run, args, got, ref, report):
        kind, fmt, M, K, N, dt, splits = run.case[:7]
        p = _plan(kind, M, K, N, run.block, splits, run.stages)
        if splits is not None:
            assert p.splits == splits, p
        vs_oracle = rel_err(got, _oracle(*args, kind, K, run.block))[0]
        assert vs_oracle < BOUND[dt], (vs_oracle, BOUND[dt])
        report(f"quant_mma kernel {kind} {fmt} M{M} K{K} N{N} {dt} grid ({p.col_tiles},{p.splits}), {p.rows} stored "
               f"rows per load, {p.stages} stage(s): max_rel vs float64 {vs_oracle:.1e}")

    def unsupported_case(self):
        return Run(("int4", 32, 2, 64, 24, "f32", None)), "bfloat16 / float16"

    def more_unsupported_reasons(self):
        out = []
        for kind, fmt, M, dt, fragment in (("fp8", (16, 16), 2, "bf16", "int4 and int8"),
                                           ("int8", "channel", 4, "f16", "int8: bfloat16 only"),
                                           ("fp8", (24, 16), 4, "bf16", "K blocks of 24"),
                                           ("fp8", "channel", 4, "f32", "bfloat16 / float16"),
                                           ("int8", "tensor", 4, "bf16", "one scale per column"),
                                           ("int4", 32, 65, "bf16", "65 rows"), ("fp8", (16, 16), 65, "bf16", "65 rows"),
                                           ("int4", 16, 2, "bf16", "group of 16")):
            x, q, s, block = _inputs(kind, fmt, M, 64, 24, dt, seed=1)
            module = mma_fp8 if kind == "fp8" and fragment != "int4 and int8" else mma
            out.append((module.unsupported_reason(x, q, s, kind=kind, k=64, block=block), fragment))
        x, q, s, block = _inputs("int4", 32, 2, 64, 22, "bf16", seed=1)
        out.append((mma.unsupported_reason(x, q, s, kind="int4", k=64, block=block), "multiple of 4"))
        return out

    def lowering_case(self):
        return Run(("int4", 32, 4, 100, 24, "bf16", None))

    def auto(self, run):
        K, block = run.case[3], run.block
        return jax.jit(lambda x, q, s: quant_matmul(x, q, s, kind="int4", k=K, block=block))

    def custom_call(self, run):
        return "quant_matmul_int4_mma"


@pytest.mark.parametrize("kind, fmt, table", [("int4", 32, "FLIP"), ("int8", "channel", "KEEP")])
def test_the_offset_correction_is_what_makes_it_right(monkeypatch, kind, fmt, table):
    """Control: the kernel reads each nibble as a base + its value (int4 136 + v; int8's low nibble 128 + l) and
    takes the bases times the sums of x off; with one base off by 8 the same case is far from the oracle."""
    M, K, N = 2, 64, 24
    x, q, s, block = _inputs(kind, fmt, M, K, N, "bf16", seed=7)
    good = mma.quant_mma_pallas(x, q, s, kind=kind, k=K, block=block, interpret=True)
    assert rel_err(good, _oracle(x, q, s, kind, K, block))[0] < BOUND["bf16"]
    bf16 = jnp.dtype(jnp.bfloat16)
    constant, base = getattr(mma, table)[bf16]
    monkeypatch.setitem(getattr(mma, table), bf16, (constant, base + 8.0))
    bad = mma.quant_mma_pallas(x, q, s, kind=kind, k=K, block=block, splits=2, interpret=True)  # a new trace
    assert rel_err(bad, _oracle(x, q, s, kind, K, block))[0] > 0.1


def test_fp8_rows_of_x_outside_f16s_range(monkeypatch):
    """The fp8 kernel multiplies in f16: rows of x at 1e6 (past f16's 65504), at 1e-6 (f16 subnormals) and of
    zeros match the float64 oracle at bf16's rounding, each row scaled by its own power of two. Control: with
    the scaling off (every row's exponent taken as 14) the 1e6 row overflows f16 and fails."""
    M, K, N, block = 4, 256, 136, (128, 128)
    x, q, s, _ = _inputs("fp8", block, M, K, N, "bf16", seed=3)
    x = x * jnp.asarray([[1e6], [1e-6], [0.0], [1.0]], jnp.bfloat16)
    want = _oracle(x, q, s, "fp8", K, block)
    for m in range(M):  # the zero row exactly; every other row at bf16's rounding of its own scale
        got = mma_fp8.quant_mma_fp8_pallas(x, q, s, k=K, block=block, interpret=True)
        if m == 2:
            assert float(jnp.abs(got[m].astype(jnp.float32)).max()) == 0.0
        else:
            assert rel_err(got[m:m + 1], want[m:m + 1])[0] < BOUND["bf16"], m
    monkeypatch.setattr(mma_fp8.jnp, "frexp", lambda a: (a, jnp.zeros(a.shape, jnp.int32)))
    bad = mma_fp8.quant_mma_fp8_pallas(x, q, s, k=K, block=block, splits=2, interpret=True)  # a new trace
    assert not bool(jnp.isfinite(bad[0].astype(jnp.float32)).all()) or rel_err(bad[:1], want[:1])[0] > 0.1


# beside the 27B matrices and 35B-A3B's experts: 122B-A10B's and 397B-A17B's shared experts (hidden 3072 / 4096,
# intermediate 1024), dense matrices of their verify
REAL_MMA = {**REAL, "122B shared gate/up": (3072, 1024), "122B shared down": (1024, 3072),
            "397B shared gate/up": (4096, 1024), "397B shared down": (1024, 4096)}


def test_verify_rows_lower_the_tensor_core_kernel_for_cuda_at_real_shapes():
    """backend "auto", bf16 x: int4 (groups of 128) from 2 rows, int8 per channel and fp8 (128, 128) blocks from
    4, up to 64, a tensor-core kernel (decode_kernel at M 1, 2, 3, 4, 9, 16, 17, 64; lowered for cuda at M 1, 16
    and 64, and 4 on gate / up: its custom call, a tt.dot in its Triton IR, no dequantized [K, N] matrix), below
    that the FMA decode kernel; for the 27B matrices, the
    35B-A3B expert shapes and the 122B-A10B / 397B-A17B shared experts; f32 x not these kernels; lowered for
    cpu, the reference."""
    for kind in ("int4", "int8", "fp8"):
        for name, (K, N) in REAL_MMA.items():
            for M in (1, 2, 3, 4, 9, 16, 17, 64):
                args, block = _real_args(kind, M, K, N)
                tc = M >= mma.MIN_ROWS[kind]
                assert (decode_kernel(*args, kind, K, block) is quant_mma) == tc, (kind, name, M)
                if M not in (1, 16, 64) and not (M == 4 and name == "gate/up"):  # the rule alone (compiles cost)
                    continue
                fn = jax.jit(lambda x, q, s, K=K, block=block, kind=kind: quant_matmul(x, q, s, kind=kind, k=K,
                                                                                       block=block))
                exported = export_for(fn, *args)
                want = [f"quant_matmul_{kind}" + "_mma" * tc]
                assert kernel_calls(exported) == want, (kind, name, M)
                assert (f"tensor<{K}x{N}xbf16>" in exported.mlir_module()) == (not want), (kind, name, M)
                if M == 4 and name == "gate/up":
                    (kernel,) = triton_kernels(exported)
                    p = _plan(kind, M, K, N, block)
                    assert "tt.dot" in kernel.ir and kernel.grid[:2] == (p.col_tiles, p.splits), (kind, kernel.grid)
                    assert kernel_calls(export_for(fn, *args, platform="cpu")) == []
        args, block = _real_args(kind, 4, 5120, 17408)
        args = (args[0].update(dtype=jnp.float32),) + tuple(args[1:])
        assert decode_kernel(*args, kind, 5120, block) is not quant_mma


# (label, kind, M, K, N): verify rows on the MLP, 16 rows on the lm_head
SM90_CASES = [("int4 gate/up M4", "int4", 4, 5120, 17408), ("int4 lm_head M16", "int4", 16, 5120, 248320),
              ("int8 down M4", "int8", 4, 17408, 5120), ("fp8 gate/up M4", "fp8", 4, 5120, 17408),
              ("int4 gate/up M64", "int4", 64, 5120, 17408), ("int8 down M64", "int8", 64, 17408, 5120),
              ("fp8 down M32", "fp8", 32, 17408, 5120)]
# the modules' estimates (int4 3.2-3.3, int8 5.6 with x read as it is (2.9, 5.0 arranged by XLA), fp8 4.1 per
# value; a 64-row tile int4 3.7, int8 5.2, fp8 2.4-2.5) with a margin for ptxas' scheduling; up to 16 rows
# within what HBM's time allows at 4.8 TB/s (int4 3.49, int8 and fp8 6.98): the estimate of memory-bound speed holds
MAX_INSTRUCTIONS_PER_VALUE = {("int4", 16): 3.4, ("int8", 16): 5.8, ("fp8", 16): 4.8, ("int4", 64): 4.0,
                             ("int8", 64): 5.6, ("fp8", 64): 2.8}


def test_tensor_core_kernel_compiles_for_sm90(report):
    """The kernel's Triton IR at real shapes (bf16 x) compiled to sm_90 machine code: shared memory within a
    block's 227 KiB, no register spill, and the loop's instructions per stored value (the warps' lane-
    instructions over the values one iteration reads) within the budget the module's HBM estimate assumes."""
    import importlib.util

    from qwen_mtp.tools.lowering import SM90_SHARED_LIMIT, compile_sm90

    if importlib.util.find_spec("triton") is None:
        why = "the sm_90 compile needs the `triton` package: pip install -e '.[sm90]'"
        if os.environ.get("QWEN_MTP_REQUIRE_SM90") == "1":
            pytest.fail(why)
        pytest.skip(why)
    kernels = []
    for _, kind, M, K, N in SM90_CASES:
        args, block = _real_args(kind, M, K, N)
        fn = jax.jit(lambda x, q, s, K=K, block=block, kind=kind: quant_mma(x, q, s, kind=kind, k=K, block=block))
        (kernel,) = triton_kernels(export_for(fn, *args))
        kernels.append(kernel)
    for (label, kind, M, K, N), kernel, r in zip(SM90_CASES, kernels, compile_sm90(kernels, loops=True)):
        assert r["error"] is None, (label, r["error"])
        assert r["shared"] <= SM90_SHARED_LIMIT and r["stack"] == 0 and r["local"] == 0, (label, r)
        p = _plan(kind, M, K, N, _real_args(kind, M, K, N)[1])
        loop = r["loops"][0]  # the innermost: one step's stored rows x 32 words (fp8: 128 bytes)
        mmas = loop["opcodes"].get("HMMA", 0) + loop["opcodes"].get("HGMMA", 0)  # mma.sync, warp-group MMA
        # the real loop; Triton's pipeline loads through shared memory (cp.async: LDGSTS) when stages > 1
        copies = loop["opcodes"].get("LDGSTS", 0)
        assert mmas > 0 and loop["opcodes"].get("LDG", 0) + copies > 0 and (copies > 0) == (p.stages > 1), loop
        per_value = loop["instructions"] * 32 * kernel.num_warps / p.step_values(kind)
        assert per_value <= MAX_INSTRUCTIONS_PER_VALUE[kind, 16 if M <= 16 else 64], (label, per_value, loop)
        report(f"sm_90 compile, quant_mma {label}: grid {kernel.grid}, {r['registers']} registers, shared "
               f"{r['shared']} B, no spill; loop {loop['instructions']} instructions per warp = {per_value:.2f} "
               f"per {kind} value ({', '.join(f'{k} {v}' for k, v in list(loop['opcodes'].items())[:8])})")


def test_sm90_loop_count_reads_the_backward_branch():
    """The loop counter under the estimate (qwen_mtp/tools/sm90_compile.loops) on a made-up disassembly: the body
    from the branch target to the backward branch, predicates and modifiers dropped; a forward branch is no loop."""
    from qwen_mtp.tools.sm90_compile import loops

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/              @P0  BRA 0x60 ;
        /*0020*/                   LDG.E.128 R4, desc[UR6][R2.64] ;
        /*0030*/                   LOP3.LUT R5, R4, 0xf000f, RZ, 0xc0, !PT ;
        /*0040*/                   HMMA.16816.F32.BF16 R8, R12, R14, R8 ;
        /*0050*/              @!P1 BRA 0x20 ;
        /*0060*/                   EXIT ;
    """
    assert loops(sass) == [{"instructions": 4, "opcodes": {"LDG": 1, "LOP3": 1, "HMMA": 1, "BRA": 1}}]
