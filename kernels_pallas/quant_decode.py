"""Which kernel runs a quantized matmul at decode and verify rows (M <= 64), and the two decode kernels'
dispatching functions (each: the kernel in a program lowered for cuda, quant_matmul_reference elsewhere).

    decode_kernel(x, q, scale, kind, k, block) -> quant_mma | quant_gemv | None   (backend "auto"'s choice)
    quant_mma(x, q, scale, *, kind, k, block, backend="auto")    the tensor-core kernel (quant_mma.py)
    quant_gemv(x, q, scale, *, kind, k, block, backend="auto")   the FMA-unit kernel (quant_gemv.py)
    decode_parts(x, q, scale, *, kind, k, block) -> S            K's parts the chosen kernel cuts the product into
    quant_decode_parts(x, q, scale, *, ...) -> [S, M, N] f32     those partials unsummed, for a consumer kernel

The rule, from the sm_90 machine code of each kernel's loop (instructions per stored value against the bytes'
time; estimates until benchmarks/gpu_check --quant-only times them on a GPU): on the tensor cores int4 with
bf16 / f16 x at 2 .. 16 rows, int8 per channel with bf16 x and fp8 with bf16 / f16 x at 4 .. 16 (2.9, 5.0 and
4.1 instructions per value at every M: estimated memory bound), and all three on to 64 rows (a batch's
verifies, one 64-row tile; int4 3.7, int8 5.2, fp8 2.4: 95%, memory bound, memory bound, where XLA's
dequantize-then-dot measured 4% of HBM for int4 and 11% for fp8 blocks at decode rows), else the FMA kernel up
to its ROWS_FMA (int4 M 1: 94% of HBM; int8 and fp8 memory bound up to M 3), else None: quant_matmul's tiled
kernel / XLA rule.
"""

from __future__ import annotations

import functools

from kernels_pallas import dispatch
from kernels_pallas import quant_gemv as gemv
from kernels_pallas import quant_mma as mma
from kernels_pallas import quant_mma_fp8 as mma_fp8
from kernels_pallas.quant_reference import check_inputs, quant_matmul_reference
from kernels_pallas.split_k import as_parts


def gemv_rows(M: int, kind: str) -> bool:
    """backend "auto" may take the FMA decode kernel (quant_gemv.py) at these rows: M <= gemv.ROWS_FMA[kind]."""
    return M <= gemv.ROWS_FMA[kind]


def decode_kernel(x, q, scale, kind: str, k: int, block):
    """backend "auto"'s decode kernel for these inputs (its dispatching function below): quant_mma (int4 with
    bf16 / f16 x at M 2 .. 64, int8 per channel with bf16 x at M 4 .. 64, fp8 with bf16 / f16 x at M 4 .. 64),
    quant_gemv (M <= ROWS_FMA), or None (quant_matmul's tiled kernel / XLA rule)."""
    M = x.shape[0]
    tensor_cores = tensor_core_module(kind).unsupported_reason(x, q, scale, kind=kind, k=k, block=block) is None
    if M >= mma.MIN_ROWS[kind] and tensor_cores:
        return quant_mma
    if gemv_rows(M, kind) and gemv.unsupported_reason(x, q, scale, kind=kind, k=k, block=block) is None:
        return quant_gemv
    return None


def _run(name, module_kernel, reason_of, x, q, scale, kind, k, block, backend, interpret):
    block = tuple(int(b) for b in block)
    check_inputs(x, q, scale, kind, k, block)
    reference = functools.partial(quant_matmul_reference, kind=kind, k=k, block=block)
    kernel = functools.partial(module_kernel, kind=kind, k=k, block=block, interpret=interpret)
    reason = reason_of(x, q, scale, kind=kind, k=k, block=block)
    return dispatch.run(name, kernel, reference, reason, backend, x, q, scale)


