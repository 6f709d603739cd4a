"""Partial rotary position embedding (rotate-half convention) on the first `rotary_dim` dims of each head."""

from __future__ import annotations

import jax.numpy as jnp


def rope_cos_sin(positions, rotary_dim, theta):
    """positions [B, T] int -> cos, sin [B, T, rotary_dim] in f32."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x, cos, sin):
    """x [B, T, heads, head_dim]; rotates x[..., :rotary_dim] where rotary_dim = cos.shape[-1]."""
    rd = cos.shape[-1]
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)
