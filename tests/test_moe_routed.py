"""The MoE block at decode reads only the routed experts (trunk/mlp.py, quant.routed_dot, kernels_pallas/moe_gemv.py).

* The routed block equals the grouped (lax.ragged_dot) block, itself checked against transformers in
  tests/test_trunk_oracle.py, in every weight format: f32 experts tightly, int8 / int4 / fp8 experts against the
  same quantized weights through the grouped path (f32 activations: tight; bf16: at its rounding). Negative
  control: a gather that takes the wrong expert is caught. The program of a decode step holds no ragged_dot and
  no array the size of all experts (nothing dequantizes or touches every expert).
* The Pallas kernel (interpret mode) against its XLA reference (tests/kernel_contract.py), and each case against
  the independent float64 oracle of tests/test_kernel_quant_matmul.py applied pair by pair.
* Lowered for cuda at the expert shapes of 35B-A3B, 122B-A10B and 397B-A17B: the MoE block holds the kernel
  (gate / up, down); lowered for cpu: no Pallas kernel. Compiled for sm_90 (needs `triton`): shared
  memory within a block, no register spill. (gate and up have the same shapes: one lowered kernel, two calls.)
* The prefill's grouped product (kernels_pallas/moe_grouped.py): the CPU's tiled loop equals lax.ragged_dot in
  every format, with an empty expert and one longer than a tile (control: wrong group sizes are caught); the MoE
  block lowered for cpu runs the loop, lowered for cuda lax.ragged_dot.
* benchmarks/bench_moe.py's short form runs, its prefill table included.
"""

import dataclasses
import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import moe_gemv as mg
from kernels_pallas import moe_grouped
from kernels_pallas import quant_gemv as gemv
from kernels_pallas import quant_gemv_grouped as grouped
from kernels_pallas.quant_layout import cdiv, pack_int4, padded_k
from qwen_mtp.tools.lowering import (
    SM90_SHARED_LIMIT,
    compile_sm90,
    export_for,
    kernel_calls,
    triton_kernels,
)
from qwen_mtp.tools.real_shapes import config as real_config
from qwen_mtp.trunk import mlp
from qwen_mtp.trunk.quant import QuantArray, grouped_dot, layout_of, quantize
from qwen_mtp.trunk.weights import MLPWeights, MoEWeights
from tests.hf_tiny import rel_err
from tests.test_kernel_quant_matmul import _oracle

pytest.register_assert_rewrite("kernel_contract")
from kernel_contract import KernelContract

ROOT = Path(__file__).resolve().parents[1]
SDS = jax.ShapeDtypeStruct
H, I, E, TOPK = 64, 48, 8, 2  # tiny MoE: 8 experts, top-2 (decode rule: tokens x 2 <= 8)
CFG = dataclasses.replace(real_config("Qwen3.5-35B-A3B", layers=1), hidden_size=H, num_experts=E, top_k=TOPK,
                          moe_intermediate_size=I, shared_expert_intermediate_size=I)


def _block_weights(seed, fmt, shared_too=False):
    """MoEWeights of the tiny config in f32; experts in `fmt` ('f32', 'int8', 'int4' groups of 32, 'fp8'), the
    shared expert too where shared_too (as QuantPolicy quantizes it), else f32."""
    rng = np.random.default_rng(seed)
    mat = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-2])).astype(np.float32)
    q = (lambda a: jnp.asarray(a)) if fmt == "f32" else (lambda a: quantize(a, fmt, 32))
    sq = q if shared_too else jnp.asarray
    return MoEWeights(router=jnp.asarray(mat(H, E) * 4), gate=q(mat(E, H, I)), up=q(mat(E, H, I)),
                      down=q(mat(E, I, H)), shared=MLPWeights(*(sq(mat(*s)) for s in ((H, I), (H, I), (I, H)))),
                      shared_gate=jnp.asarray(mat(H, 1)))


