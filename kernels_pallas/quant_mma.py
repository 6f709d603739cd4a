"""int4 and int8 matmuls at decode and verify rows (M <= 64; backend "auto" from MIN_ROWS) on the tensor cores:
x [M, K] (bf16; int4 also f16) @ a weight in quant_layout's format (int4 groups of g >= 32 rows, int8 one scale
per column) -> [M, N]. Up to 16 rows one 16-row tile (mma.sync); 17 .. 64 rows (a batch's verifies) one of 64
(Triton emits warp-group MMA there).

    quant_mma_pallas(x, q, scale, *, kind, k, block) -> [M, N]   (reference: quant_matmul_reference)

Why a third kernel. The FMA decode kernel (quant_gemv.py) multiplies on the FMA units: M multiply-adds per weight
on top of its conversion, so its estimated share of HBM falls with the rows (int4: 94% at M 1, 73% at M 2, 48% at
M 4; int8: 89% at M 4), and a k = 3 verify at batch 1 has 4 rows. The tiled kernel (quant_matmul.py)
uses the tensor cores, whose cost does not depend on M up to 16, but converts each value with I2F (an eighth of
the FMA rate): 26% of HBM for int4 on an H200. This kernel feeds the tensor cores without a conversion:

- a 32-bit word of packed values holds 4 columns (byte b: column 4c + b; int4: low nibble row j of a group, high
  nibble row j + g/2; int8: one row). One LOP3 makes two bf16 numbers of it at once: ((word >> s) & 0x000F000F)
  ^ 0x43084308 puts the nibbles at bits s .. s+3 and s+16 .. s+19 under bf16's exponent of 128 with bit 3 flipped:
  the bf16 number 128 + (n ^ 8) = 136 + v for a signed nibble v (the XOR folds the offset to unsigned into the
  same instruction; f16: 0x64086408, 1032 + v). Its low half is column 4c + b', its high half 4c + b' + 2
  (b' = 0, 1): the shifts s = 0, 4, 8, 12 give every nibble of the word;
- the numbers of one nibble position (s = 0, 8 or 4, 12) are stacked in registers into one [rows, 128] operand in
  the columns' own order (jnp.stack on the last axis, no data movement), so each step runs one dot of 128
  columns per nibble position (not four of 32: a quarter of the tensor-core instructions and their operand
  descriptors), the step's scales are one contiguous load and the output one contiguous store;
- int8 splits each byte into its unsigned low nibble (0x43004300, kept: 128 + l) and its signed high nibble
  (flipped: 136 + h), v = 16 h + l: the high nibbles multiply 16 x (exact in bf16), the low ones x, so int8 is
  int4's loop with both nibbles on one row of x;
- the tensor cores multiply x by these exact numbers (bf16 x bf16 products are exact in the f32 accumulator);
  the bases come back once per group (int4) or K part (int8), row and column: out += (acc - correction) *
  scale, the correction the bases times the sums of x they multiply;
- at up to 16 rows (decode, a verify) x is read as it is [M, K]: each load a masked [16, rows] block of x (int4:
  the group's low and high halves, rows G*g + j and G*g + g/2 + j of K; int8: x and 16 x), and the correction
  from one more load of the step's rows of x and a reduction; at the 64-row tile (batched verifies) XLA pads x
  into the rows the nibbles multiply (x's dtype [2, 64, K']) and computes the correction beside the call, where
  the kernel's own sums would cost int4 3.7 -> 5.4 lane-instructions per value. Arranged by XLA at 16 rows too,
  they were two kernels before every quantized product of a new x in a verify; the output stores only the M real
  rows;
- a CTA of 4 warps covers 32 words (128 columns) of 64 stored rows per loop step (8 KB), with the next steps'
  loads in flight (below), and K is split into parts (f32 partial products summed in XLA) until the grid gives
  the SMs about PROGRAMS_PER_SM CTAs each, while the partial products stay under MAX_PARTIAL_TRAFFIC of the
  bytes (under half of them where the grid would otherwise leave SMs idle: 27B's down at 64 rows, 40 column
  tiles, takes 4 parts).

Loads in flight. A CTA streams 8 KB of weights a step, and HBM's latency has to be covered by the bytes in
flight (Little's law: 4.8 TB/s x L / 132 SMs, 25 KB per SM if the loaded latency L is 700 ns: an assumption,
not a measurement). By default (STAGES = 3) Triton's software pipeline
copies the next two steps' words and x into shared memory (cp.async) while this one is computed: 64 KB in
flight per SM at 16 rows (4 CTAs), 32 KB at 64 rows (2 CTAs). stages=1 instead prefetches one step in
registers (24 and 16 KB): fewer instructions, fewer bytes in flight; benchmarks/gpu_check --quant-only times
both, and the faster is to become the default.

sm_90 machine code of the loop (tests/test_kernel_quant_mma.py compiles it, Triton's TTIR passes first, and
counts), 27B gate/up, bf16 x, the same code at every M <= 16, as it was with x arranged by XLA (now, x read as it
is: int4 3.2, int8 5.6): per stored value, int4 2.9 lane-instructions (LOP3
0.55, PRMT 0.5 (the pairs of rows the tensor-core operand wants), SHF 0.38, HMMA 0.25, the operand's staging
in shared memory STS 0.13 + LDSM 0.19, the per-group epilogue FADD + FFMA 0.25), int8 5.0 (the same per word,
4 values a word); 89-128 registers, no spill, 40 KB shared (stages=1: int4 2.8, int8 4.8). Against the bytes'
time at 4.8 TB/s (int4 9.6e12, int8 4.8e12 values/s; an SM issues 4 warp instructions per clock: 33.5e12
lane-instructions/s on 132 SMs at 1.98 GHz) both are estimated memory bound (int4 with 1.2x headroom, int8
1.4x): estimates, not measurements. A 64-row tile (warp-group MMA: the tensor cores read the weight operand
from shared memory themselves) costs int4 3.7 (95% of HBM; its per-group epilogue is 1.0 of it, 64 rows x 128
columns of FADD + FFMA a group) and int8 5.2 per value, at 223 and 127 registers and 80 KB shared (stages=1:
3.3 and 4.4 at 254 and 167 registers); a 32-row one (mma.sync, stages=1) int4 3.3 at 208 registers, int8 5.5,
so 17 .. 64 rows take the 64-row tile. (The first form of this kernel ran four dots of 32 columns per nibble
position and loaded each scale apart: int4 3.1 at M <= 16 and 5.5 at 64 rows, int8 5.3 and 6.1.)
benchmarks/gpu_check --quant-only times it beside the FMA and tiled kernels, XLA and qwix. The tensor cores
then run 16 padded rows x 9.6e12 int4 values/s = 307 TFLOP/s of bf16: under a third of an H200's dense bf16
peak (989 TFLOP/s, reached through wgmma; the mma.sync that Triton emits for a 16-row tile reaches less, how
much less is for the GPU run to show).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.quant_gemv import as_words
from kernels_pallas.split_k import SMS, k_parts, sum_parts
from kernels_pallas.quant_layout import VALUES_PER_COLUMN, cdiv, low_nibble_row

ROWS = 16  # one tensor-core tile of rows: M = 1 .. 16
# backend "auto" runs it (fp8: quant_mma_fp8.py) from these rows; below, the FMA decode kernel (estimated: int4
# M 1 94% of HBM, this kernel at M 1 is estimated at 100% too: the GPU run is to choose; int8 memory bound up to
# M 3, 89% at M 4; fp8 memory bound up to M 4 with less margin)
MIN_ROWS = {"int4": 2, "int8": 4, "fp8": 4}
# x's dtype -> the 32-bit LOP3 constants that put two nibbles under the exponent of 128 (bf16) / 1024 (f16),
# bit 3 flipped (the signed nibble to unsigned) or not, and the value each such nibble stands for beside v
FLIP = {jnp.dtype(jnp.bfloat16): (0x43084308, 136.0), jnp.dtype(jnp.float16): (0x64086408, 1032.0)}
KEEP = {jnp.dtype(jnp.bfloat16): (0x43004300, 128.0), jnp.dtype(jnp.float16): (0x64006400, 1024.0)}
NIBBLES = 0x000F000F
MIN_GROUP = 32  # half a group is one dot's K: >= 16
MAX_ROWS = 64  # rows of x: one tile of 16, or (batched verifies, 17 .. 64 rows) one of 64
WORDS = 32  # words (4 columns each) per CTA
MAX_STEP_ROWS = 64  # packed rows per load (a larger half group is loaded in parts; int8: K in steps of 64)
NUM_WARPS = 4
# Triton's software pipeline: the loads of STAGES - 1 steps ahead in flight through shared memory (cp.async), not
# registers; 1: the next step's loads in registers before the arithmetic on this one (module doc: which is faster
# is for the GPU run, benchmarks/gpu_check --quant-only times both)
STAGES = 3
PROGRAMS_PER_SM = 6  # about 128 registers x 128 threads: 4 CTAs fit an SM (a 64-row tile: 2); two waves hide the tail
MIN_STEPS_PER_SPLIT = 2
MAX_PARTIAL_TRAFFIC = 0.1
K_PARTS = {"target": SMS * PROGRAMS_PER_SM, "min_steps": MIN_STEPS_PER_SPLIT, "max_traffic": MAX_PARTIAL_TRAFFIC,
           "wave": SMS}
MAX_ELEMENTS = 2 ** 31
MAX_GRID = 65535
KINDS = ("int4", "int8")  # the formats this kernel takes (fp8: quant_mma_fp8.py)


def halves(kind: str, dt):
    """Per nibble position (low, high): (LOP3 constant, base): the value a nibble's bf16 / f16 number is beside
    its share of the stored value. int4: both nibbles are signed values (flipped, 136 + v); int8 per channel: the
    low nibble is unsigned (128 + l, kept), the high one signed (136 + h, flipped), v = 16 h + l, so the high
    nibbles multiply 16 x (exact in bf16)."""
    dt = jnp.dtype(dt)
    return (FLIP[dt], FLIP[dt]) if kind == "int4" else (KEEP[dt], FLIP[dt])


@dataclasses.dataclass(frozen=True)
class Plan:
    """grid (col_tiles, splits); a program covers WORDS words of `per` steps (int4: a group, scaled at its end;
    int8: 64 rows of K, scaled once at the end), each `subs` loads of `rows` stored rows."""
    col_tiles: int
    rows: int
    subs: int
    steps: int
    per: int
    splits: int
    tile_m: int = ROWS
    words: int = WORDS
    stages: int = STAGES

    @property
    def programs(self) -> int:
        return self.col_tiles * self.splits

    def step_values(self, kind: str) -> int:  # the stored values one pass of the loop reads
        return self.rows * self.subs * self.words * VALUES_PER_COLUMN[kind]


def plan(M, K, N, block, *, kind="int4", splits=None, words=None, stages=None) -> Plan:
    step = block[0] // 2 if kind == "int4" else MAX_STEP_ROWS
    rows = min(step, MAX_STEP_ROWS)
    tile_m = ROWS if M <= ROWS else MAX_ROWS  # (module doc: a tile of 64 beats one of 32 in sm_90 code)
    words = words or WORDS
    col_tiles = cdiv(N // 4, words)
    steps = cdiv(K, block[0]) if kind == "int4" else cdiv(K, step)
    splits, per = k_parts(steps, col_tiles, steps * step * N, M, N, splits=splits, **K_PARTS)
    return Plan(col_tiles, rows, step // rows, steps, per, splits, tile_m, words, stages or STAGES)


def unsupported_reason(x, q, scale, *, kind: str, k: int, block):
    """None if this kernel takes these inputs (the layout already checked), else why not."""
    M, N = x.shape[0], q.shape[1]
    g = block[0]
    dt = jnp.dtype(x.dtype)
    if kind not in ("int4", "int8"):
        return f"{kind}: the tensor-core decode kernel takes int4 and int8"
    if dt not in FLIP or (kind == "int8" and dt != jnp.bfloat16):
        return (f"x of dtype {dt}: the tensor-core decode kernel takes bfloat16 / float16 (int8: bfloat16 only, "
                "its high nibbles multiply 16 x, which float16 could overflow)")
    if kind == "int8" and tuple(block) != (k, 1):
        return f"int8 block {tuple(block)}: the tensor-core decode kernel takes one scale per column, ({k}, 1)"
    if not 1 <= M <= MAX_ROWS:
        return f"{M} rows: the tensor-core decode kernel takes 1 .. {MAX_ROWS}"
    if N == 0 or k == 0:
        return f"an empty matmul ({M} x {k} @ {k} x {N})"
    if N % 4:
        return f"N = {N} columns: {kind} values are read as int32 words of 4 columns, N must be a multiple of 4"
    if kind == "int4" and (g < MIN_GROUP or g & (g - 1)):
        return f"int4 group of {g} rows: the kernel takes a power of two >= {MIN_GROUP}"
    p = plan(M, k, N, block, kind=kind)
    if max(q.size, p.tile_m * 2 * p.steps * p.subs * p.rows, p.splits * M * N) >= MAX_ELEMENTS:
        return f"x [{M}, {k}] @ [{k}, {N}]: more than 2^31 elements in one array (the kernel's offsets are int32)"
    if max(p.col_tiles, p.splits) > MAX_GRID:
        return f"{p.col_tiles} column tiles x {p.splits} K parts: a CUDA grid's y and z stop at {MAX_GRID}"
    return None


def _kernel(*refs, kind, M, N, K, kq, g, p, dt, pair=False):
    """x as it is [M, K] (`native`: a tile of 16 rows), or as rows_of_x arranged it with its corrections (the
    64-row tile, where the kernel's own sums of x cost more than the bytes' time allows: int4 3.7 -> 5.4
    lane-instructions per value). pair (quant_mma_pair_pallas): two weights (gate, up), the grid's first col_tiles
    programs the first's tiles, the next the second's (one branch each, the same program), written to
    [splits, 2, M, N]."""
    nx = 1 if p.tile_m == ROWS else 2
    (x_ref, xs_ref), rest = (refs[:nx] + (None,))[:2], refs[nx:]
    j, part = pl.program_id(0), pl.program_id(1)
    tile = functools.partial(_tile, x_ref, xs_ref, kind=kind, M=M, N=N, K=K, kq=kq, g=g, p=p, dt=dt)
    if not pair:
        q_ref, s_ref, c_ref, o_ref = rest
        tile(q_ref, s_ref, c_ref, o_ref, j, part, None)
        return
    qg_ref, sg_ref, qu_ref, su_ref, c_ref, o_ref = rest
    pl.when(j < p.col_tiles)(lambda: tile(qg_ref, sg_ref, c_ref, o_ref, j, part, 0))
    pl.when(j >= p.col_tiles)(lambda: tile(qu_ref, su_ref, c_ref, o_ref, j - p.col_tiles, part, 1))


def _tile(x_ref, xs_ref, q_ref, s_ref, c_ref, o_ref, j, part, which, *, kind, M, N, K, kq, g, p, dt):
    """Program (column tile j, K part) of one weight; which: the pair's weight (0 gate, 1 up), None alone."""
    native = p.tile_m == ROWS
    R, step = p.rows, p.rows * p.subs
    c0, C = j * p.words, 4 * p.words  # the tile's first word, its columns
    cols = c0 * 4 + jnp.arange(C, dtype=jnp.int32)
    nibbles, magic = c_ref[0], (c_ref[1], c_ref[2])  # loaded, not literals (a LOP3 takes one immediate)
    last = p.steps * step - R  # the last load's first row (the prefetch past a part's end reads rows it skips)
    c_ragged = (N // 4) % p.words != 0
    r_ragged = kq % R != 0  # int8: K not a whole number of loads (rows past K read as 0, x is 0 there)
    col_ok = (c0 + jnp.arange(p.words, dtype=jnp.int32)) < N // 4
    row_ok = (jnp.arange(p.tile_m, dtype=jnp.int32) < M)[:, None]
    bases = [b for _, b in halves(kind, dt)]
    hg = g // 2  # int4: a group's stored rows

    def x_rows(k0):  # [tile_m, R] of x in its dtype: rows of K k0 .. k0 + R - 1, rows past M and K zero
        ok = row_ok & ((k0 + jnp.arange(R, dtype=jnp.int32)) < K)[None, :]
        return plt.load(x_ref.at[pl.ds(0, p.tile_m), pl.ds(k0, R)], mask=ok, other=0)

    def load(r0):  # [R, p.words] int32
        r0 = jnp.minimum(r0, last)
        if not (c_ragged or r_ragged):
            return q_ref[pl.ds(r0, R), pl.ds(c0, p.words)]
        ok = ((r0 + jnp.arange(R, dtype=jnp.int32)) < kq)[:, None] & col_ok[None, :]
        return plt.load(q_ref.at[pl.ds(r0, R), pl.ds(c0, p.words)], mask=ok, other=0)

    def scales(t):  # [1, C] f32: step t's scales (int4) / the column scales (int8) of the tile's columns
        if not c_ragged:
            return s_ref[pl.ds(t, 1), pl.ds(c0 * 4, C)]
        return plt.load(s_ref.at[jnp.full((C,), t, jnp.int32), cols], mask=cols < N, other=0)[None, :]

    def weights(w, half):  # [R, C] in x's dtype, natural column order: the nibbles at `half` of every byte
        pairs = []
        for b in range(2):  # bytes b and b + 2 of each word: one LOP3 makes both numbers
            sh = 8 * b + 4 * half
            v = jax.lax.shift_right_logical(w, jnp.int32(sh)) if sh else w
            v = jax.lax.bitwise_xor(jax.lax.bitwise_and(v, nibbles), magic[half])
            lo = jax.lax.bitcast_convert_type(v.astype(jnp.int16), dt)
            hi = jax.lax.bitcast_convert_type(jax.lax.shift_right_logical(v, jnp.int32(16)).astype(jnp.int16), dt)
            pairs.append(jnp.stack([lo, hi], axis=-1))  # [R, words, 2]: columns 4c + b, 4c + b + 2
        return jnp.stack(pairs, axis=-1).reshape(R, C)  # [R, words, 2, 2] -> column 4c + 2h + b

    def one_step(t, carry):
        out, wn, xs = carry
        # int4: a group's sums, scaled at its end; int8: one sum over the part, the products added to `out` itself
        acc = jnp.zeros((p.tile_m, C), jnp.float32) if kind == "int4" else out
        if kind == "int4":
            xs = jnp.zeros((p.tile_m, 1), jnp.float32)
        for s in range(p.subs):
            r0 = t * step + s * R
            if p.stages > 1:  # Triton's pipeliner keeps stages - 1 steps of loads in flight (cp.async)
                w = load(r0)
            else:  # one step in flight, in registers
                w, wn = wn, load(r0 + R)
            # x's rows the low / high nibbles multiply, read from x as it is: int4 the group's two halves (stored
            # row G * g / 2 + j: rows G * g + j and G * g + g / 2 + j of K), int8 x and 16 x (exact)
            if native:
                k0 = low_nibble_row(r0, g) if kind == "int4" else r0
                lo = x_rows(k0)
                xvs = (lo, x_rows(k0 + hg) if kind == "int4" else lo * 16)
            else:
                xvs = [x_ref[half, :, pl.ds(r0, R)] for half in range(2)]
            for half, xv in enumerate(xvs):
                acc = acc + jnp.dot(xv, weights(w, half), preferred_element_type=jnp.float32)
        if not native:  # [tile_m, 1]: the bases times the sums of x over the group (int4) / the part (int8)
            return (acc, wn, xs) if kind == "int8" else (out + (acc - xs_ref[:, pl.ds(t, 1)]) * scales(t), wn, xs)
        # the correction: the nibbles' bases times the sums of the x they multiply, the step's rows of K in one load
        # (int4: the group, both halves at one base; int8: x at the low base, 16 x at the high)
        span = g if kind == "int4" else step
        k_step = t * span
        ok = row_ok & ((k_step + jnp.arange(span, dtype=jnp.int32)) < K)[None, :]
        xt = plt.load(x_ref.at[pl.ds(0, p.tile_m), pl.ds(k_step, span)], mask=ok, other=0).astype(jnp.float32)
        xs = xs + (bases[0] if kind == "int4" else bases[0] + 16 * bases[1]) * jnp.sum(xt, axis=1, keepdims=True)
        if kind == "int8":
            return acc, wn, xs
        return out + (acc - xs) * scales(t), wn, xs

    first = part * p.per
    n = jnp.minimum(p.per, p.steps - first)
    zeros = jnp.zeros((p.tile_m, C), jnp.float32)
    out, _, xs = jax.lax.fori_loop(first, first + n, one_step, (zeros, load(first * step) if p.stages == 1 else None,
                                                                  jnp.zeros((p.tile_m, 1), jnp.float32)))
    if kind == "int8":  # the correction over the part's rows, then the column scales
        out = (out - (xs if native else xs_ref[:, pl.ds(part, 1)])) * scales(0)
    ok = (jnp.arange(p.tile_m, dtype=jnp.int32) < M)[:, None] & (cols < N)[None, :]
    if which is not None:
        plt.store(o_ref.at[part, jnp.int32(which), pl.ds(0, p.tile_m), pl.ds(c0 * 4, C)], out, mask=ok)
    elif p.splits > 1:
        plt.store(o_ref.at[part, pl.ds(0, p.tile_m), pl.ds(c0 * 4, C)], out, mask=ok)
    else:
        plt.store(o_ref.at[pl.ds(0, p.tile_m), pl.ds(c0 * 4, C)], out.astype(o_ref.dtype), mask=ok)


def rows_of_x(x, kind, block, p):
    """x [M, K] -> x's dtype [2, 16, Kx]: entry [h, m, r] multiplies stored row r's low (h 0) / high (h 1)
    nibble (int4: the two halves of a group; int8: x and 16 x); rows past M and K zero. Also the correction the
    kernel subtracts, f32: the bases (`halves`) times the sums of x they multiply, per group (int4: [16, steps])
    or per K part (int8: [16, splits])."""
    M, k = x.shape
    step = p.rows * p.subs
    xf = x.astype(jnp.float32)
    if kind == "int4":
        g = block[0]
        xp = jnp.pad(xf, ((0, p.tile_m - M), (0, p.steps * g - k)))
        xr = xp.reshape(p.tile_m, -1, 2, g // 2).transpose(2, 0, 1, 3).reshape(2, p.tile_m, p.steps * step)
    else:
        xp = jnp.pad(xf, ((0, p.tile_m - M), (0, p.steps * step - k)))
        xr = jnp.stack([xp, 16.0 * xp])
    xr = xr.astype(x.dtype)
    bases = jnp.asarray([b for _, b in halves(kind, x.dtype)], jnp.float32)
    sums = xr.astype(jnp.float32).reshape(2, p.tile_m, p.steps, step).sum(axis=3)
    if kind == "int8":  # per part of `per` steps
        sums = jnp.pad(sums, ((0, 0), (0, 0), (0, p.splits * p.per - p.steps)))
        sums = sums.reshape(2, p.tile_m, p.splits, -1).sum(3)
    return xr, jnp.einsum("h,hms->ms", bases, sums, precision=jax.lax.Precision.HIGHEST)


def launch(kernel, args, out_shape, grid, stages: int, name: str, interpret: bool):
    """The tensor-core decode kernels' pallas_call (this module's and quant_mma_fp8.py's, single and pair forms):
    every operand whole (each program indexes in place), NUM_WARPS warps, `stages` of Triton's pipeline."""
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, s: (0,) * a.ndim)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole(a) for a in args],
        out_specs=whole(out_shape),
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=stages),
        interpret=interpret,
        name=name,
    )(*args)


