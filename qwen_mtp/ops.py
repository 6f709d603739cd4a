"""Elementary ops shared by every layer: the single matmul helper and the two RMSNorm flavours.

All weight matmuls go through `linear`: a plain matrix runs one einsum, a `quant.QuantArray` runs the quantized
matmul (kernels_pallas/quant_matmul.py: the Pallas kernel on a GPU, dequantize-then-dot elsewhere).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.masked_attention import precision_for  # the one precision rule

from .quant import QuantArray
from .quant import linear as quant_linear

# Compile options of a decode loop (plain or speculative) that multiplies at most FEW_ROWS rows (batch, or
# batch x (k + 1) in a speculative verify) by each weight matrix: on a CPU, XLA's Eigen splitting such a small
# GEMM over its thread pool costs more than it saves (2 cores, the shipped model at batch 1: the speculative round
# at k = 3 went from 2.28 to 1.82 plain steps, the plain step unchanged; benchmarks/bench_round.py). Larger
# batches and prefill's GEMMs keep the threads. A CPU option: GPUs ignore it.
DECODE_COMPILER_OPTIONS = {"xla_cpu_multi_thread_eigen": False}
FEW_ROWS = 32


def linear(x, w):
    """x [..., in] @ w [in, out] -> [..., out], in x's dtype. w: a plain array or a QuantArray."""
    if isinstance(w, QuantArray):
        return quant_linear(x, w)
    return jnp.einsum("...i,io->...o", x, w.astype(x.dtype), precision=precision_for(x.dtype))


def rmsnorm_1pw(x, w, eps):
    """Qwen3.5 RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), computed in f32, cast back to x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def gated_rmsnorm(x, z, w, eps):
    """GDN output norm: rmsnorm(x) * w * silu(z) with a plain weight w (not 1 + w)."""
    xf = x.astype(jnp.float32)
    y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    y = w.astype(x.dtype) * y
    return (y * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


def l2norm(x, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)