def _grouped(x, w, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(mlp, "reads_routed_only", lambda n, cfg: False)
        return jax.jit(lambda x, w: mlp.moe(x, w, CFG))(x, w)  # a fresh function: no trace cached by the next


def test_decode_rule():
    assert mlp.reads_routed_only(4, CFG) and not mlp.reads_routed_only(5, CFG)
    big = real_config("Qwen3.5-35B-A3B", layers=1)  # 256 experts, top-8: batch 8 decode and a k=3 verify at 8
    assert mlp.reads_routed_only(8, big) and mlp.reads_routed_only(32, big) and not mlp.reads_routed_only(33, big)


@pytest.mark.parametrize("fmt,dtype", [("f32", "f32"), ("int8", "f32"), ("int4", "f32"), ("fp8", "f32"),
                                       ("int4", "bf16")])
def test_routed_block_equals_grouped_block(fmt, dtype, monkeypatch, report):
    w = _block_weights(1, fmt)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((1, 3, H)), jnp.float32)
    if dtype == "bf16":
        x = x.astype(jnp.bfloat16)
        w = jax.tree.map(lambda a: a if isinstance(a, QuantArray) else a.astype(jnp.bfloat16), w,
                         is_leaf=lambda a: isinstance(a, QuantArray))
    assert mlp.reads_routed_only(3, CFG)
    got = jax.jit(lambda x, w: mlp.moe(x, w, CFG))(x, w)
    want = _grouped(x, w, monkeypatch)
    max_rel, max_abs = rel_err(got, want)
    if dtype == "f32":
        assert max_rel < 1e-5 or max_abs < 1e-6, (max_rel, max_abs)
    else:  # the grouped path adds each token's pairs in bf16, the routed one in f32: a few output roundings
        assert max_rel < 2 ** -6, (max_rel, max_abs)
    report(f"routed MoE block == grouped block, {fmt} experts, x {dtype}: max_rel {max_rel:.1e}")


def test_wrong_expert_is_caught(monkeypatch):
    """Negative control: the routed path gathering each pair's NEXT expert is far from the grouped block."""
    w = _block_weights(1, "int4")
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, H)), jnp.float32)
    want = _grouped(x, w, monkeypatch)
    real = mlp.routed_mlp
    monkeypatch.setattr(mlp, "routed_mlp", lambda x, g, u, d, ids, **kw: real(x, g, u, d, (ids + 1) % E, **kw))
    bad = jax.jit(lambda x, w: mlp.moe(x, w, CFG))(x, w)
    assert rel_err(bad, want)[0] > 0.05


@pytest.mark.parametrize("fmt", ["f32"])  # the block's glue (each kernel family and format with the shared expert:
def test_shared_expert_as_one_more_pair(fmt, monkeypatch, report):  # test_kernel_moe_expert_mlp.py's cases)
    """On cuda the MoE block hands the shared expert to the routed experts' two launches as one more pair a token
    (mlp._routed_and_shared). Its kernels here in interpret mode: the block equals the block lowered for cpu (the
    shared expert and the routed ones run apart, as before, bit for bit), f32 tight, 3 tokens. Controls: the fold
    is taken (the call is made, the shared expert's rows read); the kernel's shared rows exchanged between tokens
    are caught."""
    w = _block_weights(3, fmt, shared_too=True)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, H)), jnp.float32)
    want = jax.jit(lambda x, w: mlp.moe(x, w, CFG))(x, w)  # lowered for cpu: the reference, the pieces apart
    with monkeypatch.context() as m:  # ... bit for bit the block as it ran before the fold
        m.setattr(mlp, "_routed_and_shared", lambda *a, **kw: None)
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda x, w: mlp.moe(x, w, CFG))(x, w)), np.asarray(want))
    real = mlp.expert_mlp.moe_expert_mlp_pallas
    calls = []

    def fold(reverse):
        def kernel(*a, **kw):
            out = real(*a, **kw, interpret=True)
            calls.append(out.shape)
            P = a[-1].shape[0]
            return jnp.concatenate([out[:P], out[P:][::-1]]) if reverse else out
        monkeypatch.setattr(mlp.expert_mlp, "moe_expert_mlp_pallas", kernel)
        monkeypatch.setattr(mlp, "dispatch", SimpleNamespace(run=lambda name, k, r, reason, backend, *a: k(*a)))
        return jax.jit(lambda x, w: mlp.moe(x, w, CFG))(x, w)

    got = fold(False)
    assert calls == [(3 * TOPK + 3, H)], calls  # the routed pairs, then a pair a token
    max_rel, max_abs = rel_err(got, want)
    assert max_rel < 1e-5 or max_abs < 1e-6, (max_rel, max_abs)
    assert rel_err(fold(True), want)[0] > 0.05, "the shared expert's rows do not tell the tokens apart"
    report(f"MoE block, shared expert folded into the routed kernels (interpret), {fmt}: max_rel {max_rel:.1e} "
           f"vs the block lowered for cpu")


