"""Lowering programs for a platform this machine may not have: `jax.export` runs the whole lowering for cuda
(Pallas-Triton kernels included) on a CPU, which proves a program compiles for the GPU up to the point where
XLA takes over, and shows which Pallas kernels it contains.

    exported = export_for(jitted_fn, *args, platform="cuda", **static_kwargs)
    kernel_calls(exported) -> ["windowed_draft_attention", ...]   # the Pallas kernels in the program
    export_spec_decode(cfg, dtype, spec, sampling, batch=..., cache_len=..., cap=...)  # the speculative loop
    export_spec_decode(..., mesh=mesh)       # the same, sharded over a ('data', 'model') mesh (see below)
    triton_kernels(exported) -> [TritonKernel(name, ir, num_warps, num_stages, grid), ...]
    manual_report(exported) -> ManualReport(kernels, collectives)  # which of them run per shard (shard_map)
    compile_sm90(triton_kernels(exported)) -> [{"shared", "registers", "stack", ...}, ...]  # needs `triton`

Args may be jax.ShapeDtypeStruct, so real model shapes (qwen_mtp.tools.real_shapes, weights.weight_shapes) lower
without allocating anything. Export is used here as a lowering check, not to serialize: the Triton custom call
carries no cross-version compatibility guarantee, so that safety check is disabled. One platform at a time: lowered for ("cpu", "cuda") together, jax lowers every branch of
platform_dependent for every platform, and the Pallas kernel refuses the cpu lowering.

Sharded export (`mesh=`): the abstract weights, states and per-row inputs carry the NamedShardings of
qwen_mtp.parallel.sharding (weight_shardings, state_shardings, rows_sharding, replicated) over a mesh of this machine's
devices (virtual CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count=8), and the program is traced under
jax.set_mesh(mesh), so spmd.py wraps each Pallas kernel in a shard_map. The exported module is StableHLO with
Shardy annotations: the mesh (`sdy.mesh`), each argument's sharding (`sdy.sharding`; exported.in_shardings_jax
reads them back), and each shard_map as an `sdy.manual_computation` whose body sees per-shard shapes. The SPMD
partitioner has NOT run on it (XLA runs it when the GPU compiles the module), so what it can show is what the
program asks for: the arguments' shardings, which kernel calls sit inside a manual region and at which per-shard
operand shapes (a split weight's local slice: the region takes it in the sharding it is stored in), and which
collectives the program writes itself (the psum of a row-parallel matmul, an all_reduce inside its region; no
all_gather). What it cannot show is what the partitioner adds for the ops outside the regions (all-gathers,
all-to-alls, permutes chosen by sharding propagation): that needs the compiled program, which the cpu lowering
of the same program gives for CPUs (manual_report's docstring) and tools/gpu_compile.py for GPUs (a mesh over
gpu_compile.devices("H200", n), XLA's GPU partitioner run on this machine).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp

from qwen_mtp.compiling.program_cache import DISABLED_CHECKS, TRITON_CALL
from qwen_mtp.decoding.speculative import spec_decode
from qwen_mtp.head.mtp import init_mtp_cache
from qwen_mtp.trunk.quant import QuantArray
from qwen_mtp.trunk.state import init_state
from qwen_mtp.trunk.weights import weight_shapes


def export_for(fn, *args, platform: str = "cuda", **static):
    """jax.export of `fn` (jitted if it is not) for one platform; static kwargs are passed through."""
    if not hasattr(fn, "lower"):
        fn = jax.jit(fn)
    return jax.export.export(fn, platforms=(platform,), disabled_checks=DISABLED_CHECKS)(*args, **static)


def kernel_calls(exported) -> list:
    """Names of the Pallas-Triton kernels called by the exported program, one entry per call site."""
    return [k.name for k in triton_kernels(exported)]


def with_shardings(tree, shardings):
    """ShapeDtypeStructs of `tree` (arrays or ShapeDtypeStructs) carrying `shardings` (a pytree like it, from
    sharding.weight_shardings / state_shardings); a QuantArray's q and scale get theirs and its `spec` is set,
    as sharding.shard_weights sets it, so the quantized matmul runs per shard."""
    is_q = lambda x: isinstance(x, QuantArray)
    sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    def one(x, s):
        if is_q(x):
            return dataclasses.replace(x, q=sds(x.q, s.q), scale=sds(x.scale, s.scale), spec=s.spec)
        return sds(x, s)

    return jax.tree.map(one, tree, shardings, is_leaf=is_q)


def spec_decode_args(cfg, dtype, spec, *, batch: int, cache_len: int, cap: int, weights=None, kv_dtype=None,
                     mesh=None, sampling=None):
    """The abstract arguments of speculative.spec_decode (weights, trunk state, the head's cache, the loop's
    SpecCarry as speculative.spec_start makes it for a buffer of `cap` tokens, eos, max_new, until), nothing
    allocated. With `mesh`, each carries the sharding generate gives it on that mesh: weights by the rule table,
    states and per-row arrays split over data (and heads over model), the rest replicated. `sampling` with a
    repetition penalty: the carry holds the [batch, vocab] context ids it needs (penalty.py)."""
    from qwen_mtp.decoding import penalty
    from qwen_mtp.decoding.speculative import spec_start
    from qwen_mtp.parallel import sharding

    SDS, i32 = jax.ShapeDtypeStruct, jnp.int32
    state = jax.eval_shape(lambda: init_state(cfg, batch, cache_len, dtype, kv_dtype))
    head = jax.eval_shape(lambda: init_mtp_cache(cfg, batch, cache_len, kv_dtype or dtype, window=spec.window,
                                                 sinks=spec.sinks, k=spec.k))
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    weights = weight_shapes(cfg, dtype) if weights is None else weights
    if mesh is None:
        rows = rep = lambda shape, dt: SDS(shape, dt)
    else:
        mesh = sharding.check_mesh(mesh)
        weights = with_shardings(weights, sharding.weight_shardings(weights, cfg, mesh))
        state = with_shardings(state, sharding.state_shardings(state, cfg, mesh, batch))
        head = with_shardings(head, sharding.state_shardings(head, cfg, mesh, batch))
        rows = lambda shape, dt: SDS(shape, dt, sharding=sharding.rows_sharding(mesh, batch, len(shape)))
        rep = lambda shape, dt: SDS(shape, dt, sharding=sharding.replicated(mesh))
    eos, scalar = rep((1,), i32), rep((), i32)
    seen = rows((batch, cfg.vocab_size), jnp.bool_) if sampling is not None and penalty.active(sampling) else None
    carry = jax.eval_shape(partial(spec_start, cap=cap, spec=spec), rows((batch,), i32),
                           rows((batch, cfg.hidden_size), dtype), rows((batch,), i32), rep(key.shape, key.dtype),
                           eos, scalar, scalar, seen=seen)
    # per-row fields split over data like the rows they come from; the key, histograms and counter replicated
    per_row = ("pos", "x", "m1", "out", "n_out", "done", "seen")
    carry = carry._replace(**{f: (rows if f in per_row else rep)(getattr(carry, f).shape, getattr(carry, f).dtype)
                              for f in carry._fields if getattr(carry, f) is not None})  # None: unused
    return (weights, state, head, carry, eos, scalar, scalar)


def export_spec_decode(cfg, dtype, spec, sampling, *, batch: int, cache_len: int, cap: int,
                       platform: str = "cuda", weights=None, kv_dtype=None, mesh=None):
    """The speculative loop (speculative.spec_decode, the program generate runs for each segment of rounds)
    exported at abstract shapes: weights, trunk state and the draft head's cache of `cfg` in `dtype`, nothing
    allocated. `weights`: an abstract Weights pytree to use instead of weight_shapes(cfg, dtype) (e.g.
    quant.abstract(...) for a quantized model); `kv_dtype`: the KV caches' dtype (generate's kv_dtype; None:
    dtype). `mesh`: a ('data', 'model') jax.sharding.Mesh (e.g. sharding.make_mesh(2, 4) over 8 virtual CPU
    devices): the program generate runs on a model sharded over it, its arguments' shardings recorded in the
    export, the kernels per shard (see the module docstring)."""
    from qwen_mtp.parallel import sharding

    args = spec_decode_args(cfg, dtype, spec, batch=batch, cache_len=cache_len, cap=cap, weights=weights,
                            kv_dtype=kv_dtype, mesh=mesh, sampling=sampling)
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(sharding.check_mesh(mesh)):
        return export_for(spec_decode, args[0], cfg, *args[1:], platform=platform, spec=spec, sampling=sampling)


COLLECTIVES = ("stablehlo.all_gather", "stablehlo.all_reduce", "stablehlo.reduce_scatter", "stablehlo.all_to_all",
               "stablehlo.collective_permute", "stablehlo.collective_broadcast")


@dataclasses.dataclass(frozen=True)
class KernelSite:
    name: str  # the Pallas kernel
    manual: bool  # every path from main to this call runs inside an sdy.manual_computation (a shard_map body)
    operands: tuple  # MLIR types of its operands, e.g. "tensor<2560x1536xui8>" (per shard when manual)


@dataclasses.dataclass(frozen=True)
class ManualReport:
    kernels: list  # [KernelSite], one per kernel call site
    collectives: list  # [(op name, manual)], one per collective op site
    regions: int  # sdy.manual_computation ops


def manual_report(exported) -> ManualReport:
    """Where the Pallas kernels and the collectives of an exported (sharded) program sit: inside a shard_map
    region (`sdy.manual_computation`, directly or in a function only called from inside one) or not.

    This reads StableHLO, before the SPMD partitioner: the collectives listed are those the program writes
    (shard_map bodies' psums), not those the partitioner will add. For those, compile the same program lowered
    for cpu on virtual devices and read the optimized HLO (jax.jit(...).lower(...).compile().as_text()): on the
    27B-shaped int4 loop over a (2, 4) mesh every all-gather there moves activations or small per-row values,
    never a weight."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    with mlir.make_ir_context():
        module = ir.Module.parse(exported.mlir_module())
        funcs = {ir.StringAttr(op.attributes["sym_name"]).value: op for op in module.body.operations
                 if op.operation.name == "func.func"}
        sites: dict = {}  # (function, op number in it) -> [kind, payload, manual on every path so far]
        walked = set()  # (function, manual): a function is walked once per context

        def note(key, kind, payload, manual):
            sites[key] = [kind, payload, manual and sites.get(key, [None, None, True])[2]]

        def walk(op, fname, manual, counter):
            for region in op.regions:
                for block in region.blocks:
                    for child in block.operations:
                        name = child.operation.name
                        counter[0] += 1
                        key = (fname, counter[0])
                        if name == "sdy.manual_computation":
                            note(key, "region", None, manual)
                            walk(child.operation, fname, True, counter)
                            continue
                        if name == "func.call":
                            callee = ir.FlatSymbolRefAttr(child.attributes["callee"]).value
                            if (callee, manual) not in walked:
                                walked.add((callee, manual))
                                walk(funcs[callee], callee, manual, [0])
                        elif name == "stablehlo.custom_call" and \
                                ir.StringAttr(child.attributes["call_target_name"]).value == TRITON_CALL:
                            kname = ir.StringAttr(child.attributes["mhlo.backend_config"]["name"]).value
                            note(key, "kernel", (kname, tuple(str(v.type) for v in child.operands)), manual)
                        elif name in COLLECTIVES:
                            note(key, "collective", name, manual)
                        walk(child.operation, fname, manual, counter)

        walk(funcs["main"], "main", False, [0])
    kernels = [KernelSite(p[0], m, p[1]) for kind, p, m in sites.values() if kind == "kernel"]
    collectives = [(p, m) for kind, p, m in sites.values() if kind == "collective"]
    regions = sum(kind == "region" for kind, _, _ in sites.values())
    return ManualReport(kernels=kernels, collectives=collectives, regions=regions)


def local_kernel_operands(exported, name: str) -> set:
    """The operand types of the one kernel `name` in an exported (sharded) program, checked to run per shard (in a
    manual computation) with no collective written in the program: a kernel's mesh test reads the local shapes
    from them. AssertionError naming what was found otherwise."""
    rep = manual_report(exported)
    kernels = [k for k in rep.kernels if k.name == name]
    assert len(kernels) == 1 and kernels[0].manual, rep.kernels
    assert not rep.collectives, rep.collectives
    return set(kernels[0].operands)


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


def compile_sm90(kernels, timeout: float = 900, loops: bool = False) -> list:
    """Compile TritonKernels to sm_90 machine code with the `triton` package, in a subprocess
    (qwen_mtp/tools/sm90_compile.py). Returns per kernel {"name", "shared", "registers", "local", "stack", "error"}
    and, with loops=True, "loops": each loop's instruction count and opcode mix (the smallest first)."""
    payload = json.dumps([dict(name=k.name, ir=k.ir, num_warps=k.num_warps, num_stages=k.num_stages, loops=loops)
                          for k in kernels])
    worker = Path(__file__).with_name("sm90_compile.py")
    done = subprocess.run([sys.executable, str(worker)], input=payload, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{worker} failed (exit {done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout)
