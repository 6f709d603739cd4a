"""A quantized dense MLP's gate and up in one launch (kernels_pallas/quant_gate_up.py): quant_gemv's decode kernel
with both weights' column tiles in one grid, then silu(gate) * up.

* The kernel contract (kernel_contract.py): interpret mode against the reference (quant_matmul_reference twice,
  the activation between), f32 tight and bf16 / f16 at the output's rounding; the custom call in a program
  lowered for cuda, none for cpu; rows the tensor-core kernel takes fall back with their reason.
* Each case also: the launch's two halves, summed over K's parts, against quant_gemv's own kernel on each weight
  (the same plan, f32 tight: a half that read the other weight, the other's scales or a dropped part fails);
  the activation against a float64 oracle of the dequantized weights; and against the reference with gate and up
  swapped, so the inputs tell the two weights apart.
* The MLP (trunk/mlp.py) takes it at decode rows with quantized gate / up: lowered for cuda at the real shapes
  (27B's MLP, the shared experts of 35B-A3B, 122B-A10B and 397B-A17B) in int4 at 1 row, int8 and fp8 at 1 and 3,
  it holds the one launch and down's kernel; int4 at 2 rows keeps the tensor-core kernel's two launches; lowered
  for cpu no Pallas kernel, and on this CPU the MLP's value is the two products' bit for bit.
* Compiled for sm_90 at 27B's gate / up (needs `triton`): shared memory within a block, no register spill, and
  the inner loop's instructions per stored value those of quant_gemv's single launch.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import quant_gate_up as gu
from kernels_pallas import quant_gemv as gemv
from qwen_mtp.tools.lowering import export_for, kernel_calls
from qwen_mtp.trunk import mlp, quant
from qwen_mtp.trunk.quant import QuantArray, layout_of
from qwen_mtp.trunk.weights import MLPWeights
from tests.hf_tiny import rel_err
from tests.test_kernel_quant_gemv import GemvCases
from tests.test_kernel_quant_gemv import Run as GemvRun
from tests.test_kernel_quant_gemv import _real_args
from tests.test_kernel_quant_matmul import ORACLE_BOUND, _inputs, _oracle

pytest.register_assert_rewrite("kernel_contract")
from kernel_contract import KernelContract  # noqa: E402

# (kind, "channel" | "tensor" | int4 group | fp8 block, M, K, N, x dtype, forced launch parameters)
CASES = [
    ("int4", 32, 1, 100, 24, "f32", {"rows": 4, "splits": 2}),     # K 100 -> 4 groups, two parts
    ("int8", "channel", 2, 42, 24, "f32", {"rows": 4, "splits": 3}),  # rows past K in the last load
    ("fp8", (16, 16), 3, 40, 40, "f32", {"rows": 4}),              # partial blocks at the K and N edges
    ("fp8", "tensor", 1, 24, 8, "f32", {"rows": 8}),
    ("int4", 16, 1, 48, 24, "bf16", {"rows": 4, "splits": 2}),
    ("fp8", "channel", 2, 40, 24, "f16", {"rows": 8, "splits": 2}),
]


@dataclasses.dataclass(frozen=True)
class Run(GemvRun):
    """quant_gemv's case (its scale block), with the keywords of this kernel's functions."""

    @property
    def kw(self):
        return {"kind": self.case[0], "k": self.case[3], "block": self.block}


class TestQuantGateUpContract(GemvCases, KernelContract):
    CASES, RUN = CASES, Run

    def inputs(self, run):
        kind, fmt, M, K, N, dtype = run.case[:6]
        x, qg, sg, _ = _inputs(kind, fmt, M, K, N, dtype, seed=M + K + N)
        _, qu, su, _ = _inputs(kind, fmt, M, K, N, dtype, seed=M + K + N + 1)
        return x, qg, sg, qu, su

    def kernel(self, run, *args):
        return gu.quant_gate_up_pallas(*args, **run.kw, interpret=True, **run.case[6])

    def reference(self, run, *args):
        return gu.quant_gate_up_reference(*args, **run.kw)

    def dispatching(self, run, *args, **kw):
        return gu.quant_gate_up(*args, **run.kw, **kw)

    def reason(self, run, *args):
        return gu.unsupported_reason(*args, **run.kw)

    def error(self, got, want):
        return rel_err(got, want)[:1]

    def tolerance(self, run):
        # gate, up and their activation each rounded to x's dtype (2^-9 in bf16 each, a unit either way where the
        # sums differ), and the reference's weights dequantized to x's dtype before its dot: up to ~3 units
        return (2e-2,)

    def check_more(self, run, args, got, ref, report):
        x, qg, sg, qu, su = args
        kind, fmt, M, K, N, dtype, tiling = run.case
        parts = gu.quant_gate_up_partials(*args, **run.kw, interpret=True, **tiling)
        p = gemv.plan(M, K, N, kind, run.block, **tiling)
        assert parts.shape == (p.splits, 2, M, N) and parts.dtype == jnp.float32, (parts.shape, p)
        # each half against quant_gemv's own launch on its weight, f32 sums of the same plan (x in f32)
        xf = x.astype(jnp.float32)
        for half, (q, s) in enumerate(((qg, sg), (qu, su))):
            alone = gemv.quant_gemv_pallas(xf, q, s, **run.kw, interpret=True, **tiling)
            both = gu.quant_gate_up_partials(xf, qg, sg, qu, su, **run.kw, interpret=True, **tiling)
            assert rel_err(both[:, half].sum(axis=0), alone)[0] < 1e-6, (half, run.case)
        g, u = (_oracle(x, q, s, kind, K, run.block) for q, s in ((qg, sg), (qu, su)))
        oracle = g / (1 + np.exp(-g)) * u
        vs_oracle = rel_err(got, oracle)[0]
        assert vs_oracle < 4 * ORACLE_BOUND[dtype], (vs_oracle, ORACLE_BOUND[dtype])
        swapped = rel_err(gu.quant_gate_up_reference(x, qu, su, qg, sg, **run.kw), ref)[0]
        assert swapped > 0.05, swapped  # gate and up tell apart: a launch that read one for the other fails
        report(f"quant_gate_up {kind} {fmt} M{M} K{K} N{N} {dtype}: grid ({2 * p.col_tiles},{p.splits}); max_rel vs "
               f"float64 {vs_oracle:.1e}; gate and up swapped: {swapped:.2f} apart")

    def unsupported_case(self):
        return Run(("int4", 32, 70, 100, 24, "bf16", {})), "70 rows"  # past every decode kernel's rows

    def check_fallback(self, run, args, out):
        np.testing.assert_array_equal(np.asarray(out), np.asarray(self.reference(run, *args)))

    def more_unsupported_reasons(self):
        x, qg, sg, _ = _inputs("int8", "channel", 1, 40, 24, "f32", seed=1)
        _, qu, su, _ = _inputs("int8", "channel", 1, 40, 28, "f32", seed=2)
        kw = {"kind": "int8", "k": 40, "block": (40, 1)}
        x17 = jnp.zeros((17, 40), jnp.float32)
        return [(gu.unsupported_reason(x, qg, sg, qu, su, **kw), "differ"),
                (gu.unsupported_reason(x17, qg, sg, qg, sg, **kw), "17 rows")]

    def lowering_case(self):
        return Run(("int4", 32, 1, 100, 24, "f32", {}))

    def auto(self, run):
        return jax.jit(lambda *a: gu.quant_gate_up(*a, **run.kw))

    def custom_call(self, run):
        return f"quant_gate_up_{run.case[0]}"


SDS = jax.ShapeDtypeStruct
STORAGE = {"int8": jnp.int8, "int4": jnp.uint8, "fp8": jnp.float8_e4m3fn}
# 27B's MLP; the shared experts of 35B-A3B, 122B-A10B and 397B-A17B (hidden x shared intermediate)
REAL = {"27B": (5120, 17408), "35B-A3B shared": (2048, 512), "122B-A10B shared": (3072, 1024),
        "397B-A17B shared": (4096, 1024)}


def _abstract(kind, K, N):
    qs, ss, block = layout_of(kind, (K, N))
    return QuantArray(q=SDS(qs, STORAGE[kind]), scale=SDS(ss, jnp.float32), kind=kind, shape=(K, N), block=block)


def _mlp_calls(kind, M, K, N, platform="cuda"):
    w = MLPWeights(gate=_abstract(kind, K, N), up=_abstract(kind, K, N), down=_abstract(kind, N, K))
    return kernel_calls(export_for(jax.jit(mlp.mlp), SDS((M, K), jnp.bfloat16), w, platform=platform))


def test_mlp_lowers_the_one_launch_for_cuda_at_real_shapes():
    """The MLP at decode rows lowered for cuda: one launch for gate / up, then down's decode kernel, at every real
    shape and format at the rows the FMA kernel takes, and for int4 / int8 at the tensor-core kernel's rows (a
    verify's, a batch's) its pair form; past them (80 rows) the two launches as before; lowered for cpu, no
    kernel."""
    for name, (K, N) in REAL.items():  # each format at its most rows (27B: at 1 row too)
        for kind, M in [("int4", 1), ("int8", 3), ("fp8", 3)] + [("int8", 1), ("fp8", 1)] * (name == "27B"):
            assert _mlp_calls(kind, M, K, N) == [f"quant_gate_up_{kind}", f"quant_matmul_{kind}"], (name, kind, M)
        for kind, M in (("int4", 4), ("int8", 9), ("fp8", 4)):  # a k = 3 verify; a batch of 9 rows
            assert _mlp_calls(kind, M, K, N) == [f"quant_gate_up_{kind}_mma", f"quant_matmul_{kind}_mma"], \
                (name, kind, M)
    assert _mlp_calls("int4", 2, 5120, 17408) == ["quant_gate_up_int4_mma", "quant_matmul_int4_mma"]
    # past the decode kernels' rows: no one launch (gate and up each quant.linear's choice there, XLA's dot)
    assert not any(c.startswith("quant_gate_up") for c in _mlp_calls("int4", 80, 5120, 17408))
    assert _mlp_calls("int4", 1, 5120, 17408, platform="cpu") == []
    assert _mlp_calls("int4", 4, 5120, 17408, platform="cpu") == []


# (kind, int4 group | "channel", M, K, N, x dtype, forced splits): the tensor-core kernel's rows, its 16-row tile
# (x as it is) and 64-row tile (rows_of_x), one K part and several
MMA_CASES = [("int4", 32, 4, 256, 64, "bf16", 2), ("int8", "channel", 5, 128, 48, "bf16", 2),
             ("int4", 32, 20, 256, 64, "bf16", 2), ("int4", 16, 3, 96, 40, "f16", 1),
             ("fp8", (32, 32), 4, 128, 64, "bf16", 2), ("fp8", "channel", 6, 96, 40, "f16", 1),
             ("fp8", (16, 16), 20, 64, 40, "bf16", 2)]


@pytest.mark.parametrize("case", MMA_CASES, ids=lambda c: f"{c[0]}-M{c[2]}-splits{c[6]}")
def test_tensor_core_rows_take_the_pair_form(case, report):
    """At the tensor-core kernel's rows the one launch is quant_mma's pair form (interpret mode): each half of its
    partials is the single launch's partials on that weight, f32 tight (each program is that launch's program: a
    half that read the other weight, its scales or a dropped part fails), and silu(gate) * up matches the
    reference at bf16 / f16 rounding and a float64 oracle, and not the reference with gate and up swapped."""
    from kernels_pallas.quant_decode import tensor_core_kernel

    kind, fmt, M, K, N, dtype, splits = case
    x, qg, sg, block = _inputs(kind, fmt, M, K, N, dtype, seed=M + K)
    _, qu, su, _ = _inputs(kind, fmt, M, K, N, dtype, seed=M + K + 1)
    kw = {"kind": kind, "k": K, "block": block}
    assert gu.unsupported_reason(x, qg, sg, qu, su, **kw) is None
    parts = gu.quant_gate_up_partials(x, qg, sg, qu, su, **kw, splits=splits, interpret=True)
    assert parts.shape == (splits, 2, M, N) and parts.dtype == jnp.float32, parts.shape
    for half, (q, s) in enumerate(((qg, sg), (qu, su))):
        alone = tensor_core_kernel(kind)(x, q, s, **kw, splits=splits, unsummed=splits > 1, interpret=True)
        alone = alone if splits > 1 else alone[None]
        # (interpret mode: XLA's CPU dots of the two programs may associate a sum differently, a unit of f32; one
        # K part: the single launch writes the product in x's dtype, the pair its f32 value)
        tol = 1e-6 if splits > 1 else 2e-3
        assert rel_err(parts[:, half], alone.astype(jnp.float32))[0] < tol, (half, case)
    got = gu.quant_gate_up_pallas(x, qg, sg, qu, su, **kw, splits=splits, interpret=True)
    ref = gu.quant_gate_up_reference(x, qg, sg, qu, su, **kw)
    assert rel_err(got, ref)[0] < 2e-2, rel_err(got, ref)
    g, u = (_oracle(x, q, s, kind, K, block) for q, s in ((qg, sg), (qu, su)))
    vs_oracle = rel_err(got, g / (1 + np.exp(-g)) * u)[0]
    assert vs_oracle < 4 * ORACLE_BOUND[dtype], vs_oracle
    swapped = rel_err(gu.quant_gate_up_reference(x, qu, su, qg, sg, **kw), ref)[0]
    assert swapped > 0.05, swapped
    report(f"quant_gate_up {kind} tensor-core pair M{M} K{K} N{N} {dtype} splits {splits}: halves == single "
           f"launches; max_rel vs reference {rel_err(got, ref)[0]:.1e}, vs float64 {vs_oracle:.1e}")


def test_mlp_on_cpu_is_the_two_products(monkeypatch):
    """On this CPU the MLP's value is the two products' bit for bit (the reference is what quant.linear lowers),
    and emptying quant.GATE_UP_KINDS (the control: the MLP as before) lowers two decode launches for cuda."""
    rng = np.random.default_rng(0)
    K, N = 96, 40
    ws = [quant.quantize(jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32), "int4", 32)
          for s in ((K, N), (K, N), (N, K))]
    w = MLPWeights(*ws)
    x = jnp.asarray(rng.standard_normal((1, K)), jnp.bfloat16)
    two = jax.jit(lambda x, w: quant.linear(jax.nn.silu(quant.linear(x, w.gate)) * quant.linear(x, w.up), w.down))
    np.testing.assert_array_equal(np.asarray(jax.jit(mlp.mlp)(x, w)), np.asarray(two(x, w)))
    assert quant.gate_up(x, w.gate, w.up) is not None
    monkeypatch.setattr(quant, "GATE_UP_KINDS", ())
    jax.clear_caches()  # mlp.mlp's trace above held the one launch
    assert quant.gate_up(x, w.gate, w.up) is None
    assert _mlp_calls("int4", 1, 5120, 17408) == ["quant_matmul_int4"] * 2  # gate / up's function, down's


@pytest.mark.parametrize("kind,fmt,M,dtype", [("int4", 32, 1, "bf16"), ("int4", 32, 4, "bf16"),
                                                ("int8", "channel", 2, "bf16"), ("fp8", (32, 32), 4, "bf16")],
                         ids=lambda c: str(c))
def test_pair_parts_are_the_two_products_partials(kind, fmt, M, dtype):
    """quant.pair_parts (an attention layer's k and v in one launch, kernels_pallas/attention_rows.py's input):
    [S, 2, M, N] float32 K partials, S the decode kernel's parts of one weight (decode_parts); off cuda (the
    reference) each half's sum rounded to x's dtype is quant.linear's product on its weight, bit for bit; the one
    launch (interpret mode, the FMA kernel at 1 row, the tensor-core one at its rows) gives each half's sum within
    f32 rounding of a float64 oracle, and half 0 is not the second weight's. Plain weights or two layouts: None."""
    from kernels_pallas.quant_decode import decode_parts
    from kernels_pallas.split_k import sum_parts

    K, N = 512, 64
    x, qa, sa, block = _inputs(kind, fmt, M, K, N, dtype, seed=M)
    _, qb, sb, _ = _inputs(kind, fmt, M, K, N, dtype, seed=M + 1)
    a, b = (QuantArray(jnp.asarray(q), jnp.asarray(s), kind=kind, block=tuple(block), shape=(K, N))
            for q, s in ((qa, sa), (qb, sb)))
    kw = {"kind": kind, "k": K, "block": block}
    S = decode_parts(x, qa, sa, **kw)
    ref = quant.pair_parts(x, a, b)
    got = gu.quant_pair_parts(x, qa, sa, qb, sb, **kw, backend="pallas", interpret=True)
    assert ref.shape == got.shape == (S, 2, M, N) and got.dtype == jnp.float32, (ref.shape, got.shape, S)
    for half, (w, q, s) in enumerate(((a, qa, sa), (b, qb, sb))):
        product = np.asarray(quant.linear(x, w))
        np.testing.assert_array_equal(np.asarray(sum_parts(ref[:, half]).astype(x.dtype)), product)
        assert rel_err(sum_parts(got[:, half]), _oracle(x, q, s, kind, K, block))[0] < 1e-5, half
    assert rel_err(sum_parts(got[:, 0]), _oracle(x, qb, sb, kind, K, block))[0] > 0.1
    assert quant.pair_parts(x, qa, qb) is None  # (plain arrays: the caller's products)
    assert quant.pair_parts(x, a, dataclasses.replace(b, block=(K, 1) if fmt != "channel" else (K, 2))) is None