def _all_eqns(jx):
    out = []
    for eq in jx.eqns:
        out.append(eq)
        for sub in jax.extend.core.jaxprs_in_params(eq.params):
            out += _all_eqns(sub)
    return out


def test_decode_step_reads_only_routed_experts():
    """The decode block's program (one token, top-2 of 8 experts): no ragged_dot, and no array larger than the
    two routed experts' weights anywhere (nothing gathers, dequantizes or multiplies all experts); the prefill
    block does use ragged_dot."""
    for fmt in ("f32", "int4", "fp8"):
        w = _block_weights(1, fmt)
        jaxpr = jax.make_jaxpr(mlp.moe, static_argnums=2)(jnp.zeros((1, H)), w, CFG)  # one token: 2 pairs
        eqns = _all_eqns(jaxpr.jaxpr)
        assert not [e for e in eqns if "ragged" in e.primitive.name], fmt
        # (a reshape or bitcast of the stacked experts moves no bytes: int4 / int8 experts are handed to the cuda
        # kernel as int32 words of the same buffer)
        sizes = [int(np.prod(v.aval.shape)) for e in eqns for v in e.outvars if hasattr(v.aval, "shape")
                 and e.primitive.name not in ("reshape", "bitcast_convert_type")]
        # the 2 routed experts' values (int4: unpacked with K padded to whole groups, 64 x 64), never 8 experts'
        assert max(sizes) <= TOPK * 64 * 64 < E * H * I, (fmt, max(sizes))
    prefill = str(jax.make_jaxpr(mlp.moe, static_argnums=2)(jnp.zeros((5, H)), _block_weights(1, "f32"), CFG))
    assert "ragged_dot" in prefill


@pytest.mark.parametrize("fmt", ["f32", "int8", "int4", "fp8"])
def test_grouped_tiles_equal_ragged_dot(fmt):
    """The prefill's tiled loop (8-row tiles) == lax.ragged_dot over 21 sorted rows of 8 experts: two experts empty,
    one of 9 rows (two tiles, the second masked). Control: the loop given wrong group sizes is far off."""
    w = _block_weights(3, fmt).gate
    sizes = jnp.asarray([3, 0, 9, 1, 0, 5, 2, 1], jnp.int32)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((21, H)), jnp.float32)
    f = jax.jit(lambda x, w, g, impl: grouped_dot(x, w, g, impl=impl), static_argnums=3)
    want = f(x, w, sizes, "ragged")
    max_rel, max_abs = rel_err(f(x, w, sizes, "tiles"), want)
    assert max_rel < 1e-5 or max_abs < 1e-6, (fmt, max_rel, max_abs)
    assert rel_err(f(x, w, jnp.roll(sizes, 1), "tiles"), want)[0] > 0.05


def test_prefill_lowers_tiles_for_cpu_and_ragged_dot_for_cuda():
    x, w = jnp.zeros((5, H)), _block_weights(1, "int4")  # 10 pairs > 8 experts: the grouped path
    assert not mlp.reads_routed_only(5, CFG)
    fn = jax.jit(mlp.moe, static_argnums=2)
    ops = lambda p: "\n".join(line for line in export_for(fn, x, w, CFG, platform=p).mlir_module().splitlines()
                              if not line.startswith("#loc"))  # the ops, not the source locations' names
    cpu, cuda = ops("cpu"), ops("cuda")
    assert "stablehlo.while" in cpu and "ragged_dot" not in cpu
    assert "chlo.ragged_dot" in cuda and "stablehlo.while" not in cuda
    with pytest.raises(ValueError, match="impl one of"):
        moe_grouped.grouped_dot(x, w.gate.q, w.gate.scale, jnp.ones(E, jnp.int32), kind="int4", k=H,
                                block=w.gate.block, impl="fast")


