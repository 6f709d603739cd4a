"""Held-out evaluation of the shipped model: trunk loss, MTP loss, teacher-forced alpha_1, speculative AL at
k = 1..6 from real generation, each against the trivial repeat-last-token drafter.

    python -m checkpoints.eval_small [--model checkpoints/qwen3_5_small] [--prompts 8] [--new 96]

The held-out files (train_small.HELD_OUT) were never seen by the tokenizer or the model. Writes eval.json
next to the checkpoint when --write is given.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints.corpus import encode, read_texts, source_files, stdlib_root
from checkpoints.train_small import SEQ, eval_windows, losses_from_logits, teacher_forced_logits


def _hits(x, trunk_logits, mtp_logits):
    """Per head row t (0..T-2): does the head's argmax equal the trunk's argmax for the token after next, and
    does repeat-last-token (x[t+1]) equal it? Returns (head hits, repeat hits, count)."""
    T = trunk_logits.shape[1]
    target = jnp.argmax(trunk_logits, -1)[:, 1:]  # trunk's choice after position t+1, given the true x[t+1]
    head = jnp.argmax(mtp_logits, -1)  # row t drafts the token at t+2
    return jnp.sum(head == target), jnp.sum(x[:, 1:T] == target), target.size


@partial(jax.jit, static_argnames=("cfg",))
def _teacher_forced(weights, cfg, x):
    """x [B, T+1]: (head hits, repeat-last-token hits, rows) of _hits, with inference's exact GDN form."""
    return _hits(x, *teacher_forced_logits(weights, cfg, x, gdn_mode="chunk"))


@partial(jax.jit, static_argnames=("cfg",))
def _eval_batch(weights, cfg, x):
    """One trunk + head forward: (trunk CE, MTP CE, head hits, repeat hits, rows)."""
    logits = teacher_forced_logits(weights, cfg, x, gdn_mode="chunk")  # inference's exact GDN chunk form
    trunk, mtp, _ = losses_from_logits(x, *logits)
    return (trunk, mtp, *_hits(x, *logits))


def repeat_last_al(tokens, k):
    """AL of the repeat-last-token drafter on a greedy output (lossless greedy: the output is fixed, so each
    round's accepted count is how many next tokens equal the last committed one, at most k)."""
    rounds, emitted, i = 0, 0, 0
    n = len(tokens)
    while i < n - 1:
        last, acc = tokens[i], 0
        while acc < k and i + 1 + acc < n and tokens[i + 1 + acc] == last:
            acc += 1
        rounds += 1
        emitted += acc + 1
        i += acc + 1
    return emitted / max(rounds, 1)


def held_out_ids(tok):
    root = stdlib_root()
    _, held = source_files(root)
    return encode(tok, read_texts(root, held))


def evaluate(model, tok, n_prompts=8, prompt_len=128, new=96, ks=range(1, 7), seed=0):
    from qwen_mtp import SpecConfig, generate

    w, cfg = model.weights, model.config
    ids = held_out_ids(tok)
    windows = eval_windows(ids, SEQ)
    B = 16
    tl, ml, hh, rh, cnt = [], [], 0, 0, 0
    for i in range(0, len(windows) - B + 1, B):
        x = jnp.asarray(windows[i:i + B])
        t, m, a, b, c = _eval_batch(w, cfg, x)
        tl.append(float(t))
        ml.append(float(m))
        hh, rh, cnt = hh + int(a), rh + int(b), cnt + int(c)
    res = dict(held_out_tokens=int(ids.size), eval_windows=int(len(windows)), trunk_loss=float(np.mean(tl)),
               mtp_loss=float(np.mean(ml)), alpha1_teacher_forced=hh / cnt, alpha1_repeat_last=rh / cnt)

    rng = np.random.default_rng(seed)
    starts = rng.integers(0, ids.size - prompt_len - 1, n_prompts)
    prompts = [ids[s:s + prompt_len] for s in starts]
    run = lambda spec: [generate(model, prompts, new, spec=spec, eos_token_id=[]) for _ in range(2)][-1]  # 1st compiles
    plain = run(None)
    res["batch"] = n_prompts
    res["plain_decode_tok_s"] = plain.stats.decode_tokens_per_s
    res["al"], res["alpha"], res["tok_s"], res["al_repeat_last"] = {}, {}, {}, {}
    for k in ks:
        r = run(SpecConfig(k=k))
        assert np.array_equal(r.tokens, plain.tokens), f"speculative k={k} differs from plain greedy"
        res["al"][k] = r.stats.acceptance_length
        res["alpha"][k] = [float(a) for a in r.stats.alpha]
        res["tok_s"][k] = r.stats.decode_tokens_per_s
        res["al_repeat_last"][k] = float(np.mean([repeat_last_al(list(p[-1:]) + list(row), k)
                                                  for p, row in zip(prompts, plain.tokens)]))
    return res


def report(res) -> str:
    lines = [f"held-out: {res['held_out_tokens']} tokens; trunk loss {res['trunk_loss']:.3f}, "
             f"MTP loss {res['mtp_loss']:.3f} (nats/token)",
             f"teacher-forced alpha_1: MTP head {res['alpha1_teacher_forced']:.3f}, "
             f"repeat-last-token {res['alpha1_repeat_last']:.3f}",
             f"greedy generation, {res['batch']} held-out prompts decoded as one batch; every k equal to plain greedy",
             "| k | AL (MTP head) | AL (repeat-last-token) | alpha_j (MTP head) | decode tok/s | vs plain |",
             "| --- | --- | --- | --- | --- | --- |"]
    for k in res["al"]:
        alphas = " ".join(f"{a:.2f}" for a in res["alpha"][k])
        lines.append(f"| {k} | {res['al'][k]:.2f} | {res['al_repeat_last'][k]:.2f} | {alphas} | "
                     f"{res['tok_s'][k]:.0f} | {res['tok_s'][k] / res['plain_decode_tok_s']:.2f}x |")
    lines.append(f"plain greedy decode: {res['plain_decode_tok_s']:.0f} tok/s")
    return "\n".join(lines)


def main(argv=None):
    import qwen_mtp
    from qwen_mtp.cli import default_model_path, load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--write", action="store_true", help="write eval.json next to the checkpoint")
    args = ap.parse_args(argv)
    model = qwen_mtp.load(args.model)
    res = evaluate(model, load_tokenizer(args.model), n_prompts=args.prompts, new=args.new)
    print(report(res))
    if args.write:
        (Path(args.model) / "eval.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
