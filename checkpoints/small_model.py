"""The shipped model's architecture (CONFIG, a Qwen3.5 text config.json: 8 layers in the 3:1 GDN / full attention
pattern, tied embeddings, a one-layer MTP head) and its training init (qwen_mtp/trunk/random_weights.py's
init="training": normals of std initializer_range, residual outputs scaled down, norms at their defaults)."""

from __future__ import annotations

from qwen_mtp.trunk.random_weights import random_weights
from qwen_mtp.trunk.weights import Weights

VOCAB = 4096

CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "intermediate_size": 640,
    "num_hidden_layers": 8,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mtp_num_hidden_layers": 1,
    "bos_token_id": None,
    "eos_token_id": 0,
    "pad_token_id": 0,
    "dtype": "bfloat16",
    "initializer_range": 0.02,
}


def init_weights(cfg, key) -> Weights:
    """The training init of `cfg` from `key` (f32): random_weights' init="training" rule with the config's
    initializer_range; the same weights, seed for seed, as the shipped model's first run started from."""
    return random_weights(cfg, key, "float32", init="training", std=CONFIG["initializer_range"])
