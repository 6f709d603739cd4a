"""Draft vocabulary (qwen_mtp/head/draft_vocab.py) vs the full vocabulary for the MTP draft head, measured in one run.

Default: the shipped model (checkpoints/qwen3_5_small, vocab 4096) at batch 1, greedy, k = 3, on prompts cut
from its held-out stdlib files (as benchmarks/bench_spec.py cuts them), for each draft vocabulary size: AL,
alpha_1 and decode tokens/s, with its ratio to the full vocabulary, and the time of one draft round alone (k head
steps, speculative._draft) with its ratio (speculative output is checked equal to plain
greedy output for every size). The runs of every size are interleaved, repeat by repeat; each size's best
repeat gives its tok/s, and the paired ratio is the median over repeats of full-vocabulary time / this size's
time within the same repeat (robust to load that drifts between repeats). The counts come from the model folder's
draft_vocab_counts.npy (python -m checkpoints.draft_vocab_counts).

    python benchmarks/bench_draft_vocab.py [--sizes 256,512,1024,2048] [--k 3] [--new 128] [--prompt 128]
                                           [--prompts 3] [--repeats 3] [--repetition-penalty 1.3]

--shape 0.8b: the Qwen3.5-0.8B shape (vocab 248320, hidden 1024, tied) with random bf16 weights (--dtype), where only the
draft cost is meaningful (acceptance is not, with random weights): the time of one draft round (k head steps,
speculative._draft, batch 1) for the full vocabulary and each size (default 8192,16384,32768), and its ratio.
The trunk is cut to one period of 4 layers (the draft round does not run it).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _sizes(text):
    return [int(s) for s in text.split(",") if s]


# ------------------------------------------------------------------------------------------- the shipped model
def shipped(args):
    import qwen_mtp
    from checkpoints.corpus import held_out_file_ids
    from qwen_mtp.loading.folder import default_model_path, load_tokenizer

    folder = args.model or str(default_model_path())
    tok = load_tokenizer(folder)
    prompts = []
    for i in range(3, 3 + args.prompts):  # difflib.py first, as bench_spec.py
        prompts.append(held_out_file_ids(tok, i, 200, args.prompt))
    full = qwen_mtp.load(folder)
    models = {"full": full}
    for n in args.sizes:
        models[str(n)] = qwen_mtp.with_draft_vocab(full, n)
    spec = qwen_mtp.SpecConfig(k=args.k)
    gen = lambda m, p, s: qwen_mtp.generate(m, p, args.new, eos_token_id=[], spec=s,
                                            repetition_penalty=args.repetition_penalty)

    plain = [gen(full, p, None).tokens for p in prompts]
    results = {}
    for name, m in models.items():  # compile, and check: the output is plain greedy output
        rs = [gen(m, p, spec) for p in prompts]
        for r, ref in zip(rs, plain):
            assert (r.tokens == ref).all(), f"draft vocab {name}: speculative output differs from plain greedy"
        results[name] = rs
    best = {name: float("inf") for name in models}
    per_repeat = {name: [] for name in models}  # decode seconds of all prompts, per repeat
    for _ in range(args.repeats):
        for name, m in models.items():
            rs = [gen(m, p, spec) for p in prompts]
            t = sum(r.stats.decode_s for r in rs)
            per_repeat[name].append(t)
            if t < best[name]:
                best[name], results[name] = t, rs
    # paired: each repeat's full-vocabulary time over this size's time in the same repeat, median over repeats
    paired = {name: float(np.median(np.array(per_repeat["full"]) / np.array(t))) for name, t in per_repeat.items()}

    def summary(rs):
        hist = sum(r.stats.accept_hist for r in rs)
        tail = np.cumsum(hist[::-1])[::-1].astype(float)
        alpha = tail[1:] / np.maximum(tail[:-1], 1)
        al = 1.0 + np.sum(np.cumprod(alpha))
        tokens = sum(r.stats.new_tokens - r.stats.batch for r in rs)
        return al, alpha[0], tokens / sum(r.stats.decode_s for r in rs)

    rounds = draft_round_times(models, args.k, args.prompt + args.new, 20 * args.repeats, args.repetition_penalty)
    cover = np.load(Path(folder) / "draft_vocab_counts.npy")
    top = np.sort(cover)[::-1]
    print(f"model {folder}; {len(prompts)} prompts of {args.prompt} tokens, {args.new} new, batch 1, "
          f"greedy{_penalty_text(args)}, "
          f"k={args.k}; best of {args.repeats} interleaved repeats")
    print("decode tok/s: best repeat; ratio: of the best repeats; paired: median over repeats of the speed ratio "
          "within one repeat; draft round: speculative._draft alone")
    print(f"{'draft vocab':>12s}{'corpus cover':>14s}{'AL':>7s}{'alpha_1':>9s}{'decode tok/s':>14s}{'ratio':>8s}"
          f"{'paired':>8s}{'draft round ms':>16s}{'ratio':>8s}")
    base = summary(results["full"])[2]
    for name in models:
        al, a1, tps = summary(results[name])
        c = 1.0 if name == "full" else top[:int(name)].sum() / top.sum()
        print(f"{name:>12s}{c:14.3f}{al:7.2f}{a1:9.3f}{tps:14.1f}{tps / base:8.3f}{paired[name]:8.3f}"
              f"{1e3 * rounds[name]:16.3f}"
              f"{rounds[name] / rounds['full']:8.3f}")


# ------------------------------------------------------------------------------------------- the 0.8B shape
def random_model(cfg, seed=0, dtype="bfloat16"):
    """A qwen_mtp.Model of `cfg` with random weights in `dtype` (qwen_mtp/trunk/random_weights.py), made on the
    default device."""
    import qwen_mtp
    from qwen_mtp.trunk.random_weights import random_weights

    return qwen_mtp.Model(config=cfg, weights=random_weights(cfg, seed, dtype), path="<random Qwen3.5-0.8B>",
                          dtype=dtype)


def draft_round_times(models: dict, k: int, context: int, repeats: int, penalty: float = 1.0) -> dict:
    """{name: median seconds of one draft round} (speculative._draft: k head steps, batch 1, greedy, a head cache
    of `context` rows, jitted and compiled first), the models' runs interleaved repeat by repeat. penalty != 1:
    the drafts are penalised with a context of the first eighth of the ids, as a penalised round does."""
    import jax
    import jax.numpy as jnp

    import qwen_mtp
    from qwen_mtp.decoding import speculative
    from qwen_mtp.decoding.sampling import Sampling
    from qwen_mtp.head.mtp import init_mtp_cache

    some = next(iter(models.values()))
    cfg, dtype = some.config, some.weights.embed.dtype
    draft = jax.jit(speculative._draft, static_argnames=("cfg", "spec", "sampling"))
    spec = qwen_mtp.SpecConfig(k=k)
    mcache = init_mtp_cache(cfg, 1, context + 64, dtype)
    m1 = jax.random.normal(jax.random.PRNGKey(1), (1, cfg.hidden_size), dtype)
    pos = jnp.full((1,), context, jnp.int32)
    sampling = Sampling(repetition_penalty=penalty)
    seen = None
    if penalty != 1.0:
        seen = jnp.zeros((1, cfg.vocab_size), jnp.bool_).at[0, :cfg.vocab_size // 8].set(True)
    run = lambda m: draft(m.weights, cfg, mcache, m1, pos, spec=spec, sampling=sampling,
                          key=jax.random.PRNGKey(2), seen=seen)[0].block_until_ready()
    for m in models.values():
        run(m)  # compile
    times = {name: [] for name in models}
    for _ in range(repeats):
        for name, m in models.items():
            t = time.perf_counter()
            run(m)
            times[name].append(time.perf_counter() - t)
    return {name: float(np.median(t)) for name, t in times.items()}


def shape_08b(args):
    import jax

    import qwen_mtp
    from qwen_mtp.tools.real_shapes import config

    cfg = config("Qwen3.5-0.8B", layers=4)
    t0 = time.perf_counter()
    full = random_model(cfg, dtype=args.dtype)
    jax.block_until_ready(full.weights)
    counts = np.random.default_rng(0).zipf(1.3, cfg.vocab_size)
    models = {"full": full}
    for n in args.sizes:
        models[str(n)] = qwen_mtp.with_draft_vocab(full, n, counts=counts)
    print(f"Qwen3.5-0.8B shape, random {args.dtype} weights (built in {time.perf_counter() - t0:.0f} s), "
          f"{jax.devices()[0].platform}; one draft round: k={args.k} head steps, batch 1, context {args.context}, "
          f"greedy{_penalty_text(args)}; median of {args.repeats}", flush=True)
    times = draft_round_times(models, args.k, args.context, args.repeats, args.repetition_penalty)
    print(f"{'draft vocab':>12s}{'round ms':>10s}{'ratio':>8s}")
    for name, t in times.items():
        print(f"{name:>12s}{1e3 * t:10.2f}{t / times['full']:8.3f}", flush=True)


def _penalty_text(args) -> str:
    return f" under repetition penalty {args.repetition_penalty:g}" if args.repetition_penalty != 1 else ""


def main():
    from qwen_mtp.tools.cli import penalty_arg  # the CLI's own validation

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=["small", "0.8b"], default="small")
    ap.add_argument("--model", default=None, help="model folder (default: the shipped model)")
    ap.add_argument("--sizes", type=_sizes, default=None, help="comma-separated draft vocabulary sizes")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--context", type=int, default=512, help="0.8b: the head's context length")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--repetition-penalty", type=penalty_arg, default=1.0, metavar="R",
                    help="greedy under this repetition penalty (default 1: off; the CLI's default on the shipped "
                    "model is its generation_config.json's 1.3); 0.8b: the draft round alone, penalised")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="0.8b: the weights' dtype (XLA's CPU dots are slow in bf16: float32 there)")
    args = ap.parse_args()
    if args.sizes is None:
        args.sizes = [256, 512, 1024, 2048] if args.shape == "small" else [8192, 16384, 32768]
    (shipped if args.shape == "small" else shape_08b)(args)


if __name__ == "__main__":
    main()