def quant_gemv(x, q, scale, *, kind: str, k: int, block, backend: str = "auto", interpret: bool = False):
    """The FMA decode kernel (quant_gemv.py) on cuda, the reference elsewhere; a shape it does not take (more
    than 16 rows, N not a multiple of 4, ...) falls back to the reference with a warning."""
    return _run("quantized matmul (decode kernel)", gemv.quant_gemv_pallas, gemv.unsupported_reason, x, q, scale,
                kind, k, block, backend, interpret)


def decode_parts(x, q, scale, *, kind: str, k: int, block, kernel=None) -> int:
    """K's parts the decode kernel backend "auto" takes for these inputs (decode_kernel; `kernel`: that choice
    already made) cuts this product into (1: none, the kernel writes the product, or no decode kernel takes
    them)."""
    kernel = kernel or decode_kernel(x, q, scale, kind, k, block)
    if kernel is None:
        return 1
    if kernel is quant_gemv:
        return gemv.plan(x.shape[0], k, q.shape[1], kind, tuple(block)).splits
    return tensor_core_module(kind).plan(x.shape[0], k, q.shape[1], tuple(block), kind=kind).splits


def quant_decode_parts(x, q, scale, *, kind: str, k: int, block, backend: str = "auto", interpret: bool = False):
    """The decode kernel's (decode_kernel: the FMA one or the tensor-core one) float32 K partials [S, M, N]
    (S = decode_parts > 1), unsummed, on cuda: their sum rounded to x's dtype is the kernel's product, which a
    consumer forms as it loads them (gdn_conv.py, gdn_step.py, attention_q.py: XLA's sum was a kernel of its
    own). Elsewhere the reference's product in part 0 and zeros in the others, so that the consumer's sum is the
    product bit for bit."""
    block = tuple(int(b) for b in block)
    check_inputs(x, q, scale, kind, k, block)
    chosen = decode_kernel(x, q, scale, kind, k, block)
    S = decode_parts(x, q, scale, kind=kind, k=k, block=block, kernel=chosen)
    if S < 2:
        raise ValueError(f"quant_decode_parts: the plan cuts [{k}, {q.shape[1]}] at {x.shape[0]} rows into {S} part")

    def reference(x, q, scale):
        return as_parts(quant_matmul_reference(x, q, scale, kind=kind, k=k, block=block), S)

    if chosen is quant_gemv:
        fn, reason_of = gemv.quant_gemv_pallas, gemv.unsupported_reason
    else:
        fn, reason_of = tensor_core_kernel(kind), tensor_core_module(kind).unsupported_reason
    kernel = functools.partial(fn, kind=kind, k=k, block=block, unsummed=True, interpret=interpret)
    reason = reason_of(x, q, scale, kind=kind, k=k, block=block)
    return dispatch.run("quantized matmul's K partials (decode kernel)", kernel, reference, reason, backend, x, q,
                        scale)


def tensor_core_module(kind: str):
    """The tensor-core decode kernel's module for a format (unsupported_reason, plan, its kernel): quant_mma_fp8
    for fp8, quant_mma for int4 / int8."""
    return mma_fp8 if kind == "fp8" else mma


def tensor_core_kernel(kind: str):
    """The tensor-core decode kernel's Pallas function for a format: quant_mma_fp8_pallas for fp8,
    quant_mma_pallas for int4 / int8 (both take kind=, k=, block=, splits=, stages=, interpret=)."""
    return mma_fp8.quant_mma_fp8_pallas if kind == "fp8" else mma.quant_mma_pallas


def quant_mma(x, q, scale, *, kind: str, k: int, block, backend: str = "auto", interpret: bool = False):
    """The tensor-core decode kernel (quant_mma.py; fp8: quant_mma_fp8.py) on cuda, the reference elsewhere;
    inputs it does not take (f32 x, more than 64 rows, ...) fall back to the reference with a warning."""
    return _run("quantized matmul (tensor-core decode kernel)", tensor_core_kernel(kind),
                tensor_core_module(kind).unsupported_reason, x, q, scale, kind, k, block, backend, interpret)