def test_kernel_compiles_for_sm90(report):
    """27B's gate / up at 1 row (int4, fp8) compiled to sm_90: within a block's shared memory, no spill, and the
    inner loop's instructions per stored value within 2% of quant_gemv's single launch of the same plan (each
    program is that launch's program)."""
    from qwen_mtp.tools.lowering import SM90_SHARED_LIMIT, compile_sm90, triton_kernels
    from tests.test_export_cuda import require_triton

    kernels = []
    for kind in ("int4", "fp8"):
        args, block = _real_args(kind, 1, 5120, 17408)
        x, q, s = args
        one = jax.jit(functools.partial(gu.quant_gate_up, kind=kind, k=5120, block=block))
        alone = jax.jit(functools.partial(gemv.quant_gemv_pallas, kind=kind, k=5120, block=block))
        (k1,) = triton_kernels(export_for(one, x, q, s, q, s))
        (k2,) = triton_kernels(export_for(alone, x, q, s))
        kernels += [(kind, k1, k2)]
    require_triton()
    results = compile_sm90([k for _, *ks in kernels for k in ks], loops=True)
    for i, (kind, k1, k2) in enumerate(kernels):
        r1, r2 = results[2 * i], results[2 * i + 1]
        assert r1["error"] is None and r2["error"] is None, (kind, r1["error"], r2["error"])
        p = gemv.plan(1, 5120, 17408, kind, _real_args(kind, 1, 5120, 17408)[1])
        assert k1.grid == (2 * p.col_tiles, p.splits, 1) and k2.grid == (p.col_tiles, p.splits, 1), (k1, k2)
        assert r1["shared"] <= SM90_SHARED_LIMIT and r1["stack"] == 0 and r1["local"] == 0, (kind, r1)
        # the innermost loops (the smallest first): one a weight in the one launch, one in the single launch
        per_value = [max(loop["instructions"] for loop in r["loops"][:n]) * 32 / p.step_values(kind)
                     for r, n in ((r1, 2), (r2, 1))]
        assert per_value[0] <= 1.02 * per_value[1], (kind, per_value)
        report(f"sm_90 compile, quant_gate_up {kind} 27B gate/up M1: grid {k1.grid}, {r1['registers']} registers "
               f"(single launch {r2['registers']}), {r1['stack']} B stack; loop {per_value[0]:.2f} lane-instructions "
               f"per value (single launch {per_value[1]:.2f})")


