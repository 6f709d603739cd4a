"""The quantized matmul's XLA reference and its input check, shared by its kernels (quant_matmul.py's tiled kernel,
quant_gemv.py's FMA decode kernel, quant_mma.py's and quant_mma_fp8.py's tensor-core decode kernels) and their
dispatchers.

    quant_matmul_reference(x, q, scale, *, kind, k, block) -> [M, N] in x's dtype
    check_inputs(x, q, scale, kind, k, block)               ValueError naming what is wrong

The reference dequantizes in XLA, then runs one dot (per-channel formats: the dot on the raw values, then one
multiply by the column scales, which is exact).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.masked_attention import precision_for
from kernels_pallas.quant_layout import STORAGE, check, dequantize, values


@functools.partial(jax.jit, static_argnames=("kind", "k", "block"))
def quant_matmul_reference(x, q, scale, *, kind: str, k: int, block):
    """XLA dequantize-then-dot. x [M, K]; q / scale 2-D in quant_layout's format (block a tuple)."""
    dt = x.dtype
    prec = precision_for(dt)
    bk, bn = block
    if bk >= k and bn == 1:  # one scale per output column: dot on the values, then scale the columns (exact)
        v = values(q, kind, block, jnp)[:k].astype(dt)
        y = jnp.dot(x, v, precision=prec, preferred_element_type=jnp.float32)
        return (y * scale[0].astype(jnp.float32)).astype(dt)
    w = dequantize(q, scale, kind, k, block, dt, jnp)
    return jnp.dot(x, w, precision=prec, preferred_element_type=jnp.float32).astype(dt)


def check_inputs(x, q, scale, kind: str, k: int, block) -> None:
    """ValueError naming what is wrong when x / q / scale do not form a quantized matmul of this layout."""
    if x.ndim != 2 or q.ndim != 2 or scale.ndim != 2:
        raise ValueError(f"quant_matmul takes x [M, K], q and scale 2-D, found x {list(x.shape)}, "
                         f"q {list(q.shape)}, scale {list(scale.shape)}")
    if x.shape[1] != k:
        raise ValueError(f"quant_matmul: x of shape [M, {k}], found {list(x.shape)}")
    err = check(kind, q.shape, scale.shape, k, q.shape[1], tuple(block))
    if err is not None:
        raise ValueError(f"quant_matmul ({kind}, block {tuple(block)}): {err}")
    if np.dtype(q.dtype) != STORAGE[kind]:
        raise ValueError(f"quant_matmul: {kind} values stored as {STORAGE[kind].name}, found {np.dtype(q.dtype).name}")
