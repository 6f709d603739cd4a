"""An attention layer's new rows as one kernel: the queries into the causal attention kernel's rows (attention_q.py)
and, in the same launch, the rows' keys and values into the KV caches, in place; then the attention over the
caches. A Pallas kernel beside its pure-JAX reference (same signature).

    attend_new_rows(q_parts, q_norm, kv_parts, k_norm, k_cache, v_cache, start, *, rope_offset, head_dim,
                    rotary_dim, theta, eps, dtype) -> o, k_cache, v_cache
      q_parts  [Sq, B T, nh 2 hd]    the q | gate product of B x T rows (attention_q.py's parts)
      kv_parts [S, 2, B T, nkv hd]   the k product ([:, 0]) and the v product ([:, 1]) as S >= 1 float32 K
                                     partials (quant.pair_parts: one launch of the decode kernel makes both), or
                                     the products themselves (S = 1)
      q_norm, k_norm [hd]            the per-head (1 + w) RMSNorm weights of the queries and the keys
      k_cache, v_cache [B, slots, nkv, hd]   in `dtype` or float8_e4m3fn; row (b, t) is written to slot
                                     min(max(start[b], 0), slots - T) + t (dynamic_update_slice's clamp) and
                                     rotated to position start[b] + t + rope_offset
      o        [B, T, nh, hd]        causal attention of each row over slots <= start[b] + t, its own included

The values are the trunk's (trunk/attention._layer): a key is the k product's row rounded to `dtype`, normed,
rotated, rounded to the cache's dtype (to_cache); a value the v product's row rounded to `dtype`, then to the
cache's. The kernel sums partials in their order and squares in another (attention_q.py), so f32 keys agree to
a few units of f32 rounding, bf16 ones to their rounding; values and every other slot are the reference's bits.

Why a kernel: compiled for a GPU, XLA wrote a decode step's or a verify's keys and values with three kernels per
attention layer (the k partials' sum and norm, then one dynamic-update-slice per cache, which computed k's RoPE
and v's sum), besides the queries' kernel (27B int4 at full depth: 64 kernels of a plain step's 1025, with k and
v's one launch, quant.pair_parts). Here the queries' programs (batch row b, kv head h, row m) with m < T
also write key and value row m of head h: no program reads what another writes, so both caches are aliased to
the outputs, and the attention kernel, the next launch, reads them. trunk/attention._from_product runs it on cuda
for a decode step, a verify and the MTP head's draft step (no mesh); dispatch.py's rule chooses the backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas import attention_q as aq
from kernels_pallas import causal_attention as ca
from kernels_pallas import dispatch
from kernels_pallas.rmsnorm import DTYPES, rmsnorm_reference
from kernels_pallas.rope import apply_rope, inverse_frequencies, rope_cos_sin
from kernels_pallas.split_k import product_of

FP8 = jnp.dtype("float8_e4m3fn")


def to_cache(x, dtype):
    """x as a KV cache of `dtype` stores it: a plain cast, except float8_e4m3fn, which saturates to its finite
    range first (a cast of |x| > 448 would give NaN). Identity when x already has that dtype (trunk/state.py)."""
    dtype = jnp.dtype(dtype)
    if x.dtype == dtype:
        return x
    if dtype == FP8:
        top = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -top, top)
    return x.astype(dtype)


def write_rows_scatter(cache, new, pos):
    """cache [B, S, nkv, hd] with new [B, T, nkv, hd] in slots pos[b] .. pos[b]+T-1 of row b (clamped to fit, as
    dynamic_update_slice does), as one batched update: a scatter (what a GPU runs)."""
    return jax.vmap(lambda c, u, p: jax.lax.dynamic_update_slice(c, u, (p, 0, 0)))(cache, new, pos)


def write_rows(cache, new, pos):
    """write_rows_scatter's result as a GPU's program writes it: one row by its dynamic-update-slice, a batch of
    rows by the scatter (trunk/attention.write_kv)."""
    if cache.shape[0] == 1:
        return jax.lax.dynamic_update_slice(cache, new, (jnp.zeros((), pos.dtype), pos[0], 0, 0))
    return write_rows_scatter(cache, new, pos)


def keys_values(kv_parts, k_norm, start, *, offset: int, num_kv_heads: int, rotary_dim: int, theta: float,
                eps: float, dtype):
    """The rows' keys (normed, rotated to start[b] + t + offset) and values [B, T, nkv, hd] in dtype."""
    B, hd = start.shape[0], k_norm.shape[0]
    T = kv_parts.shape[2] // B
    k, v = (product_of(kv_parts[:, i], dtype).reshape(B, T, num_kv_heads, hd) for i in (0, 1))
    cos, sin = rope_cos_sin(aq.rows_at(start, T) + offset, rotary_dim, theta)
    return apply_rope(rmsnorm_reference(k, k_norm, eps=eps), cos, sin), v


