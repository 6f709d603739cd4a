"""Quantized matmul: x [M, K] @ a weight stored in quant_layout's format -> [M, N] in x's dtype.

    quant_matmul(x, q, scale, *, kind, k, block) -> [M, N]

The reference dequantizes in XLA, then runs one dot (per-channel formats: the dot on the raw values, then one
multiply by the column scales, which is exact). The kernel, a Pallas-Triton kernel beside it, reads the packed
int8 / int4 / fp8 tiles of q and their scales where they lie in HBM, turns them into x's dtype in registers
(exact: |int8| <= 127, int4 and e4m3 values are exact in bf16 / f16 / f32), runs each dot on those exact values
with f32 accumulation, and applies the scales to the f32 products:

    per channel (int8, fp8 (K, 1)): acc += dot(x[:, k-step], v[k-step, n-tile]); at the end acc *= s[n-tile]
    K blocks (fp8 (128, 128), any (bk, bn)): per block of bk rows, acc += dot(x_blk, v_blk) * s[blk, n-tile]
    (a scale per tensor, block (K, N), is the per-channel case with one scale for every column)
    int4 groups of g:   per group, the g/2 packed rows give two contiguous [g/2, bn] half-tiles (low nibbles:
                        rows 0 .. g/2-1 of the group, high nibbles: rows g/2 .. g-1), sign-extended by two
                        shifts of the bytes as int8; acc += (dot(x_lo, lo) + dot(x_hi, hi)) * s[group, n-tile]

No dequantized weight is ever written: the only bytes moved are q, scale, x and the output. fp8 values are
loaded as float8_e4m3fn and converted by Triton (sm_89+: the lowering asserts compute capability >= 89; an
H100 / H200 is sm_90), so no bit decoding is needed.

Launch plan (`plan`): grid (row tiles, column tiles, K parts), every dimension masked at its edge (no padding
copy of x, q or the output in XLA):
- rows: Triton dots need every dimension >= 16, so M = 1 .. 16 (decode and speculative verify, k+1 <= 9) is one
  tile of 16 rows, the rows past M masked to zero on load and never stored; 17 .. 32 -> 32, 33 .. 64 -> 64,
  prefill (> 64) 128 (int4: 64, see `_tiles`); f32 always 16 (its IEEE dots run on the FMA units with their
  operands in registers);
- columns: a memory-bound skinny matmul needs many programs in flight on 132 SMs (TARGET_PROGRAMS = 264, two
  per SM): 128 columns per tile where that gives enough tiles, else 64 (a 64-byte int8 / fp8 / packed int4
  row per load; f32: at most 64). When even that leaves too few programs (the 27B down projection, N = 5120:
  80 tiles), K is split into parts (flash-decoding style) of at least MIN_STEPS_PER_SPLIT steps each; the
  parts write f32 partial products, summed in XLA after the call (a [parts, M, N] f32 array: small at decode
  M). A column tile never straddles a scale block: with 1 < bn < N the tile divides bn;
- K: each loop step covers block_k rows of K, in dots of at most dot_k rows (one load of x and one of q per
  dot): at decode in bf16 / f16 steps of 256 rows in one dot (a 16 KiB int8 tile at 64 columns); at prefill
  steps and dots of 64 (tensor-core tiles 128 x 128 x 64); f32 steps of 64 in dots of 32. A grouped format's
  step is a whole number of its groups / K blocks and a dot never crosses one (int4 g 128 at decode: 2 groups
  per step, 4 dots of K 64; g 32: 8 groups, 16 dots of K 16).
The real Qwen3.5-27B shapes in bf16 (grid rows x columns x K parts):
    M = 1 .. 16   gate / up 5120 -> 17408:  1 x 272 x 1 (64 columns), 20 steps of 256 rows
                  down     17408 -> 5120:   1 x 80 x 4 (64 columns, K in 4 parts of 17 steps)
                  lm_head   5120 -> 248320: 1 x 1940 x 1 (128 columns)
    M = 512       gate / up: 4 x 136 x 1 (int4: 8 x 136), down: 4 x 80 x 1 (int4: 8 x 40), lm_head 4 x 1940
tests/test_export_cuda.py lowers the kernel for cuda at these shapes and compiles its Triton IR for sm_90
(shared memory, registers, spills); benchmarks/gpu_check times it on a GPU.

Decode rows: backend "auto" first asks quant_decode.decode_kernel: a tensor-core decode kernel (quant_mma.py,
quant_mma_fp8.py: int4 from 2 rows, int8 and fp8 from 4, up to 64; bf16 / f16 x), else
quant_gemv.py's FMA kernel at M <= its ROWS_FMA, where they take the shape; only then the rule below. "pallas"
always means the tiled kernel of this module. The reference and the input check live in quant_reference.py.

Backend choice is kernels_pallas/dispatch.py's rule: the kernel in a program lowered for cuda, the reference
elsewhere; `backend="pallas"` with `interpret=True` runs the kernel on CPU, as the tests do. A format or shape
the kernel does not take (`unsupported_reason`) falls back to the reference with a one-time warning. Inputs
that break the layout itself (wrong q / scale shape or dtype for the kind, x's K not k) raise ValueError.

Where the kernel measured slower than XLA's dequantize-then-dot on a GPU (`xla_is_faster`), `backend="auto"`
lowers the reference for cuda too, silently: a choice of speed, not a limit of the kernel. The first H200 run
(benchmarks/results/h200-2026-12-04/gpu_check.log, 27B lm_head 5120 x 248320, bf16 x, times far above the
per-call dispatch floor):
    int4 g128   M 1 / 5: kernel 551 / 552 us, XLA 3581 / 3577 us   M 512: kernel 12869 us, XLA 4912 us
    fp8 128x128 M 1 / 5: kernel 623 / 605 us, XLA 2089 / 2089 us   M 512: kernel 5900 us,  XLA 3409 us
    int8 channel M 1 / 5: kernel 483 / 488 us, XLA 481 / 407 us     M 512: kernel 3037 us,  XLA 2976 us
(gate / up and down agree: XLA 1.2x-3.4x faster at M 512, the kernel 2x-4x faster for int4 and fp8 blocks at
M <= 5). So the kernel runs the grouped and K-block formats at M <= XLA_ROWS (one 16-row tile: decode, and the
verify of k + 1 rows at small batch), and XLA runs the per-channel formats (its dot fuses the one multiply by
the column scales) and every M past one tile. Rows 17 .. 511 were not measured: they follow M 512 until a sweep
says otherwise.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas import dispatch
from kernels_pallas.quant_decode import decode_kernel, gemv_rows, quant_gemv, quant_mma
from kernels_pallas.quant_layout import STORAGE, cdiv, padded_k
from kernels_pallas.quant_reference import check_inputs, quant_matmul_reference
from kernels_pallas.split_k import sum_parts

__all__ = ["check_inputs", "decode_kernel", "gemv_rows", "plan", "quant_gemv", "quant_matmul", "quant_matmul_pallas",
           "quant_matmul_reference", "quant_mma", "unsupported_reason", "xla_is_faster"]

HIGHEST = jax.lax.Precision.HIGHEST
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
TARGET_PROGRAMS = 264  # two programs per SM of an H100 / H200 (132 SMs)
MIN_STEPS_PER_SPLIT = 4  # a K part runs at least 4 loop steps, so the partial sums stay small next to the work
MIN_DIM = 16  # Triton dots need every dimension >= 16
INT4_GROUPS = (32, 64, 128, 256)  # half a group (a dot's K) must be >= 16; larger groups would hold too much
MAX_K_BLOCK = 256
MAX_ELEMENTS = 2 ** 31  # the kernel's offsets are int32
MAX_GRID_YZ = 65535  # grid (row tiles, column tiles, K parts) is CUDA's (x, y, z)
XLA_ROWS = 16  # backend "auto": past one tile of rows XLA's dequantize-then-dot measured faster (xla_is_faster)


def _mode(kind: str, k: int, block) -> str:
    """'int4' (packed groups), 'channel' (one scale per column over all of K) or 'block' (scales per K block)."""
    if kind == "int4":
        return "int4"
    return "channel" if block[0] >= k else "block"


def unsupported_reason(x, q, scale, *, kind: str, k: int, block):
    """None if the kernel takes this format, these shapes and dtypes, else why not (the caller falls back to the
    reference). The layout itself is assumed valid (check_inputs)."""
    M, N = x.shape[0], q.shape[1]
    bk, bn = block
    if jnp.dtype(x.dtype) not in {jnp.dtype(d) for d in DTYPES}:
        return f"x of dtype {jnp.dtype(x.dtype)}: the kernel takes float32 / bfloat16 / float16"
    if M == 0 or N == 0 or k == 0:
        return f"an empty matmul ({M} x {k} @ {k} x {N})"
    mode = _mode(kind, k, block)
    if mode == "int4" and bk not in INT4_GROUPS:
        return f"int4 group of {bk} rows: the kernel takes groups of {INT4_GROUPS} (half a group is one dot's K)"
    if mode == "block" and (bk & (bk - 1) or not MIN_DIM <= bk <= MAX_K_BLOCK):
        return f"K blocks of {bk} rows: the kernel takes a power of two in [{MIN_DIM}, {MAX_K_BLOCK}]"
    if 1 < bn < N and bn % MIN_DIM:
        return f"scale blocks of {bn} columns: the kernel takes 1, a multiple of {MIN_DIM} or all N"
    p = plan(M, k, N, kind, block, jnp.dtype(x.dtype).itemsize)
    if max(q.size, M * k, p.splits * M * N) >= MAX_ELEMENTS:
        return f"x [{M}, {k}] @ [{k}, {N}]: more than 2^31 elements in one array (the kernel's offsets are int32)"
    if max(p.col_tiles, p.splits) > MAX_GRID_YZ:
        return f"{p.col_tiles} column tiles x {p.splits} K parts: a CUDA grid's y and z stop at {MAX_GRID_YZ}"
    return None


def xla_is_faster(M: int, kind: str, k: int, block):
    """None where a kernel is the faster on a GPU, else why XLA's dequantize-then-dot is (module doc: the
    first H200 run). backend="auto" then lowers the reference for cuda as well. At decode rows
    (gemv_rows) the decode kernel is the choice for every format."""
    if gemv_rows(M, kind):
        return None
    if _mode(kind, k, block) == "channel":
        return (f"{kind} per channel: XLA's dot with the column scales fused after it measured as fast or faster "
                "at every M on an H200")
    if M > XLA_ROWS:
        return f"{M} rows (more than one tile of {XLA_ROWS}): XLA's dequantize-then-dot measured faster on an H200"
    return None


def _pow2(x, at_least=MIN_DIM):
    return max(at_least, 1 << (int(x) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static launch plan: grid (row_tiles, col_tiles, splits); each program runs steps_per_split loop steps of
    block_k rows of K (a whole number of scale blocks / int4 groups) over a [block_m, block_n] output tile, in
    dots of at most dot_k rows of K each (one load of x and of q per dot)."""
    block_m: int
    row_tiles: int
    block_n: int
    col_tiles: int
    block_k: int
    dot_k: int
    steps: int
    steps_per_split: int
    splits: int
    num_warps: int
    num_stages: int

    @property
    def programs(self) -> int:
        return self.row_tiles * self.col_tiles * self.splits


