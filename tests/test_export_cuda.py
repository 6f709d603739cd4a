"""Every Pallas kernel and every jitted entry point lowers for cuda on this CPU (jax.export runs the whole GPU
lowering, Pallas-Triton included), at the test shapes and at real Qwen3.5 shapes, with the kernel's custom call
in the cuda program and the pure-JAX reference in the cpu and rocm ones.

Real shapes come from qwen_mtp/tools/real_shapes.py as jax.ShapeDtypeStructs: nothing is allocated. Entry points use
real layer dimensions with one full period of layers (3 GDN : 1 attention; lowering does not depend on depth),
and one full-depth 27B program. The kernel's Triton IR is then read out of the program and compiled to sm_90
machine code with the `triton` package (test_kernels_compile_for_sm90), a close proxy for XLA's own Triton
compile, which only a GPU runs (benchmarks/gpu_check). Streaming needs nothing of its own: generate runs the
same decode programs in segments and reads the tokens between them (no host callback in any program).
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import dispatch
from kernels_pallas import quant_matmul as qmm
from kernels_pallas.windowed_attention import (
    unsupported_reason,
    windowed_attend,
    windowed_attend_pallas,
)
from qwen_mtp.decoding.plain import first_token, plain_decode, plain_start
from qwen_mtp.decoding.prefill import hidden_logits, keep_last, mtp_chunk, trunk_chunk
from qwen_mtp.decoding.sampling import Sampling
from qwen_mtp.decoding.speculative import SpecConfig
from qwen_mtp.errors import ArgumentError
from qwen_mtp.head.mtp import init_mtp_cache
from qwen_mtp.tools import real_shapes
from qwen_mtp.tools.lowering import (
    SM90_SHARED_LIMIT,
    compile_sm90,
    export_for,
    export_spec_decode,
    kernel_calls,
    triton_kernels,
)
from qwen_mtp.trunk import quant
from qwen_mtp.trunk.config import load_config
from qwen_mtp.trunk.state import init_state
from qwen_mtp.trunk.weights import weight_shapes
from tests.test_kernel_quant_matmul import CASES as QUANT_INTERPRET_CASES
from tests.test_kernel_quant_matmul import _inputs as quant_inputs
from tests.test_kernel_windowed_attention import CASES as INTERPRET_CASES

KERNEL = "windowed_draft_attention"
CAUSAL = "causal_attention"  # the trunk's and the native head's attention (kernels_pallas/causal_attention.py)
QUERIES = "attention_new_rows"  # a decode step's / verify's queries, keys and values (kernels_pallas/attention_rows.py)
GDN_STEP, GDN_VERIFY = "gdn_decode_step", "gdn_verify"  # the GDN layers' decode step and verify (gdn_step.py)
GDN_CONV = "gdn_conv_step"  # the GDN conv at a decode step, its state in place (gdn_conv.py)
ROLLBACK = "gdn_rollback"  # a GDN layer's two states rebuilt after a verify, in place (gdn_rollback.py)
SDS = jax.ShapeDtypeStruct
i32 = lambda *s: SDS(s, jnp.int32)


def require_triton():
    """The sm_90 compiles need the `triton` package, the `sm90` extra (about 1 GB, so not in `test`): without it
    the test skips, saying how to get it, unless QWEN_MTP_REQUIRE_SM90=1 (.ci/run sets it, installing the
    extra), where a missing triton fails instead, so CI cannot lose these tests unseen."""
    if importlib.util.find_spec("triton") is not None:
        return
    why = "the sm_90 compile needs the `triton` package: pip install -e '.[sm90]'"
    if os.environ.get("QWEN_MTP_REQUIRE_SM90") == "1":
        pytest.fail(why + " (QWEN_MTP_REQUIRE_SM90=1: CI requires it)")
    pytest.skip(why)

# ------------------------------------------------------------------------------------------ the kernel alone
# (q heads, kv heads) of the real models' attention and MTP head: 27B, 35B-A3B, 122B-A10B and 397B-A17B (32 / 2)
REAL_HEADS = {"27B": (24, 4), "35B-A3B": (16, 2), "122B-397B": (32, 2)}


def _kernel_args(B, T, nh, nkv, hd, L, dtype):
    return (SDS((B, T, nh, hd), dtype), SDS((B, L, nkv, hd), dtype), SDS((B, L, nkv, hd), dtype),
            SDS((B, T, nkv, hd), dtype), SDS((B, T, nkv, hd), dtype), i32(B))


# T = 1 is a draft step, T = k + 1 the refill after a verify. Every model: the draft step at batch 1 with the
# paper's W 4032, S 64, and the k = 8 refill at the largest window, batch and sinks (B 8, W 8192, S 128);
# 27B also every k in 1..8 there.
REAL_KERNEL_CASES = ([(m, 1, 1, 4032, 64) for m in REAL_HEADS] + [(m, 8, 9, 8192, 128) for m in REAL_HEADS]
                     + [("27B", 8, t, 8192, 128) for t in range(2, 9)])


@pytest.mark.parametrize("model,B,T,W,S", REAL_KERNEL_CASES, ids=lambda c: str(c))
def test_kernel_lowers_for_cuda_at_real_shapes(model, B, T, W, S):
    nh, nkv = REAL_HEADS[model]
    k = max(T - 1, 1)
    args = _kernel_args(B, T, nh, nkv, 256, S + W + k, jnp.bfloat16)
    assert unsupported_reason(args[0], args[1], args[3], S) is None
    exported = export_for(lambda *a: windowed_attend(*a, W, S), *args)
    assert kernel_calls(exported) == [KERNEL]


# the interpret-mode test cases of test_kernel_windowed_attention.py (B, T, nkv, G, hd, sinks, window, k)
TEST_SHAPES = [case[:8] for case in INTERPRET_CASES]


@pytest.mark.parametrize("case", TEST_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kernel_lowers_for_cuda_at_test_shapes(case, dtype):
    B, T, nkv, G, hd, S, W, k = case
    args = _kernel_args(B, T, nkv * G, nkv, hd, S + W + k, dtype)
    for splits in (None, 1, 3):
        exported = export_for(lambda *a: windowed_attend_pallas(*a, W, S, num_splits=splits), *args)  # noqa: B023
        assert kernel_calls(exported) == [KERNEL]


def test_backend_is_chosen_per_lowering_platform():
    """One traced function: the kernel when lowered for cuda, the reference for cpu and rocm, whatever this
    process's default backend is (a CPU here)."""
    args = _kernel_args(2, 5, 24, 4, 256, 64 + 4032 + 4, jnp.bfloat16)
    fn = jax.jit(lambda *a: windowed_attend(*a, 4032, 64))
    assert kernel_calls(export_for(fn, *args, platform="cuda")) == [KERNEL]
    for platform in ("cpu", "rocm"):
        assert kernel_calls(export_for(fn, *args, platform=platform)) == []
    forced = jax.jit(lambda *a: windowed_attend(*a, 4032, 64, backend="reference"))
    assert kernel_calls(export_for(forced, *args, platform="cuda")) == []