# ------------------------------------------------------------------------------------------------ the kernel
def _inputs(kind, fmt, P, K, N, dtype, seed, experts=5):
    """x [P, K], w [E, Kq, N] (random values over the format's range; int4's padded rows garbage), scale, ids."""
    rng = np.random.default_rng(seed)
    dt = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}[dtype]
    ids = jnp.asarray(rng.integers(0, experts, P), jnp.int32)
    x = jnp.asarray(rng.standard_normal((P, K)), jnp.float32).astype(dt)
    if kind == "plain":
        return x, jnp.asarray(rng.standard_normal((experts, K, N)), jnp.float32).astype(dt), None, ids, (K, 1)
    block = (K, 1) if fmt == "channel" else (K, N) if fmt == "tensor" else (fmt, 1) if kind == "int4" else fmt
    bk, bn = block
    if kind == "int8":
        q = rng.integers(-127, 128, (experts, K, N)).astype(np.int8)
    elif kind == "int4":
        q = pack_int4(rng.integers(-8, 8, (experts, padded_k(kind, K, bk), N)), bk)
    else:
        import ml_dtypes
        v = rng.choice([-1.0, 1.0], (experts, K, N)) * 2.0 ** rng.uniform(-12, 8.8, (experts, K, N))
        q = v.astype(ml_dtypes.float8_e4m3fn)
    scale = (rng.uniform(0.5, 2.0, (experts, cdiv(K, bk), cdiv(N, bn))) * 1e-2).astype(np.float32)
    return x, jnp.asarray(q), jnp.asarray(scale), ids, block


# (kind, format, pairs, K, N, x dtype, forced launch parameters)
CASES = [
    ("plain", None, 3, 300, 72, "f32", {"splits": 2}),    # K past the step, N past one tile, 2 K parts
    ("int8", "channel", 5, 130, 40, "f32", {}),
    ("int4", 32, 4, 300, 40, "f32", {"splits": 3}),       # K 300 padded to 10 groups, a part past the end
    ("int4", 128, 2, 200, 136, "f32", {}),
    ("fp8", (128, 128), 3, 300, 200, "f32", {}),          # partial blocks at both edges
    ("fp8", "tensor", 2, 100, 24, "f32", {}),
    ("plain", None, 4, 256, 64, "bf16", {}),
    ("int4", 128, 8, 256, 128, "bf16", {}),
    ("fp8", "channel", 3, 200, 40, "f16", {}),
    # int8 / int4 run quant_gemv's kernel over the pairs (moe_gemv.kernel_for); N not a multiple of 4 this
    # module's own
    ("int4", 64, 3, 300, 42, "f32", {"splits": 2}),
    ("int8", (64, 1), 4, 200, 30, "bf16", {}),
    ("int8", (64, 1), 3, 200, 40, "f32", {"splits": 2}),
    # the plan alternatives benchmarks/gpu_check times (a lane's words per row): ragged last column tiles
    ("int4", 32, 3, 300, 520, "f32", {"words": 2}),
    ("int8", (64, 1), 2, 200, 1040, "f32", {"words": 4, "splits": 2}),
    # x by token (rows_per_x: the pairs that read one row; pad: rows past those, random, never read): one token's
    # row padded to two as the MoE block hands it on cuda (ops.two_rows), and two or more tokens' rows
    ("plain", None, 8, 256, 64, "bf16", {"rows_per_x": 8, "pad": 1}),
    ("fp8", (128, 128), 4, 300, 200, "f32", {"rows_per_x": 2, "pad": 1, "splits": 2}),
    ("int4", 128, 8, 256, 128, "f32", {"rows_per_x": 4}),
    ("int8", "channel", 6, 130, 40, "f32", {"rows_per_x": 3, "pad": 1}),
    ("int4", 64, 4, 300, 42, "f32", {"rows_per_x": 2}),  # this module's own kernel (N not a multiple of 4)
]


@dataclasses.dataclass(frozen=True)
class Case:
    case: tuple

    @property
    def seed(self):
        return sum(self.case[2:5])