# Tile rules, chosen by compiling the kernel for sm_90 on a CPU (tests/test_export_cuda.py compiles it with the
# `triton` package and checks shared memory, registers and spills at the real shapes):
# - bf16 / f16 at decode: one 16-row tile, 256 rows of K per dot (int8 at 64 columns: 116 registers, 48 KiB of
#   shared memory in 3 stages); at prefill 128 x 128 tiles and dots of K 64 (tensor-core tiles), but 64-row
#   tiles for int4 (two f32 [128, 128] products per group, the group's and the accumulator, need 254 registers);
# - f32 (IEEE dots on the FMA units, whose operands live in registers): 16-row tiles of at most 64 columns
#   and dots of K 32 at every M; a larger tile or dot K leaves a stack frame (spills) on sm_90.
def _tiles(M, mode, wide):
    """(block_m, largest block_n, dot_k, block_k) before the format's constraints."""
    if not wide:
        return 16, 64, 32, 64
    if M <= 16:
        return 16, 128, 256, 256
    if M <= 64:
        return _pow2(M), 128, 64, 64
    return (64 if mode == "int4" else 128), 128, 64, 64


def plan(M, K, N, kind, block, itemsize=2, *, block_m=None, block_n=None, block_k=None, dot_k=None, splits=None,
         num_warps=None, num_stages=None) -> Plan:
    """Launch parameters from the shapes (module doc); any of the keyword arguments given wins."""
    bk, bns = block
    mode = _mode(kind, K, block)
    bm, max_bn, auto_dot_k, step_k = _tiles(M, mode, itemsize <= 2)
    dot_k = auto_dot_k if dot_k is None else dot_k
    block_m = bm if block_m is None else block_m
    row_tiles = cdiv(M, block_m)
    if block_n is None:
        block_n = max_bn if row_tiles * cdiv(N, max_bn) >= TARGET_PROGRAMS else 64
        block_n = min(block_n, max_bn, _pow2(N))
    if 1 < bns < N:  # a column tile inside one scale block: the largest power of two dividing bns
        block_n = min(block_n, bns & -bns)
    col_tiles = cdiv(N, block_n)
    for name, v in (("block_m", block_m), ("block_n", block_n), ("dot_k", dot_k)):
        if v < MIN_DIM or v & (v - 1):
            raise ValueError(f"quant_matmul plan: {name} a power of two >= {MIN_DIM}, found {v}")
    if mode == "int4":
        dot_k = min(dot_k, bk // 2)  # a dot multiplies (part of) one half-group
    elif mode == "block":
        dot_k = min(dot_k, bk)  # a dot stays inside one K block
    else:
        dot_k = min(dot_k, _pow2(K))
    if block_k is None:
        block_k = step_k
    if mode != "channel":
        block_k = max(block_k, bk) // bk * bk  # whole groups / K blocks per step
    else:
        block_k = max(block_k, dot_k) // dot_k * dot_k
    rows = padded_k(kind, K, bk) if mode == "int4" else K
    steps = cdiv(rows, block_k)
    if splits is None:
        want = cdiv(TARGET_PROGRAMS, row_tiles * col_tiles)
        splits = max(1, min(want, steps // MIN_STEPS_PER_SPLIT))
    splits = max(1, min(int(splits), steps))
    per = cdiv(steps, splits)
    splits = cdiv(steps, per)
    if num_warps is None:
        num_warps = 8 if block_m * block_n >= 64 * 128 else 4
    if num_stages is None:
        num_stages = 3
    return Plan(block_m, row_tiles, block_n, col_tiles, block_k, dot_k, steps, per, splits, num_warps, num_stages)


def _kernel(x_ref, q_ref, s_ref, o_ref, *, mode, M, K, N, kq, n_groups, bk, bns, bm, bn, tk, dk, per, dt, parts):
    i, j, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m0, n0 = i * bm, j * bn
    row_ok = (m0 + jnp.arange(bm, dtype=jnp.int32)) < M
    col_ok = (n0 + jnp.arange(bn, dtype=jnp.int32)) < N
    zero_q = 0.0 if q_ref.dtype == STORAGE["fp8"] else 0  # (Triton casts no int constant to fp8)

    def x_tile(k0, width):  # [bm, width] of x in its dtype; rows past M and columns past K read as 0
        ok = row_ok[:, None] & ((k0 + jnp.arange(width, dtype=jnp.int32)) < K)[None, :]
        return plt.load(x_ref.at[pl.ds(m0, bm), pl.ds(k0, width)], mask=ok, other=0)

    def q_tile(r0, height, limit):  # [height, bn] stored values; rows past `limit` and columns past N read as 0
        ok = ((r0 + jnp.arange(height, dtype=jnp.int32)) < limit)[:, None] & col_ok[None, :]
        return plt.load(q_ref.at[pl.ds(r0, height), pl.ds(n0, bn)], mask=ok, other=zero_q)

    def col_scale(g):  # the scales of K block g for this tile's columns: [1, bn], or [1, 1] inside one block
        g = jnp.minimum(g, n_groups - 1)  # a step past the end (the last K part) reads zeros: any scale will do
        if bns == 1:
            return plt.load(s_ref.at[g, pl.ds(n0, bn)], mask=col_ok, other=0)[None, :]
        return jnp.full((1, bn), s_ref[g, n0 // bns], jnp.float32)

    # HIGHEST: IEEE f32 dots for f32 x (Triton lowers DEFAULT to TF32); for bf16 / f16 it changes nothing (the
    # products of the exact small values are exact in the f32 accumulator)
    dot = lambda a, b: jnp.dot(a, b, precision=HIGHEST, preferred_element_type=jnp.float32)

    def rows_dot(k0, rows):  # x[:, k0 : k0+rows] @ values[k0 : k0+rows, tile] for int8 / fp8, in dots of dk rows
        out = None
        for c in range(0, rows, dk):
            d = dot(x_tile(k0 + c, dk), q_tile(k0 + c, dk, K).astype(dt))
            out = d if out is None else out + d
        return out

    def group_dot(kb):  # one int4 group starting at row kb: its g/2 packed rows hold both halves
        h, out = bk // 2, None
        for c in range(0, h, dk):
            packed = jax.lax.bitcast_convert_type(q_tile(kb // 2 + c, dk, kq), jnp.int8)
            lo = jax.lax.shift_right_arithmetic(jax.lax.shift_left(packed, jnp.int8(4)), jnp.int8(4))
            hi = jax.lax.shift_right_arithmetic(packed, jnp.int8(4))
            d = dot(x_tile(kb + c, dk), lo.astype(dt)) + dot(x_tile(kb + h + c, dk), hi.astype(dt))
            out = d if out is None else out + d
        return out

    def step(t, acc):
        k0 = (part * per + t) * tk
        if mode == "channel":
            return acc + rows_dot(k0, tk)
        for b in range(tk // bk):
            kb = k0 + b * bk
            acc = acc + (group_dot(kb) if mode == "int4" else rows_dot(kb, bk)) * col_scale(kb // bk)
        return acc

    acc = jax.lax.fori_loop(0, per, step, jnp.zeros((bm, bn), jnp.float32))
    if mode == "channel":
        acc = acc * col_scale(0)
    ok = row_ok[:, None] & col_ok[None, :]
    if parts > 1:
        plt.store(o_ref.at[part, pl.ds(m0, bm), pl.ds(n0, bn)], acc, mask=ok)
    else:
        plt.store(o_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], acc.astype(dt), mask=ok)


@functools.partial(jax.jit, static_argnames=("kind", "k", "block", "block_m", "block_n", "block_k", "dot_k",
                                             "splits", "num_warps", "num_stages", "interpret"))
def quant_matmul_pallas(x, q, scale, *, kind: str, k: int, block, block_m: int | None = None,
                        block_n: int | None = None, block_k: int | None = None, dot_k: int | None = None,
                        splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                        interpret: bool = False):
    """The Pallas kernel. Inputs must pass check_inputs and unsupported_reason (quant_matmul checks both).
    None picks each launch parameter from the shapes (plan); an int forces it (tests, tuning)."""
    block = tuple(block)
    M, N = x.shape[0], q.shape[1]
    dt = x.dtype
    p = plan(M, k, N, kind, block, jnp.dtype(dt).itemsize, block_m=block_m, block_n=block_n, block_k=block_k,
             dot_k=dot_k, splits=splits, num_warps=num_warps, num_stages=num_stages)
    kernel = functools.partial(
        _kernel, mode=_mode(kind, k, block), M=M, K=k, N=N, kq=q.shape[0], n_groups=scale.shape[0],
        bk=block[0], bns=block[1], bm=p.block_m, bn=p.block_n, tk=p.block_k, dk=p.dot_k, per=p.steps_per_split,
        dt=dt, parts=p.splits)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j, s: (0,) * len(a.shape))  # each program slices in place
    if p.splits > 1:
        out_shape = jax.ShapeDtypeStruct((p.splits, M, N), jnp.float32)
    else:
        out_shape = jax.ShapeDtypeStruct((M, N), dt)
    out = pl.pallas_call(
        kernel,
        grid=(p.row_tiles, p.col_tiles, p.splits),
        in_specs=[whole(x), whole(q), whole(scale)],
        out_specs=whole(out_shape),
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=p.num_warps, num_stages=p.num_stages),
        interpret=interpret,
        name=f"quant_matmul_{kind}",
    )(x, q, scale.astype(jnp.float32))
    return sum_parts(out).astype(dt) if p.splits > 1 else out


def quant_matmul(x, q, scale, *, kind: str, k: int, block, backend: str = "auto", interpret: bool = False):
    """The kernel in a program lowered for cuda, the reference elsewhere (dispatch.run); see the module doc.
    backend "auto" at decode rows runs a decode kernel (decode_kernel); "pallas" means this module's tiled kernel."""
    block = tuple(int(b) for b in block)
    check_inputs(x, q, scale, kind, k, block)
    decode = decode_kernel(x, q, scale, kind, k, block) if backend == "auto" else None
    if decode is not None:
        return decode(x, q, scale, kind=kind, k=k, block=block, interpret=interpret)
    reference = functools.partial(quant_matmul_reference, kind=kind, k=k, block=block)
    kernel = functools.partial(quant_matmul_pallas, kind=kind, k=k, block=block, interpret=interpret)
    reason = unsupported_reason(x, q, scale, kind=kind, k=k, block=block)
    if backend == "auto" and reason is None and xla_is_faster(x.shape[0], kind, k, block) is not None:
        backend = "reference"  # the faster choice on a GPU (module doc), not a fallback: no warning
    return dispatch.run("quantized matmul", kernel, reference, reason, backend, x, q, scale)