def test_unsupported_shape_lowers_the_reference_for_cuda(monkeypatch):
    monkeypatch.setattr(dispatch, "_warned", set())  # the warning is once per process: start afresh
    args = _kernel_args(1, 3, 2, 1, 24, 4 + 2, jnp.float32)  # head_dim 24: not a power of two
    assert "head_dim 24" in unsupported_reason(args[0], args[1], args[3], 0)
    assert kernel_calls(export_for(lambda *a: windowed_attend(*a, 4, 0), *args)) == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_for(lambda *a: windowed_attend(*a, 4, 0, backend="pallas"), *args)
    assert any("head_dim 24" in str(w.message) for w in caught)


# ------------------------------------------------------------------------------------- the jitted entry points
def _config(name):
    if name == "shipped":
        return load_config(Path(__file__).resolve().parents[1] / "checkpoints" / "qwen3_5_small"), jnp.float32
    if name == "27B-full-depth":
        return real_shapes.config("Qwen3.5-27B"), jnp.bfloat16
    return real_shapes.config(name, layers=4), jnp.bfloat16


WINDOWED = SpecConfig(k=4, window=4032, sinks=64)
NATIVE = SpecConfig(k=4)
GREEDY, SAMPLED = Sampling(), Sampling(temperature=0.7, top_k=50, top_p=0.9)
B, CACHE, CAP, CHUNK = 5, 2048, 64, 256  # B = 5: no other test traces these programs at these shapes


def _state(cfg, dtype):
    return jax.eval_shape(lambda: init_state(cfg, B, CACHE, dtype))


def _head_cache(cfg, dtype, spec):
    return jax.eval_shape(lambda: init_mtp_cache(cfg, B, CACHE, dtype, window=spec.window, sinks=spec.sinks,
                                                 k=spec.k))


def _n_attn(cfg):
    return cfg.layer_types.count("full_attention")


# the routed MoE experts at decode, plain: gate and up in one launch, down with the activation
# (kernels_pallas/moe_expert_mlp.py, tests/test_kernel_moe_expert_mlp.py)
MOE = ("moe_gate_up_plain", "moe_down_glu_plain")
ROUTER = "moe_router_topk"  # the router's top-k (kernels_pallas/moe_router.py, tests/test_kernel_moe_router.py)