def new_rows_reference(q_parts, q_norm, kv_parts, k_norm, k_cache, v_cache, start, *, offset: int, rows: int,
                       rotary_dim: int, theta: float, eps: float, dtype):
    """Pure JAX: attention_q.queries_grouped_reference's (qg, qpos), and the caches with keys_values' rows written
    (to_cache, write_rows)."""
    kw = dict(rotary_dim=rotary_dim, theta=theta, eps=eps, dtype=dtype)
    nkv = k_cache.shape[2]
    qg, qpos = aq.queries_grouped_reference(q_parts, q_norm, start, offset=offset, num_kv_heads=nkv, rows=rows, **kw)
    k, v = keys_values(kv_parts, k_norm, start, offset=offset, num_kv_heads=nkv, **kw)
    return (qg, qpos, write_rows(k_cache, to_cache(k, k_cache.dtype), start),
            write_rows(v_cache, to_cache(v, v_cache.dtype), start))


def check_inputs(q_parts, q_norm, kv_parts, k_norm, k_cache, v_cache, start, rotary_dim: int) -> None:
    """ValueError naming what is wrong when the arrays are not an attention layer's products, norms, caches and
    rows' first positions."""
    nkv = k_cache.shape[2] if k_cache.ndim == 4 else 1
    aq.check_inputs(q_parts, q_norm, start, nkv, rotary_dim)
    hd, B = q_norm.shape[0], start.shape[0]
    cache = (B, k_cache.shape[1] if k_cache.ndim == 4 else None, nkv, hd)
    if (k_cache.shape != cache or v_cache.shape != cache or k_norm.shape != (hd,) or kv_parts.ndim != 4
            or kv_parts.shape[1:] != (2, q_parts.shape[1], nkv * hd)):
        raise ValueError(f"attend_new_rows takes kv_parts [S, 2, B T, nkv hd] = [S, 2, {q_parts.shape[1]}, nkv {hd}], "
                         f"k_norm [{hd}] and caches [B {B}, slots, nkv, {hd}]; found kv_parts "
                         f"{list(kv_parts.shape)}, k_norm {list(k_norm.shape)}, k_cache {list(k_cache.shape)}, "
                         f"v_cache {list(v_cache.shape)}")


