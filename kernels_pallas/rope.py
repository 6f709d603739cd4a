"""Partial rotary position embedding (rotate-half convention) on the first `rotary_dim` dims of each head. The
trunk's (attention.py) and the query kernel's reference (attention_q.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def inverse_frequencies(rotary_dim, theta):
    """[rotary_dim / 2] f32: the rotation speed of each pair of dims, theta^(-2i / rotary_dim) computed in float64 on
    the host and rounded once, a constant of the program. The query kernel takes this very array: computed by XLA,
    the same expression came out a unit of f32 rounding apart where it was folded and where it ran, and at
    position p a unit of inv_freq moves the angle by p units (1e-5 at p = 1000)."""
    return jnp.asarray(1.0 / float(theta) ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim),
                       jnp.float32)


def rope_cos_sin(positions, rotary_dim, theta):
    """positions [B, T] int -> cos, sin [B, T, rotary_dim] in f32."""
    freqs = positions.astype(jnp.float32)[..., None] * inverse_frequencies(rotary_dim, theta)
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
