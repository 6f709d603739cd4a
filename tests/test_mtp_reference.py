"""The MTP head, stage by stage, against a reference built from transformers' own operator classes.

transformers ignores mtp.* (no official MTP implementation exists), so the reference loads the mtp.* weights
into transformers' Qwen3_5RMSNorm, Qwen3_5Attention, Qwen3_5MLP / Qwen3_5MoeSparseMoeBlock and rotary
embedding modules. HAND-WRITTEN here, and only here: the wiring between those modules (the two pre-fc norms,
the concat, fc, the two residuals, the final norm, RoPE positions t+1 and the causal mask). Such a reference
catches a one-sided slip, not a misreading shared by both sides; the mutation tests below show that each of
the four known silent pitfalls, introduced on purpose, makes the comparison fail.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_tiny import rel_err
from safetensors.numpy import load_file

import qwen_mtp
from qwen_mtp.head.mtp import TRACE_STAGES, init_mtp_cache, mtp_forward

T = 12  # rows compared; row 0 sees one key (attention returns v whatever q, k are): rows >= 1 carry the proof


def _reference(hf, folder, moe):
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        Qwen3_5Attention,
        Qwen3_5MLP,
        Qwen3_5RMSNorm,
        Qwen3_5TextRotaryEmbedding,
    )
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    cfg = hf.config
    t = {k: torch.from_numpy(v).double() for k, v in load_file(folder / "model.safetensors").items()
         if k.startswith("mtp.")}
    full = cfg.layer_types.index("full_attention")

    def norm(name):
        m = Qwen3_5RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps).double()
        m.weight.data.copy_(t[name])
        return m

    attn = Qwen3_5Attention(cfg, full).double().eval()
    for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
        getattr(attn, n).weight.data.copy_(t[f"mtp.layers.0.self_attn.{n}.weight"])
    if moe:
        mlp = Qwen3_5MoeSparseMoeBlock(cfg).double().eval()
        mlp.experts.gate_up_proj.data.copy_(t["mtp.layers.0.mlp.experts.gate_up_proj"])
        mlp.experts.down_proj.data.copy_(t["mtp.layers.0.mlp.experts.down_proj"])
        mlp.gate.weight.data.copy_(t["mtp.layers.0.mlp.gate.weight"])
        for n in ("gate_proj", "up_proj", "down_proj"):
            getattr(mlp.shared_expert, n).weight.data.copy_(t[f"mtp.layers.0.mlp.shared_expert.{n}.weight"])
        mlp.shared_expert_gate.weight.data.copy_(t["mtp.layers.0.mlp.shared_expert_gate.weight"])
    else:
        mlp = Qwen3_5MLP(cfg, cfg.intermediate_size).double()
        for n in ("gate_proj", "up_proj", "down_proj"):
            getattr(mlp, n).weight.data.copy_(t[f"mtp.layers.0.mlp.{n}.weight"])
    return dict(t=t, attn=attn, mlp=mlp, rotary=Qwen3_5TextRotaryEmbedding(cfg),
                n_e=norm("mtp.pre_fc_norm_embedding.weight"), n_h=norm("mtp.pre_fc_norm_hidden.weight"),
                n_in=norm("mtp.layers.0.input_layernorm.weight"),
                n_post=norm("mtp.layers.0.post_attention_layernorm.weight"), n_out=norm("mtp.norm.weight"))


def _split_halves_as_per_head(w, heads, hd):
    """Rows of q_proj rearranged so that transformers' per-head split reads [all queries | all gates]."""
    q, g = w[: heads * hd].reshape(heads, hd, -1), w[heads * hd:].reshape(heads, hd, -1)
    return torch.cat([q, g], dim=1).reshape(2 * heads * hd, -1)


