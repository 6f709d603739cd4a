"""The model that ships in checkpoints/qwen3_5_small: transformers loads it and agrees with us, its tokenizer
round-trips, its MTP head beats a trivial drafter on held-out text, and the CLI runs end to end on it."""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import qwen_mtp
from checkpoints.corpus import HELD_OUT, stdlib_root
from qwen_mtp.loading.folder import default_model_path, load_tokenizer
from qwen_mtp.tools.cli import main
from tests.hf_tiny import as_oracle, assert_close, hf_logits

PATH = default_model_path()
REPO = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def model():
    return qwen_mtp.load(PATH)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(PATH)


@pytest.fixture(scope="module")
def held_ids(tok):
    text = (stdlib_root() / HELD_OUT[0]).read_text(encoding="utf-8") + (stdlib_root() / "textwrap.py").read_text()
    return np.asarray(tok.encode(text).ids)


def test_checkpoint_layout():
    cfg = json.loads((PATH / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_text" and cfg["mtp_num_hidden_layers"] == 1
    assert cfg["layer_types"].count("full_attention") * 4 == len(cfg["layer_types"]) >= 8
    size = sum(p.stat().st_size for p in PATH.iterdir())
    assert size < 26e6, size
    from safetensors import safe_open
    names = safe_open(str(PATH / "model.safetensors"), "numpy").keys()
    assert sum(n.startswith("mtp.") for n in names) == 15


def test_trunk_matches_transformers(model, held_ids, report):
    from transformers import Qwen3_5ForCausalLM

    hf = Qwen3_5ForCausalLM.from_pretrained(PATH, dtype=torch.float32)  # skips mtp.*
    ids = held_ids[:160]
    ours = qwen_mtp.prefill_logits(model, ids, prefill_chunk=64)
    ref = hf_logits(as_oracle(hf), ids)
    err = assert_close(ours, ref, "shipped model prefill logits")
    report(f"shipped model vs transformers (T=160, pieces of 64): prefill logits max_rel={err[0]:.2e} "
           f"max_abs={err[1]:.2e}")


@pytest.mark.parametrize("text", ["def fibonacci(n):\n    if n < 2:\n        return n\n",
                                  "\t\tmixed\r\nline endings  \n\n\n   trailing   ",
                                  "unicode: héllo wörld, 日本語, emoji 🙂, zero-width \u200b, combining e\u0301",
                                  ""])
def test_tokenizer_round_trips(tok, text):
    assert tok.decode(tok.encode(text).ids) == text


def test_tokenizer_round_trips_held_out_file(tok):
    text = (stdlib_root() / "difflib.py").read_text(encoding="utf-8")
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    assert len(ids) < len(text) / 2.5  # a real BPE: well under one token per 2.5 characters on code


def test_trained_head_beats_repeat_last_token(model, held_ids, report):
    from checkpoints.eval_small import _teacher_forced

    x = jnp.asarray(held_ids[:4 * 257].reshape(4, 257))
    head, rep, n = (int(v) for v in _teacher_forced(model.weights, model.config, x))
    report(f"shipped head, teacher-forced alpha_1 on {n} held-out rows: MTP head {head / n:.3f}, "
           f"repeat-last-token {rep / n:.3f}")
    assert head / n > rep / n + 0.2


def _run_cli(args, capsys):
    rc = main(["generate", *args, "--stats-to-stderr"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out, out.err


def test_cli_spec_equals_no_spec_and_prints_stats(capsys, report):
    prompt = "def fibonacci(n):"
    spec_text, spec_err = _run_cli([prompt, "--max-new-tokens", "48", "--k", "3"], capsys)
    plain_text, plain_err = _run_cli([prompt, "--max-new-tokens", "48", "--no-spec"], capsys)
    win_text, _ = _run_cli([prompt, "--max-new-tokens", "48", "--window", "8", "--sinks", "2", "--k", "2"], capsys)
    assert spec_text == plain_text == win_text
    assert spec_text.startswith(prompt) and len(spec_text) > len(prompt) + 20
    assert "tok/s" in spec_err and "AL" in spec_err and "alpha_j" in spec_err
    assert "plain decoding" in plain_err
    # greedy under the folder's generation_config.json repetition penalty, said in the stats line; without it
    # the text differs (this model's plain argmax loops), and speculation still equals plain decoding
    assert "repetition penalty 1.3 (generation_config.json)" in spec_err
    # --k given: without it the CLI first times plain and k 1 .. 3 for its plan (tests/test_cli_auto_k.py)
    off_text, off_err = _run_cli([prompt, "--max-new-tokens", "48", "--repetition-penalty", "1", "--k", "3"], capsys)
    off_plain, _ = _run_cli([prompt, "--max-new-tokens", "48", "--repetition-penalty", "1", "--no-spec"], capsys)
    assert off_text == off_plain != spec_text and "repetition penalty" not in off_err
    report("CLI: " + spec_err.strip().splitlines()[-1])


def test_cli_bad_input(capsys, tmp_path):
    assert main(["generate", "x", "--model", str(tmp_path)]) == 2
    assert "config.json" in capsys.readouterr().err
    for bad in (["--k", "0"], ["--k", "many"], ["--max-new-tokens", "0"], ["--sinks", "2"]):
        with pytest.raises(SystemExit) as e:
            main(["generate", "x", *bad])
        assert e.value.code == 2
        capsys.readouterr()


def test_analyze_window_cli(capsys, tmp_path):
    png = tmp_path / "windows.png"
    rc = main(["analyze-window", "--windows", "8,native", "--sinks", "2", "--k", "2", "--prompts", "2",
               "--prompt-len", "64", "--max-new-tokens", "16", "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "dose-response" in out and "| 8 | 2 |" in out and "| native | 0 |" in out
    assert "95% Wilson" in out and "same top-1" in out
    ab_row = [line for line in out.splitlines() if line.startswith("| 8 | ") and line.count("|") == 8]
    assert ab_row, out  # the A/B probe + attention-mass row for W=8
    assert png.stat().st_size > 1000


def test_4k_new_tokens_with_a_small_window_stay_plain_greedy(model, held_ids, tmp_path, report):
    """Long runs: 4096 new tokens, speculative with a draft window 64 times smaller than the context (W 64, 4
    sinks: the ring wraps ~65 times), token for token plain greedy. Two regimes: the shipped model (a trained head:
    most drafts accepted, the text settles into repeats) and a random untied checkpoint (output that never
    settles: 90+ distinct ids, drafts accepted now and then)."""
    import hf_tiny

    spec = qwen_mtp.SpecConfig(k=3, window=64, sinks=4)
    prompt = np.asarray(held_ids[:64])
    plain = qwen_mtp.generate(model, prompt, 4096, eos_token_id=[])
    windowed = qwen_mtp.generate(model, prompt, 4096, eos_token_id=[], spec=spec)
    assert plain.tokens.shape == (1, 4096)
    np.testing.assert_array_equal(windowed.tokens, plain.tokens)
    assert windowed.stats.acceptance_length > 1.5  # drafts really committed along the way

    hf = hf_tiny.make_hf_model("dense", 8, max_position_embeddings=8192)
    hf.save_pretrained(tmp_path)
    hf_tiny.add_mtp(tmp_path, 8, passthrough=3.0)
    rand = qwen_mtp.load(tmp_path)
    ids = np.arange(3, 67)
    rplain = qwen_mtp.generate(rand, ids, 4096, eos_token_id=[])
    rwin = qwen_mtp.generate(rand, ids, 4096, eos_token_id=[], spec=spec)
    assert len(np.unique(rplain.tokens)) > 50  # a varied run, not a loop
    np.testing.assert_array_equal(rwin.tokens, rplain.tokens)
    accepted = int((rwin.stats.accept_hist * np.arange(len(rwin.stats.accept_hist))).sum())
    assert accepted >= 10, rwin.stats.accept_hist
    report(f"long runs: 4096 new tokens, Wind-MTP W64 S4 k=3 identical to plain greedy: shipped model AL "
           f"{windowed.stats.acceptance_length:.2f}; random checkpoint {len(np.unique(rplain.tokens))} distinct ids, "
           f"{accepted} drafts accepted")
