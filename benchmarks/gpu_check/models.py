"""The models items 6-8 run: TP_SMALL (the small config a CPU runs instead of the 27B slice) and `random_model`
(a qwen_mtp.Model with qwen_mtp.trunk.random_weights made on the device, int4 or unquantized)."""

import jax
import jax.numpy as jnp

# on CPU (virtual devices) a small config instead of the 27B slice; every kind of split still happens at model=2
TP_SMALL = {"model_type": "qwen3_5_text", "num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 32, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
            "intermediate_size": 256, "vocab_size": 1024, "full_attention_interval": 4, "rms_norm_eps": 1e-6,
            "mtp_num_hidden_layers": 1, "max_position_embeddings": 4096, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25}}


KEY_IMPL = "rbg"  # jax.random's key for random_model: XLA's RngBitGenerator (see random_model)


def random_model(cfg, name, seed=0, quant="int4", dtype="float32"):
    """A qwen_mtp.Model of `cfg` with the project's random weights (qwen_mtp.trunk.random_weights: every tensor
    random, fan-in scaled) made on the default device (random_weights(on_device=True): one jitted program per
    layer kind, the quantizer traced). quant "int4" (or "int8", "fp8"): every matrix quantized, lm_head and the
    MTP head's included (QuantPolicy(quant, 128, lm_head=True, mtp=True)); the rest (embedding, norms, conv
    taps, GDN b / a, A_log, dt_bias, router) in `dtype`. quant None: nothing quantized. The key is an "rbg" key
    (KEY_IMPL): its draws are XLA's RngBitGenerator op, which compiles in a fraction of threefry's time."""
    import qwen_mtp
    from qwen_mtp.trunk.quant import QuantPolicy
    from qwen_mtp.trunk.random_weights import random_weights

    policy = None if quant is None else QuantPolicy(quant, 128, lm_head=True, mtp=True)
    key = jax.random.key(seed, impl=KEY_IMPL)
    weights = random_weights(cfg, key, dtype, quant=policy, on_device=True)
    return qwen_mtp.Model(config=cfg, weights=weights, path=f"<random {name}>", dtype=str(jnp.dtype(dtype)),
                          quant=policy)
