"""The MTP head: one extra full-attention decoder layer that drafts the token after next.

    e   = rmsnorm_1pw(embed(token), pre_fc_norm_embedding)
    h   = rmsnorm_1pw(hidden,       pre_fc_norm_hidden)      # trunk hidden AFTER the final norm
    x   = fc(concat(e, h))                                   # embedding FIRST
    x   = x + attn(rmsnorm_1pw(x, input_layernorm))          # the trunk's own attention function
    x   = x + mlp(rmsnorm_1pw(x, post_attention_layernorm))  # the trunk's own MLP / MoE function
    out = rmsnorm_1pw(x, mtp.norm)                           # -> the trunk's lm_head

The head shares embed_tokens and lm_head with the trunk and has its own one-layer KV cache. Its row t is fed
(token t+1, trunk hidden t) and sits at RoPE position t+1, in cache slot t. Its norms follow the trunk's rule
(forward.py): at one row the layer's input norm and the final norm are one kernel on cuda (ops.rmsnorm_written),
the post-attention norm too before quantized products (forward.post_norm), and there the residual adds with the
norms after them are one kernel each (ops.add_norm_written: the attention's out-projection hands its K partials,
the MLP block its output unadded, forward.hands_on); the pre-fc norms stay XLA's (a kernel of their own cost a
draft step two more, deviceless H200 compile).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen_mtp.errors import MissingMTPHeadError
from qwen_mtp.head.ring import init_ring, ring_attention_layer
from qwen_mtp.trunk.attention import attention_layer
from qwen_mtp.trunk.config import ModelConfig
from qwen_mtp.trunk.mlp import feed_forward
from qwen_mtp.trunk.forward import add_norm_rows, added, hands_on, input_norm, post_mixer, post_norm
from qwen_mtp.trunk.ops import embed_rows, linear, rmsnorm_1pw, rmsnorm_written
from qwen_mtp.trunk.state import KVCache
from qwen_mtp.trunk.weights import Weights

TRACE_STAGES = ("e", "h", "fc_in", "fc", "ah", "attn", "res1", "mh", "mlp", "res2", "out")
ROPE_OFFSET = 1


def require_mtp(weights: Weights):
    if weights.mtp is None:
        raise MissingMTPHeadError(
            "the checkpoint has no mtp.* tensors: the MTP head (mtp_logits, speculative generate) needs "
            "mtp.fc.weight, mtp.pre_fc_norm_*, mtp.norm.weight and mtp.layers.0.*")


def init_mtp_cache(cfg: ModelConfig, batch: int, max_len: int, dtype, *, window: int | None = None,
                   sinks: int = 0, k: int = 0) -> KVCache:
    """Native: max_len slots (slot = row). Windowed: the ring of sinks + window + k slots, any context length.
    dtype: the cache's own dtype (the compute dtype, or the kv_dtype of generate, e.g. float8_e4m3fn)."""
    if window is not None:
        return init_ring(batch, sinks, window, k, cfg.num_kv_heads, cfg.head_dim, dtype)
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def mtp_forward(weights: Weights, cfg: ModelConfig, tokens, hidden, cache: KVCache, slot, *, trace: bool = False,
                window: int | None = None, sinks: int = 0):
    """tokens [B, T] (the token after each hidden's position), hidden [B, T, H] (post-norm trunk hidden, or
    the head's own previous out when drafting), head rows slot[b] .. slot[b]+T-1.
    window None: native attention, cache slot = row. window W: Wind-MTP, the rows see sinks + the last W rows
    and `cache` is the ring of draft_ring.py.
    Returns (out [B, T, H] post mtp.norm, new cache, trace dict or None). `trace` is static: off, nothing
    extra is computed or kept."""
    w = weights.mtp
    eps = cfg.rms_norm_eps
    with jax.named_scope("mtp_embed"):  # the stages in named scopes: profiling.py groups a trace by them
        e = rmsnorm_1pw(embed_rows(weights.embed, tokens), w.pre_fc_norm_embedding, eps)
        h = rmsnorm_1pw(hidden.astype(e.dtype), w.pre_fc_norm_hidden, eps)
    with jax.named_scope("mtp_fc"):
        fc_in = jnp.concatenate([e, h], axis=-1)
        x = linear(fc_in, w.fc)
    # at decode and verify rows the residual adds and the norms after them are one kernel each, as in the trunk
    # (forward.add_norm_rows, forward.hands_on), where no trace asks for the stages between them
    fused = not trace and post_norm(w.layer.mlp) is rmsnorm_written and add_norm_rows(x)
    with jax.named_scope("mtp_attention"):
        ah = rmsnorm_written(x, w.layer.input_norm, eps)
        if window is None:
            attn, cache = attention_layer(ah, w.layer.mixer, cfg, cache, slot, rope_offset=ROPE_OFFSET,
                                          out_parts=fused)
        else:
            attn, cache = ring_attention_layer(ah, w.layer.mixer, cfg, cache, slot, window, sinks, ROPE_OFFSET,
                                               out_parts=fused)
    with jax.named_scope("mtp_mlp"):  # (the head's MoE router reads the row as it is: no two rows)
        res1, mh, _ = post_mixer(x, attn, w.layer.mlp, w.layer.post_norm, eps, fused, pad=False)
        mlp_out = feed_forward(mh, w.layer.mlp, cfg, hand_on=not trace and hands_on(res1, w.layer.mlp))
    with jax.named_scope("mtp_norm"):
        res2, pending = added(res1, mlp_out)
        res2, out = input_norm(res2, pending, w.norm, eps, False)
    stages = None
    if trace:
        stages = dict(e=e, h=h, fc_in=fc_in, fc=x, ah=ah, attn=attn, res1=res1, mh=mh, mlp=mlp_out, res2=res2,
                      out=out)
    return out, cache, stages
