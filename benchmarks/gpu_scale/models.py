"""What a run is made of: the models and their configs (real or, --short, tiny), the device's peak bandwidth and
free memory, the bytes a model needs before it is built, the weights (random, made on the device) and the decode
state (allocated once, filled with random values)."""

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

# run name -> (real model, quantization method or None)
RUNS = {"27B-bf16": ("Qwen3.5-27B", None), "27B-int4": ("Qwen3.5-27B", "int4"),
        "35B-A3B-bf16": ("Qwen3.5-35B-A3B", None), "35B-A3B-int4": ("Qwen3.5-35B-A3B", "int4")}

# device name (a substring of jax's device_kind) -> peak HBM bandwidth, bytes/s (published figures); first match
PEAK_BANDWIDTH = (("B200", 8.0e12), ("GH200", 4.9e12), ("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
                  ("H800", 3.35e12), ("A100", 2.0e12), ("L40S", 0.864e12))

# --short: the same models' layer patterns at a tiny width (one 3 GDN : 1 attention period, a reduced vocabulary)
_TINY = {"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
             "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
             "linear_conv_kernel_dim": 4, "vocab_size": 512, "full_attention_interval": 4, "rms_norm_eps": 1e-6,
             "mtp_num_hidden_layers": 1, "max_position_embeddings": 4096, "tie_word_embeddings": False, "eos_token_id": 1,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}}
SHORT_CONFIGS = {"Qwen3.5-27B": dict(_TINY, model_type="qwen3_5_text", intermediate_size=128),
                 "Qwen3.5-35B-A3B": dict(_TINY, model_type="qwen3_5_moe_text", num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32, shared_expert_intermediate_size=32)}
KEY_IMPL = "rbg"  # jax.random keys of XLA's RngBitGenerator: they compile in a fraction of threefry's time


def peak_bandwidth():
    """(device kind, peak bytes/s or None when the device is not in PEAK_BANDWIDTH)."""
    kind = jax.devices()[0].device_kind
    return kind, next((bw for name, bw in PEAK_BANDWIDTH if name in kind), None)


def config(real: str, short: bool, slots: int):
    """The ModelConfig of `real` at full depth (short: SHORT_CONFIGS), positions raised to hold `slots`."""
    from qwen_mtp.tools import real_shapes
    from qwen_mtp.trunk.config import parse_config

    cfg = parse_config(SHORT_CONFIGS[real], f"<{real}-shaped tiny>") if short else real_shapes.config(real)
    return dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, slots))


def free_bytes(limit=None):
    """Bytes the device can still allocate: `limit` (--memory, to size a run for a smaller device) when given,
    else the device's memory_stats (a GPU), else the host's available memory (a CPU)."""
    if limit is not None:
        return int(limit)
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def policy(quant):
    from qwen_mtp.trunk.quant import QuantPolicy

    return None if quant is None else QuantPolicy(quant, 128, lm_head=True, mtp=True)


def nbytes(tree) -> int:
    """Bytes of a pytree of arrays or ShapeDtypeStructs (QuantArrays counted by their q and scale)."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def abstract_weights(cfg, dtype, quant):
    """The Weights random_weights(cfg, key, dtype, quant=policy(quant)) makes, as ShapeDtypeStructs."""
    from qwen_mtp.trunk import quant as quant_mod
    from qwen_mtp.trunk.weights import weight_shapes

    shapes = weight_shapes(cfg, dtype)
    return shapes if quant is None else quant_mod.abstract(shapes, policy(quant), tied=cfg.tie_word_embeddings)


def state_shapes(cfg, batch, slots, dtype):
    """The trunk's decode state and the native MTP head's cache at `slots` positions, as ShapeDtypeStructs."""
    from qwen_mtp.head.mtp import init_mtp_cache
    from qwen_mtp.trunk.state import init_state

    return (jax.eval_shape(lambda: init_state(cfg, batch, slots, dtype)),
            jax.eval_shape(lambda: init_mtp_cache(cfg, batch, slots, dtype)))


def need_bytes(cfg, dtype, quant, batch, slots, draft_vocab):
    """(bytes a run needs at its peak, what they are): the weights, then either what making them holds at once
    or the trunk state and native head cache at `slots`, the draft vocabulary's lm_head copy and a working GiB,
    whichever is more."""
    w = abstract_weights(cfg, dtype, quant)
    state, head = state_shapes(cfg, batch, slots, dtype)
    lm = w.lm_head if w.lm_head is not None else w.embed
    dv = nbytes(lm) * draft_vocab // cfg.vocab_size
    # while the weights are made: the largest tensor's float32 draw and (quantized) its blocks and quotients;
    # afterwards, in its place: the caches, the draft vocabulary and a working GiB (logits, verify intermediates)
    biggest = 4 * max(math.prod(x.shape) for x in jax.tree.leaves(weight_shapes_of(cfg, dtype)))
    making = (3 if quant else 1.5) * biggest
    running = {"state": nbytes(state), "head cache": nbytes(head), "draft vocab": dv, "working": 1 << 30}
    parts = {"weights": nbytes(w), **running}
    return parts["weights"] + max(making, sum(running.values())), parts


def weight_shapes_of(cfg, dtype):
    from qwen_mtp.trunk.weights import weight_shapes

    return weight_shapes(cfg, dtype)


def build_model(cfg, dtype, quant, name, seed=0):
    """A qwen_mtp.Model with random_weights(on_device=True) (one program per layer kind, the quantizer traced)."""
    import qwen_mtp
    from qwen_mtp.trunk.random_weights import random_weights

    pol = policy(quant)
    weights = random_weights(cfg, jax.random.key(seed, impl=KEY_IMPL), dtype, quant=pol, on_device=True)
    return qwen_mtp.Model(config=cfg, weights=weights, path=f"<random {name}>", dtype=str(jnp.dtype(dtype)), quant=pol)


def random_like(shapes, seed):
    """Arrays of `shapes` (a pytree of ShapeDtypeStructs) filled on the device with 0.5 N(0, 1) values (a KV cache
    or a GDN state that holds something), in one program."""
    leaves, tree = jax.tree.flatten(shapes)

    @jax.jit
    def fill(key):
        keys = jax.random.split(key, len(leaves))
        return [(0.5 * jax.random.normal(k, s.shape, jnp.float32)).astype(s.dtype) for k, s in zip(keys, leaves)]

    return jax.tree.unflatten(tree, fill(jax.random.key(seed, impl=KEY_IMPL)))


def draft_vocab_model(model, size):
    """`model` drafting over `size` ids (ids 0..size-1: random weights have no frequent ids)."""
    from qwen_mtp.head.draft_vocab import build_draft_vocab

    return build_draft_vocab(model, np.arange(model.config.vocab_size)[::-1], size)