def _dense_kernels(calls, cfg):
    """The kernel calls besides the MoE block's (the router's top-k, the routed experts), which an MoE model's
    decode programs hold and a dense model's do not."""
    assert all(m in calls for m in MOE) == (ROUTER in calls) == (cfg.num_experts > 0), calls
    return [c for c in calls if c not in (*MOE, ROUTER)]


def _check_round_kernels(calls, spec):
    """A round's kernels: the verify's GDN kernel and causal attention (one lowered function each for all the
    trunk's layers of a kind, whose shapes are the same; a call site per distinct shape) and the head's attention
    in the draft steps (k > 1) and in the refill, windowed (two shapes: 1 and k + 1 rows) or causal (native); each
    causal attention's queries made by the queries' kernel (a decode program's rows are few); the rollback's kernel
    (one lowered function for all the GDN layers) where the verify's rows are rollback.KERNEL_MIN_ROWS or more
    (these programs' qkv is a product, not K partials)."""
    from qwen_mtp.decoding.rollback import KERNEL_MIN_ROWS

    assert calls.count(GDN_VERIFY) == 1 and GDN_STEP not in calls and GDN_CONV not in calls, calls
    assert calls.count(ROLLBACK) == (spec.k + 1 >= KERNEL_MIN_ROWS), calls
    assert CAUSAL in calls and QUERIES in calls, calls  # (one lowered function a shape and RoPE offset each)
    calls = [c for c in calls if c not in (GDN_VERIFY, QUERIES, ROLLBACK)]
    if spec.window is not None:
        assert set(calls) == {CAUSAL, KERNEL} and calls.count(KERNEL) == 1 + (spec.k > 1), calls
    else:
        assert set(calls) == {CAUSAL}, calls


def _spec_program(cfg, dtype, spec, sampling, platform="cuda"):
    return export_spec_decode(cfg, dtype, spec, sampling, batch=B, cache_len=CACHE, cap=CAP, platform=platform)


def _plain_program(cfg, dtype, sampling, cap=CAP, keep_logits=False):
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    carry = jax.eval_shape(lambda *a: plain_start(*a, cap=cap, keep_logits=keep_logits), i32(B),
                           SDS((B, cfg.vocab_size), jnp.float32), i32(B), key, i32(1), i32())
    return export_for(plain_decode, weight_shapes(cfg, dtype), cfg, _state(cfg, dtype), carry, i32(1), i32(), i32(),
                      i32(), keep_logits=keep_logits, sampling=sampling)


ENTRY_CONFIGS = ["shipped", "Qwen3.5-27B", "Qwen3.5-35B-A3B"]


@pytest.mark.parametrize("name", ENTRY_CONFIGS)
def test_prefill_and_head_fill_lower_for_cuda(name):
    cfg, dtype = _config(name)
    w = weight_shapes(cfg, dtype)
    # an MoE's prefill and head fill hold the router's top-k too (the grouped experts are XLA's there)
    moe = [ROUTER] if cfg.num_experts else []
    prefill = export_for(trunk_chunk, w, cfg, i32(B, CHUNK), _state(cfg, dtype), i32(B), i32(B))
    assert sorted(kernel_calls(prefill)) == [CAUSAL] + moe  # every attention layer calls one lowered function
    hidden = SDS((B, CHUNK, cfg.hidden_size), dtype)
    for spec in (NATIVE, WINDOWED):
        exported = export_for(mtp_chunk, w, cfg, i32(B, CHUNK), hidden, _head_cache(cfg, dtype, spec), i32(B),
                              window=spec.window, sinks=spec.sinks)
        assert sorted(kernel_calls(exported)) == sorted(([KERNEL] if spec.window else [CAUSAL]) + moe)
    export_for(keep_last, SDS((B, CHUNK, cfg.hidden_size), dtype), SDS((B, cfg.hidden_size), dtype), i32(B), i32(B))
    export_for(hidden_logits, w, SDS((B, cfg.hidden_size), dtype))
    export_for(first_token, w, SDS((B, cfg.hidden_size), dtype), jax.eval_shape(lambda: jax.random.PRNGKey(0)),
               sampling=SAMPLED)


@pytest.mark.parametrize("name", ENTRY_CONFIGS)
def test_plain_decode_loop_lowers_for_cuda(name):
    cfg, dtype = _config(name)
    for sampling, keep in ((GREEDY, False), (SAMPLED, True)):
        calls = _dense_kernels(kernel_calls(_plain_program(cfg, dtype, sampling, keep_logits=keep)), cfg)
        assert sorted(calls) == [QUERIES, CAUSAL, GDN_CONV, GDN_STEP], calls


