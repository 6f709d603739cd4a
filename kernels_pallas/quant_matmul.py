"""Quantized matmul: x [M, K] @ a weight stored in quant_layout's format -> [M, N] in x's dtype.

    quant_matmul(x, q, scale, *, kind, k, block) -> [M, N]

The reference dequantizes in XLA, then runs one dot (per-channel formats: the dot on the raw values, then one
multiply by the column scales, which is exact). The kernel (to come beside it) reads the packed tiles and their
scales and dequantizes in registers. Backend choice is kernels_pallas/dispatch.py's rule.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from . import dispatch
from .masked_attention import precision_for
from .quant_layout import dequantize, values


def quant_matmul_reference(x, q, scale, *, kind: str, k: int, block):
    """XLA dequantize-then-dot. x [M, K]; q / scale 2-D in quant_layout's format."""
    dt = x.dtype
    prec = precision_for(dt)
    bk, bn = block
    if bk >= k and bn == 1:  # one scale per output column: dot on the values, then scale the columns (exact)
        v = values(q, kind, block, jnp)[:k].astype(dt)
        y = jnp.dot(x, v, precision=prec, preferred_element_type=jnp.float32)
        return (y * scale[0].astype(jnp.float32)).astype(dt)
    w = dequantize(q, scale, kind, k, block, dt, jnp)
    return jnp.dot(x, w, precision=prec, preferred_element_type=jnp.float32).astype(dt)


def quant_matmul(x, q, scale, *, kind: str, k: int, block, backend: str = "auto", interpret: bool = False):
    """The kernel in a program lowered for cuda, the reference elsewhere (dispatch.run)."""
    reference = functools.partial(quant_matmul_reference, kind=kind, k=k, block=tuple(block))
    return dispatch.run("quantized matmul", reference, reference, "kernel not built yet", "reference", x, q, scale)