@torch.no_grad()
def _reference_stages(hf, ref, ids, pitfall=None):
    """The hand-written wiring. pitfall: None | concat_order | pre_norm_hidden | w_not_1pw | qgate_halves."""
    cfg = hf.config
    x_ids = torch.tensor([list(ids)])
    out = hf.model(x_ids, output_hidden_states=True)
    hidden = out.last_hidden_state[0, :T]  # post final norm
    if pitfall == "pre_norm_hidden":
        captured = {}
        hook = hf.model.norm.register_forward_hook(lambda m, a, o: captured.setdefault("x", a[0]))
        hf.model(x_ids)
        hook.remove()
        hidden = captured["x"][0, :T]
    emb = hf.model.embed_tokens(torch.tensor(list(ids[1:T + 1])))

    norms = {k: ref[k] for k in ("n_e", "n_h", "n_in", "n_post", "n_out")}
    if pitfall == "w_not_1pw":  # x * w instead of x * (1 + w) in all five norms of the head
        for m in norms.values():
            m.weight.data.sub_(1.0)
    try:
        s = {"e": norms["n_e"](emb), "h": norms["n_h"](hidden)}
        s["fc_in"] = torch.cat([s["h"], s["e"]] if pitfall == "concat_order" else [s["e"], s["h"]], dim=-1)
        s["fc"] = s["fc_in"] @ ref["t"]["mtp.fc.weight"].T
        s["ah"] = norms["n_in"](s["fc"])
        pos = torch.arange(1, T + 1)[None]  # row t at RoPE position t + 1
        cos, sin = ref["rotary"](s["ah"][None], pos)
        mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        attn = ref["attn"]
        if pitfall == "qgate_halves":
            saved = attn.q_proj.weight.data.clone()
            attn.q_proj.weight.data.copy_(_split_halves_as_per_head(saved, cfg.num_attention_heads, cfg.head_dim))
        s["attn"] = attn(s["ah"][None], position_embeddings=(cos.double(), sin.double()), attention_mask=mask)[0][0]
        if pitfall == "qgate_halves":
            attn.q_proj.weight.data.copy_(saved)
        s["res1"] = s["fc"] + s["attn"]
        s["mh"] = norms["n_post"](s["res1"])
        s["mlp"] = ref["mlp"](s["mh"][None])[0]
        s["res2"] = s["res1"] + s["mlp"]
        s["out"] = norms["n_out"](s["res2"])
    finally:
        if pitfall == "w_not_1pw":
            for m in norms.values():
                m.weight.data.add_(1.0)
    return {k: v.numpy() for k, v in s.items()}, hidden.numpy()


def _our_stages(model, ids, hidden):
    cache = init_mtp_cache(model.config, 1, T, jnp.float32)
    run = jax.jit(lambda w, tok, h, c: mtp_forward(w, model.config, tok, h, c, jnp.zeros((1,), jnp.int32),
                                                    trace=True)[2], )
    st = run(model.weights, jnp.asarray(np.asarray(ids[1:T + 1])[None], jnp.int32),
             jnp.asarray(hidden[None], jnp.float32), cache)
    return {k: np.asarray(v[0]) for k, v in st.items()}


@pytest.fixture(scope="module", params=["dense_mtp", "moe_mtp"])
def setup(request, ckpt):
    hf, folder = ckpt(request.param)
    moe = request.param.startswith("moe")
    model = qwen_mtp.load(folder)
    n_tensors = len([k for k in load_file(folder / "model.safetensors") if k.startswith("mtp.")])
    assert n_tensors == (19 if moe else 15)
    ids = np.random.RandomState(11).randint(0, 97, size=T + 1)
    return request.param, hf, model, _reference(hf, folder, moe), ids


def test_every_stage_matches_reference(setup, report):
    name, hf, model, ref, ids = setup
    ref_s, hidden = _reference_stages(hf, ref, ids)
    ours = _our_stages(model, ids, hidden)
    assert set(ours) == set(TRACE_STAGES) == set(ref_s)
    worst = 0.0
    for stage in TRACE_STAGES:
        a, b = ours[stage], ref_s[stage]
        assert a.shape[0] == b.shape[0] == T >= 5
        # every compared row was written (a probe reading zeros would compare nothing)
        assert (np.abs(b).max(axis=-1) > 1e-3).all() and (np.abs(a).max(axis=-1) > 1e-3).all(), stage
        # rows t >= 1 are compared on their own (row 0 attends to a single key)
        for rows in (slice(0, T), slice(1, T)):
            r, m = rel_err(a[rows], b[rows])
            assert r < 1e-4 or m < 1e-5, f"{name} stage {stage} rows {rows}: max_rel={r:.2e} max_abs={m:.2e}"
            worst = max(worst, r)
    report(f"MTP head {name}: {len(TRACE_STAGES)} stages x {T} rows vs transformers-operator reference, "
           f"worst max_rel={worst:.2e}")


@pytest.mark.parametrize("pitfall", ["concat_order", "pre_norm_hidden", "w_not_1pw", "qgate_halves"])
def test_each_pitfall_makes_the_comparison_fail(setup, pitfall, report):
    name, hf, model, ref, ids = setup
    bad, hidden_bad = _reference_stages(hf, ref, ids, pitfall)
    _, hidden = _reference_stages(hf, ref, ids)
    ours = _our_stages(model, ids, hidden)
    r, _ = rel_err(ours["out"][1:], bad["out"][1:])
    assert r > 1e-2, f"pitfall {pitfall} went unnoticed: max_rel={r:.2e}"
    report(f"MTP head {name}: pitfall {pitfall:15s} -> out max_rel={r:.2e} (comparison fails, as it must)")


def test_mtp_logits_teacher_forced_matches_reference(setup):
    name, hf, model, ref, ids = setup
    ref_s, _ = _reference_stages(hf, ref, ids)
    ours = qwen_mtp.mtp_logits(model, ids[:T + 1])
    assert ours.shape == (T, 97)
    w = hf.lm_head.weight.detach().numpy()
    r, m = rel_err(ours, ref_s["out"] @ w.T)
    assert r < 1e-4 or m < 1e-5, f"{name}: mtp_logits max_rel={r:.2e}"
