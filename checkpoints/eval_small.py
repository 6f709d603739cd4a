"""Held-out evaluation of the shipped model: trunk loss, MTP loss, teacher-forced alpha_1, speculative AL at
k = 1..6 from real generation (alpha_j with 95% Wilson intervals), each against the trivial repeat-last-token
drafter; and what a user reads: the share of distinct 4-grams in 128 greedy tokens after each of ten held-out
prompts (a looping model repeats its 4-grams), and the README example's greedy continuation of
`def fibonacci(n):` with the most times one line of it repeats; then the sample figures and AL (k = 1..4)
again, greedy under the repetition penalty the CLI uses (the folder's generation_config.json, or
--repetition-penalty; with --quality-only a comma list compares several).

    python -m checkpoints.eval_small [--model checkpoints/qwen3_5_small] [--prompts 8] [--new 96]
                                     [--quality-only] [--repetition-penalty R[,R...]] [--write]

The held-out files (train_small.HELD_OUT) were never seen by the tokenizer or the model. Writes eval.json
next to the checkpoint when --write is given.
"""

from __future__ import annotations

import argparse
import json
import re
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints.corpus import HELD_OUT, encode, held_out_texts, stdlib_root
from checkpoints.train_small import SEQ, eval_windows, losses_from_logits, teacher_forced_logits
from qwen_mtp.decoding.stats import alpha_intervals, wilson


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


README_PROMPT = "def fibonacci(n):"
QUALITY_PROMPTS = 10
QUALITY_PROMPT_TOKENS = 32
QUALITY_NEW = 128


def distinct_4gram_share(tokens) -> float:
    """Distinct 4-grams over all 4-grams of a token sequence (1.0: no 4-gram repeats; a loop drives it to 0)."""
    grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    return len(set(grams)) / len(grams) if grams else float("nan")