@pytest.mark.parametrize("name", ENTRY_CONFIGS)
@pytest.mark.parametrize("spec,sampling", [(NATIVE, GREEDY), (WINDOWED, GREEDY), (WINDOWED, SAMPLED),
                                           (NATIVE, SAMPLED), (SpecConfig(k=1, window=256, sinks=4), GREEDY)],
                         ids=["native", "windowed", "windowed-sampled", "native-sampled", "windowed-k1"])
def test_speculative_loop_lowers_for_cuda(name, spec, sampling):
    cfg, dtype = _config(name)
    _check_round_kernels(_dense_kernels(kernel_calls(_spec_program(cfg, dtype, spec, sampling)), cfg), spec)


PENALISED = {"greedy": Sampling(repetition_penalty=1.3),
             "sampled": Sampling(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1)}


@pytest.mark.parametrize("name", ["shipped", "Qwen3.5-27B"])  # the penalty's ops do not depend on the MLP
def test_repetition_penalty_programs_lower_for_cuda(name):
    """The programs generate adds under a repetition penalty: the prompt's ids, the first token, the plain loop
    and the speculative loop with the [B, vocab] context in their carries (penalty.py)."""
    from qwen_mtp.decoding.plain import prompt_seen

    cfg, dtype = _config(name)
    s = PENALISED["sampled"]
    export_for(prompt_seen, i32(B, CHUNK), i32(B), vocab_size=cfg.vocab_size, sampling=s)
    export_for(first_token, weight_shapes(cfg, dtype), SDS((B, cfg.hidden_size), dtype),
               jax.eval_shape(lambda: jax.random.PRNGKey(0)), SDS((B, cfg.vocab_size), jnp.bool_), sampling=s)
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    carry = jax.eval_shape(lambda *a: plain_start(*a, cap=CAP, keep_logits=False), i32(B),
                           SDS((B, cfg.vocab_size), jnp.float32), i32(B), key, i32(1), i32(),
                           SDS((B, cfg.vocab_size), jnp.bool_))
    assert carry.seen.shape == (B, cfg.vocab_size)
    plain = export_for(plain_decode, weight_shapes(cfg, dtype), cfg, _state(cfg, dtype), carry, i32(1), i32(),
                       i32(), i32(), keep_logits=False, sampling=PENALISED["greedy"])
    assert sorted(kernel_calls(plain)) == [QUERIES, CAUSAL, GDN_CONV, GDN_STEP]
    for spec, sampling in ((NATIVE, PENALISED["greedy"]), (WINDOWED, PENALISED["sampled"])):
        _check_round_kernels(kernel_calls(_spec_program(cfg, dtype, spec, sampling)), spec)


def test_a_penalised_loop_without_the_context_is_refused():
    cfg, dtype = _config("shipped")
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    carry = jax.eval_shape(lambda *a: plain_start(*a, cap=CAP, keep_logits=False), i32(B),
                           SDS((B, cfg.vocab_size), jnp.float32), i32(B), key, i32(1), i32())  # no seen=
    with pytest.raises(ArgumentError, match="carry.seen"):
        export_for(plain_decode, weight_shapes(cfg, dtype), cfg, _state(cfg, dtype), carry, i32(1), i32(), i32(),
                   i32(), keep_logits=False, sampling=PENALISED["greedy"])


def test_full_depth_27b_speculative_loop_lowers_for_cuda():
    cfg, dtype = _config("27B-full-depth")
    assert cfg.num_layers == 64
    _check_round_kernels(kernel_calls(_spec_program(cfg, dtype, WINDOWED, SAMPLED)), WINDOWED)
    assert _n_attn(cfg) == 16


def test_windowed_program_lowered_for_cpu_holds_the_reference():
    cfg, dtype = _config("shipped")
    assert kernel_calls(_spec_program(cfg, dtype, WINDOWED, GREEDY, platform="cpu")) == []


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kernel_triton_ir_dots(dtype):
    """What the GPU gets, read from the Triton IR: f32 dots in IEEE precision (Triton's DEFAULT would be TF32,
    about 1e-3 relative error), bf16 dots on bf16 operands (tensor cores) accumulating in f32."""
    args = _kernel_args(1, 1, 24, 4, 256, 64 + 4032 + 7, dtype)
    (kernel,) = triton_kernels(export_for(lambda *a: windowed_attend(*a, 4032, 64), *args))
    dots = [line for line in kernel.ir.splitlines() if "tt.dot" in line]
    assert len(dots) == 4, dots  # q.k and p.v, for the ring blocks and for the new rows
    name = "f32" if dtype == jnp.float32 else "bf16"
    for line in dots:
        assert "tf32" not in line, line
        operands, result = line.split(":")[-1].split("->")
        assert operands.count(f"x{name}>") == 2 and result.strip().endswith("xf32>"), line


