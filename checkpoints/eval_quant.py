"""Quality of the shipped model under each weight format, with the MTP head quantized and kept in bf16.

    python -m checkpoints.eval_quant [--model checkpoints/qwen3_5_small] [--formats bf16,int8,int4,fp8]
                                     [--windows 64] [--prompts 8] [--new 96] [--ks 1,2,3,4] [--write]

For each format: held-out trunk loss and teacher-forced alpha_1 (eval_small's measures, over --windows windows
of 256 tokens), then greedy generation from --prompts held-out prompts at k = 1..4 (each checked equal to plain
greedy) for the acceptance length AL, and the bytes of the weights against bf16. The checkpoint's weights are
bf16; every row computes in f32, so the rows differ only by the weight format. int4 uses --group-size (128).
Writes quant_eval.json next to the checkpoint with --write.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from checkpoints.eval_small import _eval_batch, held_out_ids
from checkpoints.train_small import SEQ, eval_windows

FORMATS = ("bf16", "int8", "int4", "fp8")


def bytes_in_bf16(weights) -> int:
    """Bytes of the weights with every plain array held in bf16 (quantized arrays as they are)."""
    import jax

    from qwen_mtp.trunk.quant import QuantArray

    total = 0
    for leaf in jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, QuantArray)):
        total += leaf.nbytes if isinstance(leaf, QuantArray) else int(leaf.size) * 2
    return total


def quantized_matrix_ratio(weights) -> float | None:
    """Bytes of the quantized matrices (values + scales) over the same matrices in bf16; None if none."""
    import jax

    from qwen_mtp.trunk.quant import QuantArray

    q = [x for x in jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, QuantArray)) if isinstance(x, QuantArray)]
    return sum(x.nbytes for x in q) / sum(2 * int(np.prod(x.shape)) for x in q) if q else None


def measure(model, ids, prompts, new, ks, n_windows):
    from qwen_mtp import SpecConfig, generate

    windows = eval_windows(ids, SEQ, n_max=n_windows)
    B = 16
    tl, hits, rows = [], 0, 0
    for i in range(0, len(windows) - B + 1, B):
        t, _, a, _, c = _eval_batch(model.weights, model.config, jnp.asarray(windows[i:i + B]))
        tl.append(float(t))
        hits, rows = hits + int(a), rows + int(c)
    plain = generate(model, prompts, new, eos_token_id=[])
    al = {}
    for k in ks:
        r = generate(model, prompts, new, eos_token_id=[], spec=SpecConfig(k=k))
        if not np.array_equal(r.tokens, plain.tokens):
            raise AssertionError(f"speculative k={k} differs from plain greedy")
        al[k] = float(r.stats.acceptance_length)
    return {"trunk_loss": float(np.mean(tl)), "alpha1_teacher_forced": hits / rows, "al": al,
            "bytes": bytes_in_bf16(model.weights), "matrices_vs_bf16": quantized_matrix_ratio(model.weights)}


def run(path, formats=FORMATS, n_windows=64, n_prompts=8, prompt_len=128, new=96, ks=(1, 2, 3, 4),
        group_size=128, seed=0, progress=print):
    import qwen_mtp
    from qwen_mtp.loading.folder import load_tokenizer

    ids = held_out_ids(load_tokenizer(path))
    rng = np.random.default_rng(seed)
    prompts = [ids[s:s + prompt_len] for s in rng.integers(0, ids.size - prompt_len - 1, n_prompts)]
    rows = []
    for fmt in formats:
        for head_q in ([False] if fmt == "bf16" else [True, False]):
            quant = None if fmt == "bf16" else fmt
            model = qwen_mtp.load(path, dtype="float32", quant=quant, group_size=group_size, quant_mtp=head_q)
            res = measure(model, ids, prompts, new, ks, n_windows)
            res.update(format=fmt, mtp_head=fmt if head_q else "bf16")
            rows.append(res)
            progress(f"{fmt:5s} head {res['mtp_head']:5s}: trunk loss {res['trunk_loss']:.3f}, "
                     f"alpha_1 {res['alpha1_teacher_forced']:.3f}, AL {[round(v, 2) for v in res['al'].values()]}")
    base = rows[0]["bytes"]
    for r in rows:
        r["bytes_vs_bf16"] = r["bytes"] / base
    return {"windows": n_windows, "prompts": n_prompts, "new": new, "group_size": group_size, "rows": rows}


def report(res) -> str:
    ks = list(res["rows"][0]["al"])
    head = "| weights | MTP head | trunk loss | alpha_1 (teacher-forced) | " + " | ".join(f"AL k={k}" for k in ks) \
        + " | bytes vs bf16 | quantized matrices vs bf16 |"
    lines = [head, "|" + " --- |" * (6 + len(ks))]
    for r in res["rows"]:
        als = " | ".join(f"{r['al'][k]:.2f}" for k in ks)
        lines.append(f"| {r['format']} | {r['mtp_head']} | {r['trunk_loss']:.4f} | "
                     f"{r['alpha1_teacher_forced']:.3f} | {als} | {r['bytes_vs_bf16']:.2f} | "
                     f"{'-' if r.get('matrices_vs_bf16') is None else format(r['matrices_vs_bf16'], '.3f')} |")
    lines.append(f"held-out: {res['windows']} windows of {SEQ} tokens; AL over {res['prompts']} prompts x "
                 f"{res['new']} greedy tokens (speculative output equal to plain greedy at every k); int4 groups "
                 f"of {res['group_size']}; compute in f32; bytes: plain arrays counted in bf16")
    return "\n".join(lines)


def main(argv=None):
    from qwen_mtp.loading.folder import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--write", action="store_true", help="write quant_eval.json next to the checkpoint")
    args = ap.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats or formats[0] != "bf16":
        ap.error(f"--formats: a comma list of {list(FORMATS)} starting with bf16 (the reference), found {args.formats!r}")
    res = run(args.model, formats, args.windows, args.prompts, new=args.new,
              ks=tuple(int(k) for k in args.ks.split(",")), group_size=args.group_size)
    print(report(res))
    if args.write:
        (Path(args.model) / "quant_eval.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
