"""Gated full attention (trunk full-attention layers and the MTP head share these functions).

q_proj emits, per head, `head_dim` query values followed by `head_dim` output-gate values (split per head,
not first half / second half of the row). q and k get (1+w) RMSNorms over head_dim, then partial RoPE. The
output is o_proj(attn * sigmoid(gate)).

The KV cache may be stored in another dtype than the compute dtype (fp8; state.py has the rule): new rows are
written with state.to_cache first, and the attention then reads every row, the call's own included, back from
the cache upcast to the compute dtype, so T rows at once see exactly what T single steps see.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.causal_attention import causal_attend

from . import spmd
from .config import ModelConfig
from .ops import linear, rmsnorm_1pw
from .rope import apply_rope, rope_cos_sin
from .state import KVCache, to_cache
from .weights import AttnWeights


def project_qkv(x, w: AttnWeights, cfg: ModelConfig, positions):
    """x [B, T, H], positions [B, T] -> q [B,T,nh,hd], k, v [B,T,nkv,hd] (RoPE applied), gate [B,T,nh*hd]."""
    B, T, _ = x.shape
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qg = linear(x, w.q_proj).reshape(B, T, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(B, T, nh * hd)
    q = rmsnorm_1pw(q, w.q_norm, cfg.rms_norm_eps)
    k = rmsnorm_1pw(linear(x, w.k_proj).reshape(B, T, nkv, hd), w.k_norm, cfg.rms_norm_eps)
    v = linear(x, w.v_proj).reshape(B, T, nkv, hd)
    cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate


def write_kv(cache: KVCache, k, v, pos) -> KVCache:
    """Write k, v [B, T, nkv, hd] into slots pos[b] .. pos[b]+T-1 of each row, rounded to the cache dtype."""
    upd = jax.vmap(lambda c, u, p: jax.lax.dynamic_update_slice(c, u, (p, 0, 0)))
    return KVCache(upd(cache.k, to_cache(k, cache.k.dtype), pos), upd(cache.v, to_cache(v, cache.v.dtype), pos))


def output(o, gate, w: AttnWeights):
    B, T = o.shape[:2]
    return linear(o.reshape(B, T, -1) * jax.nn.sigmoid(gate), w.o_proj)


def attention_layer(x, w: AttnWeights, cfg: ModelConfig, cache: KVCache, pos, rope_offset: int = 0):
    """Causal attention of T new tokens in slots pos[b] + t of the row's cache, each seeing slots <= its own.
    RoPE position = slot + rope_offset (0 for the trunk; 1 for the MTP head, whose row t sits at t + 1).
    The new rows are written first and read back from the cache (in its dtype, upcast to the compute dtype) by
    kernels_pallas/causal_attention.py, which walks the cache in blocks and stops after the furthest position."""
    B, T, _ = x.shape
    positions = pos[:, None] + jnp.arange(T, dtype=pos.dtype)[None]
    q, k, v, gate = project_qkv(x, w, cfg, positions + rope_offset)
    cache = write_kv(cache, k, v, pos)
    # blocked over the cache, up to the furthest position: the Pallas kernel in a program lowered for cuda, its
    # pure-JAX reference elsewhere; under a mesh, per (row, kv head) shard (spmd.py)
    o = spmd.causal(q, cache.k, cache.v, positions, causal_attend)
    return output(o, gate, w), cache
