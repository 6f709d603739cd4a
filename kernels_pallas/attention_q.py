"""An attention layer's queries from its q | gate product as one kernel: the product's K partials summed, the
per-head (1 + w) RMSNorm, partial RoPE, written where the causal attention kernel reads them. A Pallas kernel
beside its pure-JAX reference (same signature).

    queries_grouped(parts, w, start, *, offset, num_kv_heads, rows, rotary_dim, theta, eps, dtype) -> qg, qpos
      parts   [S, B T, nh 2 hd]  the q | gate product of B x T rows (q_proj: per head, hd query values then hd gate
              values) as S >= 1 partial sums over K (quant.linear_parts: f32), or the product itself (S = 1)
      w       [hd]               q_norm's weight; the scale is (1 + w)
      start   [B] int            row b's first position: row (b, t) sits at start[b] + t (a decode step, a verify,
                                 the native MTP head's draft step) and is rotated to start[b] + t + offset (static:
                                 0 in the trunk, 1 in the MTP head), from the array the layer already holds, so
                                 that no positions are made for the kernel
      qg      [B, nkv, rows, hd] in `dtype`: row t G + g of kv head h is query head h G + g of row t (G = nh / nkv),
                                 rows T G .. rows - 1 zeros (windowed_attention.group, the attention kernel's tiles)
      qpos    [B, rows] int32    each of those rows' cache position start[b] + t, -1 for the padding rows
                                 (windowed_attention.row_positions): the attention kernel's other operand, which XLA
                                 made in a kernel of its own

    queries(parts, w, positions, *, head_dim, rotary_dim, theta, eps, dtype) -> q [B, T, nh, hd]
      the same queries in the trunk's layout at RoPE positions [B, T] (attention.project_qkv); the reference is
      windowed_attention.group of it.

The values are the trunk's: the partials' sum rounded to `dtype` (ops.linear's product), rmsnorm_reference of each
head's hd query values, kernels_pallas/rope.py's rotation. The kernel sums the partials in their order and the
squares in another, so f32 results agree to a few units of f32 rounding and bf16 ones to their rounding; it reads
the reference's own inverse frequencies (a constant), so an angle is the same f32 number in both.

Why a kernel: compiled for a GPU, XLA ran a decode step's or a verify's queries as three kernels before the
attention kernel (27B int4, read from the compiled HLO: the partials' sum and the query slice; the norm, a Triton
block fusion, which takes no reducing producer; RoPE with the regrouping and the pad to the row tiles): here one
program per output row does all of it, two kernels an attention layer fewer. Its programs are also
attention_rows.py's, which write the layer's keys and values in the same launch (trunk/attention.attention_layer
on cuda); dispatch.py's rule chooses the backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas import dispatch
from kernels_pallas import windowed_attention as wa
from kernels_pallas.rmsnorm import DTYPES, rmsnorm_reference
from kernels_pallas.rope import apply_rope, inverse_frequencies, rope_cos_sin
from kernels_pallas.split_k import product_of

MAX_HEAD_DIM = 1024
NUM_WARPS = 2


def queries(parts, w, positions, *, head_dim: int, rotary_dim: int, theta: float, eps: float, dtype):
    """The trunk's queries from the q | gate product's partials (module doc): [B, T, nh, hd] in dtype."""
    B, T = positions.shape
    q = product_of(parts, dtype).reshape(B, T, -1, 2 * head_dim)[..., :head_dim]
    cos, sin = rope_cos_sin(positions, rotary_dim, theta)
    return apply_rope(rmsnorm_reference(q, w, eps=eps), cos, sin)


def rows_at(start, T: int):
    """[B, T]: row (b, t)'s position start[b] + t."""
    return start[:, None] + jnp.arange(T, dtype=start.dtype)[None]