# kernels compiled to sm_90 machine code: (label, B, T, q heads, kv heads, head_dim, sinks, window, dtype)
SM90_CASES = [("27B draft step", 1, 1, 24, 4, 256, 64, 4032, jnp.bfloat16),
              ("27B refill k8", 1, 9, 24, 4, 256, 64, 4032, jnp.bfloat16),
              ("35B-A3B refill k4 B8", 8, 5, 16, 2, 256, 64, 4032, jnp.bfloat16),
              ("397B refill k8 W8192", 4, 9, 32, 2, 256, 128, 8192, jnp.bfloat16),
              ("shipped model step", 1, 1, 4, 2, 64, 4, 64, jnp.bfloat16),
              ("shipped model refill", 1, 5, 4, 2, 64, 4, 64, jnp.bfloat16),
              ("27B draft step f32", 1, 1, 24, 4, 256, 64, 4032, jnp.float32),
              ("397B refill k8 f32", 4, 9, 32, 2, 256, 128, 8192, jnp.float32)]


def test_kernels_compile_for_sm90(report):
    """The kernel's Triton IR compiled to H100 / H200 (sm_90) machine code on this CPU with the `triton`
    package: it compiles, its shared memory fits one block's 227 KiB, and in bf16 (the speed path) it spills no
    register. f32 at head_dim >= 128 spills a little (the f32 accumulator, the f32 query tile and an f32 K / V
    block share the registers); it is the precision path, bounded here so it cannot grow unseen."""
    require_triton()
    kernels = []
    for label, b, t, nh, nkv, hd, sinks, window, dtype in SM90_CASES:
        args = _kernel_args(b, t, nh, nkv, hd, sinks + window + max(t - 1, 1), dtype)
        (kernel,) = triton_kernels(export_for(lambda *a: windowed_attend(*a, window, sinks), *args))  # noqa: B023
        kernels.append(kernel)
    # and one launch the rules would never pick (K / V blocks of 128 slots, 3 stages): the probe must see it
    # overflow shared memory, or it is not reading real numbers
    args = _kernel_args(1, 1, 24, 4, 256, 64 + 4032 + 1, jnp.bfloat16)
    (too_big,) = triton_kernels(export_for(lambda *a: windowed_attend_pallas(*a, 4032, 64, block_k=128,
                                                                             num_stages=3), *args))
    *results, big = compile_sm90(kernels + [too_big])
    assert big["error"] is None and big["shared"] > SM90_SHARED_LIMIT, big
    for (label, *_, dtype), kernel, r in zip(SM90_CASES, kernels, results):
        assert r["error"] is None, (label, r["error"])
        report(f"sm_90 compile, {label}: grid {kernel.grid}, {kernel.num_warps} warps, {kernel.num_stages} stages, "
               f"shared {r['shared']} B (limit {SM90_SHARED_LIMIT}), {r['registers']} registers, "
               f"{r['stack']} B spilled per thread")
        assert 0 < r["shared"] <= SM90_SHARED_LIMIT, (label, r)
        assert r["stack"] == 0 if dtype == jnp.bfloat16 else r["stack"] <= 256, (label, r)


# ------------------------------------------------------------------------------ the quantized-matmul kernel
# real Qwen3.5-27B matrices [in, out]: the MLP's gate / up and down, and lm_head
QUANT_REAL = {"gate/up": (5120, 17408), "down": (17408, 5120), "lm_head": (5120, 248320)}
QUANT_M = (1, 5, 512)  # a decode step, the verify of k = 4 drafts, a prefill chunk


def _quant_args(kind, M, K, N, dtype, fmt=None):
    """(x, q, scale) ShapeDtypeStructs and the block of a [K, N] weight in `kind`: quant.layout_of's layout
    (int4 groups of 128, fp8 128 x 128 blocks), or fp8 per channel with fmt="channel"."""
    qs, ss, block = quant.layout_of(kind, (K, N), 128)
    if fmt == "channel":
        ss, block = (1, N), (K, 1)
    return (SDS((M, K), dtype), SDS(qs, qmm.STORAGE[kind]), SDS(ss, jnp.float32)), block


def _quant_fn(kind, K, block, **kw):
    return jax.jit(lambda x, q, s: qmm.quant_matmul(x, q, s, kind=kind, k=K, block=block, **kw))


