"""The MoE experts at prefill: a grouped matmul over rows sorted by expert, reading each expert's weights once per
tile of its rows, by index.

    grouped_dot(x, w, scale, group_sizes, *, kind, k, block, impl="auto") -> [n, N]
      x            [n, K]       rows sorted by expert (group e: the next group_sizes[e] rows)
      w            [E, Kq, N]   stacked experts: plain float (kind "plain", scale None) or quant_layout values
      scale        [E, gk, gn]  float32 scales of the quantized formats (None for "plain")
      group_sizes  [E] int      rows of each expert, summing to n
      out[r] = x[r] @ weight(w[e(r)], scale[e(r)])   in x's dtype

Two implementations, `impl`:
  "tiles"   an XLA loop over tiles of TILE rows of one expert each (an expert's rows cut into whole tiles, the
            last one masked), as many iterations as the routing needs (a dynamic trip count, at most
            ceil(n / TILE) + min(E, n)); each iteration reads its expert's weights by index (dynamic_index: no
            gathered copy), dequantizes that one expert (int4 / fp8 blocks; per-channel formats scale the f32
            product's columns, exact) and multiplies TILE rows, f32 accumulation. It reads each routed expert
            once per tile and no expert no row was routed to;
  "ragged"  jax.lax.ragged_dot over all experts (grouped formats dequantize all of them first, per-channel
            ones scale each row by its expert's column scales): what XLA's GPU backend runs as a grouped GEMM;
  "auto"    tiles in a program lowered for cpu, ragged elsewhere (jax.lax.platform_dependent, per lowering).
Why: XLA's CPU ragged_dot costs about a dense product against every expert. Measured in one run on this 2-core
CPU (benchmarks/bench_moe.py --prefill; benchmarks/results/cpu-2026-12-05-bench_moe-prefill.txt), the MoE block
at Qwen3.5-35B-A3B's experts: the tiles took 3.1x-3.9x less time than lax.ragged_dot at 16 and 32 tokens (bf16
and int4; 11x at 64 tokens in bf16 in a first run), and tokamax's ragged dot (on CPU, XLA's ragged_dot_general) was slower still; at 16-32 tokens the
routed path (decode's) is faster than both, which is where mlp.reads_routed_only sends them; from 64 tokens on
the tiles are the fastest path in bf16 (2.1x the routed one) and within 10% of it in int4. On a GPU,
lax.ragged_dot stays until a GPU run measures otherwise (benchmarks/gpu_check/moe.py times it beside tokamax's
and our routed kernel): a loop of small dots would be one launch per tile there.
`RAGGED` = the function "ragged" calls (jax.lax.ragged_dot; the benchmark swaps in tokamax.ragged_dot).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.masked_attention import precision_for
from kernels_pallas.quant_layout import cdiv, dequantize, values

TILE = 8  # rows per loop iteration: the prefill's pairs per expert are few (35B-A3B, 512 tokens: 16 on average)
IMPLS = ("auto", "tiles", "ragged")
RAGGED = jax.lax.ragged_dot


def _channel(kind: str, k: int, block) -> bool:
    """Per-channel formats: one scale per column over all of K (the product is scaled after, exactly)."""
    return kind in ("int8", "fp8") and block[0] >= k and block[1] == 1


def ragged(x, w, scale, group_sizes, *, kind: str, k: int, block):
    """lax.ragged_dot over every expert (module doc)."""
    prec = precision_for(x.dtype)
    gs = group_sizes.astype(jnp.int32)
    if kind == "plain":
        return RAGGED(x, w.astype(x.dtype), gs, precision=prec)
    if _channel(kind, k, block):
        v = values(w, kind, block, jnp)[:, :k].astype(x.dtype)
        y = RAGGED(x, v, gs, precision=prec, preferred_element_type=jnp.float32)
        row_expert = jnp.repeat(jnp.arange(gs.shape[0]), gs, total_repeat_length=x.shape[0])
        return (y * scale[row_expert, 0]).astype(x.dtype)
    return RAGGED(x, dequantize(w, scale, kind, k, block, x.dtype, jnp), gs, precision=prec)


def tiles(x, w, scale, group_sizes, *, kind: str, k: int, block, tile: int = TILE):
    """The tiled loop (module doc)."""
    n, dt = x.shape[0], x.dtype
    E, N = w.shape[0], w.shape[-1]
    prec = precision_for(dt)
    sizes = group_sizes.astype(jnp.int32)
    per = (sizes + tile - 1) // tile  # tiles of each expert
    ends = jnp.cumsum(per)
    first = ends - per
    row0 = jnp.cumsum(sizes) - sizes
    t = jnp.arange(cdiv(n, tile) + min(E, n), dtype=jnp.int32)  # a static bound on the tiles
    t_expert = jnp.minimum(jnp.searchsorted(ends, t, side="right"), E - 1).astype(jnp.int32)
    t_row = row0[t_expert] + (t - first[t_expert]) * tile
    t_rows = jnp.clip(row0[t_expert] + sizes[t_expert] - t_row, 0, tile)
    xp = jnp.concatenate([x, jnp.zeros((tile, x.shape[1]), dt)])
    channel = kind != "plain" and _channel(kind, k, block)

    def product(xt, e):
        we = jax.lax.dynamic_index_in_dim(w, e, keepdims=False)
        if kind == "plain":
            v = we.astype(dt)
        elif channel:
            v = values(we, kind, block, jnp)[:k].astype(dt)
        else:
            v = dequantize(we, jax.lax.dynamic_index_in_dim(scale, e, keepdims=False), kind, k, block, dt, jnp)
        y = jnp.dot(xt, v, precision=prec, preferred_element_type=jnp.float32)
        if channel:
            y = y * jax.lax.dynamic_index_in_dim(scale, e, keepdims=False)[0].astype(jnp.float32)
        return y

    def body(i, out):
        r = t_row[i]
        y = product(jax.lax.dynamic_slice_in_dim(xp, r, tile), t_expert[i])
        y = jnp.where(jnp.arange(tile)[:, None] < t_rows[i], y, 0.0)
        return jax.lax.dynamic_update_slice_in_dim(out, jax.lax.dynamic_slice_in_dim(out, r, tile) + y, r, 0)

    out = jax.lax.fori_loop(0, ends[-1], body, jnp.zeros((n + tile, N), jnp.float32))
    return out[:n].astype(dt)


def grouped_dot(x, w, scale, group_sizes, *, kind: str, k: int, block, impl: str = "auto"):
    """The grouped product (module doc); `impl` one of IMPLS."""
    if impl not in IMPLS:
        raise ValueError(f"grouped_dot: impl one of {IMPLS}, found {impl!r}")
    if x.ndim != 2 or w.ndim != 3 or group_sizes.shape != (w.shape[0],) or x.shape[1] != k:
        raise ValueError(f"grouped_dot takes x [n, {k}], w [E, Kq, N], group_sizes [E], found x {list(x.shape)}, "
                         f"w {list(w.shape)}, group_sizes {list(group_sizes.shape)}")
    kw = {"kind": kind, "k": k, "block": tuple(block)}
    if impl == "tiles" or impl == "ragged":
        return (tiles if impl == "tiles" else ragged)(x, w, scale, group_sizes, **kw)
    return jax.lax.platform_dependent(x, w, scale, group_sizes, cpu=lambda *a: tiles(*a, **kw),
                                      default=lambda *a: ragged(*a, **kw))
