"""Decode state pytrees: a KV cache per full-attention layer, conv window + recurrent state per GDN layer.

KV cache dtype (generate(..., kv_dtype=...)): the caches of the trunk's attention layers and of the MTP head
(native cache or Wind-MTP ring) may be stored in a dtype other than the compute dtype, float8_e4m3fn to halve
them against bf16. The rule, one for every reader and writer:
  - write: `to_cache(x, cache_dtype)`. For float8_e4m3fn the values are SATURATED to +-448 (the largest finite
    e4m3fn value) and then rounded to nearest: e4m3fn has no inf, and a plain cast of a value beyond the range
    gives NaN (and a NaN in a masked slot would still poison the attention's p @ V). No scale is kept (the
    equivalent of a per-tensor scale of 1, as vLLM's uncalibrated fp8 cache): K is RMS-normed per head
    (k_norm: per-head RMS ~ |1 + w|), and V is a plain projection whose entries sit inside e4m3fn's normal
    range [2^-6, 448] in practice: the shipped checkpoint's caches (trunk layers and MTP head, 200 positions)
    have amax 4.4 .. 7.1, RMS 0.96 .. 1.4 and 0.8 .. 1.5 % of entries below 2^-6. Normal values round with
    relative error <= 2^-4 (3 mantissa bits); entries below 2^-6 to a multiple of 2^-9 (absolute error
    <= 2^-10). A per-token scale would only help heads whose values fall far outside that range.
  - read: upcast the stored value to the compute dtype before any attention math (exact: every e4m3fn value
    is a bf16 / f32 value).
  - every row attention reads, a step's OWN new rows included, is its stored (rounded) value: the trunk writes
    first and attends over the cache (attention.attention_layer); the head's ring rounds its new rows with
    `to_cache` before the windowed attention (draft_ring.ring_attention_layer). So a verify forward of k+1 rows
    sees exactly what k+1 sequential plain steps see, and speculative decoding stays lossless against plain
    decoding with the same kv_dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kernels_pallas import attention_rows
from qwen_mtp.errors import ArgumentError
from qwen_mtp.trunk.config import ModelConfig

FP8_KV = attention_rows.FP8
to_cache = attention_rows.to_cache  # the rule's writer (module doc), shared with the kernel that writes rows
KV_DTYPE_NAMES = ("float8_e4m3fn", "bfloat16", "float32")  # fp8, or a compute dtype name (load(dtype=...))


@struct.dataclass
class KVCache:
    k: jax.Array  # [B, S, kv_heads, head_dim], RoPE applied; slot = logical position
    v: jax.Array  # [B, S, kv_heads, head_dim]


@struct.dataclass
class GDNState:
    conv: jax.Array  # [B, kernel - 1, conv_dim]: the last kernel-1 conv inputs, oldest first
    rec: jax.Array  # [B, num_v_heads, k_head_dim, v_head_dim], f32


@struct.dataclass
class GDNVerify:
    """What a speculative verify of T positions leaves per GDN layer (gdn mode "verify"): enough to rebuild the
    GDNState after ANY of its positions (rollback.select_states) without storing T states.
    The recurrent state after position n is rec_n = exp(G_n) rec + sum_{s<=n} exp(G_n - G_s) k_s delta_s^T."""
    conv: jax.Array  # [B, kernel - 1, conv_dim]: the conv state BEFORE the verify
    # [B, T, conv_dim]: the T new conv inputs, in conv's dtype; or (a quantized qkv on the decode kernel) their
    # float32 K partials [S, B, T, conv_dim], which the rollback's kernel sums as it loads them
    x: jax.Array
    rec: jax.Array  # [B, num_v_heads, k_head_dim, v_head_dim] f32: the recurrent state BEFORE the verify
    G: jax.Array  # [B, num_v_heads, T] f32: cumulative log decay, sum of g over positions 0..t
    k: jax.Array  # [B, num_v_heads, T, k_head_dim] f32: the (normed) keys
    delta: jax.Array  # [B, num_v_heads, T, v_head_dim] f32: the delta rule's update beta * (v - kv_mem) per position


def resolve_kv_dtype(kv_dtype, compute_dtype):
    """The KV caches' dtype for generate(kv_dtype=...): None is the compute dtype; otherwise one of
    KV_DTYPE_NAMES, as a name or a dtype. Anything else is an ArgumentError."""
    if kv_dtype is None:
        return jnp.dtype(compute_dtype)
    name = kv_dtype if isinstance(kv_dtype, str) else None
    if isinstance(kv_dtype, (np.dtype, type)):
        try:
            name = jnp.dtype(kv_dtype).name
        except TypeError:
            name = None
    if name not in KV_DTYPE_NAMES:
        raise ArgumentError("kv_dtype", f"None (the compute dtype) or one of {list(KV_DTYPE_NAMES)}", repr(kv_dtype))
    return jnp.dtype(name)


def kv_bytes(state) -> int:
    """Bytes of the KV caches in a state (a tuple of layer states, or one KVCache)."""
    leaves = [s for s in (state if isinstance(state, tuple) else (state,)) if isinstance(s, KVCache)]
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for c in leaves for x in (c.k, c.v))


def init_state(cfg: ModelConfig, batch: int, max_len: int, dtype, kv_dtype=None) -> tuple:
    """Zero state. dtype: the compute dtype (conv windows); kv_dtype: the attention caches' (None: dtype)."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    layers = []
    for kind in cfg.layer_types:
        if kind == "full_attention":
            shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
            layers.append(KVCache(jnp.zeros(shape, kv_dtype), jnp.zeros(shape, kv_dtype)))
        else:
            layers.append(GDNState(
                jnp.zeros((batch, cfg.conv_kernel - 1, cfg.conv_dim), dtype),
                jnp.zeros((batch, cfg.gdn_num_v_heads, cfg.gdn_k_head_dim, cfg.gdn_v_head_dim), jnp.float32)))
    return tuple(layers)
