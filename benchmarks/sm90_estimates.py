"""Where the quantized decode kernels stand by their sm_90 machine code, on a machine without a GPU: each kernel's
Triton IR at a real shape compiled for sm_90 (qwen_mtp/tools/sm90_compile.py, Triton's TTIR passes first, as
XLA's pipeline runs them), its loop's instructions per stored value, and the share of HBM that count allows.

    python benchmarks/sm90_estimates.py [--shape 5120x17408] [--rows 1,2,4,8,16,64] [--formats int4,int8,fp8]
                                        [--bandwidth 4.8e12]
    python benchmarks/sm90_estimates.py --moe [--pairs 8,64] [--words 1,2,4] [--moe-splits plan,most]
                                        [--formats int4,int8]

--moe: the routed MoE product at decode (quant_gemv_grouped.py: the decode kernel over (token, expert) pairs) at
Qwen3.5-35B-A3B's experts (256; gate / up 2048 -> 512, down 512 -> 2048), one row per plan alternative
(quant_gemv_grouped.plan_alternatives: a lane's 4-byte words per row x K's parts, --moe-splits plan,most), the
plan's own choice marked: the alternatives `benchmarks/gpu_check --moe-only` times on a GPU.

The model: an SM issues 4 warp instructions per clock (132 SMs at 1.98 GHz on an H100 / H200: 33.5e12 lane-
instructions/s); a kernel whose loop needs n lane-instructions per stored value is bound by its instructions
when n exceeds the bytes' time, 33.5e12 / (values per second at the bandwidth), and reads at min(1, budget / n)
of HBM otherwise. It leaves out latency, tail waves, the tensor cores' own rate and the conversions' lower
issue rates (I2F), so it is an upper bound to compare kernels, not a speed: benchmarks/gpu_check --quant-only
measures them on a GPU, and its lines are what backend "auto" is to follow. The last column is the kernel
quant_decode.decode_kernel picks at those rows.

Latency is shown apart, not modelled: "in flight per SM" is the bytes of the loop steps whose loads are issued
ahead of the arithmetic (one, prefetched in registers; stages - 1 where Triton's pipeline copies them through
shared memory) times the CTAs an SM holds at once (by registers, warps and shared memory, and no more than the
grid gives it). By Little's law HBM at 4.8 TB/s with a loaded
latency of L ns wants 4.8e12 x L / 132 bytes in flight per SM (about 25 KB at 700 ns); the latency is the GPU
run's to measure, so no share is derived from this column.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels_pallas.split_k import SMS  # noqa: E402 (after the path): the kernels' grids are sized for these SMs

LANE_INSTRUCTIONS_PER_S = SMS * 1.98e9 * 4 * 32
SM_REGISTERS, SM_WARPS, SM_SHARED, SM_CTAS = 65536, 64, 228 * 1024, 32  # sm_90, per SM
BYTES_PER_VALUE = {"int4": 0.5, "int8": 1.0, "fp8": 1.0}
BLOCK = {"int4": (128, 1), "int8": None, "fp8": (128, 128)}


def _args(kind, M, K, N):
    import jax
    import jax.numpy as jnp

    from kernels_pallas.quant_layout import cdiv, padded_k

    block = BLOCK[kind] or (K, 1)
    storage = {"int4": jnp.uint8, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[kind]
    kq = padded_k(kind, K, block[0]) // (2 if kind == "int4" else 1)
    sds = jax.ShapeDtypeStruct
    return (sds((M, K), jnp.bfloat16), sds((kq, N), storage),
            sds((cdiv(K, block[0]), cdiv(N, block[1])), jnp.float32)), block


def kernels(kind, M, K, N):
    """[(name, jitted fn, per-iteration stored values of its innermost loop, programs in its grid, loop steps
    loaded ahead)]: the FMA decode kernel and the tensor-core one, where each takes the shape."""
    import jax

    from kernels_pallas import quant_gemv as gemv
    from kernels_pallas.quant_decode import tensor_core_kernel, tensor_core_module

    args, block = _args(kind, M, K, N)
    out = []
    if gemv.unsupported_reason(*args, kind=kind, k=K, block=block) is None:
        p = gemv.plan(M, K, N, kind, block)
        fn = jax.jit(lambda x, q, s: gemv.quant_gemv_pallas(x, q, s, kind=kind, k=K, block=block))
        out.append(("FMA decode kernel", fn, p.step_values(kind), p.col_tiles * p.splits, 1))
    module = tensor_core_module(kind)
    if module.unsupported_reason(*args, kind=kind, k=K, block=block) is None:
        p = module.plan(M, K, N, block, kind=kind)
        kernel = tensor_core_kernel(kind)
        fn = jax.jit(lambda x, q, s: kernel(x, q, s, kind=kind, k=K, block=block))
        out.append(("tensor-core decode kernel", fn, p.step_values(kind), p.col_tiles * p.splits,
                    max(1, p.stages - 1)))
    return args, block, out


MOE_EXPERTS = 256
MOE_SHAPES = {"gate/up": (2048, 512), "down": (512, 2048)}  # Qwen3.5-35B-A3B experts, K x N


def moe_kernels(kind, P, K, N, words_list, splits_list=("plan",)):
    """[(words, splits, jitted fn, per-iteration stored values, programs, grid, the plan's own choice)] and the
    args: the grouped decode kernel at each alternative (quant_gemv_grouped.plan_alternatives)."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas.quant_gemv_grouped import plan_alternatives, quant_gemv_grouped_pallas

    (x, q, s), block = _args(kind, P, K, N)
    sds = jax.ShapeDtypeStruct
    args = (x, sds((MOE_EXPERTS,) + q.shape, q.dtype), sds((MOE_EXPERTS,) + s.shape, s.dtype), sds((P,), jnp.int32))
    out = []
    for words, splits, p, own in plan_alternatives(kind, K, N, block, P, words_list, splits_list):
        fn = jax.jit(functools.partial(quant_gemv_grouped_pallas, kind=kind, k=K, block=block, words=words,
                                       splits=splits))
        out.append((words, splits, fn, p.step_values(kind), P * p.programs, (P, p.col_tiles, p.splits), own))
    return args, out


def moe_main(a) -> int:
    from qwen_mtp.tools.lowering import compile_sm90, export_for, triton_kernels

    cases, triton = [], []
    for kind in a.formats.split(","):
        for label, (K, N) in MOE_SHAPES.items():
            for P in (int(v) for v in a.pairs.split(",")):
                args, found = moe_kernels(kind, P, K, N, [int(w) for w in a.words.split(",")],
                                          a.moe_splits.split(","))
                for words, _, fn, values, programs, grid, own in found:
                    (kernel,) = triton_kernels(export_for(fn, *args))
                    cases.append((kind, label, P, words, values, programs, grid, kernel.num_warps, own))
                    triton.append(kernel)
    print(f"Qwen3.5-35B-A3B experts ({MOE_EXPERTS}), bf16 x, the routed decode kernel over (token, expert) pairs; "
          f"HBM {a.bandwidth / 1e12:.2f} TB/s; {LANE_INSTRUCTIONS_PER_S:.3g} lane-instructions/s")
    print("| format | matrix | pairs | words a lane | grid | registers | instructions / value | budget | "
          "est. share of HBM | in flight per SM | plan's choice |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (kind, label, P, words, values, programs, grid, warps, own), r in zip(cases, compile_sm90(triton, loops=True)):
        if r["error"]:
            print(f"| {kind} | {label} | {P} | {words} | compile error: {r['error'][-200:]} | | | | | | |")
            continue
        cells = _cells(r, kind, warps, values, programs, 1, a.bandwidth, kb_digits=1)
        print(f"| {kind} | {label} | {P} | {words} | {grid} | {cells} | {'**yes**' if own else ''} |")
    return 0


def _cells(r, kind, warps, values, programs, ahead, bandwidth, kb_digits=0) -> str:
    """A compiled kernel's table cells: registers (and any spill) | instructions per stored value | the budget |
    the estimated share of HBM | the bytes in flight per SM (`ahead` loop steps' loads of `values` values, times
    the CTAs an SM holds)."""
    ctas = ctas_per_sm(r["registers"], r["shared"], warps, programs)
    flight = f"{ctas * ahead * values * BYTES_PER_VALUE[kind] / 1024:.{kb_digits}f} KB ({ctas} CTA{'s' * (ctas > 1)})"
    budget = LANE_INSTRUCTIONS_PER_S * BYTES_PER_VALUE[kind] / bandwidth
    spill = "" if r["local"] == 0 else f" ({r['local']} B spilled)"
    if r["loops"]:
        per_value = r["loops"][0]["instructions"] * 32 * warps / values
        cost = f"{per_value:.2f} | {budget:.2f} | {min(1.0, budget / per_value):.0%}"
    else:  # one loop step a program: the compiler drops the loop, nothing to count per iteration
        cost = f"(no loop) | {budget:.2f} | "
    return f"{r['registers']}{spill} | {cost} | {flight}"


def ctas_per_sm(registers, shared, num_warps, programs):
    """CTAs one SM holds at once: registers (allocated per warp in units of 256), warps, shared memory (1 KB
    reserved per CTA) and the CTA limit, and no more than the grid spreads over the SMs."""
    per_warp = -(-registers * 32 // 256) * 256
    fit = min(SM_REGISTERS // (per_warp * num_warps), SM_WARPS // num_warps, SM_SHARED // (shared + 1024), SM_CTAS)
    return max(1, min(fit, -(-programs // SMS)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="5120x17408", help="K x N of the matrix (default: Qwen3.5-27B gate / up)")
    ap.add_argument("--rows", default="1,2,4,8,16,64",
                    help="rows of x (decode, verify rows, a batch's verifies) (default: 1,2,4,8,16,64)")
    ap.add_argument("--formats", default="int4,int8,fp8", help="weight formats (default: int4,int8,fp8)")
    ap.add_argument("--bandwidth", type=float, default=4.8e12, help="HBM bytes/s (default: an H200's 4.8e12)")
    ap.add_argument("--moe", action="store_true",
                    help="the routed MoE decode kernel at 35B-A3B's experts, one row per plan alternative")
    ap.add_argument("--pairs", default="8,64", help="--moe: (token, expert) pairs (default: batch 1 and 8 at top-8)")
    ap.add_argument("--words", default="1,2,4", help="--moe: a lane's 4-byte words per row (default: 1,2,4)")
    ap.add_argument("--moe-splits", default="plan",
                    help="--moe: K parts to compare: plan (the plan's cut), most (up to 16 programs a SM), half, "
                         "double or a number")
    a = ap.parse_args(argv)
    if a.moe:
        if a.formats == ap.get_default("formats"):
            a.formats = "int4,int8"  # the formats the grouped decode kernel takes
        return moe_main(a)
    from kernels_pallas.quant_decode import decode_kernel, quant_mma
    from qwen_mtp.tools.lowering import compile_sm90, export_for, triton_kernels

    K, N = (int(v) for v in a.shape.lower().split("x"))
    rows = [int(r) for r in a.rows.split(",")]
    cases, triton = [], []
    for kind in a.formats.split(","):
        for M in rows:
            args, block, found = kernels(kind, M, K, N)
            picks = decode_kernel(*args, kind, K, block)
            pick = {quant_mma: "tensor-core decode kernel"}.get(picks, "FMA decode kernel" if picks else "tiled / XLA")
            for name, fn, values, programs, ahead in found:
                (kernel,) = triton_kernels(export_for(fn, *args))
                cases.append((kind, M, name, values, programs, ahead, kernel.num_warps, pick))
                triton.append(kernel)
    print(f"K x N {K} x {N}, bf16 x; HBM {a.bandwidth / 1e12:.2f} TB/s; {LANE_INSTRUCTIONS_PER_S:.3g} "
          "lane-instructions/s")
    print("| format | rows | kernel | registers | instructions / value | budget | est. share of HBM | in flight per SM "
          "| auto picks |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (kind, M, name, values, programs, ahead, warps, pick), r in zip(cases, compile_sm90(triton, loops=True)):
        if r["error"]:
            print(f"| {kind} | {M} | {name} | compile error: {r['error'][-200:]} | | | | | |")
            continue
        print(f"| {kind} | {M} | {name} | {_cells(r, kind, warps, values, programs, ahead, a.bandwidth)} | "
              f"{'**' if pick == name else ''}{pick}{'**' if pick == name else ''} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
