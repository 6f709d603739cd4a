"""Causal attention over a KV cache that walks the keys in blocks: prefill, decode and verify at any context.

    causal_attend(q, k_cache, v_cache, q_pos) -> [B, T, nh, hd]

q [B, T, nh, hd] are T new queries per row at cache positions q_pos [B, T] (RoPE applied); k_cache / v_cache
[B, S, nkv, hd] hold every row's keys and values, the call's own already written, in the cache dtype (the
compute dtype or float8_e4m3fn). Query (b, t) sees slots s <= q_pos[b, t]: the causal mask of the trunk and of
the native MTP head. GQA: nh = G * nkv, query head h reads kv head h // G.

The dense form (`masked_attention.attend`) scores every query against every slot, future ones included, and
holds [B, nkv, G, T, S] f32 scores at once: at Qwen3.5-27B's 24 query heads a 256-row chunk against a 1M-slot
cache is 25 GB for one layer. Here (`causal_attend_reference`, pure JAX, and the one CPUs run):
- the keys are read in parts of `split` blocks of `block` slots, in a loop that stops after the last slot any
  query of the call can see (the batch's furthest q_pos), so a prefill chunk never reads the future of the
  cache and the whole prompt costs about the causal half of the dense work;
- each block's partial softmax (its max, sum and weighted values, f32) is computed independently (split-K /
  flash-decoding: decode and verify have few queries, so several blocks per step), then the partials are
  combined with the running ones by their log-sum-exp: memory for scores is one part, whatever the context;
- cache blocks are upcast to q's dtype one part at a time (an fp8 cache is never widened whole).
A cache no longer than one part takes the dense form unchanged (the same program as before for short contexts),
and so does a decode-like call whose dense scores stay small (DENSE_FEW_QUERY_BYTES: faster on a CPU). A decode
step's or a verify's dense form (T <= masked_attention.BLOCK_DIAGONAL_ROWS) is two plain products over the cache
read in place, the queries spread over a block-diagonal matrix (masked_attention.py): no per-step cache copy.
Scores and the softmax run in f32; the products in q's dtype with f32 accumulation at the project's precision
rule (HIGHEST for f32).

The result equals the dense form up to the order of f32 sums (tests/test_causal_attention.py: block
boundaries, ragged batches, chunks that do not divide the prompt, positions past one block, fp8 caches).

On a GPU the same computation is one Pallas-Triton kernel (`causal_attend_pallas`), chosen per lowering
platform by dispatch.py like the other kernels. Its grid is (batch row, kv head, row tile, cache part), the plan
of windowed_attention.py: the G query heads x T rows of one kv head form [rows, head_dim] tiles, and the cache is
cut into parts (flash-decoding) so that a decode step at batch 1 still fills the GPU; each program streams its
part's blocks of block_k slots with an online softmax and stops after the last slot its tile's queries see (a
loop with a dynamic trip count: future blocks are never loaded), the cache read in place, fp8 upcast in
registers; the parts' (max, sum, accumulator) are combined in XLA. Why our own kernel rather than a library's:
jax.nn.dot_product_attention with cuDNN takes a causal mask aligned to the top-left corner and per-row lengths,
but not T queries at their own per-row offsets into a longer cache (the chunked prefill, the verify), short of a
materialised [B, T, S] mask; tokamax's Pallas attention is written for training-style equal-length sequences.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas import dispatch
from kernels_pallas import windowed_attention as wa
from kernels_pallas.masked_attention import attend, attend_with_new, precision_for

PREFILL_BLOCK = 512  # slots per block when the call has many queries (prefill chunks)
DECODE_BLOCK = 1024  # ... and when it has few (decode: 1 row, verify: k + 1 rows)
DECODE_SPLIT = 4  # blocks per loop step for few queries, each its own partial softmax
FEW_QUERIES = 32  # T at or below which a call is decode-like
# a decode-like call whose dense scores [B, nh, T, S] (f32) fit in this many bytes takes the dense form on a CPU:
# one product over the cache beats the blocked loop there (measured: 5.0 against 9.1 ms per decode step at an 8K
# context, 14.6 against 24.2 at 32K, with the batched products that masked_attention.py has since replaced for
# decode by faster ones); beyond it (a 27B verify over 1M slots: 0.9 GB) the blocked loop bounds
# the memory. Prefill chunks (T > FEW_QUERIES) take the blocked form whenever the cache exceeds one part.
DENSE_FEW_QUERY_BYTES = 64 << 20


def plan(T: int, S: int) -> tuple:
    """(block, split) for T queries against an S-slot cache."""
    if T <= FEW_QUERIES:
        return DECODE_BLOCK, DECODE_SPLIT
    return PREFILL_BLOCK, 1


def dense_causal(q, k_cache, v_cache, q_pos):
    """The dense masked form: every slot scored, those past each query's position masked."""
    key_ok = jnp.arange(k_cache.shape[1], dtype=q_pos.dtype)[None, None, :] <= q_pos[:, :, None]
    return attend(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), key_ok)


