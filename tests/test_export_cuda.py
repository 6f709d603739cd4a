"""Every Pallas kernel and every jitted entry point lowers for cuda on this CPU (jax.export runs the whole GPU
lowering, Pallas-Triton included), at the test shapes and at real Qwen3.5 shapes, with the kernel's custom call
in the cuda program and the pure-JAX reference in the cpu and rocm ones.

Real shapes come from qwen_mtp/real_shapes.py as jax.ShapeDtypeStructs: nothing is allocated. Entry points use
real layer dimensions with one full period of layers (3 GDN : 1 attention; lowering does not depend on depth),
and one full-depth 27B program. The kernel's Triton IR is then read out of the program and compiled to sm_90
machine code with the `triton` package (test_kernels_compile_for_sm90), a close proxy for XLA's own Triton
compile, which only a GPU runs (benchmarks/gpu_check.py). Not provable here: the host callback of streaming
(jax registers it with a live CUDA client at lowering time; see test_streaming_callback_needs_a_live_cuda_client).
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import dispatch
from kernels_pallas.windowed_attention import unsupported_reason, windowed_attend, windowed_attend_pallas
from qwen_mtp import real_shapes
from qwen_mtp.config import load_config
from qwen_mtp.generate import _choose, _logits, _mtp_chunk, _plain_decode, _prefill_chunk
from qwen_mtp.lowering import (SM90_SHARED_LIMIT, compile_sm90, export_for, export_spec_decode, kernel_calls,
                               triton_kernels)
from qwen_mtp.mtp import init_mtp_cache
from qwen_mtp.sampling import Sampling
from qwen_mtp.speculative import SpecConfig
from qwen_mtp.state import init_state
from qwen_mtp.weights import weight_shapes
from tests.test_kernel_windowed_attention import CASES as INTERPRET_CASES

KERNEL = "windowed_draft_attention"
SDS = jax.ShapeDtypeStruct
i32 = lambda *s: SDS(s, jnp.int32)

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
        exported = export_for(lambda *a: windowed_attend_pallas(*a, W, S, num_splits=splits), *args)
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


def _kernels_expected(spec):
    # the head's attention runs in the draft steps (k > 1) and in the refill: two call sites with a window
    return [KERNEL] * (1 + (spec.k > 1)) if spec.window is not None else []


def _spec_program(cfg, dtype, spec, sampling, streaming, platform="cuda"):
    return export_spec_decode(cfg, dtype, spec, sampling, batch=B, cache_len=CACHE, cap=CAP, streaming=streaming,
                              platform=platform)


def _plain_program(cfg, dtype, sampling, streaming, cap=CAP):
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    return export_for(_plain_decode, weight_shapes(cfg, dtype), cfg, _state(cfg, dtype), i32(B),
                      SDS((B, cfg.vocab_size), jnp.float32), i32(B), i32(1), i32(), key, i32(), cap=cap,
                      keep_logits=False, sampling=sampling, streaming=streaming)


@pytest.fixture
def stand_in_emit(monkeypatch):
    """streaming=True programs with the host callback replaced by a no-op: everything else in them lowers."""
    for name in ("qwen_mtp.generate", "qwen_mtp.speculative"):  # (the package's `generate` is the function)
        monkeypatch.setattr(importlib.import_module(name), "emit", lambda tokens, counts: None)


ENTRY_CONFIGS = ["shipped", "Qwen3.5-27B", "Qwen3.5-35B-A3B"]


@pytest.mark.parametrize("name", ENTRY_CONFIGS)
def test_prefill_and_head_fill_lower_for_cuda(name):
    cfg, dtype = _config(name)
    w = weight_shapes(cfg, dtype)
    assert kernel_calls(export_for(_prefill_chunk, w, cfg, i32(B, CHUNK), _state(cfg, dtype), i32(B), i32(B))) == []
    hidden = SDS((B, CHUNK, cfg.hidden_size), dtype)
    for spec in (NATIVE, WINDOWED):
        exported = export_for(_mtp_chunk, w, cfg, i32(B, CHUNK), hidden, _head_cache(cfg, dtype, spec), i32(B),
                              window=spec.window, sinks=spec.sinks)
        assert kernel_calls(exported) == ([KERNEL] if spec.window else [])
    export_for(_logits, w, SDS((B, cfg.hidden_size), dtype))
    export_for(_choose, jax.eval_shape(lambda: jax.random.PRNGKey(0)), SDS((B, cfg.vocab_size), jnp.float32), s=SAMPLED)


@pytest.mark.parametrize("name", ENTRY_CONFIGS)
def test_plain_decode_loop_lowers_for_cuda(name, stand_in_emit):
    cfg, dtype = _config(name)
    assert kernel_calls(_plain_program(cfg, dtype, GREEDY, streaming=False)) == []
    assert kernel_calls(_plain_program(cfg, dtype, SAMPLED, streaming=True)) == []


@pytest.mark.parametrize("name", ENTRY_CONFIGS)
@pytest.mark.parametrize("spec,sampling,streaming", [(NATIVE, GREEDY, False), (WINDOWED, GREEDY, False),
                                                     (WINDOWED, SAMPLED, True), (NATIVE, SAMPLED, True),
                                                     (SpecConfig(k=1, window=256, sinks=4), GREEDY, False)],
                         ids=["native", "windowed", "windowed-sampled-streaming", "native-sampled-streaming",
                              "windowed-k1"])
def test_speculative_loop_lowers_for_cuda(name, spec, sampling, streaming, stand_in_emit):
    cfg, dtype = _config(name)
    assert kernel_calls(_spec_program(cfg, dtype, spec, sampling, streaming)) == _kernels_expected(spec)


def test_full_depth_27b_speculative_loop_lowers_for_cuda():
    cfg, dtype = _config("27B-full-depth")
    assert cfg.num_layers == 64
    assert kernel_calls(_spec_program(cfg, dtype, WINDOWED, SAMPLED, False)) == [KERNEL, KERNEL]


def test_windowed_program_lowered_for_cpu_holds_the_reference():
    cfg, dtype = _config("shipped")
    assert kernel_calls(_spec_program(cfg, dtype, WINDOWED, GREEDY, False, platform="cpu")) == []


def test_streaming_callback_needs_a_live_cuda_client():
    """jax lowers io_callback by registering the Python callable with the live backend's client, so a program
    that streams cannot be lowered for cuda on a machine without one. If this starts passing, a newer jax can
    lower callbacks offline: drop stand_in_emit above and export the real streaming programs."""
    cfg, dtype = _config("shipped")
    with pytest.raises(ValueError, match="different from the lowering platform cuda"):
        _plain_program(cfg, dtype, GREEDY, streaming=True, cap=2 * CAP)  # a cap no stand-in trace used


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
    if importlib.util.find_spec("triton") is None:
        pytest.fail("the `triton` package is missing: pip install -e '.[test]' installs it")
    kernels = []
    for label, b, t, nh, nkv, hd, sinks, window, dtype in SM90_CASES:
        args = _kernel_args(b, t, nh, nkv, hd, sinks + window + max(t - 1, 1), dtype)
        (kernel,) = triton_kernels(export_for(lambda *a: windowed_attend(*a, window, sinks), *args))
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