@functools.partial(jax.jit, static_argnames=("kind", "k", "block", "splits", "words", "stages", "unsummed",
                                             "interpret"))
def quant_mma_pallas(x, q, scale, *, kind: str = "int4", k: int, block, splits: int | None = None,
                     words: int | None = None, stages: int | None = None, unsummed: bool = False,
                     interpret: bool = False):
    """The kernel. Inputs must pass quant_matmul.check_inputs and unsupported_reason here. unsummed: K's float32
    partials [splits, M, N] as the kernel writes them (quant_gemv_pallas's `unsummed`)."""
    block = tuple(block)
    M, N = x.shape[0], q.shape[1]
    dt = jnp.dtype(x.dtype)
    p = plan(M, k, N, block, kind=kind, splits=splits, words=words, stages=stages)
    xs = (x,) if p.tile_m == ROWS else rows_of_x(x, kind, block, p)  # x as it is at 16 rows (_kernel's doc)
    (m_lo, _), (m_hi, _) = halves(kind, dt)
    consts = jnp.asarray(np.array([NIBBLES, m_lo, m_hi], np.uint32).view(np.int32))
    out_shape = jax.ShapeDtypeStruct((p.splits, M, N) if p.splits > 1 else (M, N),
                                     jnp.float32 if p.splits > 1 else dt)
    out = launch(functools.partial(_kernel, kind=kind, M=M, N=N, K=k, kq=q.shape[0], g=block[0], p=p, dt=dt),
                 (*xs, as_words(q), scale.astype(jnp.float32), consts), out_shape, (p.col_tiles, p.splits), p.stages,
                 f"quant_matmul_{kind}_mma", interpret)
    if unsummed:
        assert p.splits > 1, "quant_mma_pallas(unsummed=True): a plan of one K part has no partials"
        return out
    return sum_parts(out).astype(dt) if p.splits > 1 else out