def _small_dense(B, T, nh, S):
    return T <= FEW_QUERIES and B * nh * T * S * 4 <= DENSE_FEW_QUERY_BYTES


def takes_dense_form(B: int, T: int, nh: int, S: int) -> bool:
    """Whether causal_attend_reference (its default plan) runs the dense form for these shapes: a cache no longer
    than one part, or a decode-like call whose dense scores fit in DENSE_FEW_QUERY_BYTES."""
    block, split = plan(T, S)
    return S <= block * split or _small_dense(B, T, nh, S)


def causal_attend_before_write(q, k_cache, v_cache, k_new, v_new, q_pos):
    """causal_attend's dense form for a call whose T new rows k_new, v_new [B, T, nkv, hd] (in the cache dtype)
    are not yet in the cache: query t sees the cache's slots before q_pos[b, 0] and new rows 0 .. t, which are
    the slots <= q_pos[b, t] of the cache once they are written at q_pos[b, 0] ... The caller writes them after
    (attention.attention_layer on a CPU). Pure JAX (masked_attention.attend_with_new)."""
    T, S = q.shape[1], k_cache.shape[1]
    key_ok = jnp.arange(S, dtype=q_pos.dtype)[None, None, :] < q_pos[:, :1, None]
    new_ok = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (q.shape[0], T, T))
    up = lambda x: x.astype(q.dtype)
    return attend_with_new(q, up(k_cache), up(v_cache), key_ok, up(k_new), up(v_new), new_ok)


