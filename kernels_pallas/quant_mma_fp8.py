"""fp8 (e4m3) matmul at decode and verify rows (M 4 .. 64) on the tensor cores: x [M, K] (bf16 / f16) @ an fp8
weight in quant_layout's format (K blocks with column blocks, as Qwen's (128, 128) checkpoints; or one scale per
column) -> [M, N]. quant_mma.py's sibling for fp8: the same launch (one 16-row tile up to 16 rows, one of 64 for
17 .. 64 (a batch's verifies; Triton emits warp-group MMA there), 4 warps, K in parts), another conversion. The
16-row tile prefetches the next step's bytes in registers (stages=1; through Triton's pipeline, stages=3, its fp8
bytes would cost byte-wise LDS and a stack frame, 4.4 instructions per value); the 64-row tile takes the
pipeline (quant_mma.STAGES: two steps in flight through shared memory, 64 KB per SM).

    quant_mma_fp8_pallas(x, q, scale, *, k, block) -> [M, N]   (reference: quant_matmul_reference)

The tensor cores take no fp8 x bf16 product, and converting e4m3 to bf16 costs several instructions per value
(no paired instruction does it). e4m3 to f16 has one, exact, for two values (F2FP: every e4m3 value, subnormals
included, is an f16 normal), so the dot runs in f16: x is brought to f16 in XLA, each row scaled by a power of
two, 2^(14 - e) with e the exponent of the row's largest |x| (frexp), so that its largest entry lies in
[2^13, 2^14): no entry overflows, and bf16's 8 significant bits are exact in f16's 11 for every entry down to
2^-24 of the row's largest (2^-38 of it as f16 subnormals); smaller ones change the row's dot product by less
than 2^-24 of the largest term. The f16 x f16 products are exact in the f32 accumulator; each K block's sum
is scaled by its f32 scales (per column: once at the end), and the row's power of two comes off at the end
(exact).

sm_90 machine code of the loop (tests/test_kernel_quant_mma.py), 27B gate/up, (128, 128) blocks, bf16 x:
M 4 .. 16 (mma.sync): 4.1 lane-instructions per value (F2FP 0.5, the operand's staging and byte shuffles PRMT
0.77, LDS 0.6, IMAD 0.9, HMMA 0.25), 195 registers, no spill, 18 KB shared; M 17 .. 64 (warp-group MMA, whose
weight operand the tensor cores read from shared memory themselves): 2.4 (F2FP 0.5, the per-block scaling FFMA
0.5, LDS 0.2, IMAD 0.2), 184-202 registers, no spill, 96 KB shared (stages=1: 3.0-3.2 at 238 registers). HBM's
time allows 7.0 per value at 4.8 TB/s (one byte a value): estimated memory bound, not measured (the FMA decode
kernel: 6.6 at M 4, 12.6 at M 8; XLA's dequantize-then-dot, which 17 .. 64 rows ran before, measured 11% of HBM
at 5 rows on the H200).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.split_k import k_parts, sum_parts
from kernels_pallas.quant_layout import cdiv
from kernels_pallas.quant_mma import (
    K_PARTS,
    MAX_ELEMENTS,
    MAX_GRID,
    MAX_ROWS,
    MAX_STEP_ROWS,
    ROWS,
    STAGES,
    launch,
)

COLUMNS = 128  # fp8 bytes (columns) per CTA: one 128-byte line per row
MAX_K_BLOCK = 256
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
F16_TOP = 14  # each row of x scaled so that its largest |entry| lies in [2^13, 2^14)


@dataclasses.dataclass(frozen=True)
class Plan:
    """grid (col_tiles, splits); a program covers COLUMNS columns of `per` steps (a K block, scaled at its end;
    per channel: 64 rows, scaled once at the end), each `subs` loads of `rows` rows, on a tile of tile_m rows of
    x (16, or 64 from 17 rows: quant_mma.plan's rule)."""
    col_tiles: int
    rows: int
    subs: int
    steps: int
    per: int
    splits: int
    channel: bool
    tile_m: int = ROWS
    stages: int = 1  # (a 16-row tile: its bytes through shared memory cost LDS and a stack frame; 64 rows: STAGES)

    def step_values(self, kind: str = "fp8") -> int:  # the stored values (bytes) one pass of the loop reads
        return self.rows * self.subs * COLUMNS


def plan(M, K, N, block, *, kind="fp8", splits=None, stages=None) -> Plan:  # (quant_mma.plan's signature)
    channel = block[0] >= K
    step = MAX_STEP_ROWS if channel else block[0]
    rows = min(step, MAX_STEP_ROWS)
    col_tiles = cdiv(N, COLUMNS)
    steps = cdiv(K, step)
    splits, per = k_parts(steps, col_tiles, K * N, M, N, splits=splits, **K_PARTS)
    tile_m = ROWS if M <= ROWS else MAX_ROWS
    return Plan(col_tiles, rows, step // rows, steps, per, splits, channel, tile_m,
                stages or (STAGES if tile_m == MAX_ROWS else 1))


def unsupported_reason(x, q, scale, *, kind: str, k: int, block):
    """None if this kernel takes these inputs (the layout already checked), else why not."""
    M, N = x.shape[0], q.shape[1]
    bk, bn = block
    if kind != "fp8":
        return f"{kind}: the fp8 tensor-core decode kernel takes fp8 only"
    if jnp.dtype(x.dtype) not in DTYPES:
        return f"x of dtype {jnp.dtype(x.dtype)}: the fp8 tensor-core decode kernel takes bfloat16 / float16"
    if not 1 <= M <= MAX_ROWS:
        return f"{M} rows: the fp8 tensor-core decode kernel takes 1 .. {MAX_ROWS}"
    if N == 0 or k == 0:
        return f"an empty matmul ({M} x {k} @ {k} x {N})"
    if bk < k and (bk & (bk - 1) or not 16 <= bk <= MAX_K_BLOCK):
        return f"K blocks of {bk} rows: the kernel takes a power of two in [16, {MAX_K_BLOCK}], or one block"
    if bk >= k and bn != 1 and bn < N:
        return f"one K block with column blocks of {bn}: the kernel takes per-column or per-tensor scales there"
    p = plan(M, k, N, block)
    if max(q.size, p.tile_m * p.steps * p.subs * p.rows, p.splits * M * N) >= MAX_ELEMENTS:
        return f"x [{M}, {k}] @ [{k}, {N}]: more than 2^31 elements in one array (the kernel's offsets are int32)"
    if max(p.col_tiles, p.splits) > MAX_GRID:
        return f"{p.col_tiles} column tiles x {p.splits} K parts: a CUDA grid's y and z stop at {MAX_GRID}"
    return None


def _kernel(x_ref, xe_ref, *refs, M, K, N, bn, p, pair=False):
    """pair (quant_mma_fp8_pair_pallas): two weights (gate, up), the grid's first col_tiles programs the first's
    tiles, the next the second's (one branch each, the same program), written to [splits, 2, M, N]."""
    j, part = pl.program_id(0), pl.program_id(1)
    tile = functools.partial(_tile, x_ref, xe_ref, M=M, K=K, N=N, bn=bn, p=p)
    if not pair:
        q_ref, s_ref, o_ref = refs
        tile(q_ref, s_ref, o_ref, j, part, None)
        return
    qg_ref, sg_ref, qu_ref, su_ref, o_ref = refs
    pl.when(j < p.col_tiles)(lambda: tile(qg_ref, sg_ref, o_ref, j, part, 0))
    pl.when(j >= p.col_tiles)(lambda: tile(qu_ref, su_ref, o_ref, j - p.col_tiles, part, 1))


def _tile(x_ref, xe_ref, q_ref, s_ref, o_ref, j, part, which, *, M, K, N, bn, p):
    """Program (column tile j, K part) of one weight; which: the pair's weight (0 gate, 1 up), None alone."""
    R, step = p.rows, p.rows * p.subs
    c0 = j * COLUMNS
    cidx = c0 + jnp.arange(COLUMNS, dtype=jnp.int32)
    col_ok = cidx < N
    last = p.steps * step - R  # the last load's first row (the prefetch past a part's end reads rows it skips)
    ragged = p.steps * step != K or N % COLUMNS != 0  # loads past K's last row, or a tile past N

    def load(r0):  # [R, COLUMNS] fp8; rows past K and columns past N read as 0
        r0 = jnp.minimum(r0, last)
        if not ragged:
            return q_ref[pl.ds(r0, R), pl.ds(c0, COLUMNS)]
        ok = ((r0 + jnp.arange(R, dtype=jnp.int32)) < K)[:, None] & col_ok[None, :]
        return plt.load(q_ref.at[pl.ds(r0, R), pl.ds(c0, COLUMNS)], mask=ok, other=0.0)

    def scales(t):  # [1, COLUMNS] f32: K block t's scales of these columns
        if bn >= N:
            return jnp.full((1, COLUMNS), s_ref[t, 0], jnp.float32)
        gv = jnp.full((COLUMNS,), t, jnp.int32)
        return plt.load(s_ref.at[gv, cidx // bn], mask=col_ok, other=0)[None, :]

    def one_step(t, carry):
        out, wn = carry
        acc = out if p.channel else jnp.zeros((p.tile_m, COLUMNS), jnp.float32)
        for s in range(p.subs):
            r0 = t * step + s * R
            if p.stages > 1:  # Triton's pipeliner keeps stages - 1 steps of loads in flight (cp.async)
                w = load(r0)
            else:  # one step in flight, in registers
                w, wn = wn, load(r0 + R)
            acc = acc + jnp.dot(x_ref[:, pl.ds(r0, R)], w.astype(jnp.float16), preferred_element_type=jnp.float32)
        return (acc, wn) if p.channel else (out + acc * scales(t), wn)

    first = part * p.per
    n = jnp.minimum(p.per, p.steps - first)
    out, _ = jax.lax.fori_loop(first, first + n, one_step, (jnp.zeros((p.tile_m, COLUMNS), jnp.float32),
                                                            load(first * step) if p.stages == 1 else None))
    if p.channel:
        out = out * scales(jnp.int32(0))
    out = out * xe_ref[...]  # [tile_m, 1]: each row's power of two back
    ok = (jnp.arange(p.tile_m, dtype=jnp.int32) < M)[:, None] & col_ok[None, :]
    if which is not None:
        plt.store(o_ref.at[part, jnp.int32(which), pl.ds(0, p.tile_m), pl.ds(c0, COLUMNS)], out, mask=ok)
    elif p.splits > 1:
        plt.store(o_ref.at[part, pl.ds(0, p.tile_m), pl.ds(c0, COLUMNS)], out, mask=ok)
    else:
        plt.store(o_ref.at[pl.ds(0, p.tile_m), pl.ds(c0, COLUMNS)], out.astype(o_ref.dtype), mask=ok)


def rows_of_x(x, p):
    """x [M, K] -> f16 [tile_m, K'] (each row times 2^(14 - e), e the exponent of its largest |entry|; rows past M
    and columns past K zero) and f32 [tile_m, 1]: 2^(e - 14) per row, what the kernel multiplies its sums by."""
    M, k = x.shape
    xf = x.astype(jnp.float32)
    _, e = jnp.frexp(jnp.max(jnp.abs(xf), axis=1, keepdims=True))
    xs = jnp.ldexp(xf, F16_TOP - e)
    xr = jnp.pad(xs, ((0, p.tile_m - M), (0, p.steps * p.subs * p.rows - k))).astype(jnp.float16)
    back = jnp.pad(jnp.ldexp(jnp.ones((M, 1), jnp.float32), e - F16_TOP), ((0, p.tile_m - M), (0, 0)))
    return xr, back


@functools.partial(jax.jit, static_argnames=("kind", "k", "block", "splits", "stages", "unsummed", "interpret"))
def quant_mma_fp8_pallas(x, q, scale, *, kind: str = "fp8", k: int, block, splits: int | None = None,
                         stages: int | None = None, unsummed: bool = False, interpret: bool = False):
    """The kernel. Inputs must pass quant_matmul.check_inputs and unsupported_reason here. unsummed: K's float32
    partials [splits, M, N] as the kernel writes them (quant_gemv_pallas's `unsummed`)."""
    block = tuple(block)
    M, N = x.shape[0], q.shape[1]
    p = plan(M, k, N, block, splits=splits, stages=stages)
    xr, back = rows_of_x(x, p)
    out_shape = jax.ShapeDtypeStruct((p.splits, M, N) if p.splits > 1 else (M, N),
                                     jnp.float32 if p.splits > 1 else x.dtype)
    out = launch(functools.partial(_kernel, M=M, K=k, N=N, bn=block[1], p=p), (xr, back, q, scale.astype(jnp.float32)),
                 out_shape, (p.col_tiles, p.splits), p.stages, "quant_matmul_fp8_mma", interpret)
    if unsummed:
        assert p.splits > 1, "quant_mma_fp8_pallas(unsummed=True): a plan of one K part has no partials"
        return out
    return sum_parts(out).astype(x.dtype) if p.splits > 1 else out


@functools.partial(jax.jit, static_argnames=("kind", "k", "block", "splits", "stages", "name", "interpret"))
def quant_mma_fp8_pair_pallas(x, qg, sg, qu, su, *, kind: str = "fp8", k: int, block, splits: int | None = None,
                              stages: int | None = None, name: str = "gate_up", interpret: bool = False):
    """Two weights of one shape and layout (a dense MLP's gate and up; an attention layer's k and v) in one launch:
    grid (2 col_tiles, splits), each program the single launch's program of its weight; float32 partials [splits,
    2, M, N], [s, 0] of x @ gate and [s, 1] of x @ up over K's part s (kernels_pallas/quant_gate_up.py). The
    custom call is quant_{name}_fp8_mma. Inputs must pass unsupported_reason for each weight."""
    block = tuple(block)
    M, N = x.shape[0], qg.shape[1]
    p = plan(M, k, N, block, splits=splits, stages=stages)
    xr, back = rows_of_x(x, p)
    args = (xr, back, qg, sg.astype(jnp.float32), qu, su.astype(jnp.float32))
    return launch(functools.partial(_kernel, M=M, K=k, N=N, bn=block[1], p=p, pair=True), args,
                  jax.ShapeDtypeStruct((p.splits, 2, M, N), jnp.float32), (2 * p.col_tiles, p.splits), p.stages,
                  f"quant_{name}_fp8_mma", interpret)
