"""Greedy decode speed and weight bytes per weight format (bf16, int8, int4, fp8), measured in one run on this
machine, with the ratios against bf16.

    python benchmarks/bench_quant.py [--model PATH | --shape Qwen3.5-0.8B --layers 4] [--new 64] [--repeats 3]
                                     [--formats bf16,int8,int4,fp8] [--group-size 128] [--no-quant-lm-head]
                                     [--mesh data=D,model=M]

Default: the shipped model, then a model of the Qwen3.5-0.8B shape (hidden 1024, vocab 248320, tied) cut to
--layers layers with random bf16 weights, where a decode step reads hundreds of MB of weights. Compute in bf16
at batch 1. The lm_head (for a tied model, a quantized copy of embed^T) is quantized too unless
--no-quant-lm-head: at the 0.8B shape it is a third of the weights read per token. "read/token" counts the bytes
a decode step reads (every matrix; the embedding only where it serves as the tied lm_head).

On a CPU the quantized matmul is XLA's dequantize-then-dot (kernels_pallas/quant_matmul.py's reference): each
step converts the weights it reads, so expect it to be slower than bf16 here; the Pallas kernel that reads the
packed tiles runs on a GPU (benchmarks/gpu_check times it against the same reference and a bf16 dot).
--mesh shards each loaded model over a device mesh (qwen_mtp.shard; the CLI's --mesh syntax); "weights MB" and
"read/token" stay the whole model's bytes, the sharding report prints each model's bytes per device.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def random_checkpoint(shape: str, layers: int, folder: Path, seed: int = 0) -> Path:
    """A HF checkpoint of a real shape (real_shapes.py) with `layers` layers, random bf16 weights
    (qwen_mtp/trunk/random_weights.py), an MTP head."""
    import ml_dtypes

    from qwen_mtp.loading.hf_write import save_checkpoint
    from qwen_mtp.tools.real_shapes import _COMMON, REAL_CONFIGS, config
    from qwen_mtp.trunk.random_weights import random_weights

    cfg = config(shape, layers=layers)
    weights = random_weights(cfg, seed, "bfloat16")
    raw = {**_COMMON, **REAL_CONFIGS[shape], "num_hidden_layers": layers,
           "architectures": ["Qwen3_5ForCausalLM"]}
    save_checkpoint(folder, weights, cfg, raw, dtype=ml_dtypes.bfloat16)
    return folder


def read_per_token(model) -> int:
    b = model.weight_bytes()["total"]
    w = model.weights
    if w.lm_head is not None:  # the embedding is only gathered from
        b -= int(w.embed.size * w.embed.dtype.itemsize)
    return b


def bench(path, formats, new, repeats, group_size, quant_lm_head, mesh=None):
    import qwen_mtp

    rows = []
    ids = np.random.default_rng(0).integers(1, 1000, 32)
    for fmt in formats:
        quant = None if fmt == "bf16" else fmt
        t0 = time.perf_counter()
        m = qwen_mtp.load(path, dtype="bfloat16", quant=quant, group_size=group_size, quant_lm_head=quant_lm_head)
        if mesh is not None:
            m = qwen_mtp.shard(m, mesh)
            print(f"{fmt}: {m.describe_sharding()}", flush=True)
        t_load = time.perf_counter() - t0
        qwen_mtp.generate(m, ids, new, eos_token_id=[])  # compiles
        runs = [qwen_mtp.generate(m, ids, new, eos_token_id=[]) for _ in range(repeats)]
        tok_s = max(r.stats.decode_tokens_per_s for r in runs)
        rows.append({"format": fmt, "decode_tok_s": tok_s, "bytes": m.weight_bytes()["total"],
                     "read_per_token": read_per_token(m), "load_s": t_load,
                     "tokens": runs[0].tokens[0].tolist()})
    base = rows[0]
    for r in rows:
        r["speed_vs_bf16"] = r["decode_tok_s"] / base["decode_tok_s"]
        r["bytes_vs_bf16"] = r["bytes"] / base["bytes"]
        r["same_tokens_as_bf16"] = int(np.sum(np.array(r["tokens"]) == np.array(base["tokens"])))
        r["gb_s"] = r["read_per_token"] * r["decode_tok_s"] / 1e9
    return rows


def table(title, rows, new) -> str:
    out = [title, f"{'format':8s}{'decode tok/s':>14s}{'vs bf16':>9s}{'weights MB':>12s}{'vs bf16':>9s}"
                  f"{'read/token MB':>15s}{'GB/s':>7s}{'load s':>8s}{'tokens = bf16':>15s}"]
    for r in rows:
        out.append(f"{r['format']:8s}{r['decode_tok_s']:14.1f}{r['speed_vs_bf16']:9.2f}{r['bytes'] / 1e6:12.1f}"
                   f"{r['bytes_vs_bf16']:9.2f}{r['read_per_token'] / 1e6:15.1f}{r['gb_s']:7.2f}{r['load_s']:8.1f}"
                   f"{r['same_tokens_as_bf16']:>10d}/{new}")
    return "\n".join(out)


def main(argv=None):
    import jax

    from qwen_mtp.loading.folder import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a checkpoint folder (default: the shipped model, then the --shape model)")
    ap.add_argument("--shape", default="Qwen3.5-0.8B")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--formats", default="bf16,int8,int4,fp8")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--no-quant-lm-head", action="store_true")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--mesh", default=None, metavar="data=D,model=M", help="shard each model over this mesh "
                    "after loading (load s then includes the placement)")
    args = ap.parse_args(argv)
    formats = args.formats.split(",")
    if formats[0] != "bf16":
        ap.error("--formats must start with bf16 (the reference of the ratios)")
    from qwen_mtp.errors import ArgumentError
    from qwen_mtp.parallel.sharding import parse_mesh

    try:
        mesh = None if args.mesh is None else parse_mesh(args.mesh)
    except ArgumentError as e:
        ap.error(str(e))
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; batch 1, 32-token prompt, {args.new} new tokens, "
          f"best of {args.repeats}; lm_head {'kept in bf16' if args.no_quant_lm_head else 'quantized'}; "
          f"int4 groups of {args.group_size}" + ("" if mesh is None else f"; mesh {args.mesh}"))
    targets = [("checkpoint " + args.model, Path(args.model))] if args.model else [
        (f"shipped model {default_model_path()}", default_model_path()), None]
    results = {}
    for t in targets:
        if t is None:
            tmp = Path(tempfile.mkdtemp(prefix="bench_quant_"))
            t = (f"random {args.shape} shape, {args.layers} layers", random_checkpoint(args.shape, args.layers, tmp))
        title, path = t
        rows = bench(path, formats, args.new, args.repeats, args.group_size, not args.no_quant_lm_head, mesh)
        results[title] = rows
        print(table(title, rows, args.new), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
