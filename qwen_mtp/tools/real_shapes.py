"""Real Qwen3.5 model shapes (SPEC.md section 5), as config.json dicts, for export tests, benchmarks and
sharding rules at the sizes users run.

    config("Qwen3.5-27B", layers=4) -> ModelConfig with the real layer dimensions and 4 layers

`layers` keeps the real per-layer dimensions and cuts the depth (one full period of 3 GDN : 1 attention is 4
layers): lowering, kernel choice and per-layer cost do not depend on depth. Attention and MLP dimensions of
27B, 35B-A3B and 397B-A17B are SPEC.md's table; GDN head counts marked "see config" there, and the whole of
122B-A10B (not in the table), are our reading of the published config.json files.
"""

from __future__ import annotations

from qwen_mtp.trunk.config import ModelConfig, parse_config

_COMMON = dict(vocab_size=248320, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
               linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-6,
               max_position_embeddings=262144, mtp_num_hidden_layers=1, eos_token_id=248044,
               rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25))

REAL_CONFIGS = {
    "Qwen3.5-0.8B": dict(model_type="qwen3_5_text", num_hidden_layers=24, hidden_size=1024,
                         num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=16,
                         linear_num_value_heads=16, intermediate_size=3584, tie_word_embeddings=True),
    "Qwen3.5-27B": dict(model_type="qwen3_5_text", num_hidden_layers=64, hidden_size=5120,
                        num_attention_heads=24, num_key_value_heads=4, linear_num_key_heads=16,
                        linear_num_value_heads=48, intermediate_size=17408, tie_word_embeddings=False),
    "Qwen3.5-35B-A3B": dict(model_type="qwen3_5_moe_text", num_hidden_layers=40, hidden_size=2048,
                            num_attention_heads=16, num_key_value_heads=2, linear_num_key_heads=16,
                            linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
                            moe_intermediate_size=512, shared_expert_intermediate_size=512,
                            tie_word_embeddings=False),
    "Qwen3.5-122B-A10B": dict(model_type="qwen3_5_moe_text", num_hidden_layers=48, hidden_size=3072,
                              num_attention_heads=32, num_key_value_heads=2, linear_num_key_heads=16,
                              linear_num_value_heads=64, num_experts=256, num_experts_per_tok=8,
                              moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
                              tie_word_embeddings=False),
    "Qwen3.5-397B-A17B": dict(model_type="qwen3_5_moe_text", num_hidden_layers=60, hidden_size=4096,
                              num_attention_heads=32, num_key_value_heads=2, linear_num_key_heads=16,
                              linear_num_value_heads=64, num_experts=512, num_experts_per_tok=10,
                              moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
                              tie_word_embeddings=False),
}


def config(name: str, layers: int | None = None) -> ModelConfig:
    if name not in REAL_CONFIGS:
        raise KeyError(f"real_shapes.config: expected one of {sorted(REAL_CONFIGS)}, found {name!r}")
    raw = {**_COMMON, **REAL_CONFIGS[name]}
    if layers is not None:
        raw["num_hidden_layers"] = int(layers)
    return parse_config(raw, f"<real shapes of {name}>")