@pytest.mark.parametrize("case", QUANT_INTERPRET_CASES, ids=lambda c: f"{c[0]}-{c[1]}-M{c[2]}K{c[3]}N{c[4]}-{c[5]}")
def test_quant_kernel_lowers_for_cuda_at_test_shapes(case):
    """The interpret-mode cases of test_kernel_quant_matmul.py, with their forced launch parameters."""
    kind, fmt, M, K, N, dtype, tiling = case
    *arrays, block = quant_inputs(kind, fmt, M, K, N, dtype, seed=0)
    args = [SDS(a.shape, a.dtype) for a in arrays]
    exported = export_for(lambda *a: qmm.quant_matmul_pallas(*a, kind=kind, k=K, block=block, **tiling), *args)
    assert kernel_calls(exported) == [f"quant_matmul_{kind}"]


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_quant_kernel_lowers_for_cuda_at_real_shapes(kind):
    """27B's gate / up, down and lm_head at M = 1, 5 and 512 with bf16 activations: the kernel (backend
    "pallas") is in the cuda program, and no dequantized weight is: no [K, N] bf16 array exists anywhere in it
    (the reference, lowered for cpu, has one; that is what the check would see if the kernel dequantized through
    memory). backend "auto" lowers a decode kernel where one takes the rows (qmm.decode_kernel), else the tiled
    kernel where it measured faster on an H200 (qmm.xla_is_faster: int4 groups and fp8 blocks at M <= 16) and
    XLA's dequantize-then-dot elsewhere."""
    chose_kernel = set()
    for name, (K, N) in QUANT_REAL.items():
        for M in QUANT_M:
            args, block = _quant_args(kind, M, K, N, jnp.bfloat16)
            assert qmm.unsupported_reason(*args, kind=kind, k=K, block=block) is None
            exported = export_for(_quant_fn(kind, K, block, backend="pallas"), *args)
            assert kernel_calls(exported) == [f"quant_matmul_{kind}"], (name, M)
            assert f"tensor<{K}x{N}xbf16>" not in exported.mlir_module(), (name, M)
            auto = kernel_calls(export_for(_quant_fn(kind, K, block), *args))
            faster = qmm.xla_is_faster(M, kind, K, block)
            decode = qmm.decode_kernel(*args, kind, K, block)  # first: a decode kernel where one takes the rows
            want = ([] if faster else [f"quant_matmul_{kind}"]) if decode is None else \
                [f"quant_matmul_{kind}" + "_mma" * (decode is qmm.quant_mma)]
            assert auto == want, (name, M, faster)
            if auto:
                chose_kernel.add(M)
    # the rule's table: the FMA decode kernel at M 1, a tensor-core decode kernel at 5 rows (every format), XLA at
    # a 512-row prefill
    assert chose_kernel == {1, 5}, chose_kernel
    args, block = _quant_args(kind, 5, 5120, 17408, jnp.bfloat16)
    on_cpu = export_for(_quant_fn(kind, 5120, block), *args, platform="cpu")
    assert kernel_calls(on_cpu) == [] and "tensor<5120x17408xbf16>" in on_cpu.mlir_module()
    if kind == "fp8":  # compressed-tensors' per-channel fp8 too: the kernel takes it; at 5 rows the tensor-core one
        args, block = _quant_args(kind, 5, 5120, 17408, jnp.bfloat16, fmt="channel")
        assert kernel_calls(export_for(_quant_fn(kind, 5120, block, backend="pallas"), *args)) == ["quant_matmul_fp8"]
        auto = kernel_calls(export_for(_quant_fn(kind, 5120, block), *args))
        assert qmm.decode_kernel(*args, kind, 5120, block) is qmm.quant_mma and auto == ["quant_matmul_fp8_mma"], auto