def unsupported_reason(q_parts, q_norm, kv_parts, k_norm, k_cache, v_cache, start, head_dim: int, dtype):
    """None if the kernels take these arrays, else why not (the caller runs the reference)."""
    B, T = start.shape[0], q_parts.shape[1] // start.shape[0]
    q = jax.ShapeDtypeStruct((B, T, q_parts.shape[2] // (2 * head_dim), head_dim), dtype)
    q_pos = jax.ShapeDtypeStruct((B, T), start.dtype)
    reason = aq.unsupported_reason(q_parts, q_norm, start) or ca.unsupported_reason(q, k_cache, q_pos)
    for name, a in (("k | v product", kv_parts), ("k_norm weight", k_norm)):
        if reason is None and jnp.dtype(a.dtype) not in {jnp.dtype(d) for d in DTYPES}:
            reason = f"a {name} of dtype {jnp.dtype(a.dtype)}: the kernel takes float32 / bfloat16 / float16"
    if reason is None and v_cache.dtype != k_cache.dtype:
        reason = f"a k cache of {jnp.dtype(k_cache.dtype)} and a v cache of {jnp.dtype(v_cache.dtype)}"
    if reason is None and T > k_cache.shape[1]:
        reason = f"{T} rows into a cache of {k_cache.shape[1]} slots"
    return reason


def _kernel(start_ref, freq_ref, q_ref, qw_ref, kv_ref, kw_ref, _k_in, _v_in, o_ref, qpos_ref, kc_ref, vc_ref, *, S,
            Skv, T, G, hd, half, eps, offset, slots):
    aq.query_program(start_ref, freq_ref, q_ref, qw_ref, o_ref, qpos_ref, S=S, T=T, G=G, hd=hd, half=half, eps=eps,
                     offset=offset)
    b, h, m = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(m < T)  # also key and value row m of head h
    def _():
        dt, load, pieces = o_ref.dtype, aq.loader(b), aq.pieces_of(hd, half)
        start = start_ref[b]
        slot = jnp.minimum(jnp.maximum(start, 0), slots - T) + m
        xs = aq.head_row(load, kv_ref, Skv, (jnp.int32(0), b * T + m), h * hd, pieces, dt)
        ks = aq.norm_rotate(load, xs, kw_ref, freq_ref, start + m + offset, pieces, hd=hd, half=half, eps=eps, dt=dt)
        aq.store_row(kc_ref, (b, slot, h), [to_cache(y, kc_ref.dtype) for y in ks], pieces, b)
        whole = [(0, hd)]
        vs = aq.head_row(load, kv_ref, Skv, (jnp.int32(1), b * T + m), h * hd, whole, dt)
        aq.store_row(vc_ref, (b, slot, h), [to_cache(y.astype(dt), vc_ref.dtype) for y in vs], whole, b)


@functools.partial(jax.jit, static_argnames=("offset", "rows", "rotary_dim", "theta", "eps", "dtype", "num_warps",
                                             "interpret"))
def new_rows_pallas(q_parts, q_norm, kv_parts, k_norm, k_cache, v_cache, start, *, offset: int, rows: int,
                    rotary_dim: int, theta: float, eps: float, dtype, num_warps: int = aq.NUM_WARPS,
                    interpret: bool = False):
    """The Pallas kernel: one program per query row (batch row, kv head, row), the first T of each also writing a
    key and a value row. Inputs must pass check_inputs and unsupported_reason. -> (qg, qpos, k_cache, v_cache)"""
    hd, (B, slots, nkv, _) = q_norm.shape[0], k_cache.shape
    T = q_parts.shape[1] // B
    G = q_parts.shape[2] // (2 * hd) // nkv
    whole = lambda a: pl.BlockSpec(a.shape, lambda *i: (0,) * len(a.shape))  # each program indexes in place
    out = [jax.ShapeDtypeStruct((B, nkv, rows, hd), dtype), jax.ShapeDtypeStruct((B, rows), jnp.int32),
           jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
    args = (start.astype(jnp.int32), inverse_frequencies(rotary_dim, theta), q_parts, q_norm, kv_parts, k_norm,
            k_cache, v_cache)
    return pl.pallas_call(
        functools.partial(_kernel, S=q_parts.shape[0], Skv=kv_parts.shape[0], T=T, G=G, hd=hd, half=rotary_dim // 2,
                          eps=eps, offset=offset, slots=slots),
        grid=(B, nkv, rows),
        in_specs=[whole(a) for a in args],
        out_specs=[whole(o) for o in out],
        out_shape=out,
        input_output_aliases={6: 2, 7: 3},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="attention_new_rows",
    )(*args)


def new_rows(q_parts, q_norm, kv_parts, k_norm, k_cache, v_cache, start, *, offset: int, rows: int,
             rotary_dim: int, theta: float, eps: float, dtype, backend: str = "auto", interpret: bool = False):
    """(qg, qpos, k_cache, v_cache): the kernel in a program lowered for cuda, new_rows_reference elsewhere
    (dispatch.run); what attend_new_rows runs before the attention kernel."""
    check_inputs(q_parts, q_norm, kv_parts, k_norm, k_cache, v_cache, start, rotary_dim)
    args = (q_parts, q_norm, kv_parts, k_norm, k_cache, v_cache, start)
    kw = dict(offset=offset, rows=rows, rotary_dim=rotary_dim, theta=theta, eps=eps, dtype=jnp.dtype(dtype))
    return dispatch.run("attention's new rows", functools.partial(new_rows_pallas, interpret=interpret, **kw),
                        functools.partial(new_rows_reference, **kw),
                        unsupported_reason(*args, q_norm.shape[0], dtype), backend, *args)


def attend_new_rows(q_parts, q_norm, kv_parts, k_norm, k_cache, v_cache, start, *, rope_offset: int,
                    head_dim: int, rotary_dim: int, theta: float, eps: float, dtype, backend: str = "auto",
                    interpret: bool = False):
    """The module doc's attention: on cuda this kernel writes the queries into the attention kernel's rows and the
    keys and values into the caches, and the attention kernel reads them (dispatch.run: either kernel refusing the
    shapes runs the whole reference); elsewhere the reference (the rows written by write_rows, then
    causal_attend_reference). Differentiable: the gradient is the reference's through the dense form."""
    check_inputs(q_parts, q_norm, kv_parts, k_norm, k_cache, v_cache, start, rotary_dim)
    kw = dict(head_dim=head_dim, rotary_dim=rotary_dim, theta=theta, eps=eps, dtype=jnp.dtype(dtype))
    static = (int(rope_offset), tuple(kw.items()))
    return _attend(q_parts, q_norm, kv_parts, k_norm, k_cache, v_cache, start, static, backend, interpret)


def _reference(q_parts, q_norm, kv_parts, k_norm, k_cache, v_cache, start, static, attend=None):
    offset, kw = static[0], dict(static[1])
    B, nkv = start.shape[0], k_cache.shape[2]
    T = q_parts.shape[1] // B
    norm_rope = {k: kw[k] for k in ("rotary_dim", "theta", "eps", "dtype")}
    k, v = keys_values(kv_parts, k_norm, start, offset=offset, num_kv_heads=nkv, **norm_rope)
    k_cache = write_rows(k_cache, to_cache(k, k_cache.dtype), start)
    v_cache = write_rows(v_cache, to_cache(v, v_cache.dtype), start)
    positions = aq.rows_at(start, T)
    q = aq.queries(q_parts, q_norm, positions + offset, **kw)
    return (attend or ca.causal_attend_reference)(q, k_cache, v_cache, positions), k_cache, v_cache


def _dispatch(q_parts, q_norm, kv_parts, k_norm, k_cache, v_cache, start, static, backend, interpret):
    offset, kw = static[0], dict(static[1])
    hd, B = kw["head_dim"], start.shape[0]
    T = q_parts.shape[1] // B
    args = (q_parts, q_norm, kv_parts, k_norm, k_cache, v_cache, start)
    reason = unsupported_reason(*args, hd, kw["dtype"])

    def kernel(*args):
        p = ca.kernel_plan((B, T, q_parts.shape[2] // (2 * hd), hd), kw["dtype"], k_cache)
        qg, qpos, k, v = new_rows_pallas(*args, offset=offset, rows=p.row_tile * p.row_tiles, interpret=interpret,
                                         **{k: kw[k] for k in ("rotary_dim", "theta", "eps", "dtype")})
        o = ca.causal_attend_grouped_pallas(qg, qpos, k, v, T=T, num_heads=q_parts.shape[2] // (2 * hd), plan=p,
                                            interpret=interpret)
        return o, k, v

    return dispatch.run("attention's new rows", kernel, lambda *a: _reference(*a, static), reason, backend, *args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _attend(q_parts, q_norm, kv_parts, k_norm, k_cache, v_cache, start, static, backend, interpret):
    return _dispatch(q_parts, q_norm, kv_parts, k_norm, k_cache, v_cache, start, static, backend, interpret)


def _attend_fwd(*args):
    return _dispatch(*args), args[:7]


def _attend_bwd(static, backend, interpret, res, g):
    *diff, start = res
    dense = lambda *a: _reference(*a, start, static, attend=ca.dense_causal)
    _, vjp = jax.vjp(dense, *diff)
    return (*vjp(g), None)


_attend.defvjp(_attend_fwd, _attend_bwd)
