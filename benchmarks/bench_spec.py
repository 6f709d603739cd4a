"""Speculative (MTP head) vs plain greedy decode on the same model, k = 1..6, measured in one run.

Default: the shipped trained model (checkpoints/qwen3_5_small) on prompts cut from its held-out stdlib files.
--random builds instead the tiny randomised checkpoint of the lossless tests (acceptance meaningless there).
Prints, for each batch size, decode tokens/s (all rows), AL and the ratio to plain, and the choice `--k auto`
makes there (the fastest, plain included). Every program is compiled ahead of time (qwen_mtp.precompile).

    python benchmarks/bench_spec.py [--model PATH | --random] [--prompt 128] [--new 128] [--repeats 2]
                                    [--batch 1,4,16] [--k 1,2,3,4,5,6] [--mesh data=D,model=M]
                                    [--repetition-penalty 1.3] [--draft-vocab 1024]

--mesh shards the model over a device mesh after loading (qwen_mtp.shard; the CLI's --mesh syntax).
--repetition-penalty R decodes greedy under Hugging Face's repetition penalty (default 1: off; the CLI takes
the shipped folder's generation_config.json value, 1.3). --draft-vocab N drafts over the N most frequent ids
(load(..., draft_vocab=N); the CLI's default on the shipped model is 1024). Both together measure what
`python -m qwen_mtp generate --k K` runs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main():
    from qwen_mtp.tools.cli import penalty_arg  # the CLI's own validation

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--random", action="store_true")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch", default="1", help="comma list of batch sizes (rows cut from the same text)")
    ap.add_argument("--k", default="1,2,3,4,5,6", help="comma list of k")
    ap.add_argument("--mesh", default=None, metavar="data=D,model=M", help="shard the model over this mesh")
    ap.add_argument("--repetition-penalty", type=penalty_arg, default=1.0, metavar="R",
                    help="greedy under this repetition penalty (default 1: off)")
    ap.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                    help="draft over the N most frequent ids (default: the full vocabulary)")
    args = ap.parse_args()
    import qwen_mtp
    from qwen_mtp.parallel.sharding import parse_mesh

    try:
        mesh = None if args.mesh is None else parse_mesh(args.mesh)
    except qwen_mtp.ArgumentError as e:
        ap.error(str(e))

    folder = args.model
    text_ids = None
    if folder is None and not args.random:
        from checkpoints.corpus import held_out_file_ids
        from qwen_mtp.loading.folder import default_model_path, load_tokenizer

        folder = str(default_model_path())
        text_ids = held_out_file_ids(load_tokenizer(folder), 3)
    elif folder is None:
        from qwen_mtp.extras import require
        require("bench_spec.py --random (a transformers-built checkpoint)", "test", ["torch", "transformers"])
        import hf_tiny
        folder = tempfile.mkdtemp(prefix="bench_spec_")
        m = hf_tiny.make_hf_model("dense", 8, embed_std=0.6, tie_word_embeddings=True, max_position_embeddings=4096)
        m.save_pretrained(folder)
        hf_tiny.add_mtp(folder, 8, passthrough=3.0)
    try:
        model = qwen_mtp.load(folder, draft_vocab=args.draft_vocab)
    except qwen_mtp.ArgumentError as e:
        ap.error(str(e))
    if mesh is not None:
        model = qwen_mtp.shard(model, mesh)
        print(model.describe_sharding())
    if text_ids is None:
        text_ids = np.random.RandomState(0).randint(0, model.config.vocab_size, size=200 + 64 * 16 + args.prompt)
    ks = [int(x) for x in args.k.split(",")]

    kw = dict(eos_token_id=[], repetition_penalty=args.repetition_penalty)

    def run(rows, spec):
        qwen_mtp.precompile(model, rows, args.new, spec=spec, **kw)
        rs = [qwen_mtp.generate(model, rows, args.new, spec=spec, **kw) for _ in range(args.repeats)]
        return max(rs, key=lambda r: r.stats.decode_tokens_per_s)

    extra = "".join([f", repetition penalty {args.repetition_penalty:g}" if args.repetition_penalty != 1 else "",
                     f", draft vocabulary {args.draft_vocab}" if args.draft_vocab else ""])
    print(f"model {folder}; prompt {args.prompt}, new {args.new}, greedy{extra}; decode tok/s over all rows")
    for batch in [int(x) for x in args.batch.split(",")]:
        rows = [text_ids[200 + 64 * b:200 + 64 * b + args.prompt] for b in range(batch)]
        base = run(rows, None)
        print(f"batch {batch}")
        print(f"  {'':8s}{'decode tok/s':>14s}{'ratio':>8s}{'AL':>7s}  alpha_j")
        print(f"  {'plain':8s}{base.stats.decode_tokens_per_s:14.1f}{1.0:8.2f}{1.0:7.2f}")
        best = (1.0, None)
        for k in ks:
            r = run(rows, qwen_mtp.SpecConfig(k=k))
            assert (r.tokens == base.tokens).all(), "speculative output differs from plain greedy"
            ratio = r.stats.decode_tokens_per_s / base.stats.decode_tokens_per_s
            best = max(best, (ratio, k), key=lambda x: x[0])
            print(f"  {'k=' + str(k):8s}{r.stats.decode_tokens_per_s:14.1f}{ratio:8.2f}"
                  f"{r.stats.acceptance_length:7.2f}  " + " ".join(f"{a:.2f}" for a in r.stats.alpha))
        choice = "plain (no speculation)" if best[1] is None else f"k={best[1]} ({best[0]:.2f}x plain)"
        print(f"  batch {batch}: best {choice}: what --k auto picks when these timings repeat")


if __name__ == "__main__":
    main()