def test_tensor_core_pair_compiles_for_sm90(report):
    """27B's gate / up at a k = 3 verify's 4 rows (int4, int8, fp8) through the tensor-core kernels' pair form
    (quant_mma, quant_mma_fp8), compiled to sm_90:
    within a block's shared memory, no spill, and the inner loop's instructions per stored value within 2% of the
    single launch's (each program is that launch's program)."""
    from kernels_pallas.quant_decode import tensor_core_kernel, tensor_core_module
    from qwen_mtp.tools.lowering import SM90_SHARED_LIMIT, compile_sm90, triton_kernels
    from tests.test_export_cuda import require_triton

    kernels = []
    for kind in ("int4", "int8", "fp8"):
        (x, q, s), block = _real_args(kind, 4, 5120, 17408)
        one = jax.jit(functools.partial(gu.quant_gate_up, kind=kind, k=5120, block=block))
        alone = jax.jit(functools.partial(tensor_core_kernel(kind), kind=kind, k=5120, block=block))
        (k1,) = triton_kernels(export_for(one, x, q, s, q, s))
        (k2,) = triton_kernels(export_for(alone, x, q, s))
        assert k1.name == f"quant_gate_up_{kind}_mma", k1.name
        kernels += [(kind, block, k1, k2)]
    require_triton()
    results = compile_sm90([k for _, _, *ks in kernels for k in ks], loops=True)
    for i, (kind, block, k1, k2) in enumerate(kernels):
        r1, r2 = results[2 * i], results[2 * i + 1]
        assert r1["error"] is None and r2["error"] is None, (kind, r1["error"], r2["error"])
        p = tensor_core_module(kind).plan(4, 5120, 17408, block, kind=kind)
        assert k1.grid == (2 * p.col_tiles, p.splits, 1) and k2.grid == (p.col_tiles, p.splits, 1), (k1, k2)
        assert r1["shared"] <= SM90_SHARED_LIMIT and r1["stack"] == 0 and r1["local"] == 0, (kind, r1)
        per_value = [max(loop["instructions"] for loop in r["loops"][:n]) * 32 / p.step_values(kind)
                     for r, n in ((r1, 2), (r2, 1))]
        assert per_value[0] <= 1.02 * per_value[1], (kind, per_value)
        report(f"sm_90 compile, quant_gate_up {kind} 27B gate/up M4 (tensor cores): grid {k1.grid}, "
               f"{r1['registers']} registers (single launch {r2['registers']}), shared {r1['shared']} B, "
               f"{r1['stack']} B stack; innermost loop {per_value[0]:.2f} lane-instructions per value (single launch "
               f"{per_value[1]:.2f})")
