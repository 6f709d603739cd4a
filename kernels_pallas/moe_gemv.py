"""Routed MoE products at decode: each (token, expert) pair's row of x times THAT expert's weight, reading only
the routed experts' weights (plain or in quant_layout's format), never a dequantized copy of any expert.

    moe_gemv(x, w, scale, ids, *, kind, k, block, rows_per_x=1) -> [P, N]
      x      [R, K]        pair p reads row p // rows_per_x: one row per pair (rows_per_x 1: the pair's activation
                           for down) or per token (rows_per_x = top_k: the token's hidden for gate / up, read by
                           each of its pairs where it lies, not copied to them); R >= ceil(P / rows_per_x), rows
                           past those read unused (the two-row form ops.linear pads one row to)
      w      [E, Kq, N]    stacked experts: plain float (kind "plain", scale None) or quant_layout values
      scale  [E, gk, gn]   float32 scales of the quantized formats (None for "plain")
      ids    [P] int32     the expert of each pair
      out[p] = x[p // rows_per_x] @ weight(w[ids[p]], scale[ids[p]])   in x's dtype, f32 accumulation

The reference (what every non-cuda lowering runs, the CPU's fast path) is XLA's gather of the routed experts'
values and scales, the format's dequantization of the gathered experts only (per-channel formats: none, the
column scales multiply the f32 products, exact), and one batched product. The Pallas-Triton kernel beside it
is a grouped GEMV: program (pair p, column tile j, K part s) reads ids[p] from its ref, then walks its part of
K over the tiles w[ids[p], rows, n0 : n0 + bn] where they lie in HBM, turns the stored int8 / packed int4 /
fp8 / float values into f32 in registers, multiplies them by the pair's slice of x, accumulates [dk, bn] f32
products per scale block (int4 groups, fp8 / int8 K blocks) and adds them times the block's scales once at its
end (per-channel and plain formats: once at the end), summed over the rows at the end. It uses the CUDA
cores, not tensor cores (one row per pair: a dot would pad it to 16), which is what a memory-bound GEMV needs.

int8 and int4 experts run instead quant_gemv.py's decode kernel over the pairs (`kernel_for`;
quant_gemv_grouped.py: its grid with a leading axis of pairs, each program reading its pair's expert): int32
words of packed values, each value built under 1.0's exponent where it lies in the word, no conversion
instruction (I2F issues at 16 per SM per clock on sm_90, an eighth of the FMA rate: one per value capped int4 at
44% of an H200's HBM). This module's kernel keeps plain and fp8 experts, and int8 / int4 shapes the other does
not take (N not a multiple of 4), where it converts with no I2F too: the byte, or each nibble, offset to
unsigned and XOR-ed under the exponent of 2^23 is the float 2^23 + u, one subtraction gives the value, exact.
sm_90 loop, 35B-A3B experts at batch 1 (tests/test_moe_routed.py compiles it), lane-instructions per stored
value: fp8 blocks 3.7 (was 4.5, the scales applied per element), bf16 3.9, under the bytes' time at 4.8 TB/s
(fp8 7.0, bf16 13.9): estimates, not timings (gpu_check --moe-only times them). K is split into parts (partial
sums in f32 summed after the call) when pairs x column tiles alone give too few programs for 132 SMs (35B-A3B
gate / up at batch 1: 8 pairs x 4 tiles of 128 columns).

The same kernel (routed_kernel) runs the experts' whole SwiGLU in two launches for moe_expert_mlp.py: gate and up
in one grid (pair=True), down forming the activation from their partials as it loads x (glu_parts), the MoE
block's shared expert one more pair a token in both (shared).

Backend: kernels_pallas/dispatch.py's rule, the kernel in a program lowered for cuda, the reference
elsewhere; `backend="pallas"` with interpret=True runs the kernel on CPU (tests). A format or shape the kernel
does not take (`unsupported_reason`) falls back to the reference with a one-time warning. Inputs that break the
layout raise ValueError naming what was expected and found.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas import dispatch
from kernels_pallas import quant_gemv_grouped as grouped
from kernels_pallas.masked_attention import precision_for
from kernels_pallas.quant_layout import STORAGE, cdiv, check, dequantize, padded_k, values
from kernels_pallas.split_k import sum_parts

KINDS = ("plain", "int8", "int4", "fp8")
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
TARGET_PROGRAMS = 264  # two programs per SM of an H100 / H200 (132 SMs)
MIN_STEPS_PER_SPLIT = 2
INT4_GROUPS = (32, 64, 128, 256)
MAX_K_BLOCK = 256
MAX_OFFSET = 2 ** 31  # element offsets are int32: every element loaded must lie below this
PLAIN_STEP = 128  # rows of K per loop step for plain and per-channel formats


def _mode(kind: str, k: int, block) -> str:
    """'plain', 'int4' (packed groups), 'channel' (one scale per column over all of K) or 'block' (K blocks)."""
    if kind in ("plain", "int4"):
        return kind
    return "channel" if block[0] >= k else "block"


def pair_rows(x, pairs: int, rows_per_x: int):
    """x's row of each of `pairs` pairs (pair p: row p // rows_per_x), [pairs, K]."""
    return x if rows_per_x == 1 and x.shape[0] == pairs else x[jnp.arange(pairs) // rows_per_x]


@functools.partial(jax.jit, static_argnames=("kind", "k", "block", "rows_per_x"))
def moe_gemv_reference(x, w, scale, ids, *, kind: str, k: int, block, rows_per_x: int = 1):
    """XLA: gather the routed experts (values and scales), dequantize only those, one batched product."""
    x = pair_rows(x, ids.shape[0], rows_per_x)
    dt = x.dtype
    prec = precision_for(dt)
    prod = lambda v: jnp.einsum("pk,pkn->pn", x, v, precision=prec, preferred_element_type=jnp.float32)
    if kind == "plain":
        return prod(w[ids].astype(dt)).astype(dt)
    q, s = w[ids], scale[ids]
    if _mode(kind, k, block) == "channel":  # the product on the raw values, then the column scales (exact)
        y = prod(values(q, kind, block, jnp)[:, :k].astype(dt))
        if block[1] == 1:
            return (y * s[:, 0].astype(jnp.float32)).astype(dt)
        cols = jnp.arange(y.shape[1]) // block[1]
        return (y * s[:, 0, cols].astype(jnp.float32)).astype(dt)
    return prod(dequantize(q, s, kind, k, block, dt, jnp)).astype(dt)


def check_inputs(x, w, scale, ids, kind: str, k: int, block, rows_per_x: int = 1) -> None:
    """ValueError naming what is wrong when the arrays do not form a routed product of this layout."""
    if kind not in KINDS:
        raise ValueError(f"moe_gemv: kind one of {KINDS}, found {kind!r}")
    if x.ndim != 2 or w.ndim != 3 or ids.ndim != 1:
        raise ValueError(f"moe_gemv takes x [R, K], w [E, Kq, N], ids [P], found x {list(x.shape)}, "
                         f"w {list(w.shape)}, ids {list(ids.shape)}")
    if rows_per_x < 1:
        raise ValueError(f"moe_gemv: rows_per_x (pairs reading one row of x) >= 1, found {rows_per_x}")
    if rows_per_x == 1 and x.shape[0] != ids.shape[0]:
        raise ValueError(f"moe_gemv: one expert id per row of x ({x.shape[0]}), found {ids.shape[0]}")
    if x.shape[0] < cdiv(ids.shape[0], rows_per_x):
        raise ValueError(f"moe_gemv: {ids.shape[0]} pairs at {rows_per_x} a row of x need "
                         f"{cdiv(ids.shape[0], rows_per_x)} rows, found x {list(x.shape)}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"moe_gemv: integer expert ids, found {ids.dtype}")
    if x.shape[1] != k:
        raise ValueError(f"moe_gemv: x of shape [P, {k}], found {list(x.shape)}")
    if kind == "plain":
        if scale is not None or w.shape[1] != k:
            raise ValueError(f"moe_gemv (plain): w [E, {k}, N] and no scale, found w {list(w.shape)}, scale "
                             f"{None if scale is None else list(scale.shape)}")
        return
    if scale is None or scale.ndim != 3:
        raise ValueError(f"moe_gemv ({kind}): scale [E, gk, gn], found {None if scale is None else list(scale.shape)}")
    err = check(kind, w.shape, scale.shape, k, w.shape[2], tuple(block))
    if err is not None:
        raise ValueError(f"moe_gemv ({kind}, block {tuple(block)}): {err}")
    if np.dtype(w.dtype) != STORAGE[kind]:
        raise ValueError(f"moe_gemv: {kind} values stored as {STORAGE[kind].name}, found {np.dtype(w.dtype).name}")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Grid (pairs, col_tiles, splits); each program runs steps_per_split loop steps of block_k rows of K, in
    chunks of dot_k rows (one load of x and of w each) into a [dot_k, block_n] f32 accumulator."""
    block_n: int
    col_tiles: int
    block_k: int
    dot_k: int
    steps: int
    steps_per_split: int
    splits: int
    num_warps: int
    num_stages: int

    def programs(self, pairs: int) -> int:
        return pairs * self.col_tiles * self.splits


def _pow2(x, at_least=16):
    return max(at_least, 1 << (int(x) - 1).bit_length())


def plan(P, K, N, kind, block, itemsize=2, *, block_n=None, dot_k=None, splits=None, num_warps=None,
         num_stages=None) -> Plan:
    """Launch parameters from the shapes (module doc); a keyword given wins."""
    bk, bns = block
    mode = _mode(kind, K, block)
    if block_n is None:
        block_n = 128 if P * cdiv(N, 128) >= TARGET_PROGRAMS // 2 else 64
        block_n = min(block_n, _pow2(N))
    if 1 < bns < N:  # a column tile inside one scale block
        block_n = min(block_n, bns & -bns)
    if dot_k is None:
        dot_k = 32 if itemsize <= 2 else 16
    if mode == "int4":
        dot_k, block_k, rows = min(dot_k, bk // 2), bk, padded_k(kind, K, bk)
    elif mode == "block":
        dot_k, block_k, rows = min(dot_k, bk), bk, K
    else:
        dot_k = min(dot_k, _pow2(K, 1))
        block_k, rows = max(PLAIN_STEP, dot_k), K
    for name, v in (("block_n", block_n), ("dot_k", dot_k)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"moe_gemv plan: {name} a power of two, found {v}")
    col_tiles = cdiv(N, block_n)
    steps = cdiv(rows, block_k)
    if splits is None:
        want = cdiv(TARGET_PROGRAMS, P * col_tiles)
        splits = max(1, min(want, steps // MIN_STEPS_PER_SPLIT))
    splits = max(1, min(int(splits), steps))
    per = cdiv(steps, splits)
    splits = cdiv(steps, per)
    return Plan(block_n, col_tiles, block_k, dot_k, steps, per, splits, num_warps or 4, num_stages or 3)


def unsupported_reason(x, w, scale, ids, *, kind: str, k: int, block):
    """None if the kernel takes this format, these shapes and dtypes, else why not (the caller falls back)."""
    P, N = ids.shape[0], w.shape[2]
    bk, bn = block
    if jnp.dtype(x.dtype) not in {jnp.dtype(d) for d in DTYPES}:
        return f"x of dtype {jnp.dtype(x.dtype)}: the kernel takes float32 / bfloat16 / float16"
    if kind == "plain" and jnp.dtype(w.dtype) not in {jnp.dtype(d) for d in DTYPES}:
        return f"plain experts of dtype {jnp.dtype(w.dtype)}: the kernel takes float32 / bfloat16 / float16"
    if P == 0 or N == 0 or k == 0:
        return f"an empty product ({P} pairs, {k} x {N})"
    mode = _mode(kind, k, block)
    if mode == "int4" and bk not in INT4_GROUPS:
        return f"int4 group of {bk} rows: the kernel takes groups of {INT4_GROUPS}"
    if mode == "block" and (bk & (bk - 1) or not 16 <= bk <= MAX_K_BLOCK):
        return f"K blocks of {bk} rows: the kernel takes a power of two in [16, {MAX_K_BLOCK}]"
    if kind != "plain" and 1 < bn < N and bn % 16:
        return f"scale blocks of {bn} columns: the kernel takes 1, a multiple of 16 or all N"
    p = plan(P, k, N, kind, block, jnp.dtype(x.dtype).itemsize)
    # a loaded element's offset is below w.size (masked lanes are never dereferenced)
    if max(w.size, x.size + 1, p.splits * P * N + 1) > MAX_OFFSET:
        return f"experts {list(w.shape)}: more than 2^31 elements in one array (the kernel's offsets are int32)"
    return None


MAGIC = 0x4B000000  # float32 2^23: OR-ed (or XOR-ed) over an integer u below 2^23, the float 2^23 + u, exact


def _exact(bits, offset):
    """int32 words MAGIC + u (u = v + offset, 0 <= u < 2^23) -> the f32 values v, exact: one subtraction."""
    return jax.lax.bitcast_convert_type(bits, jnp.float32) - (float(2 ** 23) + offset)


def routed_kernel(*refs, mode, K, N, kq, n_groups, bk, bns, bn, tk, dk, per, dt, parts, rpx, pair=False,
                  glu_parts=0, shared=0, shared_row0=0):
    """Program (pair p, column tile j, K part). pair (moe_expert_mlp.py's gate / up call): the refs hold two
    weights and their scales, tiles past N's own read the second, the output is float32 partials
    [parts, 2, P, N]. glu_parts: x is such partials [glu_parts, 2, P, K] and pair p's row of x is
    silu(gate) * up of its row, each rounded to dt where the reference rounds it (down's call). shared (routed
    pairs P; 0: none): pairs P + t are the shared expert's (its arrays one expert [1, ...] each, after the ids, as
    the routed ones'), reading x's row shared_row0 + t."""
    n_w = 2 if pair else 1
    x_ref, o_ref = refs[0], refs[-1]
    routed = (refs[1:1 + n_w], refs[1 + n_w:1 + 2 * n_w])  # the weights' refs, their scales' refs
    id_ref = refs[1 + 2 * n_w]
    p, j, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    zero_w = 0.0 if routed[0][0].dtype in (STORAGE["fp8"],) or mode == "plain" else 0

    def x_chunk(k0, row):  # [dk, 1] f32: x[row, k0 : k0 + dk], past K read as 0
        ok = (k0 + jnp.arange(dk, dtype=jnp.int32)) < K
        if not glu_parts:
            return plt.load(x_ref.at[row, pl.ds(k0, dk)], mask=ok, other=0).astype(jnp.float32)[:, None]

        def total(h):  # the gate's (h 0) or up's (h 1) product, its parts summed, in dt as the reference has it
            t = sum(plt.load(x_ref.at[jnp.int32(s), jnp.int32(h), row, pl.ds(k0, dk)], mask=ok, other=0)
                    for s in range(glu_parts))
            return t.astype(dt).astype(jnp.float32)

        g, u = total(0), total(1)
        act = (g * jax.nn.sigmoid(g)).astype(dt).astype(jnp.float32)
        return (act * u).astype(dt).astype(jnp.float32)[:, None]

    def run(w_ref, s_ref, jt, which, e, row):  # column tile jt of weight w_ref (scales s_ref) of expert e, x's row
        n0 = jt * bn
        col_ok = (n0 + jnp.arange(bn, dtype=jnp.int32)) < N

        def w_tile(r0, limit):  # [dk, bn] stored values of expert e; rows past `limit`, columns past N read as 0
            ok = ((r0 + jnp.arange(dk, dtype=jnp.int32)) < limit)[:, None] & col_ok[None, :]
            return plt.load(w_ref.at[e, pl.ds(r0, dk), pl.ds(n0, bn)], mask=ok, other=zero_w)

        def col_scale(g):  # the scales of K block g for this tile's columns: [1, bn]
            g = jnp.minimum(g, n_groups - 1)  # a step past the end (the last K part) reads zeros: any scale will do
            if bns == 1:
                return plt.load(s_ref.at[e, g, pl.ds(n0, bn)], mask=col_ok, other=0)[None, :]
            return jnp.full((1, bn), s_ref[e, g, n0 // bns], jnp.float32)

        def value(t):  # stored values -> f32 (plain weights through x's dtype, as the reference casts them)
            if mode == "plain":
                return t.astype(dt).astype(jnp.float32)
            if t.dtype == jnp.int8:  # int8: no I2F (module doc), the byte offset to unsigned under 2^23's exponent
                u = jax.lax.bitcast_convert_type(t, jnp.uint8).astype(jnp.int32)
                return _exact(jax.lax.bitwise_xor(u, jnp.int32(MAGIC | 0x80)), 128.0)
            return t.astype(jnp.float32)  # fp8: the paired conversion instruction

        def step(t, acc):
            k0 = (part * per + t) * tk
            if mode in ("plain", "channel"):
                for c in range(0, tk, dk):
                    acc = acc + x_chunk(k0 + c, row) * value(w_tile(k0 + c, K))
                return acc
            s = col_scale(k0 // bk)
            g = jnp.zeros((dk, bn), jnp.float32)  # the K block's (int4: group's) products, scaled once at its end
            if mode == "block":
                for c in range(0, tk, dk):
                    g = g + x_chunk(k0 + c, row) * value(w_tile(k0 + c, K))
                return acc + g * s
            h = bk // 2  # int4: one group; its h packed rows hold rows k0 .. k0+h-1 (low), k0+h .. k0+bk-1 (high)
            for c in range(0, h, dk):
                u = w_tile(k0 // 2 + c, kq).astype(jnp.int32)  # the stored bytes, 0 .. 255
                # each nibble n to the float 2^23 + (n ^ 8) = 2^23 + 8 + v (v: its signed value), exact
                lo = _exact(jax.lax.bitwise_xor(jax.lax.bitwise_and(u, jnp.int32(0xF)), jnp.int32(MAGIC | 8)), 8.0)
                hi = _exact(jax.lax.bitwise_xor(jax.lax.shift_right_logical(u, jnp.int32(4)),
                                                jnp.int32(MAGIC | 8)), 8.0)
                g = g + x_chunk(k0 + c, row) * lo + x_chunk(k0 + h + c, row) * hi
            return acc + g * s

        acc = jax.lax.fori_loop(0, per, step, jnp.zeros((dk, bn), jnp.float32))
        out = jnp.sum(acc, axis=0)
        if mode == "channel":
            out = out * col_scale(0)[0]
        if pair:
            plt.store(o_ref.at[part, jnp.int32(which), p, pl.ds(n0, bn)], out, mask=col_ok)
        elif parts > 1:
            plt.store(o_ref.at[part, p, pl.ds(n0, bn)], out, mask=col_ok)
        else:
            plt.store(o_ref.at[p, pl.ds(n0, bn)], out.astype(dt), mask=col_ok)

    def weights(ws, ss, e, row):
        if pair:  # the first N's tiles the gate's, the next the up's: one branch each, the same loop
            tiles = cdiv(N, bn)
            pl.when(j < tiles)(lambda: run(ws[0], ss[0], j, 0, e, row))
            pl.when(j >= tiles)(lambda: run(ws[1], ss[1], j - tiles, 1, e, row))
        else:
            run(ws[0], ss[0], j, 0, e, row)

    own_row = p if glu_parts else p // rpx
    if not shared:
        weights(*routed, id_ref[p], own_row)
    else:  # the routed pairs, then the shared expert's: one branch each, the same loops
        own = (refs[2 + 2 * n_w:2 + 3 * n_w], refs[2 + 3 * n_w:2 + 4 * n_w])
        pl.when(p < shared)(lambda: weights(*routed, id_ref[p], own_row))
        pl.when(p >= shared)(lambda: weights(*own, jnp.int32(0), p - shared + shared_row0))


@functools.partial(jax.jit, static_argnames=("kind", "k", "block", "block_n", "dot_k", "splits", "num_warps",
                                             "num_stages", "rows_per_x", "interpret"))
def moe_gemv_pallas(x, w, scale, ids, *, kind: str, k: int, block, block_n: int | None = None,
                    dot_k: int | None = None, splits: int | None = None, num_warps: int | None = None,
                    num_stages: int | None = None, rows_per_x: int = 1, interpret: bool = False):
    """The Pallas kernel. Inputs must pass check_inputs and unsupported_reason (moe_gemv checks both)."""
    block = tuple(block)
    P, N = ids.shape[0], w.shape[2]
    dt = x.dtype
    p = plan(P, k, N, kind, block, jnp.dtype(dt).itemsize, block_n=block_n, dot_k=dot_k, splits=splits,
             num_warps=num_warps, num_stages=num_stages)
    scale = scales_of(scale)
    kernel = bind(kind, k, N, block, p, dt, w.shape[1], scale.shape[1], rpx=rows_per_x)
    return launch(kernel, p, P, N, dt, (x, w, scale, ids.astype(jnp.int32)), f"moe_gemv_{kind}", interpret)


def launch(kernel, p: Plan, P, N, dt, args, name, interpret, *, tiles=1, out_shape=None, unsummed=False):
    """routed_kernel over the grid (P, tiles x p.col_tiles, p.splits), every operand whole; the output [P, N] in
    dt, its K parts summed (out_shape given: that array as the kernel writes it; unsummed: the parts [S, P, N])."""
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j, s: (0,) * len(a.shape))  # each program slices in place
    summed = out_shape is None
    if summed:
        out_shape = jax.ShapeDtypeStruct((p.splits, P, N) if p.splits > 1 else (P, N),
                                         jnp.float32 if p.splits > 1 else dt)
    out = pl.pallas_call(
        kernel,
        grid=(P, tiles * p.col_tiles, p.splits),
        in_specs=[whole(a) for a in args],
        out_specs=whole(out_shape),
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=p.num_warps, num_stages=p.num_stages),
        interpret=interpret,
        name=name,
    )(*args)
    if unsummed:
        return out if p.splits > 1 else out[None]
    return sum_parts(out).astype(dt) if summed and p.splits > 1 else out


def scales_of(scale):
    """The kernel's float32 scale operand: plain experts' (None) one unused scale (one signature for every
    format)."""
    return jnp.ones((1, 1, 1), jnp.float32) if scale is None else scale.astype(jnp.float32)


def bind(kind, k, N, block, p: Plan, dt, kq, n_groups, **extra):
    """routed_kernel for a [k, N] product of this format and plan (extra: rpx, pair, glu_parts)."""
    return functools.partial(routed_kernel, mode=_mode(kind, k, block), K=k, N=N, kq=kq, n_groups=n_groups,
                             bk=block[0], bns=block[1], bn=p.block_n, tk=p.block_k, dk=p.dot_k,
                             per=p.steps_per_split, dt=dt, parts=p.splits, **{"rpx": 1, **extra})


def moe_gemv(x, w, scale, ids, *, kind: str, k: int, block=None, rows_per_x: int = 1, backend: str = "auto",
             interpret: bool = False):
    """The kernel in a program lowered for cuda, the reference elsewhere (dispatch.run); see the module doc.
    block: the quantized layout's (bk, bn); ignored (None) for plain experts."""
    block = (k, 1) if block is None else tuple(int(b) for b in block)
    check_inputs(x, w, scale, ids, kind, k, block, rows_per_x)
    reference = functools.partial(moe_gemv_reference, kind=kind, k=k, block=block, rows_per_x=rows_per_x)
    kernel, reason = kernel_for(x, w, scale, ids, kind=kind, k=k, block=block)
    kernel = functools.partial(kernel, kind=kind, k=k, block=block, rows_per_x=rows_per_x, interpret=interpret)
    return dispatch.run("routed MoE product", kernel, reference, reason, backend, x, w, scale, ids)


def kernel_for(x, w, scale, ids, *, kind: str, k: int, block):
    """(the kernel function, None) for these inputs, or (moe_gemv_pallas, why no kernel takes them): int8 and
    int4 experts run quant_gemv's decode kernel over the pairs (quant_gemv_grouped_pallas, module doc), every
    other format, and int8 / int4 shapes it does not take (N not a multiple of 4), this module's kernel."""
    if grouped.grouped_unsupported_reason(x, w, scale, ids, kind=kind, k=k, block=block) is None:
        return grouped.quant_gemv_grouped_pallas, None
    return moe_gemv_pallas, unsupported_reason(x, w, scale, ids, kind=kind, k=k, block=block)