def max_line_repeats(text: str) -> int:
    """How many times the most repeated non-blank line of a text occurs in it."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return max((lines.count(ln) for ln in set(lines)), default=0)


def quality_prompts(tok):
    """QUALITY_PROMPTS prompts of QUALITY_PROMPT_TOKENS tokens, each from its own held-out file (in HELD_OUT's
    order): the start of the file's first top-level `def` or `class` line (the file's start where it has none)."""
    root = stdlib_root()
    prompts = []
    for rel in HELD_OUT:
        text = (root / rel).read_text(encoding="utf-8")
        first = re.search(r"^(def|class) ", text, re.MULTILINE)
        ids = tok.encode(text[first.start() if first else 0:]).ids[:QUALITY_PROMPT_TOKENS]
        if len(ids) == QUALITY_PROMPT_TOKENS:
            prompts.append((rel, ids))
        if len(prompts) == QUALITY_PROMPTS:
            break
    return prompts


def sample_quality(model, tok, repetition_penalty=1.0) -> dict:
    """Greedy continuations a user reads: distinct-4-gram shares of QUALITY_NEW tokens after each quality
    prompt, and the README prompt's continuation (128 tokens, the CLI's default) with its most repeated line;
    greedy under `repetition_penalty` (1: plain argmax)."""
    from qwen_mtp import generate

    prompts = quality_prompts(tok)
    out = generate(model, [ids for _, ids in prompts], QUALITY_NEW, eos_token_id=[],
                   repetition_penalty=repetition_penalty)
    shares = [distinct_4gram_share([int(t) for t in row]) for row in out.tokens]
    readme = generate(model, [tok.encode(README_PROMPT).ids], QUALITY_NEW, repetition_penalty=repetition_penalty)
    text = README_PROMPT + tok.decode([int(t) for t in readme.tokens[0]])
    return dict(distinct_4gram_prompts=[rel for rel, _ in prompts], distinct_4gram_shares=shares,
                distinct_4gram_mean=float(np.mean(shares)), distinct_4gram_min=float(np.min(shares)),
                readme_prompt=README_PROMPT, readme_continuation=text,
                readme_max_line_repeats=max_line_repeats(text),
                readme_distinct_4gram=distinct_4gram_share([int(t) for t in readme.tokens[0]]))


def held_out_ids(tok):
    """The held-out files as train_small evaluates them: one stream, each file followed by EOS."""
    return encode(tok, held_out_texts())


def penalised_al(model, prompts, new, repetition_penalty, ks):
    """{k: (AL, alpha_j)} of greedy speculative decoding under a repetition penalty on `prompts` (each k
    checked equal to plain greedy under the same penalty)."""
    from qwen_mtp import SpecConfig, generate

    run = lambda spec: [generate(model, prompts, new, spec=spec, eos_token_id=[],
                                 repetition_penalty=repetition_penalty) for _ in range(2)][-1]  # 1st compiles
    plain = run(None)
    out = {"plain_decode_tok_s": plain.stats.decode_tokens_per_s, "al": {}, "alpha": {}, "tok_s": {}}
    for k in ks:
        r = run(SpecConfig(k=k))
        assert np.array_equal(r.tokens, plain.tokens), f"speculative k={k} differs from plain greedy under the penalty"
        out["al"][k] = r.stats.acceptance_length
        out["alpha"][k] = [float(a) for a in r.stats.alpha]
        out["tok_s"][k] = r.stats.decode_tokens_per_s
    return out


def evaluate(model, tok, n_prompts=8, prompt_len=128, new=96, ks=range(1, 7), seed=0, repetition_penalty=None):
    """repetition_penalty: also the sample figures and AL (k = 1..4) greedy under this penalty (the model
    folder's generation_config.json default, what the CLI uses), in res["penalised"]."""
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
               mtp_loss=float(np.mean(ml)), alpha1_teacher_forced=hh / cnt,
               alpha1_teacher_forced_ci=list(wilson(hh, cnt)), alpha1_repeat_last=rh / cnt)

    rng = np.random.default_rng(seed)
    starts = rng.integers(0, ids.size - prompt_len - 1, n_prompts)
    prompts = [ids[s:s + prompt_len] for s in starts]
    run = lambda spec: [generate(model, prompts, new, spec=spec, eos_token_id=[]) for _ in range(2)][-1]  # 1st compiles
    plain = run(None)
    res["batch"] = n_prompts
    res["plain_decode_tok_s"] = plain.stats.decode_tokens_per_s
    res["al"], res["alpha"], res["alpha_ci"], res["tok_s"], res["al_repeat_last"] = {}, {}, {}, {}, {}
    for k in ks:
        r = run(SpecConfig(k=k))
        assert np.array_equal(r.tokens, plain.tokens), f"speculative k={k} differs from plain greedy"
        res["al"][k] = r.stats.acceptance_length
        res["alpha"][k] = [float(a) for a in r.stats.alpha]
        res["alpha_ci"][k] = [[lo, hi, succ, n] for _, lo, hi, succ, n in alpha_intervals(r.stats)]
        res["tok_s"][k] = r.stats.decode_tokens_per_s
        res["al_repeat_last"][k] = float(np.mean([repeat_last_al(list(p[-1:]) + list(row), k)
                                                  for p, row in zip(prompts, plain.tokens)]))
    res.update(sample_quality(model, tok))
    if repetition_penalty is not None and repetition_penalty != 1.0:
        res["penalised"] = dict(repetition_penalty=repetition_penalty,
                                **penalised_al(model, prompts, new, repetition_penalty, [k for k in ks if k <= 4]),
                                **sample_quality(model, tok, repetition_penalty))
    return res


def quality_report(res) -> str:
    shares = " ".join(f"{x:.2f}" for x in res["distinct_4gram_shares"])
    return (f"distinct 4-grams in {QUALITY_NEW} greedy tokens after {len(res['distinct_4gram_shares'])} held-out "
            f"prompts: mean {res['distinct_4gram_mean']:.3f}, min {res['distinct_4gram_min']:.3f} ({shares})\n"
            f"README prompt, greedy {QUALITY_NEW} tokens (distinct 4-grams {res['readme_distinct_4gram']:.2f}, most "
            f"repeated line x{res['readme_max_line_repeats']}):\n"
            + "\n".join("    " + ln for ln in res["readme_continuation"].splitlines()))


