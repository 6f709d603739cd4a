"""Wind-MTP windowed decode attention: a Pallas kernel beside its pure-JAX reference (same signature).

    windowed_attend(q, ring_k, ring_v, new_k, new_v, start, window, sinks) -> [B, T, nh, hd]

q [B, T, nh, hd] are the draft head's queries for rows start .. start+T-1 (T = 1 for a draft step, k+1 for the
refill), RoPE applied. ring_k/v [B, S + ring, nkv, hd] hold the head's KV ring as it was before this call
(ring_layout.py: sinks keep slot = row, later rows wrap); new_k/v [B, T, nkv, hd] are the call's own rows.
Row r attends to rows [0, S) and (r - W, r]. GQA: nh = G * nkv, query head h reads kv head h // G.

The kernel is a Pallas-Triton kernel (`plt.CompilerParams`): it lowers for cuda, which the export tests prove
on a CPU at the test shapes and at real Qwen3.5 shapes, and they compile its Triton IR for sm_90 to check
shared memory and register spills. Its grid is (batch row, kv head, row tile, ring split), planned by `plan`:
- the G query heads x T rows of one kv head are one [M, hd] tile, cut into row tiles (at head_dim 256: 64 rows
  in bf16, 16 in f32) so the f32 accumulator stays in registers (G 16 x k+1 9 = 144 rows happens);
- flash-decoding: the ring is split into `num_splits` contiguous parts that run as separate programs (a draft
  step at batch 1 has only B x nkv = 2..4 (row, head) pairs, far too few for a GPU's 132 SMs); each part
  streams its slots in blocks of `block_k` with an online softmax, computing each slot's logical row from
  `start` (no gather, no materialised mask), and the last part also takes the call's new rows; the parts'
  (max, sum, accumulator) are combined in XLA after the call.
Dots run in q's dtype with f32 accumulation (bf16 products are exact in f32), at HIGHEST precision
(for f32 inputs that is IEEE, not TF32).

KV dtype: the ring and the new rows (one dtype for both) are in q's dtype or in float8_e4m3fn (the fp8 KV
cache, qwen_mtp/trunk/state.py). The kernel loads fp8 blocks as they are (half the bytes of bf16 streamed from
memory) and converts them to q's dtype in registers; the reference upcasts them the same way before its dots,
so both see the same values (every e4m3fn value is exact in bf16 and f32). The caller rounds the new rows to
the ring dtype (new_k / new_v arrive in it), so kernel and reference read a call's own rows exactly as a later
call reads them from the ring. Any other ring dtype (e.g. a bf16 ring under f32 queries) takes the reference.

Backend choice is kernels_pallas/dispatch.py's rule: the kernel in a program lowered for cuda, the reference
elsewhere; `backend="pallas"` with `interpret=True` runs the kernel on CPU, as the tests do. A shape the kernel
does not take (`unsupported_reason`) falls back to the reference with a one-time warning.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas import dispatch
from kernels_pallas.masked_attention import attend
from kernels_pallas.ring_layout import slot_rows, visible, window_mask

HIGHEST = jax.lax.Precision.HIGHEST
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256  # Triton dots need every dimension >= 16
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)  # q (the compute dtype); the ring in q's dtype or in FP8
FP8 = jnp.float8_e4m3fn
TARGET_PROGRAMS = 264  # two programs per SM of an H100 / H200 (132 SMs)
MIN_BLOCKS_PER_SPLIT = 4  # a ring part streams at least 4 blocks, so the combine stays small next to the ring
NUM_STAGES = 2


def windowed_attend_reference(q, ring_k, ring_v, new_k, new_v, start, window: int, sinks: int):
    """Pure-JAX reference: one softmax over [ring slots ; new rows] with ring_layout.window_mask. The new rows
    are taken in the ring's dtype (a plain cast; the caller rounds them as it stores them) and everything is
    upcast to q's dtype before the dots."""
    T = q.shape[1]
    ring = ring_k.shape[1] - sinks
    key_ok = window_mask(start, T, window, sinks, ring)
    keys = jnp.concatenate([ring_k, new_k.astype(ring_k.dtype)], axis=1).astype(q.dtype)
    vals = jnp.concatenate([ring_v, new_v.astype(ring_v.dtype)], axis=1).astype(q.dtype)
    return attend(q, keys, vals, key_ok)


