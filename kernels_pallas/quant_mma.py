"""int4 matmul at decode and verify rows (M = 2 .. 16) on the tensor cores: x [M, K] (bf16 / f16) @ an int4
weight in quant_layout's format (groups of g >= 32 rows) -> [M, N].

    quant_mma_pallas(x, q, scale, *, k, block) -> [M, N]   (reference: quant_matmul_reference)

Why a third kernel. The decode kernel (quant_gemv.py) multiplies on the FMA units: M multiply-adds per weight on
top of its conversion, so its estimated share of HBM falls with the rows (int4: 93% at M 1, 72% at M 2, 42% at
M 4), and a k = 3 verify at batch 1 has 4 rows. The tiled kernel (quant_matmul.py) uses the tensor cores, whose
cost does not depend on M up to 16, but converts each value with I2F (an eighth of the FMA rate): 26% of HBM on
an H200. This kernel feeds the tensor cores without any conversion instruction:

- a 32-bit word of packed int4 holds 4 columns x 2 nibbles (byte b: column 4c + b, low nibble row j of a group,
  high nibble row j + g/2). One LOP3 makes two bf16 values out of it at once: ((word >> s) & 0x000F000F) ^
  0x43084308 puts nibble n (bits s .. s+3 and s+16 .. s+19) under bf16's exponent of 128 with bit 3 flipped,
  i.e. the bf16 value 128 + (n ^ 8) = 136 + v for the signed value v (the XOR folds the offset to unsigned into
  the same instruction; f16: 0x64086408, 1024 + (n ^ 8) = 1032 + v). Its low half is column 4c + b', its high
  half column 4c + b' + 2 (b' = 0, 1): four shifts (s = 0, 4, 8, 12) give all 8 values of a word;
- the tensor cores multiply x by these exact values (bf16 x bf16 products are exact in the f32 accumulator);
  the offset comes back once per group, row and column: out += (acc - 136 * sum(x over the group)) * scale;
  sum(x) is computed by XLA beside the call (a few KB);
- the rows of x are padded to one 16-row tile in XLA (bf16 [2, 16, Kq]: the low and high halves of each group,
  as in quant_gemv.rows_of_x), so the loads of x need no mask; the output stores only the M real rows;
- a CTA of 4 warps covers 32 words (128 columns) of one group's g/2 packed rows per loop step (64 rows at g 128:
  8 KB), loads the next step's words before the arithmetic on these (a software pipeline of one step in
  registers), and K is split into parts (f32 partial products summed in XLA) until the grid gives the SMs
  about PROGRAMS_PER_SM CTAs each, while the partial products stay under MAX_PARTIAL_TRAFFIC of the bytes.

sm_90 machine code of the loop (tests/test_kernel_quant_mma.py compiles it and counts), M 4, 27B gate/up, bf16:
per stored value 3.4 lane-instructions (LOP3 0.53, PRMT 0.5 (the pairs of rows the tensor-core operand wants),
SHF 0.38, shared-memory operand staging STS 0.27 + LDSM 0.19, HMMA 0.25, the per-group epilogue 0.5), 168
registers, no spill, 12 KB shared; the same code at every M <= 16. Against the bytes' time at 4.8 TB/s (9.6e12
int4 values/s; an SM issues 4 warp instructions per clock, 33.5e12 lane-instructions/s on 132 SMs at 1.98 GHz)
that is an estimate of 100% of HBM, not a measurement: benchmarks/gpu_check --quant-only times it beside the
decode kernel, the tiled kernel, XLA and qwix. The tensor cores then run at about a third of their mma.sync
rate (16 padded rows x 9.6e12 values/s = 307 TFLOP/s of bf16).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.quant_layout import cdiv

ROWS = 16  # one tensor-core tile of rows: M = 1 .. 16
MIN_ROWS = 2  # backend "auto" runs it at M >= 2 (M 1: the decode kernel, estimated at 93% of HBM)
# x's dtype -> (the 32-bit LOP3 constant putting two nibbles under the exponent, with bit 3 flipped; the value
# 0x..08 stands for: 136 = 128 + 8 (bf16), 1032 = 1024 + 8 (f16))
MAGIC = {jnp.dtype(jnp.bfloat16): (0x43084308, 136.0), jnp.dtype(jnp.float16): (0x64086408, 1032.0)}
NIBBLES = 0x000F000F
MIN_GROUP = 32  # half a group is one dot's K: >= 16
WORDS = 32  # words (4 columns each) per CTA
MAX_STEP_ROWS = 64  # packed rows per load (a larger half group is loaded in parts)
NUM_WARPS = 4
PROGRAMS_PER_SM = 6  # 168 registers x 128 threads: 3 CTAs fit an SM; two waves' worth hides the tail
SMS = 132
MIN_STEPS_PER_SPLIT = 2
MAX_PARTIAL_TRAFFIC = 0.1
MAX_ELEMENTS = 2 ** 31
MAX_GRID = 65535


@dataclasses.dataclass(frozen=True)
class Plan:
    """grid (col_tiles, splits); a program covers WORDS words of every loop step (one load of `rows` packed rows;
    a group's half is `subs` steps) of `per` groups."""
    col_tiles: int
    rows: int
    subs: int
    groups: int
    per: int
    splits: int

    @property
    def programs(self) -> int:
        return self.col_tiles * self.splits


def plan(M, K, N, block, *, splits=None) -> Plan:
    g = block[0]
    h = g // 2
    rows = min(h, MAX_STEP_ROWS)
    col_tiles = cdiv(N // 4, WORDS)
    groups = cdiv(K, g)
    if splits is None:
        want = cdiv(SMS * PROGRAMS_PER_SM, col_tiles)
        weight_bytes = groups * h * N
        traffic = int(MAX_PARTIAL_TRAFFIC * weight_bytes // (2 * 4 * M * N))
        splits = max(1, min(want, groups // MIN_STEPS_PER_SPLIT, traffic))
    splits = max(1, min(int(splits), groups))
    per = cdiv(groups, splits)
    return Plan(col_tiles, rows, h // rows, groups, per, cdiv(groups, per))


def unsupported_reason(x, q, scale, *, kind: str, k: int, block):
    """None if this kernel takes these inputs (the layout already checked), else why not."""
    M, N = x.shape[0], q.shape[1]
    g = block[0]
    if kind != "int4":
        return f"{kind}: the tensor-core decode kernel takes int4 only"
    if jnp.dtype(x.dtype) not in MAGIC:
        return f"x of dtype {jnp.dtype(x.dtype)}: the tensor-core decode kernel takes bfloat16 / float16"
    if not 1 <= M <= ROWS:
        return f"{M} rows: the tensor-core decode kernel takes 1 .. {ROWS}"
    if N == 0 or k == 0:
        return f"an empty matmul ({M} x {k} @ {k} x {N})"
    if N % 4:
        return f"N = {N} columns: int4 values are read as int32 words of 4 columns, N must be a multiple of 4"
    if g < MIN_GROUP or (g // 2) % min(g // 2, MAX_STEP_ROWS) or g & (g - 1):
        return f"int4 group of {g} rows: the kernel takes a power of two >= {MIN_GROUP}"
    p = plan(M, k, N, block)
    if max(q.size, ROWS * 2 * q.shape[0], p.splits * M * N) >= MAX_ELEMENTS:
        return f"x [{M}, {k}] @ [{k}, {N}]: more than 2^31 elements in one array (the kernel's offsets are int32)"
    if max(p.col_tiles, p.splits) > MAX_GRID:
        return f"{p.col_tiles} column tiles x {p.splits} K parts: a CUDA grid's y and z stop at {MAX_GRID}"
    return None


def _kernel(x_ref, xs_ref, q_ref, s_ref, c_ref, o_ref, *, M, N, h, p, base, dt):
    j, part = pl.program_id(0), pl.program_id(1)
    R = p.rows
    c0 = j * WORDS
    cidx = c0 + jnp.arange(WORDS, dtype=jnp.int32)
    nibbles, magic = c_ref[0], c_ref[1]  # loaded, not literals (a LOP3 takes one immediate)
    last = p.groups * h - R  # the last load's first row (the prefetch past a part's end reads rows it skips)
    c_ragged = (N // 4) % WORDS != 0
    col_ok = cidx < N // 4

    def load(r0):  # [R, WORDS] int32
        r0 = jnp.minimum(r0, last)
        if not c_ragged:
            return q_ref[pl.ds(r0, R), pl.ds(c0, WORDS)]
        return plt.load(q_ref.at[pl.ds(r0, R), pl.ds(c0, WORDS)], mask=col_ok[None, :], other=0)

    def group(t, carry):
        out, wn = carry
        acc = [jnp.zeros((ROWS, WORDS), jnp.float32) for _ in range(4)]
        for s in range(p.subs):
            r0 = t * h + s * R
            w, wn = wn, load(r0 + R)
            xv = (x_ref[0, :, pl.ds(r0, R)], x_ref[1, :, pl.ds(r0, R)])  # [16, R]: low / high nibbles' rows of x
            for b in range(2):  # bytes b and b + 2 of each word
                for half in range(2):
                    sh = 8 * b + 4 * half
                    v = jax.lax.shift_right_logical(w, jnp.int32(sh)) if sh else w
                    v = jax.lax.bitwise_xor(jax.lax.bitwise_and(v, nibbles), magic)
                    lo = jax.lax.bitcast_convert_type(v.astype(jnp.int16), dt)
                    hi = jax.lax.bitcast_convert_type(jax.lax.shift_right_logical(v, jnp.int32(16)).astype(jnp.int16),
                                                      dt)
                    acc[b] = acc[b] + jnp.dot(xv[half], lo, preferred_element_type=jnp.float32)
                    acc[b + 2] = acc[b + 2] + jnp.dot(xv[half], hi, preferred_element_type=jnp.float32)
        xs = xs_ref[:, pl.ds(t, 1)]  # [16, 1]: the sum of x over the group
        res = []
        for b in range(4):
            cols = cidx * 4 + b
            sc = plt.load(s_ref.at[jnp.full((WORDS,), t, jnp.int32), cols], mask=cols < N, other=0)
            res.append(out[b] + (acc[b] - base * xs) * sc[None, :])
        return res, wn

    out0 = [jnp.zeros((ROWS, WORDS), jnp.float32) for _ in range(4)]
    first = part * p.per
    n = jnp.minimum(p.per, p.groups - first)
    out, _ = jax.lax.fori_loop(first, first + n, group, (out0, load(first * h)))
    rows = jnp.arange(ROWS, dtype=jnp.int32)[:, None] + jnp.zeros((1, WORDS), jnp.int32)
    for b in range(4):
        cols = (cidx * 4 + b)[None, :] + jnp.zeros((ROWS, 1), jnp.int32)  # a scatter: byte b's columns, 4 apart
        ok = (rows < M) & (cols < N)
        if p.splits > 1:
            plt.store(o_ref.at[jnp.full((ROWS, WORDS), part, jnp.int32), rows, cols], out[b], mask=ok)
        else:
            plt.store(o_ref.at[rows, cols], out[b].astype(o_ref.dtype), mask=ok)


def rows_of_x(x, g, kq):
    """x [M, K] -> x's dtype [2, 16, kq]: entry [h, m, r] multiplies packed row r's low (h 0) / high (h 1) nibble;
    rows past M and K zero. Also f32 [16, groups]: the sum of x over each group (the offset's correction)."""
    M, k = x.shape
    xp = jnp.pad(x.astype(jnp.float32), ((0, ROWS - M), (0, 2 * kq - k)))
    xr = xp.reshape(ROWS, -1, 2, g // 2).transpose(2, 0, 1, 3).reshape(2, ROWS, kq)
    xr = xr.astype(x.dtype)
    xs = xr.astype(jnp.float32).reshape(2, ROWS, -1, g // 2).sum(axis=(0, 3))
    return xr, xs


@functools.partial(jax.jit, static_argnames=("kind", "k", "block", "splits", "interpret"))
def quant_mma_pallas(x, q, scale, *, kind: str = "int4", k: int, block, splits: int | None = None,
                     interpret: bool = False):
    """The kernel. Inputs must pass quant_matmul.check_inputs and unsupported_reason here."""
    from kernels_pallas.quant_gemv import as_words

    assert kind == "int4", kind
    block = tuple(block)
    M, N = x.shape[0], q.shape[1]
    dt = jnp.dtype(x.dtype)
    g = block[0]
    p = plan(M, k, N, block, splits=splits)
    magic, base = MAGIC[dt]
    xr, xs = rows_of_x(x, g, q.shape[0])
    consts = jnp.asarray(np.array([NIBBLES, magic], np.uint32).view(np.int32))
    words = as_words(q)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, s: (0,) * a.ndim)
    out_shape = jax.ShapeDtypeStruct((p.splits, M, N) if p.splits > 1 else (M, N),
                                     jnp.float32 if p.splits > 1 else dt)
    out = pl.pallas_call(
        functools.partial(_kernel, M=M, N=N, h=g // 2, p=p, base=base, dt=dt),
        grid=(p.col_tiles, p.splits),
        in_specs=[whole(xr), whole(xs), whole(words), whole(scale), whole(consts)],
        out_specs=whole(out_shape),
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="quant_matmul_int4_mma",
    )(xr, xs, words, scale.astype(jnp.float32), consts)
    return out.sum(axis=0).astype(dt) if p.splits > 1 else out