def causal_attend_reference(q, k_cache, v_cache, q_pos, *, block: int | None = None, split: int | None = None):
    """Pure JAX: the blocked online softmax described in the module docstring."""
    B, T, nh, hd = q.shape
    S, nkv = k_cache.shape[1], k_cache.shape[2]
    G = nh // nkv
    b0, s0 = plan(T, S)
    small = block is None and _small_dense(B, T, nh, S)
    block, split = block or b0, split or s0
    part = block * split
    if S <= part or small:  # the dense form (an explicit block forces the blocked one past one part)
        return dense_causal(q, k_cache, v_cache, q_pos)

    prec = precision_for(q.dtype)
    qg = q.reshape(B, T, nkv, G, hd)
    scale = hd ** -0.5
    last = jnp.max(q_pos)  # the furthest slot any query sees
    n_parts = last // part + 1

    def body(i, carry):
        m, l, acc = carry  # [B, nkv, G, T], [B, nkv, G, T], [B, nkv, G, T, hd] (f32)
        start = i * part
        lo = jnp.minimum(start, S - part)  # dynamic_slice's clamp, made explicit: the tail part overlaps
        kb = jax.lax.dynamic_slice_in_dim(k_cache, lo, part, axis=1).astype(q.dtype)
        vb = jax.lax.dynamic_slice_in_dim(v_cache, lo, part, axis=1).astype(q.dtype)
        kb = kb.reshape(B, split, block, nkv, hd)
        vb = vb.reshape(B, split, block, nkv, hd)
        s = jnp.einsum("btkgd,bjskd->bkgtjs", qg, kb, precision=prec, preferred_element_type=jnp.float32) * scale
        slot = lo + jnp.arange(part, dtype=q_pos.dtype).reshape(split, block)
        # visible: causal, and not already taken by an earlier part (the overlapped tail)
        ok = (slot[None, None] <= q_pos[:, :, None, None]) & (slot >= start)[None, None]  # [B, T, split, block]
        s = jnp.where(ok[:, None, None], s, -jnp.inf)
        # each block's partial softmax
        m_j = jnp.max(s, axis=-1)  # [B, nkv, G, T, split]
        m_j_safe = jnp.where(jnp.isfinite(m_j), m_j, 0.0)
        p = jnp.exp(s - m_j_safe[..., None])
        l_j = jnp.sum(p, axis=-1)
        acc_j = jnp.einsum("bkgtjs,bjskd->bkgtjd", p.astype(q.dtype), vb, precision=prec,
                           preferred_element_type=jnp.float32)
        # combined with the running partial by log-sum-exp
        m_new = jnp.maximum(m, jnp.max(m_j, axis=-1))
        m_new_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        a_old = jnp.exp(jnp.where(jnp.isfinite(m), m - m_new_safe, -jnp.inf))
        a_j = jnp.exp(jnp.where(jnp.isfinite(m_j), m_j - m_new_safe[..., None], -jnp.inf))
        l = l * a_old + jnp.sum(l_j * a_j, axis=-1)
        acc = acc * a_old[..., None] + jnp.sum(acc_j * a_j[..., None], axis=-2)
        return m_new, l, acc

    m0 = jnp.full((B, nkv, G, T), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((B, nkv, G, T), jnp.float32)
    acc0 = jnp.zeros((B, nkv, G, T, hd), jnp.float32)
    _, l, acc = jax.lax.fori_loop(0, n_parts, body, (m0, l0, acc0))
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # every query sees its own slot: l > 0
    return jnp.moveaxis(out, 3, 1).reshape(B, T, nh, hd).astype(q.dtype)


def unsupported_reason(q, k_cache, q_pos):
    """None if the kernel takes these shapes and dtypes, else why not (the caller falls back to the reference)."""
    B, T, nh, hd = q.shape
    nkv = k_cache.shape[2]
    if nh % nkv:
        return f"query heads {nh} not a multiple of kv heads {nkv}"
    if not wa.MIN_HEAD_DIM <= hd <= wa.MAX_HEAD_DIM or hd & (hd - 1):
        return f"head_dim {hd} is not a power of two in [{wa.MIN_HEAD_DIM}, {wa.MAX_HEAD_DIM}]"
    if q_pos.shape != (B, T):
        return f"q_pos of shape {q_pos.shape} for queries [{B}, {T}]"
    qd, kd = jnp.dtype(q.dtype), jnp.dtype(k_cache.dtype)
    if qd not in {jnp.dtype(d) for d in wa.DTYPES} or kd not in (qd, jnp.dtype(wa.FP8)):
        return (f"dtypes q {qd}, cache {kd}: the kernel takes q in float32 / bfloat16 / float16 and the cache in "
                f"q's dtype or in float8_e4m3fn")
    return None


def _kernel(qpos_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *, bps, block_k, scale, slots):
    part = pl.program_id(3)
    q = q_ref[...]  # [bm, hd], input dtype
    qpos = qpos_ref[...]  # [bm] the cache position of each query row; -1 for padding
    first_block = part * bps
    # the blocks of this part that hold a slot some query of the tile sees: the loop stops there
    n = jnp.clip(jnp.max(qpos) // block_k + 1 - first_block, 0, bps)

    def block(j, carry):
        first = (first_block + j) * block_k
        slot = first + jnp.arange(block_k, dtype=jnp.int32)
        inside = (slot < slots)[:, None]
        k = plt.load(k_ref.at[pl.ds(first, block_k), :], mask=inside, other=0.0)
        v = plt.load(v_ref.at[pl.ds(first, block_k), :], mask=inside, other=0.0)
        return wa.online_block(carry, q, k, v, slot[None, :] <= qpos[:, None], scale)

    bm, hd = q.shape
    carry = (jnp.full((bm,), -jnp.inf, jnp.float32), jnp.zeros((bm,), jnp.float32), jnp.zeros((bm, hd), jnp.float32))
    m_i, l_i, acc = jax.lax.fori_loop(0, n, block, carry)
    acc_ref[...] = acc
    m_ref[...] = m_i
    l_ref[...] = l_i


def kernel_plan(q_shape, q_dtype, k_cache, block_k=None, num_splits=None, num_warps=None, num_stages=None):
    """The kernel's launch parameters (windowed_attention.Plan) for queries [B, T, nh, hd] of q_dtype; None picks
    each from the shapes, an int forces it."""
    B, T, nh, hd = q_shape
    return wa.plan(B, T, nh, k_cache.shape[2], hd, k_cache.shape[1], jnp.dtype(q_dtype).itemsize, block_k,
                   num_splits, num_warps, num_stages, kv_itemsize=jnp.dtype(k_cache.dtype).itemsize)


@functools.partial(jax.jit, static_argnames=("block_k", "num_splits", "num_warps", "num_stages", "interpret"))
def causal_attend_pallas(q, k_cache, v_cache, q_pos, block_k: int | None = None, num_splits: int | None = None,
                         num_warps: int | None = None, num_stages: int | None = None, interpret: bool = False):
    """The Pallas kernel. Shapes must pass unsupported_reason (causal_attend checks it). None picks each launch
    parameter from the shapes (windowed_attention.plan); an int forces it (tests, tuning)."""
    p = kernel_plan(q.shape, q.dtype, k_cache, block_k, num_splits, num_warps, num_stages)
    rows = p.row_tile * p.row_tiles
    qg = wa.group(q, k_cache.shape[2], rows)
    qpos = wa.row_positions(q_pos, q.shape[2] // k_cache.shape[2], rows)
    return causal_attend_grouped_pallas(qg, qpos, k_cache, v_cache, T=q.shape[1], num_heads=q.shape[2], plan=p,
                                        interpret=interpret)


@functools.partial(jax.jit, static_argnames=("T", "num_heads", "plan", "interpret"))
def causal_attend_grouped_pallas(qg, qpos, k_cache, v_cache, *, T: int, num_heads: int, plan,
                                 interpret: bool = False):
    """The kernel on queries already in its rows: qg [B, nkv, rows, hd] and their positions qpos [B, rows]
    (windowed_attention's `group` and `row_positions` of q [B, T, nh, hd] and q_pos [B, T], or attention_q.py's
    kernel, which writes
    both), plan from kernel_plan -> [B, T, nh, hd]. The cache is not copied: the kernel reads k_cache / v_cache
    [B, S, nkv, hd] where they are."""
    B, nkv, M, hd = qg.shape
    S, G = k_cache.shape[1], num_heads // nkv
    p = plan
    bm, n_tiles, block_k, bps, n_split = p.row_tile, p.row_tiles, p.block_k, p.blocks_per_split, p.splits
    if M != bm * n_tiles or qpos.shape != (B, M):
        raise ValueError(f"causal_attend_grouped_pallas: queries of {M} rows a kv head and positions "
                         f"{list(qpos.shape)}; the plan's tiles hold {bm * n_tiles} rows")
    kernel = functools.partial(_kernel, bps=bps, block_k=block_k, scale=hd ** -0.5, slots=S)
    acc, m_i, l_i = pl.pallas_call(
        kernel,
        grid=(B, nkv, n_tiles, n_split),
        in_specs=[pl.BlockSpec((None, bm), lambda b, h, r, s: (b, r)),
                  pl.BlockSpec((None, None, bm, hd), lambda b, h, r, s: (b, h, r, 0)),
                  pl.BlockSpec((None, S, None, hd), lambda b, h, r, s: (b, 0, h, 0)),
                  pl.BlockSpec((None, S, None, hd), lambda b, h, r, s: (b, 0, h, 0))],
        out_specs=wa.split_specs(bm, hd),
        out_shape=wa.split_shapes(B, nkv, n_split, M, hd),
        compiler_params=plt.CompilerParams(num_warps=p.num_warps, num_stages=p.num_stages),
        interpret=interpret,
        name="causal_attention",
    )(qpos, qg, k_cache, v_cache)
    out = wa.combine_splits(acc, m_i, l_i)  # [B, nkv, M, hd] f32
    out = out[:, :, :T * G].astype(qg.dtype).reshape(B, nkv, T, G, hd)
    return jnp.moveaxis(out, 1, 2).reshape(B, T, num_heads, hd)


def _dispatch(q, k_cache, v_cache, q_pos, backend, interpret):
    kernel = functools.partial(causal_attend_pallas, interpret=interpret)
    reason = unsupported_reason(q, k_cache, q_pos)
    return dispatch.run("causal attention", kernel, causal_attend_reference, reason, backend, q, k_cache, v_cache,
                        q_pos)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attend(q, k_cache, v_cache, q_pos, backend, interpret):
    return _dispatch(q, k_cache, v_cache, q_pos, backend, interpret)


def _attend_fwd(q, k_cache, v_cache, q_pos, backend, interpret):
    return _dispatch(q, k_cache, v_cache, q_pos, backend, interpret), (q, k_cache, v_cache, q_pos)


def _attend_bwd(backend, interpret, res, g):
    q, k_cache, v_cache, q_pos = res
    _, vjp = jax.vjp(lambda q, k, v: dense_causal(q, k, v, q_pos), q, k_cache, v_cache)
    return (*vjp(g), None)


_attend.defvjp(_attend_fwd, _attend_bwd)


def causal_attend(q, k_cache, v_cache, q_pos, *, backend: str = "auto", interpret: bool = False):
    """The trunk's and the native MTP head's attention over their KV caches: the kernel in a program lowered for
    cuda, the blocked reference elsewhere (dispatch.run); see the module docstring. Differentiable (training
    runs the trunk through it): the gradient is the dense form's, so that neither the kernel nor the reference's
    dynamic-length loop is ever differentiated."""
    return _attend(q, k_cache, v_cache, q_pos, backend, interpret)