def unsupported_reason(q, ring_k, new_k, sinks: int):
    """None if the kernel takes these shapes and dtypes, else why not (the caller falls back to the reference)."""
    B, T, nh, hd = q.shape
    nkv = ring_k.shape[2]
    if nh % nkv:
        return f"query heads {nh} not a multiple of kv heads {nkv}"
    if not MIN_HEAD_DIM <= hd <= MAX_HEAD_DIM or hd & (hd - 1):
        return f"head_dim {hd} is not a power of two in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]"
    if ring_k.shape[1] <= sinks:
        return f"ring of {ring_k.shape[1]} slots has no room past {sinks} sinks"
    if new_k.shape[1] != T:
        return f"new_k has {new_k.shape[1]} rows for {T} queries"
    qd, rd, nd = jnp.dtype(q.dtype), jnp.dtype(ring_k.dtype), jnp.dtype(new_k.dtype)
    if qd not in {jnp.dtype(d) for d in DTYPES} or rd != nd or rd not in (qd, jnp.dtype(FP8)):
        return (f"dtypes q {qd}, ring {rd}, new {nd}: the kernel takes q in float32 / bfloat16 / float16 and "
                f"the ring and new rows both in q's dtype or both in float8_e4m3fn")
    return None


def _pow2(x, at_least=16):
    return max(at_least, 1 << (int(x) - 1).bit_length())


