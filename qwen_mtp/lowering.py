"""Lowering programs for a platform this machine may not have: `jax.export` runs the whole lowering for cuda
(Pallas-Triton kernels included) on a CPU, which proves a program compiles for the GPU up to the point where
XLA takes over, and shows which Pallas kernels it contains.

    exported = export_for(jitted_fn, *args, platform="cuda", **static_kwargs)
    kernel_calls(exported) -> ["windowed_draft_attention", ...]   # the Pallas kernels in the program
    export_spec_decode(cfg, dtype, spec, sampling, batch=..., cache_len=..., cap=...)  # the speculative loop
    triton_kernels(exported) -> [TritonKernel(name, ir, num_warps, num_stages, grid), ...]
    compile_sm90(triton_kernels(exported)) -> [{"shared", "registers", "stack", ...}, ...]  # needs `triton`

Args may be jax.ShapeDtypeStruct, so real model shapes (qwen_mtp.real_shapes, weights.weight_shapes) lower
without allocating anything. Export is used here as a lowering check, not to serialize: the Triton custom call
and the host callback of streaming carry no cross-version compatibility guarantee, so those safety checks are
disabled. One platform at a time: lowered for ("cpu", "cuda") together, jax lowers every branch of
platform_dependent for every platform, and the Pallas kernel refuses the cpu lowering.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from .mtp import init_mtp_cache
from .speculative import spec_decode
from .state import init_state
from .weights import weight_shapes

TRITON_CALL = "__gpu$xla.gpu.triton"
_UNSTABLE_CALLS = (TRITON_CALL, "xla_ffi_python_gpu_callback", "xla_ffi_python_cpu_callback",
                   "xla_python_gpu_callback", "xla_python_cpu_callback")
DISABLED_CHECKS = [jax.export.DisabledSafetyCheck.custom_call(c) for c in _UNSTABLE_CALLS]


def export_for(fn, *args, platform: str = "cuda", **static):
    """jax.export of `fn` (jitted if it is not) for one platform; static kwargs are passed through."""
    if not hasattr(fn, "lower"):
        fn = jax.jit(fn)
    return jax.export.export(fn, platforms=(platform,), disabled_checks=DISABLED_CHECKS)(*args, **static)


def kernel_calls(exported) -> list:
    """Names of the Pallas-Triton kernels called by the exported program, one entry per call site."""
    return [k.name for k in triton_kernels(exported)]


def export_spec_decode(cfg, dtype, spec, sampling, *, batch: int, cache_len: int, cap: int, streaming=False,
                       platform: str = "cuda", weights=None, kv_dtype=None):
    """The speculative loop (speculative.spec_decode) exported at abstract shapes: weights, trunk state and
    the draft head's cache of `cfg` in `dtype`, nothing allocated. `weights`: an abstract Weights pytree to use
    instead of weight_shapes(cfg, dtype) (e.g. quant.abstract(...) for a quantized model); `kv_dtype`: the KV
    caches' dtype (generate's kv_dtype; None: dtype)."""
    SDS, i32 = jax.ShapeDtypeStruct, lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    state = jax.eval_shape(lambda: init_state(cfg, batch, cache_len, dtype, kv_dtype))
    head = jax.eval_shape(lambda: init_mtp_cache(cfg, batch, cache_len, kv_dtype or dtype, window=spec.window,
                                                 sinks=spec.sinks, k=spec.k))
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    weights = weight_shapes(cfg, dtype) if weights is None else weights
    return export_for(spec_decode, weights, cfg, state, head, i32(batch),
                      SDS((batch, cfg.hidden_size), dtype), i32(batch), i32(1), i32(), key, i32(), platform=platform,
                      cap=cap, spec=spec, sampling=sampling, streaming=streaming)


SM90_SHARED_LIMIT = 232448  # bytes of shared memory one block may use on an H100 / H200 (227 KiB)


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    name: str
    ir: str  # Triton IR, text: what XLA compiles to PTX on the GPU
    num_warps: int
    num_stages: int
    grid: tuple


def triton_kernels(exported) -> list:
    """Each Pallas-Triton kernel call of the exported program, with its Triton IR decoded from the custom call's
    bytecode (dot precisions, operand dtypes, block shapes) and its launch parameters."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as triton_dialect

    found = []
    with mlir.make_ir_context() as ctx:
        triton_dialect.register_dialect(ctx)
        module = ir.Module.parse(exported.mlir_module())

        def walk(op):
            for region in op.regions:
                for block in region.blocks:
                    for child in block.operations:
                        if child.operation.name == "stablehlo.custom_call" and \
                                ir.StringAttr(child.attributes["call_target_name"]).value == TRITON_CALL:
                            cfg = child.attributes["mhlo.backend_config"]
                            num = lambda key: ir.IntegerAttr(cfg[key]).value
                            found.append(TritonKernel(
                                name=ir.StringAttr(cfg["name"]).value,
                                ir=str(ir.Module.parse(ir.StringAttr(cfg["ir"]).value_bytes)),
                                num_warps=num("num_warps"), num_stages=num("num_stages"),
                                grid=(num("grid_x"), num("grid_y"), num("grid_z"))))
                        walk(child.operation)

        walk(module.operation)
    return found


def compile_sm90(kernels, timeout: float = 900) -> list:
    """Compile TritonKernels to sm_90 machine code with the `triton` package, in a subprocess
    (qwen_mtp/sm90_compile.py). Returns per kernel {"name", "shared", "registers", "local", "stack", "error"}."""
    payload = json.dumps([dict(name=k.name, ir=k.ir, num_warps=k.num_warps, num_stages=k.num_stages)
                          for k in kernels])
    worker = Path(__file__).with_name("sm90_compile.py")
    done = subprocess.run([sys.executable, str(worker)], input=payload, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{worker} failed (exit {done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout)
