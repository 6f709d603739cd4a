"""Gated full attention (trunk full-attention layers and the MTP head share these functions).

q_proj emits, per head, `head_dim` query values followed by `head_dim` output-gate values (split per head,
not first half / second half of the row). q and k get (1+w) RMSNorms over head_dim, then partial RoPE. The
output is o_proj(attn * sigmoid(gate)).

The KV cache may be stored in another dtype than the compute dtype (fp8; state.py has the rule): new rows are
rounded with state.to_cache and written, and the attention then reads every row, the call's own included, back
from the cache upcast to the compute dtype, so T rows at once see exactly what T single steps see. (A CPU decode
step or verify reads the cache first and the same rounded rows beside it, then writes: attention_layer.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import per_shard as spmd
from kernels_pallas.attention_q import queries, rows_at
from kernels_pallas.attention_rows import attend_new_rows, write_rows, write_rows_scatter
from kernels_pallas.causal_attention import FEW_QUERIES, causal_attend, causal_attend_before_write, takes_dense_form
from kernels_pallas.masked_attention import BLOCK_DIAGONAL_ROWS
from kernels_pallas.per_shard import active_mesh
from kernels_pallas.rope import apply_rope, rope_cos_sin
from kernels_pallas.split_k import product_of
from qwen_mtp.trunk.config import ModelConfig
from qwen_mtp.trunk.ops import linear, linear_of_two, product_parts, rmsnorm_1pw
from qwen_mtp.trunk.quant import linear_parts, pair_parts
from qwen_mtp.trunk.state import KVCache, to_cache
from qwen_mtp.trunk.weights import AttnWeights


def project_qkv(x, w: AttnWeights, cfg: ModelConfig, positions, two=None):
    """x [B, T, H], positions [B, T] -> q [B,T,nh,hd], k, v [B,T,nkv,hd] (RoPE applied), gate [B,T,nh*hd].
    two: one row's x and a zero row [2, 1, H] as the input norm's kernel wrote them, read through
    ops.linear_of_two."""
    B, T, _ = x.shape
    qg = _lin(two)(x, w.q_proj)
    q = queries(qg.reshape(1, B * T, -1), w.q_norm, positions, **_query_args(cfg, x.dtype))
    return (q, *project_kv(x, w, cfg, positions, two), gate_of(qg.reshape(B, T, -1), cfg))


def _lin(two):
    return linear if two is None else (lambda x, m: linear_of_two(x, two, m))


def _query_args(cfg: ModelConfig, dtype) -> dict:
    return dict(head_dim=cfg.head_dim, rotary_dim=cfg.rotary_dim, theta=cfg.rope_theta, eps=cfg.rms_norm_eps,
                dtype=dtype)


def gate_of(qg, cfg: ModelConfig):
    """The output gate [B, T, nh hd] of the q | gate product [B, T, nh 2 hd] (per head: hd q, then hd gate)."""
    B, T, _ = qg.shape
    return qg.reshape(B, T, cfg.num_heads, 2 * cfg.head_dim)[..., cfg.head_dim:].reshape(B, T, -1)


def project_kv(x, w: AttnWeights, cfg: ModelConfig, positions, two=None):
    """k (normed, RoPE applied) and v [B, T, nkv, hd] of x [B, T, H] at RoPE positions [B, T]."""
    B, T, _ = x.shape
    nkv, hd = cfg.num_kv_heads, cfg.head_dim
    k = rmsnorm_1pw(_lin(two)(x, w.k_proj).reshape(B, T, nkv, hd), w.k_norm, cfg.rms_norm_eps)
    v = _lin(two)(x, w.v_proj).reshape(B, T, nkv, hd)
    cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
    return apply_rope(k, cos, sin), v


# write_rows_per_row unrolls its updates up to this many rows, and loops over the rows beyond (a 2000-row batch
# unrolled made XLA's CPU compiler crash)
UNROLL_ROWS = 8


def write_rows_per_row(cache, new, pos, *, as_bits: bool = False):
    """write_rows_scatter's result as one dynamic-update-slice per row (what a CPU runs).

    Why on a CPU: XLA's CPU backend expands the scatter into a guarded update and copies its result whole into the
    decode loop's carry; a bf16 cache is also widened to f32 and back around it: two passes over every KV cache
    at every decode step or verify. Row by row the copy is gone, but XLA's CPU backend still runs any bf16 (or
    fp8) dynamic-update-slice as a widening pass over the whole cache. as_bits: update the cache's bits instead
    (viewed as unsigned integers of its width, which no pass widens), so the update is done in place, for a
    caller whose attention read the cache before this write (attention_layer's read_then_write: the cache
    viewed back as floats is then read by nothing but the next step). An f32 cache is updated as it is."""
    zero = jnp.zeros((), pos.dtype)
    dtype = cache.dtype
    bits = as_bits and dtype.itemsize < 4
    if bits:
        uint = jnp.dtype(f"uint{8 * dtype.itemsize}")
        cache, new = jax.lax.bitcast_convert_type(cache, uint), jax.lax.bitcast_convert_type(new, uint)
    if cache.shape[0] <= UNROLL_ROWS:
        for b in range(cache.shape[0]):
            cache = jax.lax.dynamic_update_slice(cache, new[b:b + 1], (b + zero, pos[b], zero, zero))
    else:
        def row(b, c):
            return jax.lax.dynamic_update_slice(c, jax.lax.dynamic_slice_in_dim(new, b, 1),
                                                (b.astype(pos.dtype), pos[b], zero, zero))

        cache = jax.lax.fori_loop(0, cache.shape[0], row, cache)
    return jax.lax.bitcast_convert_type(cache, dtype) if bits else cache


# A batch of one row is written by its dynamic-update-slice on a GPU too: XLA (0.10.2) turned the batched
# scatter into a select of the new rows against the cache's old ones and an update, and computed the new rows
# (k's norm and RoPE, v's product) in the select's kernel, so each of k and v took two kernels; the update alone
# takes the new rows' computation into its own kernel, in place (27B / 35B-A3B, compiled for an H200 on a CPU:
# 3 kernels an attention layer fewer).
ONE_ROW_WRITE = True


def write_kv(cache: KVCache, k, v, pos, *, as_bits: bool = False) -> KVCache:
    """Write k, v [B, T, nkv, hd] into slots pos[b] .. pos[b]+T-1 of each row, rounded to the cache dtype.
    as_bits: see write_rows_per_row (on a CPU; a GPU's writes ignore it)."""
    per_row = functools.partial(write_rows_per_row, as_bits=as_bits)

    gpu = write_rows if ONE_ROW_WRITE else write_rows_scatter  # (attention_rows.write_rows: the rule above)

    def write(c, new):
        return jax.lax.platform_dependent(c, to_cache(new, c.dtype), pos, cpu=per_row, default=gpu)

    return KVCache(write(cache.k, k), write(cache.v, v))


def output(o, gate, w: AttnWeights, parts: bool = False):
    """o_proj(attn * sigmoid(gate)) [B, T, H]; parts: as ops.product_parts' [S, B T, H] (forward.decoder_layer)."""
    B, T = o.shape[:2]
    return (product_parts if parts else linear)(o.reshape(B, T, -1) * jax.nn.sigmoid(gate), w.o_proj)


def attention_layer(x, w: AttnWeights, cfg: ModelConfig, cache: KVCache, pos, rope_offset: int = 0, two=None,
                    out_parts: bool = False):
    """Causal attention of T new tokens in slots pos[b] + t of the row's cache, each seeing slots <= its own.
    RoPE position = slot + rope_offset (0 for the trunk; 1 for the MTP head, whose row t sits at t + 1).
    The new rows are rounded to the cache dtype, written, and read back from the cache (upcast to the compute
    dtype) by kernels_pallas/causal_attention.py, which walks the cache in blocks and stops after the furthest
    position. On cuda a decode step's or a verify's (T <= FEW_QUERIES, no mesh) queries, keys and values are
    made by kernels_pallas/attention_rows.py's kernel from the products (their K partials), the queries written
    where the attention kernel reads them, the keys and values into the caches (_from_product: at a 27B int4
    decode step 7 kernels fewer than XLA's, tests/test_gpu_compile.py).

    On a CPU, a decode step or a verify (T <= BLOCK_DIAGONAL_ROWS) whose attention takes the dense form reads
    the cache BEFORE the write instead, with the same rounded new rows held apart (causal_attend_before_write:
    the same slots, the same values), and then writes them in place. Written first, the cache had two readers
    after its update, and XLA's CPU backend computed the update twice or copied the cache whole: in f32, the
    shipped model with a short prompt in a 128K-slot cache took 90 ms per plain step, 24.5 ms read first.
    two: one row's x and a zero row (project_qkv). out_parts: the output as o_proj's K partials [S, B T, H]
    (ops.product_parts), which forward.decoder_layer adds to the residual in its norm's kernel."""
    T = x.shape[1]
    if T <= FEW_QUERIES and active_mesh() is None and QUERY_KERNEL:  # a decode step or a verify: on cuda, the
        # queries' kernel (_from_product)
        on = lambda f: lambda x, w, cache, pos, two: f(x, w, cfg, cache, pos, rope_offset, two, out_parts)
        return jax.lax.platform_dependent(x, w, cache, pos, two, cuda=on(_from_product), default=on(_layer))
    return _layer(x, w, cfg, cache, pos, rope_offset, two, out_parts)


# a decode step's or a verify's new rows (no mesh) by kernels_pallas/attention_rows.py's kernel on cuda
# (_from_product); False: XLA's ops there too (tests/gpu_compile_kernels.py's control)
QUERY_KERNEL = True


def _layer(x, w: AttnWeights, cfg: ModelConfig, cache: KVCache, pos, rope_offset, two, out_parts=False):
    B, T, _ = x.shape
    positions = rows_at(pos, T)
    q, k, v, gate = project_qkv(x, w, cfg, positions + rope_offset, two)
    k, v = to_cache(k, cache.k.dtype), to_cache(v, cache.v.dtype)

    def write_then_read(q, k, v, cache, positions):
        cache = write_kv(cache, k, v, positions[:, 0])
        # blocked over the cache, up to the furthest position: the Pallas kernel in a program lowered for cuda,
        # its pure-JAX reference elsewhere; under a mesh, per (row, kv head) shard (spmd.py)
        return spmd.causal(q, cache.k, cache.v, positions, causal_attend), cache

    def read_then_write(q, k, v, cache, positions):
        o = spmd.causal_before_write(q, cache.k, cache.v, k, v, positions, causal_attend_before_write)
        return o, write_kv(cache, k, v, positions[:, 0], as_bits=True)

    if T <= BLOCK_DIAGONAL_ROWS and takes_dense_form(B, T, cfg.num_heads, cache.k.shape[1]):
        o, cache = jax.lax.platform_dependent(q, k, v, cache, positions, cpu=read_then_write,
                                              default=write_then_read)
    else:
        o, cache = write_then_read(q, k, v, cache, positions)
    return output(o, gate, w, out_parts), cache


def _from_product(x, w: AttnWeights, cfg: ModelConfig, cache: KVCache, pos, rope_offset, two, out_parts=False,
                  backend: str = "auto", interpret: bool = False):
    """_layer for a decode step or a verify with no mesh, as a GPU runs it: the q | gate product, and k's and v's
    together, as their float32 K partials where the quantized decode kernel makes them (quant.linear_parts; k and
    v in one launch, quant.pair_parts), else the products themselves, read by kernels_pallas/attention_rows.py's
    kernel, which sums, norms and rotates the queries into the attention kernel's rows and writes the keys and
    values into the caches in place (quantized, no kernel of XLA's is left between the products and the attention
    kernel; plain, XLA's split-K sums of its products); the gate sums the partials in the output's fusion. The
    same values as _layer (backend / interpret: the tests run the kernels on a CPU)."""
    B, T, _ = x.shape
    q_parts = _parts(x, w.q_proj, two)
    qg = product_of(q_parts, x.dtype)  # (the gate's: summed in chunks XLA fuses into the output's fusion)
    o, k, v = attend_new_rows(q_parts, w.q_norm, _kv_parts(x, w, two), w.k_norm, cache.k, cache.v, pos,
                              rope_offset=rope_offset, **_query_args(cfg, x.dtype), backend=backend,
                              interpret=interpret)
    return output(o, gate_of(qg.reshape(B, T, -1), cfg), w, out_parts), KVCache(k, v)


def _parts(x, m, two):
    """x @ m as [S, B T, N]: the decode kernel's K partials (quant.linear_parts), else the product itself (S 1)."""
    parts = linear_parts(x, m)
    return _product(x, m, two) if parts is None else parts


def _product(x, m, two):
    return _lin(two)(x, m).reshape(1, x.shape[0] * x.shape[1], -1)


def _kv_parts(x, w: AttnWeights, two):
    """k's and v's products as [S, 2, B T, nkv hd]: one launch's K partials (quant.pair_parts), else each one's
    (_parts; both products where one has partials and the other none)."""
    kv = pair_parts(x, w.k_proj, w.v_proj, name="k_v")
    if kv is not None:
        return kv.reshape(*kv.shape[:2], -1, kv.shape[-1])
    k, v = _parts(x, w.k_proj, two), _parts(x, w.v_proj, two)
    if k.shape != v.shape or k.dtype != v.dtype:
        k, v = _product(x, w.k_proj, two), _product(x, w.v_proj, two)
    return jnp.stack([k, v], axis=1)