def test_quant_speed_rule_warns_nothing(monkeypatch):
    """XLA chosen for speed (a prefill's 512 rows) is not a fallback: no warning, unlike a format the kernel
    does not take."""
    monkeypatch.setattr(dispatch, "_warned", set())
    args, block = _quant_args("int4", 512, 5120, 17408, jnp.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert kernel_calls(export_for(_quant_fn("int4", 5120, block), *args)) == []
    assert not [w for w in caught if "quantized matmul" in str(w.message)], [str(w.message) for w in caught]


def test_quant_backend_is_chosen_per_lowering_platform(monkeypatch):
    args, block = _quant_args("int4", 5, 5120, 17408, jnp.bfloat16)
    assert kernel_calls(export_for(_quant_fn("int4", 5120, block), *args, platform="rocm")) == []
    assert kernel_calls(export_for(_quant_fn("int4", 5120, block, backend="reference"), *args)) == []
    # a format the kernel does not take (int4 groups of 16) lowers the reference for cuda, with the warning
    monkeypatch.setattr(dispatch, "_warned", set())
    qs, ss, block16 = quant.layout_of("int4", (5120, 17408), 16)
    small = (args[0], SDS(qs, jnp.uint8), SDS(ss, jnp.float32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert kernel_calls(export_for(_quant_fn("int4", 5120, block16, backend="pallas"), *small)) == []
    assert any("int4 group of 16" in str(w.message) for w in caught)


# compiled to sm_90 (label, kind, M, K, N, x dtype, fp8 format): the tightest launches of the real shapes
# (lm_head's 128-column decode tile holds the most registers, prefill tiles the most shared memory), the
# split-K decode of down, and the f32 path (IEEE dots on the FMA units)
QUANT_SM90_CASES = [("int8 lm_head M1", "int8", 1, 5120, 248320, jnp.bfloat16, None),
                    ("int4 down M5", "int4", 5, 17408, 5120, jnp.bfloat16, None),
                    ("int4 gate/up M512", "int4", 512, 5120, 17408, jnp.bfloat16, None),
                    ("fp8 gate/up M512", "fp8", 512, 5120, 17408, jnp.bfloat16, None),
                    ("int4 down M5 f32", "int4", 5, 17408, 5120, jnp.float32, None)]


def test_quant_kernel_compiles_for_sm90(report):
    """The quantized-matmul kernel's Triton IR at real 27B shapes compiled to sm_90 machine code: shared
    memory within one block's 227 KiB, no register spill (no stack, no local memory) in any format, M or
    dtype; its dots take the stored values converted to x's dtype (bf16 operands, f32 accumulation; f32 in IEEE
    precision, not TF32), read from int8 / packed uint8 / fp8 tiles, never a dequantized matrix."""
    require_triton()
    kernels, plans = [], []
    for label, kind, M, K, N, dtype, fmt in QUANT_SM90_CASES:
        args, block = _quant_args(kind, M, K, N, dtype, fmt)
        (kernel,) = triton_kernels(export_for(_quant_fn(kind, K, block, backend="pallas"), *args))
        kernels.append(kernel)
        plans.append(qmm.plan(M, K, N, kind, block, jnp.dtype(dtype).itemsize))
        stored = {"int8": "ptr<i8>>", "int4": "ptr<i8>>", "fp8": "ptr<f8E4M3FN>>"}[kind]  # (uint8 is i8 there)
        loads = [line for line in kernel.ir.splitlines() if "tt.load" in line]
        assert any(line.endswith(stored) for line in loads), (label, loads)
        name = "f32" if dtype == jnp.float32 else "bf16"
        dots = [line for line in kernel.ir.splitlines() if "tt.dot" in line]
        assert dots, label
        for line in dots:
            operands, result = line.split(":")[-1].split("->")
            assert "tf32" not in line and operands.count(f"x{name}>") == 2 and result.strip().endswith("xf32>"), line
    results = compile_sm90(kernels)  # (test_kernels_compile_for_sm90 shows the probe sees an overflow)
    for (label, *_), kernel, p, r in zip(QUANT_SM90_CASES, kernels, plans, results):
        assert r["error"] is None, (label, r["error"])
        report(f"sm_90 compile, quant_matmul {label}: grid {kernel.grid} (tile {p.block_m}x{p.block_n}, K step "
               f"{p.block_k}, dot K {p.dot_k}), {kernel.num_warps} warps, {kernel.num_stages} stages, shared "
               f"{r['shared']} B (limit {SM90_SHARED_LIMIT}), {r['registers']} registers, {r['stack']} B stack, "
               f"{r['local']} B local")
        assert kernel.grid == (p.row_tiles, p.col_tiles, p.splits), (label, kernel.grid, p)
        assert 0 < r["shared"] <= SM90_SHARED_LIMIT and r["stack"] == 0 and r["local"] == 0, (label, r)


def test_quantized_27b_speculative_loop_lowers_for_cuda():
    """The speculative loop of a 27B (4 real layers) quantized as load(quant="int4") quantizes it, with an fp8
    KV cache (generate(kv_dtype="float8_e4m3fn")): every quantized matrix of the trunk and the MTP head is read
    by a quantized-matmul kernel (its packed values are an operand of a kernel call), none exists
    dequantized, and the windowed draft attention kernel reads the fp8 ring as it is stored."""
    cfg, dtype = _config("Qwen3.5-27B")
    weights = quant.abstract(weight_shapes(cfg, dtype), quant.QuantPolicy("int4"))
    exported = export_spec_decode(cfg, dtype, WINDOWED, GREEDY, batch=1, cache_len=CACHE, cap=CAP, weights=weights,
                                  kv_dtype="float8_e4m3fn")
    calls = kernel_calls(exported)
    # the draft steps (1 row) on the FMA decode kernel (the head's MLP gate and up in one launch, quant_gate_up.py),
    # the verify (k + 1 rows) on the tensor-core one; the draft head's norms of one row before quantized products
    # on the RMSNorm row kernel (forward.post_norm); the verify's attention layers' k and v in one launch
    # (quant.pair_parts), their rows written by the new rows' kernel (QUERIES); the verify's residual add after a
    # mixer and its post norm in one kernel (add_rmsnorm.py)
    assert calls.count(KERNEL) == 2 and set(calls) == {KERNEL, CAUSAL, QUERIES, GDN_VERIFY, ROLLBACK,
                                                        "quant_matmul_int4", "quant_matmul_int4_mma",
                                                        "quant_gate_up_int4", "quant_gate_up_int4_mma",
                                                        "quant_k_v_int4_mma", "rmsnorm_rows", "add_rmsnorm_rows"}, calls
    # the verify's attention (every layer's) reads the fp8 trunk cache too, its queries from the queries' kernel
    assert calls.count(CAUSAL) == 1 and QUERIES in calls
    text = exported.mlir_module()
    ring = WINDOWED.sinks + WINDOWED.window + WINDOWED.k
    attn = [line for line in text.splitlines() if "xla.gpu.triton" in line and f"x{ring}x" in line]
    assert attn and all(f"x{ring}x{cfg.num_kv_heads}x{cfg.head_dim}xf8E4M3FN>" in line for line in attn), attn
    matrices = [leaf for leaf in jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, quant.QuantArray))
                if isinstance(leaf, quant.QuantArray)]
    assert len(matrices) > 20
    kernel_operands = "\n".join(line.rsplit(" : (", 1)[-1] for line in text.splitlines() if "xla.gpu.triton" in line)
    for w in matrices:
        K, N = w.shape
        packed = f"tensor<{w.q.shape[0]}x{N}xui8>"  # the tiled kernel's operand; the decode kernel's (M <= 4):
        words = f"tensor<{w.q.shape[0]}x{N // 4}xi32>"  # the same bytes as int32 words, a bitcast
        assert packed in kernel_operands or words in kernel_operands, (w.shape, packed)
        assert f"tensor<{K}x{N}xbf16>" not in text, w.shape


# ------------------------------------------------------------------------ the causal attention kernel
def _causal_args(B, T, nh, nkv, hd, S, dtype, kv_dtype=None):
    kv = SDS((B, S, nkv, hd), kv_dtype or dtype)
    return SDS((B, T, nh, hd), dtype), kv, kv, i32(B, T)


# a 256-row prefill chunk at 128K and 1M slots, a decode step at 1M, the k = 8 verify at batch 8; every model's
# heads; an fp8 cache
CAUSAL_REAL = ([(m, 1, 256, 131072, jnp.bfloat16, None) for m in REAL_HEADS]
               + [("27B", 1, 256, 1 << 20, jnp.bfloat16, None), ("27B", 1, 1, 1 << 20, jnp.bfloat16, None),
                  ("27B", 8, 9, 131072, jnp.bfloat16, None), ("27B", 1, 9, 131072, jnp.bfloat16, jnp.float8_e4m3fn),
                  ("27B", 1, 256, 131072, jnp.float32, None)])


def test_causal_kernel_lowers_and_compiles_for_sm90_at_real_shapes(report):
    from kernels_pallas import causal_attention as ca
    kernels = []
    for model, b, t, S, dtype, kv_dtype in CAUSAL_REAL:
        nh, nkv = REAL_HEADS[model]
        args = _causal_args(b, t, nh, nkv, 256, S, dtype, kv_dtype)
        assert ca.unsupported_reason(args[0], args[1], args[3]) is None
        exported = export_for(lambda *a: ca.causal_attend(*a), *args)
        assert kernel_calls(exported) == [CAUSAL]
        assert kernel_calls(export_for(lambda *a: ca.causal_attend(*a), *args, platform="cpu")) == []
        (kernel,) = triton_kernels(exported)
        kernels.append(kernel)
    require_triton()  # the lowering above needs no triton; the sm_90 compile below does
    for (model, b, t, S, dtype, kv_dtype), kernel, r in zip(CAUSAL_REAL, kernels, compile_sm90(kernels)):
        label = f"{model} B{b} T{t} S{S} {jnp.dtype(dtype).name}" + (" fp8 cache" if kv_dtype else "")
        assert r["error"] is None, (label, r["error"])
        report(f"sm_90 compile, causal attention {label}: grid {kernel.grid}, shared {r['shared']} B, "
               f"{r['registers']} registers, {r['stack']} B spilled")
        assert 0 < r["shared"] <= SM90_SHARED_LIMIT and r["stack"] <= (0 if dtype == jnp.bfloat16 else 256), (label, r)
