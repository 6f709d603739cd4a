"""Quantized matmul at decode rows (M = 1 .. 16): x [M, K] @ a weight in quant_layout's format -> [M, N].

    quant_gemv_pallas(x, q, scale, *, kind, k, block) -> [M, N]   (reference: quant_matmul_reference)

A decode matmul reads every byte of the weight once and does M multiply-adds per weight: it is bound by HBM as
long as the instructions that turn each stored value into a number cost less than the bytes take to arrive.
The tiled kernel (quant_matmul.py) converts each int8 / int4 value with I2F (sm_90: 16 conversions per SM per
clock, an eighth of the FMA rate) and feeds tensor-core dots padded to 16 rows; the first H200 run measured it
at 26% (int4), 43% (fp8 blocks) and 55% (int8 per channel) of HBM on the 27B lm_head. This kernel instead:

- reads the packed values as int32 words (int8 / int4: XLA reinterprets q [Kq, N] as int32 [Kq, N / 4], a
  bitcast, no copy) or as fp8 bytes, in tiles as wide as one 16-byte load per thread (a CTA of w warps covers
  512 w bytes of a row), so every load is a full 128-byte line per 8 threads;
- turns the values into f32 with integer logic and one subtraction, no conversion instruction (the
  "magic number" of FasterTransformer / Marlin's dequantizers): the values are first offset to unsigned
  (int4: word ^ 0x88888888, u = v + 8; int8: word ^ 0x80808080, u = v + 128), then each value's bits, where
  they lie in the word (bits p .. p + b - 1, p + b <= 23) or after one shift of the word shared by several
  values, are masked and OR-ed under the exponent of 1.0: float(0x3F800000 | u << p) - 1 = u * 2^(p - 23),
  exact. x is multiplied by 2^(23 - p) once per tile row (not per weight) so the products are x * u; the
  offset comes back once per scale block as -8 (-128) times the sum of x's entries over the block. int4: 10
  integer and 16 float instructions per 8 values (one word), int8: 6 and 8 per 4;
- reads x [M, K] as it is, in its dtype: each x entry a stored row multiplies is one scalar load (int4: rows
  G*g + j and G*g + g/2 + j of K for packed row G*g/2 + j), turned into f32 in registers, and the sum of x over
  a scale block (the offset's, below) is one vector load and a reduction a block (per channel: a step). XLA
  used to arrange x in the stored rows' order in f32 and sum its blocks before the kernel: two kernels before
  every quantized product of a new x, which a decode step paid in launches (27B int4, 4 real-width layers:
  124 -> 100 kernels a step with the norms written by one kernel, forward.post_norm), for about 0.3
  instructions per value here;
- fp8 (e4m3) tiles load as bytes and convert with the hardware's paired fp8 -> f16 instruction;
- multiplies on the FMA units (no tensor cores: at M <= ROWS_FMA rows there is nothing to pad to 16), keeps the
  tile's rows inside each thread (a CTA spreads only along columns) so the sum over K is a chain of FMAs in
  registers with no shuffle, and applies each scale in f32 once per scale block and column;
- runs many small CTAs of one warp: 32 x vector_words(M) words (int4 / int8) or 4x that many fp8 bytes per row,
  K split into parts (written as f32 partial products, summed in XLA) until the grid gives every SM about 8
  CTAs (`plan`, in quant_gemv_plan.py with the alternatives benchmarks/gpu_check times); int4 / int8 carry
  the next R rows' loads through the loop (issued before the arithmetic on the current rows: `prefetch`), fp8
  loads each tile where it is used (fp8 bytes carried through the loop lose their packing).

sm_90 machine code of the inner loop (benchmarks/sm90_estimates.py at 27B gate / up; per stored value, bf16 x):
int4 M 1: 4.0 instructions (3.7 with x arranged by XLA in f32), 142 registers, no spill; int8 M 1: 4.1 (3.9);
fp8 M 1: 2.9. Not yet timed on a GPU: benchmarks/gpu_check --quant-only times it.

The FMA path costs M multiply-adds per weight on top of the conversion, so it stays under the bytes' time up
to a few rows only (ROWS_FMA: an issue-slot budget, module `rows_fma`); quant_matmul dispatches M <= ROWS_FMA to
this kernel and keeps the tiled kernel / XLA rule above. Over (token, expert) pairs: quant_gemv_grouped.py.

Layout per loop step (one scale block of stored rows, cut into sub-steps of `rows` rows, each one load):
    int4 (g, 1):   the g/2 packed rows of one group; word c of packed row j holds columns 4c .. 4c+3 (byte b),
                   low nibble = row G*g + j, high nibble = row G*g + g/2 + j (quant_layout's packing)
    int8 / fp8:    bk rows of one K block (per channel: STEP_ROWS rows, the scales applied at the end)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.quant_gemv_plan import (
    MIN_STEPS_PER_SPLIT,
    MOST_PER_SM,
    SUB_ROWS,
    TARGET_PROGRAMS,
    WORDS,
    Plan,
    alternatives,
    mode,
    plan,
    reads_words,
    vector_words,
)
from kernels_pallas.quant_layout import low_nibble_row
from kernels_pallas.split_k import sum_parts

# the kernel, and its plan's names (quant_gemv_plan.py) re-exported: callers write gemv.plan, gemv.WORDS
__all__ = ["CONSTS", "DTYPES", "MAX_ELEMENTS", "MAX_GRID", "MAX_ROWS", "MIN_STEPS_PER_SPLIT", "MOST_PER_SM",
           "ROWS_FMA", "SUB_ROWS", "TARGET_PROGRAMS", "WORDS", "Plan", "alternatives", "as_words",
           "gemv_kernel", "mode", "plan", "quant_gemv_pallas", "reads_words", "unsupported_reason", "vector_words"]

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_ROWS = 16  # decode rows: the kernel takes M <= 16
# backend "auto" (quant_matmul.gemv_rows) runs this kernel up to these rows, below the tensor-core kernels'
# MIN_ROWS (quant_decode.decode_kernel takes those first); above, the tiled kernel / XLA. From
# the sm_90 machine code of the inner loop (instructions issued per stored value, an SM issuing 4 warp
# instructions per clock: 33.5e12 lane-instructions/s on 132 SMs at 1.98 GHz) against the bytes' time at 4.8 TB/s
# (27B gate/up, tools/sm90_compile.py with Triton's TTIR passes, 2026-12-05):
#   int4 M 1: 3.7 / value -> 94% of HBM, M 2: 4.8 -> 73%, M 4: 7.3 -> 48% (tiled kernel measured 26%)
#   int8 M 1: 3.9 -> memory bound, M 2: 5.1 -> memory bound, M 4: 7.9 -> 89% (tiled kernel / XLA measured 55%)
#   fp8  M 1: 2.9 -> memory bound, M 4: 6.6 -> memory bound, M 8: 12.6 -> 55% (tiled kernel measured 43%)
# and with x read as it is (2026-12-07, the module doc): int4 M 1 4.0 -> 87%, M 2 5.6 -> 63%, M 4 10.6 -> 33%;
# int8 M 1 4.1, M 2 5.5 -> memory bound, M 4 9.3 -> 75%; fp8 M 1 2.9, M 4 7.6 -> 92%, M 8 16.5 -> 42%. Where
# these fall behind, the tensor-core decode kernel (quant_decode.py) takes the rows first, as before.
ROWS_FMA = {"int4": 4, "int8": 4, "fp8": 8}
MAX_ELEMENTS = 2 ** 31
MAX_GRID = 65535
ONE = 0x3F800000  # float32 1.0


def _i32(v: int):
    return jnp.int32(np.array(v & 0xFFFFFFFF, np.uint32).view(np.int32))


def unsupported_reason(x, q, scale, *, kind: str, k: int, block):
    """None if this kernel takes these inputs (layout already checked), else why not."""
    M, N = x.shape[0], q.shape[1]
    bk = block[0]
    if jnp.dtype(x.dtype) not in {jnp.dtype(d) for d in DTYPES}:
        return f"x of dtype {jnp.dtype(x.dtype)}: the kernel takes float32 / bfloat16 / float16"
    if not 1 <= M <= MAX_ROWS:
        return f"{M} rows: the decode kernel takes 1 .. {MAX_ROWS}"
    if N == 0 or k == 0:
        return f"an empty matmul ({M} x {k} @ {k} x {N})"
    md = mode(kind, k, block)
    if reads_words(kind) and N % 4:
        return f"N = {N} columns: int8 / int4 values are read as int32 words of 4 columns, N must be a multiple of 4"
    step = bk // 2 if md == "int4" else bk
    if md != "channel" and step > SUB_ROWS and step % SUB_ROWS:
        what = f"int4 group of {bk} rows" if md == "int4" else f"K blocks of {bk} rows"
        return f"{what}: the kernel loads {SUB_ROWS} stored rows at a time, a block must hold a whole number"
    p = plan(M, k, N, kind, block)
    if max(q.size, M * k, p.splits * M * N) >= MAX_ELEMENTS:
        return f"x [{M}, {k}] @ [{k}, {N}]: more than 2^31 elements in one array (the kernel's offsets are int32)"
    if max(p.col_tiles, p.splits) > MAX_GRID:
        return f"{p.col_tiles} column tiles x {p.splits} K parts: a CUDA grid's y and z stop at {MAX_GRID}"
    return None


# int4: (shift of the word, bit position p of the value in the shifted word) of the low and the high nibble of
# byte b, both at the same p so that one accumulator per byte takes both: low nibbles at 8b, high at 8b + 4
INT4_FIELDS = (((0, 0), (4, 0)), ((0, 8), (4, 8)), ((0, 16), (4, 16)), ((12, 12), (16, 12)))
# int8: (shift, p) of byte b
INT8_FIELDS = ((0, 0), (0, 8), (9, 7), (9, 15))
# the kernel's int32 constants (an input array: see _value): 1.0's bits, the int4 / int8 offsets to unsigned,
# then every field mask
_MASKS = sorted({(4, p) for fields in INT4_FIELDS for _, p in fields} | {(8, p) for _, p in INT8_FIELDS})
CONSTS = np.array([ONE, 0x88888888, 0x80808080] + [((1 << w) - 1) << p for w, p in _MASKS],
                  np.uint32).view(np.int32)
MASK_AT = {wp: 3 + i for i, wp in enumerate(_MASKS)}


def _value(word, shift, mask, one):
    """The unsigned field `mask` (in place: bits p .. p + width - 1) of each int32 word after a right shift by
    `shift`, times 2^(p - 23), as f32: OR-ed under the exponent of 1.0 (`one`) and 1.0 subtracted (exact, no
    conversion instruction). `mask` and `one` are loaded, not literals: a LOP3 takes one immediate, and ptxas
    would rebuild a second literal with a MOV before every use."""
    w = jax.lax.shift_right_logical(word, jnp.int32(shift)) if shift else word
    bits = jax.lax.bitwise_or(jax.lax.bitwise_and(w, mask), one)
    return jax.lax.bitcast_convert_type(bits, jnp.float32) - 1.0


def gemv_kernel(*refs, kind, md, M, K, N, kq, bk, bns, p, dt, gk, grouped=0, pair=False, shared=0, shared_row0=0):
    """grouped (the routed MoE product, quant_gemv_grouped_pallas: the pairs that read one row of x, >= 1):
    program (pair, column tile, K part) of a grid one axis longer, M = 1, the output's row the pair's, x's row
    pair // grouped, q and the scales those of expert ids[pair]. pair (a gate and an up in one launch: the
    experts', kernels_pallas/moe_expert_mlp.py, or a dense MLP's, quant_gate_up.py): the refs hold two weights and
    their scales, column tiles past the first weight's read the second, and the output is float32 partials
    [parts, 2, P or M, N]. shared (grouped only: the number of routed pairs P, 0 for none): the MoE block's shared
    expert as pairs P, P + 1, ...: its weights and scales (one expert, [1, Kq, N / 4] / [1, gk, gn], as many as
    the routed ones') follow the ids, and pair P + t reads x's row shared_row0 + t."""
    n_w = 2 if pair else 1
    x_ref, c_ref, o_ref = refs[0], refs[1 + 2 * n_w], refs[-1]
    routed = (refs[1:1 + n_w], refs[1 + n_w:1 + 2 * n_w])  # the weights' refs, their scales' refs
    id_ref = refs[2 + 2 * n_w] if grouped else None
    if grouped:
        pair_id, j_all, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        row_of = lambda m: pair_id
    else:
        j_all, part = pl.program_id(0), pl.program_id(1)
        row_of = lambda m: m

    def tiles(q_ref, s_ref, j, which, lead, x_row):
        """Column tile j of weight q_ref (scales s_ref; lead: the expert's index into them, () for one weight);
        which: its output half; x_row(m): x's row of output row m."""
        C, R = p.cols, p.rows
        words = reads_words(kind)
        nb = 4 if words else 1
        c0 = j * C
        cidx = c0 + jnp.arange(C, dtype=jnp.int32)
        col_ok = cidx < (N // 4 if words else N)

        # static: do rows past K exist in the last block (x must read 0 there, the values too when not int4's
        # zero padding), do the columns end inside a tile
        q_ragged = md != "int4" and K % p.step != 0
        x_ragged = K % (bk if md == "int4" else p.step) != 0
        c_ragged = (N // 4 if words else N) % C != 0
        hg = bk // 2  # int4: a group's stored rows

        def x_at(m, k):  # x[m's row, k] as f32 (its dtype's value), 0 past K
            if not x_ragged:
                return x_ref[x_row(m), k].astype(jnp.float32)
            return plt.load(x_ref.at[jnp.int32(x_row(m)), k], mask=k < K, other=0).astype(jnp.float32)

        def x_sum(m, k0, n):  # the f32 sum of x[m's row, k0 : k0 + n] (0 past K): one vector load and a reduction
            lanes = k0 + jnp.arange(1 << (n - 1).bit_length(), dtype=jnp.int32)
            ok = (lanes < k0 + n) & (lanes < K)
            return jnp.sum(plt.load(x_ref.at[jnp.int32(x_row(m)), lanes], mask=ok, other=0).astype(jnp.float32))

        consts = [c_ref[i] for i in range(len(CONSTS))]  # before the loops: held in registers
        one = consts[0]

        def row(r):  # [C] stored words / bytes of stored row r; rows past the stored rows read as 0
            if not (q_ragged or c_ragged):
                return q_ref[lead + (r, pl.ds(c0, C))]
            mask = col_ok & (r < kq) if q_ragged else col_ok
            return plt.load(q_ref.at[lead + (r, pl.ds(c0, C))], mask=mask, other=0 if words else 0.0)

        def scales(g, b):  # [C] f32 scales of K block g for the columns of byte b (words) / of the tile (fp8)
            g = jnp.minimum(g, gk - 1)
            if bns >= N:
                return jnp.full((C,), s_ref[lead + (g, 0)], jnp.float32)
            cols = cidx * 4 + b if words else cidx
            gv = jnp.full((C,), g, jnp.int32)  # a gather: the columns of byte b lie 4 apart
            ev = tuple(jnp.full((C,), i, jnp.int32) for i in lead)
            return plt.load(s_ref.at[ev + (gv, cols // bns)], mask=cols < N, other=0)

        last = p.steps * p.step - R  # the last load's first row

        def tile(r0):  # the R rows from r0 (clamped: the prefetch after a part's last load reads rows it skips)
            r0 = jnp.minimum(r0, last)
            return [row(r0 + i) for i in range(R)]

        def sub_step(r0, carry):
            """The R stored rows from r0, already loaded (`ws`): acc[m][b] += x * value (the values still offset to
            unsigned and scaled by 2^(p - 23)); and the next R rows' loads, issued before this arithmetic so that
            they are in flight during it (a software pipeline of one tile)."""
            acc, ws = carry
            acc = [list(a) for a in acc]
            if not p.prefetch:  # nothing carried: load these rows now
                ws = tile(r0)
            ws_next = tile(r0 + R) if p.prefetch else []
            # the row of K stored row r0 + i multiplies: r0 + i (int4: its low nibbles', row G * g + j of stored
            # row G * g / 2 + j; its high nibbles' g / 2 rows on). R rows never cross a group (R divides g / 2).
            k0 = low_nibble_row(r0, bk) if kind == "int4" else r0
            for i in range(R):
                w = ws[i]
                if kind == "int4":
                    xv = [(x_at(m, k0 + i), x_at(m, k0 + i + hg)) for m in range(M)]
                    u = jax.lax.bitwise_xor(w, consts[1])
                    for b, ((s_lo, p_lo), (s_hi, p_hi)) in enumerate(INT4_FIELDS):
                        lo = _value(u, s_lo, consts[MASK_AT[(4, p_lo)]], one)
                        hi = _value(u, s_hi, consts[MASK_AT[(4, p_hi)]], one)
                        for m in range(M):
                            acc[m][b] = acc[m][b] + xv[m][0] * lo + xv[m][1] * hi
                elif kind == "int8":
                    xv = [x_at(m, k0 + i) for m in range(M)]
                    u = jax.lax.bitwise_xor(w, consts[2])
                    for b, (sh, pos) in enumerate(INT8_FIELDS):
                        v = _value(u, sh, consts[MASK_AT[(8, pos)]], one)
                        for m in range(M):
                            acc[m][b] = acc[m][b] + xv[m] * v
                else:
                    v = w.astype(jnp.float32)
                    for m in range(M):
                        acc[m][0] = acc[m][0] + x_at(m, k0 + i) * v
            return acc, ws_next

        if kind == "int4":
            unscale = [float(2 ** (23 - fields[0][1])) for fields in INT4_FIELDS]
        elif kind == "int8":
            unscale = [float(2 ** (23 - pos)) for _, pos in INT8_FIELDS]
        else:
            unscale = [1.0]
        offset = {"int4": 8.0, "int8": 128.0}.get(kind, 0.0)

        def block_sums(t, ws):
            """Scale block t (its first rows loaded: ws): per row m and byte b, the sum over its rows of x * value,
            [C] f32; and the next block's first rows, loaded."""
            zero = [[jnp.zeros((C,), jnp.float32) for _ in range(nb)] for _ in range(M)]
            subs = p.step // R
            if subs == 1:
                acc, ws = sub_step(t * p.step, (zero, ws))
            else:
                acc, ws = jax.lax.fori_loop(0, subs, lambda i, c: sub_step(t * p.step + i * R, c), (zero, ws))
            if md == "channel" or not offset:  # per channel the offset goes once, at the end
                return [[acc[m][b] * unscale[b] for b in range(nb)] for m in range(M)], ws
            xs = [offset * x_sum(m, t * bk, bk) for m in range(M)]  # the block's rows of K (int4: the group's)
            return [[acc[m][b] * unscale[b] - xs[m] for b in range(nb)] for m in range(M)], ws

        channel_sums = md == "channel" and offset  # the sum of x over the part's rows, a step's rows a load

        def step(t, carry):
            out, ws, xs = carry
            ti = part * p.per + t
            sums, ws = block_sums(ti, ws)
            if md == "channel":
                if channel_sums:
                    xs = [xs[m] + x_sum(m, ti * p.step, p.step) for m in range(M)]
                return [[out[m][b] + sums[m][b] for b in range(nb)] for m in range(M)], ws, xs
            sc = [scales(ti, b) for b in range(nb)]  # one scale block per step: its index is the step's
            return [[out[m][b] + sums[m][b] * sc[b] for b in range(nb)] for m in range(M)], ws, xs

        out0 = [[jnp.zeros((C,), jnp.float32) for _ in range(nb)] for _ in range(M)]
        xs0 = [jnp.zeros((), jnp.float32) for _ in range(M)] if channel_sums else []
        n_steps = jnp.minimum(p.per, p.steps - part * p.per)  # the last part may hold fewer steps
        first = tile(part * p.per * p.step) if p.prefetch else []
        out, _, xs = jax.lax.fori_loop(0, n_steps, step, (out0, first, xs0))
        if md == "channel":
            if channel_sums:
                out = [[out[m][b] - offset * xs[m] for b in range(nb)] for m in range(M)]
            out = [[out[m][b] * scales(0, b) for b in range(nb)] for m in range(M)]
        for m in range(M):
            for b in range(nb):
                cols = cidx * 4 + b if words else cidx
                mv = jnp.full((C,), row_of(m), jnp.int32)  # a scatter: the columns of byte b lie 4 apart
                if pair:
                    at = (jnp.full((C,), part, jnp.int32), jnp.full((C,), which, jnp.int32), mv, cols)
                    plt.store(o_ref.at[at], out[m][b], mask=cols < N)
                elif p.splits > 1:
                    plt.store(o_ref.at[jnp.full((C,), part, jnp.int32), mv, cols], out[m][b], mask=cols < N)
                else:
                    plt.store(o_ref.at[mv, cols], out[m][b].astype(dt), mask=cols < N)

    def weights(qs, ss, lead, x_row):
        if pair:  # the first weight's column tiles, then the second's: one branch each, the same loop
            pl.when(j_all < p.col_tiles)(lambda: tiles(qs[0], ss[0], j_all, 0, lead, x_row))
            pl.when(j_all >= p.col_tiles)(lambda: tiles(qs[1], ss[1], j_all - p.col_tiles, 1, lead, x_row))
        else:
            tiles(qs[0], ss[0], j_all, 0, lead, x_row)

    if not grouped:
        weights(*routed, (), lambda m: m)
    elif not shared:
        weights(*routed, (id_ref[pair_id],), lambda m: pair_id // grouped)
    else:  # the routed pairs, then the shared expert's: one branch each, the same loops
        own = (refs[3 + 2 * n_w:3 + 3 * n_w], refs[3 + 3 * n_w:3 + 4 * n_w])
        pl.when(pair_id < shared)(lambda: weights(*routed, (id_ref[pair_id],), lambda m: pair_id // grouped))
        pl.when(pair_id >= shared)(lambda: weights(*own, (jnp.int32(0),), lambda m: pair_id - shared + shared_row0))


def as_words(q):
    """int8 / packed int4 values [..., Kq, N] (N % 4 == 0) as int32 words [..., Kq, N / 4]: a bitcast (no copy)."""
    return jax.lax.bitcast_convert_type(q.reshape(*q.shape[:-1], q.shape[-1] // 4, 4), jnp.int32)


@functools.partial(jax.jit, static_argnames=("kind", "k", "block", "num_warps", "splits", "rows", "prefetch",
                                             "words", "unsummed", "interpret"))
def quant_gemv_pallas(x, q, scale, *, kind: str, k: int, block, num_warps: int | None = None,
                      splits: int | None = None, rows: int | None = None, prefetch: bool | None = None,
                      words: int | None = None, unsummed: bool = False, interpret: bool = False):
    """The decode kernel. Inputs must pass quant_matmul.check_inputs and unsupported_reason here. unsummed: K's
    float32 partials [splits, M, N] as the kernel writes them (their sum, rounded to x's dtype, the product), for a
    consumer that sums them as it loads them (quant_decode.quant_decode_parts); a plan of one part must not ask."""
    block = tuple(block)
    M, N = x.shape[0], q.shape[1]
    dt = x.dtype
    p = plan(M, k, N, kind, block, num_warps=num_warps, splits=splits, rows=rows, prefetch=prefetch, words=words)
    stored = as_words(q) if reads_words(kind) else q
    consts = jnp.asarray(CONSTS)
    kernel = functools.partial(gemv_kernel, kind=kind, md=mode(kind, k, block), M=M, K=k, N=N, kq=q.shape[0],
                               bk=block[0], bns=block[1], p=p, dt=dt, gk=scale.shape[0])
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, s: (0,) * len(a.shape))
    if p.splits > 1:
        out_shape = jax.ShapeDtypeStruct((p.splits, M, N), jnp.float32)
    else:
        out_shape = jax.ShapeDtypeStruct((M, N), dt)
    out = pl.pallas_call(
        kernel,
        grid=(p.col_tiles, p.splits),
        in_specs=[whole(x), whole(stored), whole(scale), whole(consts)],
        out_specs=whole(out_shape),
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=p.num_warps, num_stages=1),
        interpret=interpret,
        name=f"quant_matmul_{kind}",
    )(x, stored, scale.astype(jnp.float32), consts)
    if unsummed:
        assert p.splits > 1, "quant_gemv_pallas(unsummed=True): a plan of one K part has no partials"
        return out
    return sum_parts(out).astype(dt) if p.splits > 1 else out


