"""The JAX trunk against transformers (the oracle we did not write): prefill logits and greedy decode."""

import numpy as np
import pytest
from conftest import VARIANTS
from hf_tiny import assert_close, hf_greedy, hf_logits, rel_err

import qwen_mtp


def _ids(n, seed, vocab=97):
    return np.random.RandomState(seed).randint(0, vocab, size=n)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_and_greedy_decode_match_transformers(ckpt, name, report):
    hf, folder = ckpt(name)
    model = qwen_mtp.load(folder)
    assert model.config.model_type == hf.config.model_type or name == "dense_multimodal"

    # 150 tokens: longer than the GDN chunk (64), prefilled in three pieces of 64
    ids = _ids(150, 0)
    ref = hf_logits(hf, ids)
    assert ref.std() > 0.1 and len(set(ref.argmax(-1))) > 10, "degenerate oracle: the test could not fail"
    ours = qwen_mtp.prefill_logits(model, ids, prefill_chunk=64)
    assert ours.shape == ref.shape
    pre = assert_close(ours, ref, f"{name} prefill logits")

    # 16 greedy steps after a 70-token prompt (two GDN chunks), with the oracle's own cache
    prompt = ids[:70]
    toks, ref_lg = hf_greedy(hf, prompt, 16)
    assert len(set(toks.tolist())) > 3, "degenerate greedy continuation: the test could not fail"
    res = qwen_mtp.generate(model, prompt, 16, eos_token_id=[], return_logits=True)
    assert res.tokens.shape == (1, 16) and res.lengths.tolist() == [16]
    np.testing.assert_array_equal(res.tokens[0], toks)
    dec = assert_close(res.logits[0], ref_lg, f"{name} decode logits")
    report(f"{name:20s} prefill T=150 max_rel={pre[0]:.2e} max_abs={pre[1]:.2e} | "
           f"16 greedy steps equal, logits max_rel={dec[0]:.2e} max_abs={dec[1]:.2e}")


def test_prefill_in_pieces_equals_one_pass(ckpt):
    _, folder = ckpt("dense")
    model = qwen_mtp.load(folder)
    ids = _ids(150, 1)
    one = qwen_mtp.prefill_logits(model, ids, prefill_chunk=256)
    pieces = qwen_mtp.prefill_logits(model, ids, prefill_chunk=64)
    odd = qwen_mtp.prefill_logits(model, ids, prefill_chunk=48)  # pieces not aligned to the GDN chunk
    assert_close(pieces, one, "pieces of 64 vs one pass")
    assert_close(odd, one, "pieces of 48 vs one pass")


def test_batch_with_unequal_prompt_lengths(ckpt, report):
    hf, folder = ckpt("moe_per_expert")
    model = qwen_mtp.load(folder)
    prompts = [_ids(9, 2), _ids(90, 3), _ids(33, 4)]
    res = qwen_mtp.generate(model, prompts, 16, eos_token_id=[], return_logits=True)
    assert res.tokens.shape == (3, 16)
    worst = 0.0
    for b, p in enumerate(prompts):
        toks, ref_lg = hf_greedy(hf, p, 16)
        np.testing.assert_array_equal(res.tokens[b], toks, err_msg=f"row {b}")
        worst = max(worst, assert_close(res.logits[b], ref_lg, f"row {b}")[0])
    report(f"batch of 3 (prompts 9/90/33, MoE): each row equals the oracle run alone, logits max_rel={worst:.2e}")


def test_eos_stops_each_row_exactly(ckpt):
    hf, folder = ckpt("dense")
    model = qwen_mtp.load(folder)
    prompts = [_ids(12, 5), _ids(40, 6)]
    free = qwen_mtp.generate(model, prompts, 12, eos_token_id=[])
    eos = int(free.tokens[0, 4])  # row 0 stops at step 4 (or earlier if the token came before)
    stop0 = int(np.flatnonzero(free.tokens[0] == eos)[0])
    res = qwen_mtp.generate(model, prompts, 12, eos_token_id=eos)
    assert res.lengths[0] == stop0 + 1
    np.testing.assert_array_equal(res.tokens[0, :stop0 + 1], free.tokens[0, :stop0 + 1])
    assert (res.tokens[0, stop0 + 1:] == res.pad_id).all()
    hits1 = np.flatnonzero(free.tokens[1] == eos)
    n1 = hits1[0] + 1 if hits1.size else 12
    assert res.lengths[1] == n1
    np.testing.assert_array_equal(res.tokens[1, :n1], free.tokens[1, :n1])
    # the config's eos is used by default
    assert qwen_mtp.generate(model, prompts[0], 3).lengths[0] == 3  # tiny config has no eos_token_id


def test_bfloat16_error_against_float32(ckpt, report):
    """bf16 is judged against the same model in f32, next to transformers' own bf16 error on the same
    weights: ours must be of the same order, not merely 'small'."""
    import torch
    from transformers import AutoModelForCausalLM

    hf, folder = ckpt("dense")
    ids = _ids(100, 7)
    exact = hf_logits(hf, ids)
    bf16_model = qwen_mtp.load(folder, dtype="bfloat16")
    assert bf16_model.weights.embed.dtype.name == "bfloat16"
    ours = qwen_mtp.prefill_logits(bf16_model, ids)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    theirs = hf_logits(hf_bf16, ids)
    (o_rel, o_abs), (t_rel, t_abs) = rel_err(ours, exact), rel_err(theirs, exact)
    o_agree = float((ours.argmax(-1) == exact.argmax(-1)).mean())
    t_agree = float((theirs.argmax(-1) == exact.argmax(-1)).mean())
    report(f"bf16 prefill logits vs f32 (T=100): ours max_rel={o_rel:.3e} argmax agreement={o_agree:.0%}; "
           f"transformers bf16 max_rel={t_rel:.3e} agreement={t_agree:.0%}")
    assert o_rel < 2 * t_rel + 0.02 and o_agree >= t_agree - 0.05