class TestMoeGemvContract(KernelContract):
    F32_TOL = (1e-5,)

    def f32_cases(self):
        return [Case(c) for c in CASES if c[5] == "f32"]

    def low_precision_cases(self):
        return [Case(c) for c in CASES if c[5] != "f32"]

    def case_id(self, c):
        kind, fmt, P, K, N, dtype = c.case[:6]
        _, rpx, pad = self._split(c)
        by_token = f"-x{cdiv(P, rpx) + pad}rows" if rpx > 1 else ""
        return f"{kind}-{fmt}-P{P}K{K}N{N}-{dtype}{by_token}".replace(" ", "")

    @staticmethod
    def _split(c):
        """(the launch parameters forced, rows_per_x, rows of x past those its pairs read)."""
        tiling = dict(c.case[6])
        return tiling, tiling.pop("rows_per_x", 1), tiling.pop("pad", 0)

    def inputs(self, c):
        x, w, s, ids, _ = _inputs(*c.case[:6], seed=c.seed)
        _, rpx, pad = self._split(c)
        return (x[:cdiv(c.case[2], rpx) + pad] if rpx > 1 else x), w, s, ids

    def _kw(self, c):
        kind, K = c.case[0], c.case[3]
        return {"kind": kind, "k": K, "block": _inputs(*c.case[:6], seed=c.seed)[4],
                "rows_per_x": self._split(c)[1]}

    def kernel(self, c, *args):
        kw = self._kw(c)
        fn, _ = mg.kernel_for(*args, **{k: v for k, v in kw.items() if k != "rows_per_x"})
        tiling = self._split(c)[0]
        if fn is not mg.moe_gemv_pallas:
            tiling = {k: v for k, v in tiling.items() if k in ("splits", "words")}
        return fn(*args, **kw, interpret=True, **tiling)

    def reference(self, c, *args):
        return mg.moe_gemv_reference(*args, **self._kw(c))

    def dispatching(self, c, *args, **kw):
        return mg.moe_gemv(*args, **self._kw(c), **kw)

    def reason(self, c, *args):
        return mg.kernel_for(*args, **{k: v for k, v in self._kw(c).items() if k != "rows_per_x"})[1]

    def error(self, got, want):
        return rel_err(got, want)[:1]

    def tolerance(self, c):
        return (1e-2,)  # the reference rounds each dequantized weight to x's dtype; the kernel does not

    def check_more(self, c, args, got, ref, report):
        kind, fmt, P, K, N, dtype, _ = c.case
        tiling, rpx, _ = self._split(c)
        x, w, scale, ids = args
        x = x[np.arange(P) // rpx]  # each pair's row
        kw = {k: v for k, v in self._kw(c).items() if k != "rows_per_x"}
        if kind == "plain":
            want = np.einsum("pk,pkn->pn", np.asarray(x.astype(jnp.float32), np.float64),
                             np.asarray(w.astype(jnp.float32), np.float64)[np.asarray(ids)])
        else:
            want = np.concatenate([_oracle(x[p:p + 1], w[e], scale[e], kind, K, kw["block"])
                                   for p, e in enumerate(np.asarray(ids))])
        kernel_vs_oracle = rel_err(got, want)[0]
        assert kernel_vs_oracle < (1e-5 if dtype == "f32" else 2.0 ** -7), kernel_vs_oracle
        fn, _ = mg.kernel_for(*args, **kw)
        if fn is mg.moe_gemv_pallas:
            p = mg.plan(P, K, N, kind, kw["block"], jnp.dtype(x.dtype).itemsize, **tiling)
        else:
            p = gemv.plan(1, K, N, kind, kw["block"], pairs=P, splits=tiling.get("splits"), words=tiling.get("words"))
            if "words" in tiling:  # the override reached the plan: each lane's words, the column tiles they give
                assert p.cols == 32 * tiling["words"] and p.col_tiles == cdiv(N // 4, p.cols) > 1, p
        if "splits" in tiling:
            assert p.splits == tiling["splits"], p
        report(f"moe_gemv kernel {kind} {fmt} P{P} K{K} N{N} {dtype} ({fn.__name__}) grid ({P},{p.col_tiles},"
               f"{p.splits}): max_rel vs float64 {kernel_vs_oracle:.1e}")

    def unsupported_case(self):
        return Case(("fp8", (96, 16), 2, 200, 40, "f32", {})), "K blocks of 96"

    def more_unsupported_reasons(self):
        x, w, s, ids, blk = _inputs("fp8", (96, 16), 2, 200, 40, "f32", seed=1)
        reasons = [(mg.unsupported_reason(x, w, s, ids, kind="fp8", k=200, block=blk), "K blocks of 96")]
        reasons.append((mg.unsupported_reason(x[:0], w, s, ids[:0], kind="fp8", k=200, block=blk), "empty"))
        huge = (SDS((1, 4096), jnp.bfloat16), SDS((513, 4096, 1024), jnp.bfloat16), None, SDS((1,), jnp.int32))
        reasons.append((mg.unsupported_reason(*huge, kind="plain", k=4096, block=(4096, 1)), "2^31"))
        return reasons

    def lowering_case(self):
        return Case(("int4", 32, 3, 300, 40, "f32", {}))

    def auto(self, c):
        return jax.jit(lambda *a: mg.moe_gemv(*a, **self._kw(c)))

    def custom_call(self, c):
        return f"moe_gemv_{c.case[0]}"


def test_bad_inputs_name_what_is_wrong():
    x, w, s, ids, blk = _inputs("int4", 32, 3, 64, 16, "f32", seed=0)
    with pytest.raises(ValueError, match="one expert id per row"):
        mg.moe_gemv(x, w, s, ids[:2], kind="int4", k=64, block=blk)
    with pytest.raises(ValueError, match="stored as uint8"):
        mg.moe_gemv(x, w.astype(jnp.int8), s, ids, kind="int4", k=64, block=blk)
    with pytest.raises(ValueError, match="kind one of"):
        mg.moe_gemv(x, w, s, ids, kind="int2", k=64, block=blk)


# --------------------------------------------------------------------------------- real shapes, cuda / sm_90
REAL = ["Qwen3.5-35B-A3B", "Qwen3.5-122B-A10B", "Qwen3.5-397B-A17B"]


def _moe_shapes(name, quant, tokens=1):
    cfg = dataclasses.replace(real_config(name, layers=1))
    Hh, Ii, Ee = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    bf = jnp.bfloat16

    def experts(K, N, lead=(Ee,)):  # the shared expert (lead ()) quantized as the experts are (QuantPolicy)
        if quant is None:
            return SDS((*lead, K, N), bf)
        qs, ss, block = layout_of(quant, (*lead, K, N))
        return QuantArray(q=SDS(qs, {"int8": jnp.int8, "int4": jnp.uint8, "fp8": jnp.float8_e4m3fn}[quant]),
                          scale=SDS(ss, jnp.float32), kind=quant, shape=(*lead, K, N), block=block)

    Is = cfg.shared_expert_intermediate_size
    w = MoEWeights(router=SDS((Hh, Ee), bf), gate=experts(Hh, Ii), up=experts(Hh, Ii), down=experts(Ii, Hh),
                   shared=MLPWeights(experts(Hh, Is, ()), experts(Hh, Is, ()), experts(Is, Hh, ())),
                   shared_gate=SDS((Hh, 1), bf))
    return cfg, (SDS((tokens, Hh), bf), w)


ROUTER = "moe_router_topk"  # the router's top-k (kernels_pallas/moe_router.py)


@functools.cache  # the sm_90 compile below reads the same exports as the lowering test (unpatched functions both)
def _export(name, quant, platform, tokens=1):
    cfg, args = _moe_shapes(name, quant, tokens)
    return export_for(jax.jit(mlp.moe, static_argnums=2), *args, cfg, platform=platform)


@pytest.mark.parametrize("name,quant", [(n, None) for n in REAL] + [("Qwen3.5-35B-A3B", q)
                                                                    for q in ("int8", "int4", "fp8")])
def test_moe_block_lowers_the_kernel_for_cuda_at_real_shapes(name, quant):
    assert kernel_calls(_export(name, quant, "cuda")) == [ROUTER, *_expert_kernels(quant)], (name, quant)
    assert kernel_calls(_export(name, quant, "cpu")) == []


def _expert_kernels(quant):
    """The routed experts' kernels after the router's top-k (moe_router.py), gate and up in one launch
    (moe_expert_mlp.py), then down: with the activation for plain and fp8 experts, quant_gemv's kernel over the
    pairs for int8 / int4 (XLA's activation before it)."""
    kind = quant or "plain"
    return [f"moe_gate_up_{kind}", f"moe_gemv_{kind}" if kind in grouped.GROUPED_KINDS else f"moe_down_glu_{kind}"]


def test_batch8_and_prefill_at_35b():
    """Batch 8 decode (64 pairs) routes; a prefill chunk of 64 tokens takes the grouped path (no routed kernel; the
    router's top-k is its kernel there too)."""
    assert kernel_calls(_export("Qwen3.5-35B-A3B", "int4", "cuda", tokens=8)) == [ROUTER, *_expert_kernels("int4")]
    assert kernel_calls(_export("Qwen3.5-35B-A3B", None, "cuda", tokens=8)) == [ROUTER, *_expert_kernels(None)]
    assert kernel_calls(_export("Qwen3.5-35B-A3B", None, "cuda", tokens=64)) == [ROUTER]


SM90 = [("35B-A3B bf16", "Qwen3.5-35B-A3B", None), ("35B-A3B int4", "Qwen3.5-35B-A3B", "int4"),
        ("35B-A3B fp8", "Qwen3.5-35B-A3B", "fp8"), ("35B-A3B int8", "Qwen3.5-35B-A3B", "int8"),
        ("397B-A17B bf16", "Qwen3.5-397B-A17B", None)]
# the modules' lane-instructions per stored value, the most of any loop of the kernel (each weight's loops, the
# routed experts' branch and the shared expert's; 35B-A3B: int4 6.2 gate / up, 5.3 down, int8 6.1 / 6.0 on
# quant_gemv's kernel over the pairs, one word a lane, x read as it is, within 3% of the same count before the
# shared expert's branch; fp8 3.7 and bf16 3.7-3.9 on moe_gemv's) with a margin for ptxas' scheduling; no I2F (an
# eighth of the FMA rate)
MOE_PER_VALUE = {"int4": 6.5, "int8": 6.4, "fp8": 4.1, None: 4.7}
# down after gate and up in one launch (moe_expert_mlp.py) forms silu(gate) * up of each row of x it loads (the
# partials' loads, their sums, a sigmoid and the roundings, in every thread holding the row): 35B-A3B bf16 8.2,
# fp8 5.6, under the bytes' time at 4.8 TB/s (bf16 13.9, fp8 7.0)
GLU_PER_VALUE = {"fp8": 6.3, None: 8.6}


def test_kernel_compiles_for_sm90(report):
    if importlib.util.find_spec("triton") is None:
        why = "the sm_90 compile needs the `triton` package: pip install -e '.[sm90]'"
        if os.environ.get("QWEN_MTP_REQUIRE_SM90") == "1":  # CI installs it and requires the test to run
            pytest.fail(why)
        pytest.skip(why)
    kernels = []
    for label, name, quant in SM90:
        router, gate, down = triton_kernels(_export(name, quant, "cuda"))
        assert [router.name, gate.name, down.name] == [ROUTER, *_expert_kernels(quant)], (router, gate, down)
        kernels += [(f"{label} gate/up", quant, name, gate), (f"{label} down", quant, name, down)]
    for (label, quant, name, k), r in zip(kernels, compile_sm90([k for *_, k in kernels], loops=True)):
        assert r["error"] is None, (label, r["error"])
        cfg = _moe_shapes(name, quant)[0]
        K, N = (cfg.moe_intermediate_size, cfg.hidden_size) if label.endswith("down") else \
            (cfg.hidden_size, cfg.moe_intermediate_size)
        if quant in grouped.GROUPED_KINDS:  # quant_gemv's kernel over the pairs: one load of `rows` stored rows
            pairs = k.grid[0] * (2 if k.name.startswith("moe_gate_up") else 1)  # the pair form: planned as 2P
            p = gemv.plan(1, K, N, quant, layout_of(quant, (1, K, N))[2], pairs=pairs)
            values = p.step_values(quant)
        else:  # one scale block (fp8 K block; per channel and plain PLAIN_STEP rows) of a column tile; gate and
            # up's grid holds both weights' tiles (one loop each)
            tiles = k.grid[1] // 2 if k.name.startswith("moe_gate_up") else k.grid[1]
            values = {"fp8": 128}.get(quant, mg.PLAIN_STEP) * (N // tiles)
        limit = (GLU_PER_VALUE if k.name.startswith("moe_down_glu") else MOE_PER_VALUE)[quant]
        loops = r["loops"]  # each weight's loops, the routed experts' and the shared expert's (one more pair a token)
        per_value = max(loop["instructions"] for loop in loops) * 32 * k.num_warps / values
        assert all("I2F" not in loop["opcodes"] for loop in loops) and per_value <= limit, (label, per_value, loops)
        report(f"sm_90 compile, moe_gemv {label}: grid {k.grid}, {k.num_warps} warps, shared {r['shared']} B, "
               f"{r['registers']} registers, {r['stack']} B stack, {r['local']} B local; loop {per_value:.2f} "
               f"lane-instructions per value")
        assert r["shared"] <= SM90_SHARED_LIMIT and r["stack"] == 0 and r["local"] == 0, (label, r)
        assert k.grid[0] * k.grid[1] * k.grid[2] >= 132, (label, k.grid)  # every SM of an H100 / H200 busy


def test_bench_moe_short_form_runs():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_moe.py"), "--short", "--prefill", "12"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "MoE block / dense MLP" in out.stdout, out.stdout
    assert "bf16  T=  12: fastest " in out.stdout and "dispatch tiles" in out.stdout, out.stdout


def test_gpu_check_moe_section_runs_on_cpu(capsys):
    """benchmarks/gpu_check's MoE section (the kernel in interpret mode on CPU, one smoke case) reports no failure."""
    bench = str(ROOT / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from gpu_check.moe import MOE_PREFILL_SMOKE, MOE_SMOKE, check_moe, check_moe_prefill

    assert check_moe(MOE_SMOKE[:1], interpret=True, timings=False) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "x by token (2 pairs a row) max_rel" in out, out  # the gate / up form of the call
    assert check_moe_prefill(MOE_PREFILL_SMOKE[:1], interpret=True, timings=False) == 0
    out = capsys.readouterr().out
    assert "lax.ragged_dot max_rel" in out and "tiles (CPU path) max_rel" in out and "routed kernel max_rel" in out
    from gpu_check.moe_swiglu import SWIGLU_SMOKE, check_moe_swiglu

    assert check_moe_swiglu(SWIGLU_SMOKE, interpret=True, timings=False) == 0  # the fused experts' SwiGLU
    out = capsys.readouterr().out
    assert "fused max_rel" in out and "three calls max_rel" in out and "OK" in out, out
    from gpu_check.moe_swiglu import SHARED_SMOKE

    assert check_moe_swiglu(SHARED_SMOKE[:1], interpret=True, timings=False, shared=True) == 0  # a pair a token
    out = capsys.readouterr().out
    assert out.count("one launch pair max_rel") == 1 and "shared expert apart max_rel" in out, out
    from gpu_check.router import ROUTER_SMALL, check_router

    assert check_router(ROUTER_SMALL, interpret=True, timings=False) == 0  # the router's top-k, bit for bit
    out = capsys.readouterr().out
    assert out.count("values equal, ids equal OK") == len(ROUTER_SMALL), out


def test_gpu_check_times_the_plan_alternatives(capsys, monkeypatch):
    """gpu_check's plan sweep (check_moe_plans): every alternative of plan_alternatives is checked against the
    reference (interpret mode here); with timings (a fake clock: the last alternative fastest, the plan's own 3x
    slower), the line names the fastest and how far the plan's own choice is from it."""
    bench = str(ROOT / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from gpu_check import moe as gmoe
    from gpu_check import plans

    (case,) = gmoe.MOE_PLANS_SMOKE
    kind, fmt, P, E, K, N, _ = case
    alternatives = grouped.plan_alternatives(kind, K, N, (fmt, 1), P)
    assert len(alternatives) >= 4 and sum(own for *_, own in alternatives) == 1, alternatives
    assert {w for w, *_ in alternatives} == set(gemv.WORDS), alternatives
    own = next(i for i, a in enumerate(alternatives) if a[-1])
    fastest = len(alternatives) - 1 if own != len(alternatives) - 1 else 0
    clock = iter([1e-6 if i == fastest else 3e-6 for i in range(len(alternatives))])
    monkeypatch.setattr(plans, "time_call", lambda *a, **k: next(clock))
    # one sweep: each alternative is checked against the reference (plans.sweep), and timed only once it matches
    assert gmoe.check_moe_plans([case], interpret=True, timings=True) == 0
    line = capsys.readouterr().out
    assert "FAIL" not in line, line
    w, sp, p, _ = alternatives[fastest]
    assert f"fastest: {w} word{'s' * (w > 1)} a lane, {sp} K part" in line, line
    assert "the plan's choice takes 3.00x its time" in line and line.count(" us (") == len(alternatives), line