def report(res) -> str:
    lines = [f"held-out: {res['held_out_tokens']} tokens; trunk loss {res['trunk_loss']:.3f}, "
             f"MTP loss {res['mtp_loss']:.3f} (nats/token)",
             f"teacher-forced alpha_1: MTP head {res['alpha1_teacher_forced']:.3f} "
             + ("(95% Wilson {:.3f}-{:.3f}), ".format(*res["alpha1_teacher_forced_ci"])
                if "alpha1_teacher_forced_ci" in res else ", ")
             + f"repeat-last-token {res['alpha1_repeat_last']:.3f}",
             f"greedy generation, {res['batch']} held-out prompts decoded as one batch; every k equal to plain greedy",
             "| k | AL (MTP head) | AL (repeat-last-token) | alpha_j (MTP head) | decode tok/s | vs plain |",
             "| --- | --- | --- | --- | --- | --- |"]
    for k in res["al"]:
        cis = res.get("alpha_ci", {}).get(k) or [None] * len(res["alpha"][k])  # eval.json of before the intervals
        alphas = " ".join(f"{a:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
                          for a, ci in zip(res["alpha"][k], cis))
        lines.append(f"| {k} | {res['al'][k]:.2f} | {res['al_repeat_last'][k]:.2f} | {alphas} | "
                     f"{res['tok_s'][k]:.0f} | {res['tok_s'][k] / res['plain_decode_tok_s']:.2f}x |")
    lines.append(f"plain greedy decode: {res['plain_decode_tok_s']:.0f} tok/s")
    if "distinct_4gram_shares" in res:
        lines.append(quality_report(res))
    if "penalised" in res:
        p = res["penalised"]
        lines.append(f"\ngreedy under repetition penalty {p['repetition_penalty']:g} (generation_config.json), same "
                     f"prompts; every k equal to plain greedy under it")
        lines.append("| k | AL (MTP head) | alpha_j | decode tok/s | vs plain |")
        lines.append("| --- | --- | --- | --- | --- |")
        for k in p["al"]:
            lines.append(f"| {k} | {p['al'][k]:.2f} | {' '.join(f'{a:.2f}' for a in p['alpha'][k])} | "
                         f"{p['tok_s'][k]:.0f} | {p['tok_s'][k] / p['plain_decode_tok_s']:.2f}x |")
        lines.append(f"plain greedy decode: {p['plain_decode_tok_s']:.0f} tok/s")
        lines.append(quality_report(p))
    return "\n".join(lines)


def _penalties(text):
    try:
        out = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers > 0, found {text!r}") from None
    if not all(0 < r < float("inf") for r in out):
        raise argparse.ArgumentTypeError(f"expected numbers > 0, found {text!r}")
    return out


def main(argv=None):
    import qwen_mtp
    from qwen_mtp.loading.folder import default_model_path, generation_repetition_penalty, load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--write", action="store_true", help="write eval.json next to the checkpoint")
    ap.add_argument("--quality-only", action="store_true", help="only the greedy-sample figures (4-grams, README "
                    "prompt), not written")
    ap.add_argument("--repetition-penalty", type=_penalties, default=None, metavar="R[,R...]", help="the "
                    "penalised figures at R (default: the folder's generation_config.json repetition_penalty); "
                    "with --quality-only, a comma list compares several")
    args = ap.parse_args(argv)
    model = qwen_mtp.load(args.model)
    penalties = args.repetition_penalty or [generation_repetition_penalty(args.model) or 1.0]
    if args.quality_only:
        for r in sorted(set([1.0] + penalties)):
            print(f"\n== repetition penalty {r:g}\n" + quality_report(sample_quality(model, load_tokenizer(args.model), r)))
        return
    if len(penalties) > 1:
        ap.error("--repetition-penalty takes one value without --quality-only")
    res = evaluate(model, load_tokenizer(args.model), n_prompts=args.prompts, new=args.new,
                   repetition_penalty=penalties[0])
    print(report(res))
    if args.write:
        (Path(args.model) / "eval.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
