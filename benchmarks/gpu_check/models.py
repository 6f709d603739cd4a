"""The models items 6-8 run: TP_SMALL (the small config a CPU runs instead of the 27B slice) and `random_model`
(a qwen_mtp.Model with random weights made on the device in one jit, int4 or unquantized)."""

import jax
import jax.numpy as jnp
import numpy as np

# on CPU (virtual devices) a small config instead of the 27B slice; every kind of split still happens at model=2
TP_SMALL = {"model_type": "qwen3_5_text", "num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 32, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
            "intermediate_size": 256, "vocab_size": 1024, "full_attention_interval": 4, "rms_norm_eps": 1e-6,
            "mtp_num_hidden_layers": 1, "max_position_embeddings": 4096, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25}}


def _hash_bits(shape, seed):
    """Pseudo-random uint32 per element, a counter hash (lowbias32) of the element index and `seed`: made on the
    device like jax.random, but elementwise integer ops compile in milliseconds where each jax.random call costs
    a second or more of XLA compile on a CPU."""
    size = int(np.prod(shape))
    h = jax.lax.iota(jnp.uint32, size) * jnp.uint32(0x9E3779B1) + jnp.uint32((seed * 0x85EBCA77 + 1) % 2**32)
    for shift, mul in ((16, 0x7FEB352D), (15, 0x846CA68B), (16, None)):
        h = h ^ (h >> shift)
        if mul is not None:
            h = h * jnp.uint32(mul)
    return h.reshape(shape)


def random_model(cfg, name, seed=0, quant="int4", dtype="float32"):
    """A qwen_mtp.Model of `cfg` with random weights made on the default device in one jit. quant "int4": every
    matrix int4 (groups of 128, lm_head and the MTP head's included) as random packed values with scales that
    keep activations O(1), the rest (embedding, norms, conv taps, GDN b / a, A_log, dt_bias) in `dtype`. quant
    None: every array in `dtype`, nothing quantized. Unquantized values are uniform with std 0.02 (embedding),
    1 / sqrt(fan-in) (other matrices) or 0.1 (vectors)."""
    import qwen_mtp
    from qwen_mtp.trunk import quant as quant_mod
    from qwen_mtp.trunk.weights import weight_shapes

    policy = None if quant is None else quant_mod.QuantPolicy(quant, 128, lm_head=True, mtp=True)
    shapes = weight_shapes(cfg, dtype)
    if policy is not None:
        shapes = quant_mod.abstract(shapes, policy, tied=cfg.tie_word_embeddings)
    is_q = lambda x: isinstance(x, quant_mod.QuantArray)
    leaves, tree = jax.tree.flatten(shapes, is_leaf=is_q)
    uniform = lambda shape, i: (_hash_bits(shape, i) >> 8).astype(jnp.float32) * 2.0 ** -24  # [0, 1)

    @jax.jit
    def make():
        out = []
        for i, s in enumerate(leaves, start=1000 * seed):
            if is_q(s):  # uniform bytes: int4 values of std ~4.6 in both nibbles
                q = (_hash_bits(s.q.shape, 2 * i) >> 24).astype(jnp.uint8)
                scale = (0.5 + uniform(s.scale.shape, 2 * i + 1)) / (4.6 * np.sqrt(s.shape[-2]))
                out.append(s.replace(q=q, scale=scale))
                continue
            std = 0.1 if len(s.shape) < 2 else 0.02 if s.shape[0] == cfg.vocab_size else 1 / np.sqrt(s.shape[-2])
            out.append((std * np.sqrt(12) * (uniform(s.shape, 2 * i) - 0.5)).astype(s.dtype))
        return out

    weights = jax.tree.unflatten(tree, make())
    return qwen_mtp.Model(config=cfg, weights=weights, path=f"<random {name}>", dtype=str(jnp.dtype(dtype)),
                          quant=policy)