@functools.partial(jax.jit, static_argnames=("kind", "k", "block", "splits", "words", "stages", "name", "interpret"))
def quant_mma_pair_pallas(x, qg, sg, qu, su, *, kind: str = "int4", k: int, block, splits: int | None = None,
                          words: int | None = None, stages: int | None = None, name: str = "gate_up",
                          interpret: bool = False):
    """Two weights of one shape and layout (a dense MLP's gate and up; an attention layer's k and v) in one launch:
    grid (2 col_tiles, splits), each program the single launch's program of its weight (the plan of one weight);
    float32 partials [splits, 2, M, N], [s, 0] of x @ gate and [s, 1] of x @ up over K's part s
    (kernels_pallas/quant_gate_up.py). The custom call is quant_{name}_{kind}_mma. Inputs must pass
    unsupported_reason for each weight."""
    block = tuple(block)
    M, N = x.shape[0], qg.shape[1]
    dt = jnp.dtype(x.dtype)
    p = plan(M, k, N, block, kind=kind, splits=splits, words=words, stages=stages)
    xs = (x,) if p.tile_m == ROWS else rows_of_x(x, kind, block, p)
    (m_lo, _), (m_hi, _) = halves(kind, dt)
    consts = jnp.asarray(np.array([NIBBLES, m_lo, m_hi], np.uint32).view(np.int32))
    args = (*xs, as_words(qg), sg.astype(jnp.float32), as_words(qu), su.astype(jnp.float32), consts)
    return launch(functools.partial(_kernel, kind=kind, M=M, N=N, K=k, kq=qg.shape[0], g=block[0], p=p, dt=dt,
                                    pair=True),
                  args, jax.ShapeDtypeStruct((p.splits, 2, M, N), jnp.float32), (2 * p.col_tiles, p.splits),
                  p.stages, f"quant_{name}_{kind}_mma", interpret)