def queries_grouped_reference(parts, w, start, *, offset: int, num_kv_heads: int, rows: int, rotary_dim: int,
                              theta: float, eps: float, dtype):
    """Pure JAX: group(queries(parts, w, rows_at(start, T) + offset, ...)) and row_positions(rows_at(start, T))."""
    positions = rows_at(start, parts.shape[1] // start.shape[0])
    q = queries(parts, w, positions + offset, head_dim=w.shape[0], rotary_dim=rotary_dim, theta=theta, eps=eps,
                dtype=dtype)
    return wa.group(q, num_kv_heads, rows), wa.row_positions(positions, q.shape[2] // num_kv_heads, rows)


def check_inputs(parts, w, start, num_kv_heads: int, rotary_dim: int) -> None:
    """ValueError naming what is wrong when the arrays are not a q | gate product, its norm's weight and the
    rows' first positions."""
    hd = w.shape[0] if w.ndim == 1 else None
    B = start.shape[0] if start.ndim == 1 and start.shape[0] else None
    if hd is None or B is None or parts.ndim != 3 or parts.shape[1] % B or parts.shape[2] % (2 * hd):
        raise ValueError(f"queries take parts [S, B T, nh 2 hd], w [hd] and start [B]; found parts "
                         f"{list(parts.shape)}, w {list(w.shape)}, start {list(start.shape)}")
    nh = parts.shape[2] // (2 * hd)
    if nh % num_kv_heads or rotary_dim % 2 or not 0 < rotary_dim <= hd:
        raise ValueError(f"queries: {nh} query heads over {num_kv_heads} kv heads, rotary_dim {rotary_dim} of "
                         f"head_dim {hd}: expected a multiple and an even rotary_dim in (0, {hd}]")


def unsupported_reason(parts, w, start):
    """None if the kernel takes these arrays, else why not (the caller falls back to the reference)."""
    for name, a in (("q | gate product", parts), ("q_norm weight", w)):
        if jnp.dtype(a.dtype) not in {jnp.dtype(d) for d in DTYPES}:
            return f"a {name} of dtype {jnp.dtype(a.dtype)}: the kernel takes float32 / bfloat16 / float16"
    if not jnp.issubdtype(start.dtype, jnp.integer):
        return f"positions of dtype {jnp.dtype(start.dtype)}: the kernel takes integers"
    if w.shape[0] > MAX_HEAD_DIM:
        return f"head_dim {w.shape[0]}: one program's row holds at most {MAX_HEAD_DIM}"
    if parts.size == 0:
        return "no rows"
    return None


def _pow2(n: int) -> int:
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def _lanes(width):
    return jnp.arange(_pow2(width), dtype=jnp.int32) < width


def loader(b):
    """load(ref, start, width, *lead) -> ref[*lead, start:start + width] in f32 (a power of two of lanes, the rest
    masked to 0) for the program of batch row b (a Triton kernel's, attention_rows.py's too)."""
    def load(ref, start, width, *lead):  # one indexer (Triton's lowering takes no chain of them)
        return plt.load(ref.at[(*lead, pl.ds(_at(start, b), _pow2(width)))], mask=_lanes(width),
                        other=0).astype(jnp.float32)
    return load


def _at(start, b):
    # a static start past 0 made dynamic: the indexer refuses a static slice whose padded lanes pass the end,
    # masked or not (jax.experimental.state.indexing), and pl.ds(0, ...) is only let through because 0 is falsy
    return start + 0 * b


def pieces_of(hd: int, half: int) -> list:
    """A head's row as (start, width) pieces: x1 | x2 rotate, the rest passes."""
    rd = 2 * half
    return [(0, half), (half, half)] + [(rd, hd - rd)] * (hd > rd)


def head_row(load, parts_ref, S: int, lead, base, pieces, dt):
    """One head's values (pieces) of a row of a product's K partials [S, *lead's dims, N] (the row parts_ref[s,
    *lead]) from column `base`: the partials summed in their order, rounded to dt (ops.linear's product), in f32."""
    return [sum(load(parts_ref, base + a, n, jnp.int32(s), *lead) for s in range(S)).astype(dt).astype(jnp.float32)
            for a, n in pieces]


def norm_rotate(load, xs, w_ref, freq_ref, angle_at, pieces, *, hd: int, half: int, eps: float, dt):
    """The (1 + w) RMSNorm of a head's row xs (head_row's pieces) rounded to dt, then rotate-half RoPE at position
    angle_at (an int scalar): the pieces in dt (rmsnorm_reference, then rope.apply_rope)."""
    r = jax.lax.rsqrt(sum(jnp.sum(x * x) for x in xs) / hd + eps)
    ys = [(x * r * (1.0 + load(w_ref, a, n))).astype(dt) for x, (a, n) in zip(xs, pieces)]
    angle = angle_at.astype(jnp.float32) * load(freq_ref, 0, half)
    cos, sin = jnp.cos(angle).astype(dt), jnp.sin(angle).astype(dt)
    return [ys[0] * cos + -ys[1] * sin, ys[1] * cos + ys[0] * sin] + ys[2:]


def store_row(ref, lead, ys, pieces, b, valid=True):
    """ref[*lead, a:a + n] = y for each piece (zeros where not valid)."""
    for y, (a, n) in zip(ys, pieces):
        plt.store(ref.at[(*lead, pl.ds(_at(a, b), _pow2(n)))], jnp.where(valid, y, jnp.zeros_like(y)),
                  mask=_lanes(n))


def query_program(start_ref, freq_ref, parts_ref, w_ref, o_ref, qpos_ref, *, S, T, G, hd, half, eps, offset):
    """Program (b, h, m): output row m of kv head h (query head h G + m % G of row m // G), and its position."""
    b, h, m = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dt, load = o_ref.dtype, loader(b)
    valid = m < T * G
    t = jnp.minimum(m // G, T - 1)
    pieces = pieces_of(hd, half)
    xs = head_row(load, parts_ref, S, (b * T + t,), (h * G + m % G) * 2 * hd, pieces, dt)
    position = start_ref[b] + t
    ys = norm_rotate(load, xs, w_ref, freq_ref, position + offset, pieces, hd=hd, half=half, eps=eps, dt=dt)
    store_row(o_ref, (b, h, m), ys, pieces, b, valid)

    @pl.when(h == 0)  # the row's position, once
    def _():
        qpos_ref[b, pl.ds(m, 1)] = jnp.where(valid, position, -1).astype(jnp.int32)[None]


@functools.partial(jax.jit, static_argnames=("offset", "num_kv_heads", "rows", "rotary_dim", "theta", "eps", "dtype",
                                             "num_warps", "interpret"))
def queries_grouped_pallas(parts, w, start, *, offset: int, num_kv_heads: int, rows: int, rotary_dim: int,
                           theta: float, eps: float, dtype, num_warps: int = NUM_WARPS, interpret: bool = False):
    """The Pallas kernel: one program per output row (batch row, kv head, row). Inputs must pass check_inputs and
    unsupported_reason."""
    S, hd = parts.shape[0], w.shape[0]
    B = start.shape[0]
    T = parts.shape[1] // B
    G = parts.shape[2] // (2 * hd) // num_kv_heads
    freq = inverse_frequencies(rotary_dim, theta)
    whole = lambda a: pl.BlockSpec(a.shape, lambda *i: (0,) * len(a.shape))  # each program indexes in place
    out = [jax.ShapeDtypeStruct((B, num_kv_heads, rows, hd), dtype), jax.ShapeDtypeStruct((B, rows), jnp.int32)]
    args = (start.astype(jnp.int32), freq, parts, w)
    qg, qpos = pl.pallas_call(
        functools.partial(query_program, S=S, T=T, G=G, hd=hd, half=rotary_dim // 2, eps=eps, offset=offset),
        grid=(B, num_kv_heads, rows),
        in_specs=[whole(a) for a in args],
        out_specs=[whole(o) for o in out],
        out_shape=out,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="attention_queries",
    )(*args)
    return qg, qpos


def queries_grouped(parts, w, start, *, offset: int, num_kv_heads: int, rows: int, rotary_dim: int, theta: float,
                    eps: float, dtype, backend: str = "auto", interpret: bool = False):
    """The queries in the attention kernel's rows and their positions (module doc): the kernel in a program lowered
    for cuda, queries_grouped_reference elsewhere (dispatch.run)."""
    check_inputs(parts, w, start, num_kv_heads, rotary_dim)
    kw = dict(offset=offset, num_kv_heads=num_kv_heads, rows=rows, rotary_dim=rotary_dim, theta=theta, eps=eps,
              dtype=jnp.dtype(dtype))
    kernel = functools.partial(queries_grouped_pallas, interpret=interpret, **kw)
    reference = functools.partial(queries_grouped_reference, **kw)
    return dispatch.run("attention queries", kernel, reference, unsupported_reason(parts, w, start), backend, parts,
                        w, start)
