"""Compiling a program for an NVIDIA GPU this machine does not have: XLA's own GPU compiler, run deviceless.

    from qwen_mtp.tools import gpu_compile
    gpu_compile.prepare()                          # before jax starts its backends (sets JAX_PLATFORMS=cpu)
    compiled = gpu_compile.compile_for(jitted_fn, *args, target="H200", **static_kwargs)
    compiled.as_text()                             # the optimised GPU HLO: fusions, gemms, Pallas kernels
    gpu_compile.pallas_kernels(compiled.as_text()) # Counter of the Pallas kernels in it, by name
    gpu_compile.devices("H200", 8)                 # 8 compile-only H200s: a mesh over them, a sharded program

`jax.export` (tools/lowering.py) stops where XLA takes over; this goes all the way: the CUDA plugin of the pinned
jax release compiles for a compile-only device described by a target config (TARGETS: the published figures of
an H100 SXM and an H200), with the whole GPU pipeline, fusion and scheduling included, and compiles each
Pallas-Triton kernel with XLA's own Triton and ptxas to sm_90 machine code. What it gives that nothing short of a
GPU gave before: the program a GPU would run (so the kernels a decode step launches at full depth,
benchmarks/gpu_scale --compile-for), and the proof that every kernel compiles in XLA's exact pipeline (not the
`triton` package's close proxy, tools/sm90_compile.py). What it cannot give: autotuning (no device to time on:
XLA takes its default gemm configurations) and any time.

Args may be jax.ShapeDtypeStruct: real model shapes compile without allocating anything (`place` puts every
argument on the compile-only device). Needs the plugin and ptxas: pip install -e ".[gpu-compile]" (about 0.6 GB).
Best in an environment of its own (CI: .venv-gpu-compile, made with --system-site-packages): installed beside a
CPU jax, the plugin looks for the missing GPU at each start and logs an error unless JAX_PLATFORMS=cpu, which
`prepare()` sets (the plugin then registers without looking, and the CPU still traces the programs).
"""

from __future__ import annotations

import collections
import functools
import json
import os
import re

from qwen_mtp.errors import QwenMTPError

# the compile-only device: the fields of XLA's GpuTargetConfig that its GPU compiler reads (sm_90, 132 SMs)
_SM90 = {"threads_per_block_limit": 1024, "threads_per_warp": 32, "shared_memory_per_block": 49152,
         "shared_memory_per_core": 233472, "threads_per_core_limit": 2048, "core_count": 132, "fpus_per_core": 128,
         "block_dim_limit_x": 2147483647, "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
         "l2_cache_size": 52428800, "clock_rate_ghz": 1.98, "shared_memory_per_block_optin": 232448,
         "registers_per_core_limit": 65536, "registers_per_block_limit": 65536,
         # the CUDA versions XLA reads to decide what a CUDA graph may hold (its command buffers): below 12.3 it
         # keeps gemm libraries, custom calls and on-device control flow out of the graphs. The runtime and
         # toolkit: the CUDA 12.9 that jax[cuda12] installs; the driver: 12.4, assumed (no driver is read here).
         # A machine with an older driver gets fewer graphs than these compiles show: gpu_scale prints its own.
         "driver_version": "12.4.0", "runtime_version": "12.9.0", "compile_time_toolkit_version": "12.9.0"}
TARGETS = {"H100": dict(_SM90, memory_bandwidth=3352320000000, device_memory_size=84978434048,
                        name="NVIDIA H100 80GB HBM3"),
           "H200": dict(_SM90, memory_bandwidth=4800000000000, device_memory_size=150754820096,
                        name="NVIDIA H200")}
INSTALL = 'pip install -e ".[gpu-compile]" (the CUDA plugin of jax 0.10.2 and ptxas; no GPU needed)'


class GpuCompileUnavailable(QwenMTPError, RuntimeError):
    """This environment cannot compile for a GPU: the CUDA plugin is missing or failed to register."""


def prepare():
    """Lets the CUDA plugin register without a GPU: jax's platforms "cpu" unless set (JAX_PLATFORMS, and jax's
    config where jax is imported). Call before jax's backends start (the first jax computation); later it changes
    nothing, and `device` says so."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if not jax.config.jax_platforms:
        jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])


def target_config(target: str) -> str:
    """The GpuTargetConfig text proto of `target` (a key of TARGETS)."""
    if target not in TARGETS:
        from qwen_mtp.errors import ArgumentError

        raise ArgumentError("target", f"one of {sorted(TARGETS)}", repr(target))
    t = TARGETS[target]
    fields = "\n".join(f"  {k}: {json.dumps(v) if isinstance(v, str) else v}" for k, v in t.items()
                       if k != "name")
    return (f"gpu_device_info {{\n{fields}\n  cuda_compute_capability {{ major: 9 minor: 0 }}\n}}\n"
            f'platform_name: "CUDA"\ndnn_version_info {{ major: 9 minor: 8 }}\n'
            f'device_description_str: "{t["name"]}"\n')


def device(target: str = "H200"):
    """The compile-only device of `target` (GpuCompileUnavailable when this environment has no CUDA plugin)."""
    return devices(target, 1)[0]


@functools.lru_cache(maxsize=None)
def devices(target: str = "H200", count: int = 1) -> tuple:
    """`count` compile-only devices of `target` on one host (a mesh over them compiles a sharded program with
    the collectives XLA's partitioner writes; GpuCompileUnavailable when there is no CUDA plugin)."""
    text = target_config(target)
    try:
        from jax.experimental import topologies

        topo = topologies.get_topology_desc("cuda", "cuda", target_config=text, topology=f"1x1x{count}")
    except Exception as e:  # noqa: BLE001 - any failure here means the same thing: no plugin to compile with
        raise GpuCompileUnavailable(
            f"compiling for {target}: expected jax's CUDA plugin registered in this process (JAX_PLATFORMS="
            f"{os.environ.get('JAX_PLATFORMS', '<unset>')}), found {type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''}; install it with {INSTALL}, and start the process "
            "with JAX_PLATFORMS=cpu (gpu_compile.prepare())") from e
    return tuple(topo.devices)


def place(tree, target: str = "H200"):
    """Every array / ShapeDtypeStruct leaf of `tree` as a ShapeDtypeStruct on `target`'s compile-only device
    (other leaves, a static config say, as they are)."""
    import jax

    s = jax.sharding.SingleDeviceSharding(device(target))
    on = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) if hasattr(x, "shape") and hasattr(
        x, "dtype") else x
    return jax.tree.map(on, tree)


def compile_for(fn, *args, target: str = "H200", **static):
    """`fn` (jitted; its static arguments as keywords) compiled for `target` at `args`' shapes and dtypes. Returns
    jax's Compiled: as_text() is the optimised GPU HLO; it cannot run here."""
    return fn.trace(*place(args, target), **static).lower().compile()


_PALLAS = re.compile(r'custom_call_target="__gpu\$xla\.gpu\.triton".*?op_name="([^"]*)/pallas_call"')


def pallas_kernels(hlo: str) -> collections.Counter:
    """The Pallas kernels of a compiled GPU program's text, counted by name (the name of the function the kernel
    was traced in: quant_matmul_int4, windowed_draft_attention, ...), each call site once."""
    return collections.Counter(m.group(1).rsplit("/", 1)[-1] for m in _PALLAS.finditer(hlo))
