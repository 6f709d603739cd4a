"""Dense masked grouped-query softmax attention: the pure-JAX reference that the trunk's attention layers and the
windowed kernel's reference both use, and the project's matmul precision rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def precision_for(dtype):
    """f32 runs at full precision (no TF32 / bf16 passes on GPU); low-precision dtypes use the default."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def attend(q, k, v, key_ok):
    """Grouped-query softmax attention.

    q [B, T, nh, hd]; k, v [B, S, nkv, hd]; key_ok [B, T, S] bool (which keys each query may see).
    Scores and softmax in f32; returns [B, T, nh, hd] in q's dtype.
    """
    B, T, nh, hd = q.shape
    nkv = k.shape[2]
    qg = q.reshape(B, T, nkv, nh // nkv, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, precision=precision_for(q.dtype),
                        preferred_element_type=jnp.float32) * (hd ** -0.5)
    scores = jnp.where(key_ok[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, precision=precision_for(q.dtype))
    return out.reshape(B, T, nh, hd)
