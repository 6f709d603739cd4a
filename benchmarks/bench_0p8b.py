"""Plain vs speculative greedy decode cost at the Qwen3.5-0.8B shape on CPU, random bf16 weights (one run).

    python benchmarks/bench_0p8b.py [--new 32] [--prompt 64] [--k 1,2,3,4,5,6] [--batch 1] [--alpha A1,A2,...]
                                    [--draft-vocab 32768]

The model is qwen_mtp.tools.real_shapes.config("Qwen3.5-0.8B") (24 layers, hidden 1024, vocab 248320, tied
embeddings) with an MTP head, every array random bf16 (qwen_mtp/trunk/random_weights.py: fan-in scaled normals,
every norm and gate random too). Measured, each generate compiled by a first call and timed
on a second (eos_token_id=[]):
  plain     TPOT (decode time per token of a row) and GB/s of weights read per step (every trunk layer's arrays,
            the final norm and the tied lm_head = embed; the embedding rows gathered are not counted);
  k         one speculative round, decode time / rounds per row (stats.rounds sums over rows; random weights
            accept ~nothing, so every row runs the same rounds), as a multiple of one plain step, with the
            weights it reads (gpu_check.e2e_27b.round_bytes: trunk + (k + 1) lm_head + k MTP head) and their GB/s.
--draft-vocab N (default 32768; 0: the full vocabulary): the draft head scores N ids (qwen_mtp/head/draft_vocab.py;
ids 0..N-1 here, random weights have no frequent tokens), the verify all 248320: every draft step reads an
N x 1024 lm_head instead of the 508 MB embedding. The projection then assumes the alpha_j of the full
vocabulary (the shipped model lost none at 1024 of its 4096 ids, benchmarks/bench_draft_vocab.py).
Random weights have random acceptance, so the measured speedup is meaningless; the table's last columns are a
PROJECTION: the speedup k would give at the acceptance alpha_j of the shipped model,
  AL(k) = 1 + sum_{j=1..k} prod_{i<=j} alpha_i,  projected speedup = AL(k) / (round cost in plain steps).

--alpha default (ALPHA_SHIPPED): stats.alpha of one k=6 greedy generate of the shipped model
checkpoints/qwen3_5_small (float32) on bench_spec.py's held-out prompt (HELD_OUT[3], token ids 200..327, 128
new tokens): 36 rounds, accept histogram [6, 9, 8, 2, 0, 0, 11], AL 3.69. alpha_5 = alpha_6 = 1.00 rest on the
11 rounds that got past draft 4 (all accepted everything); the same run with 512 new tokens gave 0.82, 0.87,
0.89, 0.95, 1.00, 1.00 (AL 4.96).
These are run 1 of the shipped model, kept on purpose. Run 4 (the model shipped now) gives 0.89, 0.84, 0.95,
0.90, 0.89, 0.19 on the same prompt (28 rounds, AL 4.68), but its greedy output there loops on one list item
(`'is_unix', 'is_unix', ...`), which is easy to draft, so those figures would flatter the projection. Under the
CLI's default repetition penalty (1.3) run 4's alpha_1 on that prompt is 0.64-0.68 (benchmarks/bench_spec.py
--repetition-penalty 1.3); pass --alpha for either.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_check (it puts the repository on sys.path)

ALPHA_SHIPPED = (0.83, 0.70, 0.62, 0.85, 1.00, 1.00)


def _int_list(text, name):
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name}: expected integers separated by commas, found {text!r}")


def projected_al(alpha, k):
    """AL(k) = 1 + sum_{j=1..k} prod_{i<=j} alpha_i, from the first k conditional acceptances."""
    return float(1.0 + np.sum(np.cumprod(np.asarray(alpha[:k], dtype=float))))


def _timed(model, ids, new, spec):
    """Stats of a second generate call (the first compiles and warms)."""
    import qwen_mtp

    qwen_mtp.generate(model, ids, new, spec=spec, eos_token_id=[])
    return qwen_mtp.generate(model, ids, new, spec=spec, eos_token_id=[]).stats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=32, help="new tokens per generate (default 32)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per row (default 64)")
    ap.add_argument("--k", default="1,2,3,4,5,6", help="draft lengths, comma separated (default 1..6)")
    ap.add_argument("--batch", type=int, default=1, help="rows (default 1)")
    ap.add_argument("--draft-vocab", type=int, default=32768,
                    help="ids the draft head scores (default 32768; 0: the full vocabulary)")
    ap.add_argument("--alpha", default=",".join(f"{a:.2f}" for a in ALPHA_SHIPPED),
                    help="alpha_1,...: conditional acceptance for the projection (default: the shipped model's)")
    args = ap.parse_args(argv)
    try:
        ks = _int_list(args.k, "--k")
        alpha = [float(a) for a in args.alpha.split(",") if a.strip()]
    except (argparse.ArgumentTypeError, ValueError) as e:
        ap.error(str(e))
    for name, value in (("--new", args.new), ("--prompt", args.prompt), ("--batch", args.batch)):
        if value < 1:
            ap.error(f"{name}: expected an integer >= 1, found {value}")
    if not 0 <= args.draft_vocab <= 248320:
        ap.error(f"--draft-vocab: expected an integer in [0, 248320], found {args.draft_vocab}")
    if args.new < 2:
        ap.error(f"--new: expected an integer >= 2 (one decode step at least), found {args.new}")
    if not ks or any(not 1 <= k <= 16 for k in ks):
        ap.error(f"--k: expected integers in [1, 16], found {args.k!r}")
    if len(alpha) < max(ks) or any(not 0.0 <= a <= 1.0 for a in alpha):
        ap.error(f"--alpha: expected at least {max(ks)} values in [0, 1] (one per draft position), "
                 f"found {args.alpha!r}")

    import jax
    from gpu_check.e2e_27b import round_bytes, weight_read_bytes

    import qwen_mtp
    from qwen_mtp.tools import real_shapes
    from qwen_mtp.trunk.random_weights import random_weights

    cfg = real_shapes.config("Qwen3.5-0.8B")
    t = time.perf_counter()
    model = qwen_mtp.Model(config=cfg, weights=random_weights(cfg, 0, "bfloat16"), path="<random Qwen3.5-0.8B shape>",
                           dtype="bfloat16")
    jax.block_until_ready(model.weights)
    trunk, lm_head, head = weight_read_bytes(model.weights)
    spec_model, draft_head = model, lm_head
    if args.draft_vocab:
        from qwen_mtp.head.draft_vocab import build_draft_vocab

        spec_model = build_draft_vocab(model, np.arange(cfg.vocab_size)[::-1], args.draft_vocab)
        draft_head = lm_head * args.draft_vocab // cfg.vocab_size
    print(f"Qwen3.5-0.8B shape ({len(cfg.layer_types)} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
          f"tied), random bf16 weights, built in {time.perf_counter() - t:.1f} s on {jax.devices()[0]}; "
          f"batch {args.batch}, prompt {args.prompt}, new {args.new}", flush=True)
    print(f"weights read: trunk {trunk / 1e6:.0f} MB, lm_head (= embed) {lm_head / 1e6:.0f} MB, "
          f"MTP head {head / 1e6:.0f} MB, draft lm_head {draft_head / 1e6:.0f} MB "
          f"({args.draft_vocab or cfg.vocab_size} ids)", flush=True)
    ids = np.random.default_rng(0).integers(1, cfg.vocab_size, (args.batch, args.prompt))

    t = time.perf_counter()
    plain = _timed(model, ids, args.new, None)
    step_s = plain.tpot_s
    plain_gb = (trunk + lm_head) / 1e9
    print(f"plain: TPOT {1e3 * step_s:.1f} ms, {plain_gb / step_s:.2f} GB/s of weights "
          f"({time.perf_counter() - t:.0f} s with its compile)", flush=True)

    rows = []
    for k in ks:
        t = time.perf_counter()
        st = _timed(spec_model, ids, args.new, qwen_mtp.SpecConfig(k=k))
        round_s = st.decode_s / (st.rounds / st.batch)
        gb = (round_bytes(trunk, lm_head, head, k) - k * (lm_head - draft_head)) / 1e9
        al = projected_al(alpha, k)
        rows.append((k, round_s, round_s / step_s, gb, gb / round_s, st.acceptance_length, al,
                     al / (round_s / step_s)))
        print(f"  k={k} done in {time.perf_counter() - t:.0f} s with its compile", flush=True)

    print()
    print(f"alpha (projection): {', '.join(f'{a:.2f}' for a in alpha[:max(ks)])}")
    print(f"{'':6s}{'ms/round':>10s}{'plain steps':>13s}{'GB/round':>10s}{'GB/s':>7s}{'AL meas':>9s}"
          f"{'AL proj':>9s}{'speedup proj':>14s}")
    print(f"{'plain':6s}{1e3 * step_s:10.1f}{1.0:13.2f}{plain_gb:10.3f}{plain_gb / step_s:7.2f}{1.0:9.2f}"
          f"{1.0:9.2f}{1.0:14.2f}")
    for k, round_s, steps, gb, gbs, al_meas, al, speedup in rows:
        print(f"{'k=' + str(k):6s}{1e3 * round_s:10.1f}{steps:13.2f}{gb:10.3f}{gbs:7.2f}{al_meas:9.2f}"
              f"{al:9.2f}{speedup:14.2f}")
    print("AL meas: random weights (acceptance ~0). AL proj / speedup proj: a projection at the alpha above, "
          "speedup = AL proj / plain steps per round.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