# Launch rules, chosen by compiling the kernel for sm_90 on a CPU (tests/test_export_cuda.py compiles it with
# the `triton` package and checks shared memory and register spills): the f32 accumulator [row tile, head_dim]
# and one block of K and V must fit the registers of the program's warps.
def _row_tile(M, hd, itemsize):
    if itemsize <= 2:
        return min(_pow2(M), 128, max(16, 16384 // hd))  # 64 rows at head_dim 256, 128 at 64
    return 16  # f32: larger tiles spill registers at every head_dim


# An fp8 ring (kv_itemsize 1) holds each block twice, as loaded and upcast to q's dtype: bf16 / f16 queries take
# 16-slot blocks at head_dim 256 when the row tile is large; f32 queries take one pipeline stage (two spill
# thousands of bytes per thread at head_dim 256) and 32-slot blocks at head_dim <= 64.
def _block_k(bm, hd, itemsize, kv_itemsize=None):
    fp8 = kv_itemsize is not None and kv_itemsize < itemsize
    if itemsize > 2:
        return 32 if fp8 and hd <= 64 else min(128, max(16, 8192 // hd))  # 32 slots at head_dim 256
    if fp8 and bm > 16:
        return min(128, max(16, 4096 // hd))  # 16 slots at head_dim 256
    return min(128, max(16, (16384 if bm <= 16 else 8192) // hd))  # 64 / 32 slots at head_dim 256


def _num_stages(itemsize, kv_itemsize):
    return 1 if itemsize > 2 and kv_itemsize < itemsize else NUM_STAGES


def _num_warps(bm, hd):
    return 8 if bm * hd >= 4096 else 4


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static launch plan of one call: grid (B, nkv, row_tiles, splits), each program streaming
    blocks_per_split blocks of block_k ring slots."""
    row_tile: int
    row_tiles: int
    block_k: int
    blocks_per_split: int
    splits: int
    num_warps: int
    num_stages: int


def plan(B, T, nh, nkv, hd, L, itemsize=2, block_k=None, num_splits=None, num_warps=None, num_stages=None, *,
         kv_itemsize=None) -> Plan:
    """Launch parameters from the shapes; any of block_k / num_splits / num_warps / num_stages given wins.
    itemsize: bytes of q's dtype; kv_itemsize: of the ring's (None: the same)."""
    kv_itemsize = itemsize if kv_itemsize is None else kv_itemsize
    G = nh // nkv
    bm = _row_tile(G * T, hd, itemsize)
    n_tiles = -(-G * T // bm)
    if block_k is None:
        block_k = _block_k(bm, hd, itemsize, kv_itemsize)
    n_blocks = -(-L // block_k)
    if num_splits is None:
        want = -(-TARGET_PROGRAMS // (B * nkv * n_tiles))
        num_splits = max(1, min(want, n_blocks // MIN_BLOCKS_PER_SPLIT))
    num_splits = max(1, min(int(num_splits), n_blocks))
    bps = -(-n_blocks // num_splits)
    num_splits = -(-n_blocks // bps)
    if num_warps is None:
        num_warps = _num_warps(bm, hd)
    if num_stages is None:
        num_stages = _num_stages(itemsize, kv_itemsize)
    return Plan(bm, n_tiles, block_k, bps, num_splits, num_warps, num_stages)


def online_block(carry, q, k, v, ok, scale):
    """One block of a flash-attention loop inside a kernel: (m, l, acc) [bm], [bm], [bm, hd] f32 updated with
    keys k / values v [block, hd] (upcast to q's dtype in registers: an fp8 cache, else a no-op) where ok
    [bm, block]. HIGHEST: IEEE f32 dots for f32 inputs (Triton lowers DEFAULT to TF32); for bf16 / f16 inputs it
    changes nothing (their products are exact in the f32 accumulator). Shared by this kernel and
    causal_attention.py's."""
    m_i, l_i, acc = carry
    prec = HIGHEST
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    s = jnp.dot(q, k.T, precision=prec, preferred_element_type=jnp.float32) * scale  # [bm, block]
    s = jnp.where(ok, s, -jnp.inf)
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.where(ok, jnp.exp(s - m_safe[:, None]), 0.0)
    corr = jnp.where(m_i == -jnp.inf, 0.0, jnp.exp(m_i - m_safe))
    l_i = l_i * corr + jnp.sum(p, axis=1)
    acc = acc * corr[:, None] + jnp.dot(p.astype(v.dtype), v, precision=prec, preferred_element_type=jnp.float32)
    return m_new, l_i, acc


def _kernel(qrow_ref, newest_ref, newrow_ref, q_ref, rk_ref, rv_ref, nk_ref, nv_ref, acc_ref, m_ref, l_ref, *,
            sinks, ring, window, bps, block_k, scale, last_split, slots):
    part = pl.program_id(3)
    q = q_ref[...]  # [bm, hd], input dtype
    qrow = qrow_ref[...]  # [bm] logical row of each query row; -1 for padding
    newest = newest_ref[...]  # [block_k], all equal to start - 1

    def update(carry, k, v, key_row):
        return online_block(carry, q, k, v, visible(key_row[None, :], qrow[:, None], window, sinks), scale)

    def ring_block(j, carry):
        # rk_ref / rv_ref are this (row, kv head)'s whole ring [slots, hd], read in place (strided by the kv
        # heads); the last block of the last part runs past the ring: masked loads, and slot_rows gives -1 there
        first = (part * bps + j) * block_k
        slot = first + jnp.arange(block_k, dtype=jnp.int32)
        inside = (slot < slots)[:, None]
        k = plt.load(rk_ref.at[pl.ds(first, block_k), :], mask=inside, other=0.0)
        v = plt.load(rv_ref.at[pl.ds(first, block_k), :], mask=inside, other=0.0)
        return update(carry, k, v, slot_rows(slot, newest, sinks, ring))

    bm, hd = q.shape
    carry = (jnp.full((bm,), -jnp.inf, jnp.float32), jnp.zeros((bm,), jnp.float32), jnp.zeros((bm, hd), jnp.float32))
    carry = jax.lax.fori_loop(0, bps, ring_block, carry)
    # the call's own rows: only the last ring part counts them (elsewhere every key row is masked as -1)
    newrow = jnp.where(part == last_split, newrow_ref[...], -1)
    m_i, l_i, acc = update(carry, nk_ref[...], nv_ref[...], newrow)
    acc_ref[...] = acc
    m_ref[...] = m_i
    l_ref[...] = l_i


@functools.partial(jax.jit, static_argnames=("window", "sinks", "block_k", "num_splits", "num_warps", "num_stages",
                                             "interpret"))
def windowed_attend_pallas(q, ring_k, ring_v, new_k, new_v, start, window: int, sinks: int, block_k: int | None = None,
                           num_splits: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, interpret: bool = False):
    """The Pallas kernel. Shapes must pass unsupported_reason (windowed_attend checks it). None picks each
    launch parameter from the shapes (plan); an int forces it (tests, tuning)."""
    B, T, nh, hd = q.shape
    L, nkv = ring_k.shape[1], ring_k.shape[2]
    G = nh // nkv
    ring = L - sinks
    p = plan(B, T, nh, nkv, hd, L, jnp.dtype(q.dtype).itemsize, block_k, num_splits, num_warps, num_stages,
             kv_itemsize=jnp.dtype(ring_k.dtype).itemsize)
    bm, n_tiles, block_k, bps, n_split = p.row_tile, p.row_tiles, p.block_k, p.blocks_per_split, p.splits
    M = bm * n_tiles
    Tn = _pow2(T)
    # the queries and the call's new rows are small: regrouped per kv head, padded to their tiles in XLA.
    # [B, nkv, M, hd] with rows (t, g) t-major; padding rows are masked out by qrow = -1. The ring is not
    # copied: the kernel reads ring_k / ring_v [B, L, nkv, hd] where they are.
    qg = group(q, nkv, M)
    kv = lambda x, n: jnp.pad(jnp.moveaxis(x, 2, 1), ((0, 0), (0, 0), (0, n - x.shape[1]), (0, 0)))
    nk, nv = kv(new_k, Tn), kv(new_v, Tn)
    start = start.astype(jnp.int32)
    qrow = row_positions(start[:, None] + jnp.arange(T, dtype=jnp.int32)[None], G, M)  # [B, M]
    newest = jnp.broadcast_to((start - 1)[:, None], (B, block_k))
    t = jnp.arange(Tn, dtype=jnp.int32)
    newrow = jnp.where(t[None] < T, start[:, None] + t[None], -1)  # [B, Tn]
    kernel = functools.partial(_kernel, sinks=sinks, ring=ring, window=window, bps=bps, block_k=block_k,
                               scale=hd ** -0.5, last_split=n_split - 1, slots=L)
    tile = lambda n, idx: pl.BlockSpec((None, None, n, hd), idx)
    acc, m_i, l_i = pl.pallas_call(
        kernel,
        grid=(B, nkv, n_tiles, n_split),
        in_specs=[pl.BlockSpec((None, bm), lambda b, h, r, s: (b, r)),
                  pl.BlockSpec((None, block_k), lambda b, h, r, s: (b, 0)),
                  pl.BlockSpec((None, Tn), lambda b, h, r, s: (b, 0)),
                  tile(bm, lambda b, h, r, s: (b, h, r, 0)),
                  pl.BlockSpec((None, L, None, hd), lambda b, h, r, s: (b, 0, h, 0)),
                  pl.BlockSpec((None, L, None, hd), lambda b, h, r, s: (b, 0, h, 0)),
                  tile(Tn, lambda b, h, r, s: (b, h, 0, 0)),
                  tile(Tn, lambda b, h, r, s: (b, h, 0, 0))],
        out_specs=split_specs(bm, hd),
        out_shape=split_shapes(B, nkv, n_split, M, hd),
        compiler_params=plt.CompilerParams(num_warps=p.num_warps, num_stages=p.num_stages),
        interpret=interpret,
        name="windowed_draft_attention",
    )(qrow, newest, newrow, qg, ring_k, ring_v, nk, nv)
    out = combine_splits(acc, m_i, l_i)  # [B, nkv, M, hd] f32
    out = out[:, :, :T * G].astype(q.dtype).reshape(B, nkv, T, G, hd)
    return jnp.moveaxis(out, 1, 2).reshape(B, T, nh, hd)


def group(q, num_kv_heads: int, rows: int):
    """q [B, T, nh, hd] -> [B, nkv, rows, hd]: a kernel's query rows (this one's and causal_attention.py's), per kv
    head its G = nh / nkv heads x T rows (t, g) t-major, zeros after the T G real ones (the row tiles' padding)."""
    B, T, nh, hd = q.shape
    G = nh // num_kv_heads
    qg = jnp.moveaxis(q.reshape(B, T, num_kv_heads, G, hd), 2, 1).reshape(B, num_kv_heads, T * G, hd)
    return jnp.pad(qg, ((0, 0), (0, 0), (0, rows - T * G), (0, 0)))


def row_positions(q_pos, G: int, rows: int):
    """q_pos [B, T] -> [B, rows] int32: the position of each of the kernel's query rows (`group`'s order: row t G + g
    at q_pos[b, t]), -1 for the padding rows (they see no slot)."""
    qpos = jnp.repeat(q_pos.astype(jnp.int32), G, axis=1)
    return jnp.pad(qpos, ((0, 0), (0, rows - qpos.shape[1])), constant_values=-1)


def split_specs(bm, hd):
    """The out_specs of a kernel on grid (batch, kv head, row tile, K part) writing per-part online-softmax
    results: acc [B, nkv, parts, M, hd], m and l [B, nkv, parts, M], each program its tile of bm rows
    (combine_splits merges them; causal_attention.py shares it)."""
    return [pl.BlockSpec((None, None, None, bm, hd), lambda b, h, r, s: (b, h, s, r, 0)),
            pl.BlockSpec((None, None, None, bm), lambda b, h, r, s: (b, h, s, r)),
            pl.BlockSpec((None, None, None, bm), lambda b, h, r, s: (b, h, s, r))]


def split_shapes(B, nkv, parts, M, hd):
    """The out_shape of split_specs' outputs, f32."""
    return [jax.ShapeDtypeStruct((B, nkv, parts, M, hd), jnp.float32),
            jax.ShapeDtypeStruct((B, nkv, parts, M), jnp.float32),
            jax.ShapeDtypeStruct((B, nkv, parts, M), jnp.float32)]


def combine_splits(acc, m, l):
    """Merge per-part online-softmax results along axis 2: acc [..., P, M, hd], m / l [..., P, M]."""
    m_max = jnp.max(m, axis=2, keepdims=True)
    m_max = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    w = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - m_max))  # parts that saw no key weigh nothing
    num = jnp.sum(acc * w[..., None], axis=2)
    den = jnp.sum(l * w, axis=2)
    return num / jnp.where(den > 0, den, 1.0)[..., None]


def windowed_attend(q, ring_k, ring_v, new_k, new_v, start, window: int, sinks: int, *, backend: str = "auto",
                    interpret: bool = False):
    """The kernel in a program lowered for cuda, the reference elsewhere (dispatch.run); see the module doc."""
    args = (q, ring_k, ring_v, new_k, new_v, start)
    kernel = functools.partial(windowed_attend_pallas, window=window, sinks=sinks, interpret=interpret)
    reference = functools.partial(windowed_attend_reference, window=window, sinks=sinks)
    reason = unsupported_reason(q, ring_k, new_k, sinks)
    return dispatch.run("windowed draft attention", kernel, reference, reason, backend, *args)
