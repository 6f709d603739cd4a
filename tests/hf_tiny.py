"""Tiny randomised Hugging Face checkpoints built with transformers (the oracle) for the tests.

Every tensor is randomised, norm weights, A_log, dt_bias and conv taps included: library default inits
(zeros / ones) would hide exactly the bugs the tests are for.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

COMMON = dict(vocab_size=97, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
              max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)


def _classes(kind):
    import transformers as tf
    return {"dense": (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM),
            "moe": (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM),
            "next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM)}[kind]


def randomize_(model, seed, embed_std=None):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("A_log"):  # decay rates A in [0.1, 1.0)
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 0.9 + 0.1))
            elif name.endswith("dt_bias"):
                p.copy_(r * 0.5)
            elif "norm" in name and p.ndim == 1:
                # (1+w) norms: offsets around 0; the gated GDN norm: plain w around 1
                p.copy_(1.0 + 0.3 * r if name.endswith("linear_attn.norm.weight") else 0.3 * r)
            elif name.endswith("embed_tokens.weight"):
                # a tied lm_head reads the same matrix: a smaller scale keeps the residual stream from
                # simply predicting the current token again
                p.copy_(r * (embed_std or (0.2 if model.config.tie_word_embeddings else 1.0)))
            else:
                fan_in = p.shape[-1] if p.ndim >= 2 else 1
                p.copy_(r / math.sqrt(fan_in))


def make_hf_model(kind="dense", seed=0, embed_std=None, **overrides):
    C, M = _classes(kind)
    kw = dict(COMMON)
    if kind == "dense":
        kw.update(intermediate_size=48, num_hidden_layers=4)
    elif kind == "moe":
        kw.update(moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4,
                  num_experts_per_tok=2, num_hidden_layers=4)
    else:
        kw.update(intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                  num_experts=4, num_experts_per_tok=2, num_hidden_layers=4, decoder_sparse_step=2)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = M(C(**kw)).float().eval()
    randomize_(model, seed, embed_std)
    return model


def save_hf(model, folder) -> Path:
    folder = Path(folder)
    model.save_pretrained(folder)
    return folder


def to_multimodal_layout(folder):
    """Rewrite a qwen3_5_text checkpoint into the released multimodal layout (model.language_model.*,
    config nested under text_config, a stray vision tensor that must be ignored)."""
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    out = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
           for k, v in tensors.items()}
    out["model.visual.patch_embed.proj.weight"] = np.ones((4, 3), np.float32)
    save_file(out, folder / "model.safetensors")
    top = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
           "tie_word_embeddings": cfg["tie_word_embeddings"], "text_config": dict(cfg, model_type="qwen3_5_text")}
    (folder / "config.json").write_text(json.dumps(top, indent=1))
    return folder


def to_fused_experts(folder):
    """Rewrite per-expert MoE tensors into the fused layout (experts.gate_up_proj [E, 2I, H], down_proj)."""
    folder = Path(folder)
    tensors = load_file(folder / "model.safetensors")
    out, groups = {}, {}
    for k, v in tensors.items():
        if ".mlp.experts." in k:
            pre, rest = k.split(".mlp.experts.")
            e, name = rest.split(".", 1)
            groups.setdefault(pre, {})[(int(e), name)] = v
        else:
            out[k] = v
    for pre, g in groups.items():
        E = 1 + max(e for e, _ in g)
        out[pre + ".mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([g[(e, "gate_proj.weight")], g[(e, "up_proj.weight")]]) for e in range(E)])
        out[pre + ".mlp.experts.down_proj"] = np.stack([g[(e, "down_proj.weight")] for e in range(E)])
    save_file(out, folder / "model.safetensors")
    return folder


def shard(folder, n=3):
    """Split model.safetensors into n shards with a model.safetensors.index.json."""
    folder = Path(folder)
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i in range(n):
        part = names[i::n]
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: tensors[k] for k in part}, folder / fname)
        weight_map.update({k: fname for k in part})
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def as_oracle(model):
    """The oracle runs transformers' own code in float64 on the exact f32 weights that were saved: its result
    is then the model's true value, not one more f32 rounding of it (transformers' f32 forward itself
    differs from its f64 forward by up to ~1e-4 relative on such random models)."""
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # the grouped-mm path has no float64
    return model.double()


@torch.no_grad()
def hf_logits(model, ids):
    return model(torch.tensor([list(ids)])).logits[0].double().numpy()


@torch.no_grad()
def hf_greedy(model, ids, n):
    """Greedy decode by the oracle, each step a full cache-free forward over prompt + tokens so far.

    Returns (tokens [n], logits [n, V]). Not transformers' cached `generate`: in transformers 5.24 on CPU
    (reference GDN kernels) its cached decode disagrees with its own full forward once the prompt reaches
    ~63 tokens (max_rel 0.04..0.5 on these tiny models), while the full forward is the definition.
    """
    seq = list(ids)
    logits = []
    for _ in range(n):
        step = model(torch.tensor([seq])).logits[0, -1].double().numpy()
        logits.append(step)
        seq.append(int(step.argmax()))
    return np.array(seq[len(ids):]), np.stack(logits)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    max_abs = float(np.max(np.abs(a - b)))
    return max_abs / max(float(np.max(np.abs(b))), 1e-30), max_abs


def assert_close(ours, ref, what=""):
    max_rel, max_abs = rel_err(ours, ref)
    assert max_rel < 1e-4 or max_abs < 1e-5, f"{what}: max_rel={max_rel:.3e} max_abs={max_abs:.3e}"
    return max_rel, max_abs


def add_mtp(folder, seed=0, passthrough=0.0):
    """Add a randomised MTP head (mtp.*: 15 tensors dense, 19 MoE with fused experts) to a saved checkpoint.

    passthrough > 0 adds passthrough * [0 | I] to mtp.fc, so the head's output leans on the trunk hidden: its
    drafts then agree with the trunk sometimes (not always, not never), which the lossless tests need.
    """
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    H = text["hidden_size"]
    nh, nkv, hd = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    rng = np.random.RandomState(seed)
    rnd = lambda *s: (rng.randn(*s) / math.sqrt(s[-1])).astype(np.float32)
    norm = lambda: (0.3 * rng.randn(H)).astype(np.float32)
    fc = rnd(H, 2 * H)
    fc[:, H:] += passthrough * np.eye(H, dtype=np.float32)
    t = {"mtp.fc.weight": fc, "mtp.pre_fc_norm_embedding.weight": norm(), "mtp.pre_fc_norm_hidden.weight": norm(),
         "mtp.norm.weight": norm()}
    p = "mtp.layers.0."
    t.update({p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
              p + "self_attn.q_proj.weight": rnd(2 * nh * hd, H), p + "self_attn.k_proj.weight": rnd(nkv * hd, H),
              p + "self_attn.v_proj.weight": rnd(nkv * hd, H), p + "self_attn.o_proj.weight": rnd(H, nh * hd),
              p + "self_attn.q_norm.weight": (0.3 * rng.randn(hd)).astype(np.float32),
              p + "self_attn.k_norm.weight": (0.3 * rng.randn(hd)).astype(np.float32)})
    if "num_experts" in text:
        E, I, S = text["num_experts"], text["moe_intermediate_size"], text["shared_expert_intermediate_size"]
        t.update({p + "mlp.gate.weight": rnd(E, H), p + "mlp.experts.gate_up_proj": rnd(E, 2 * I, H),
                  p + "mlp.experts.down_proj": rnd(E, H, I), p + "mlp.shared_expert.gate_proj.weight": rnd(S, H),
                  p + "mlp.shared_expert.up_proj.weight": rnd(S, H), p + "mlp.shared_expert.down_proj.weight": rnd(H, S),
                  p + "mlp.shared_expert_gate.weight": rnd(1, H)})
    else:
        I = text["intermediate_size"]
        t.update({p + "mlp.gate_proj.weight": rnd(I, H), p + "mlp.up_proj.weight": rnd(I, H),
                  p + "mlp.down_proj.weight": rnd(H, I)})
    if (folder / "model.safetensors").is_file():
        tensors = load_file(folder / "model.safetensors")
        tensors.update(t)
        save_file(tensors, folder / "model.safetensors")
    else:
        raise ValueError("add_mtp expects a single-file checkpoint")
    (folder / "config.json").write_text(json.dumps(dict(cfg, mtp_num_hidden_layers=1), indent=1))
    return t
