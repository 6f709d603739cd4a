"""Plain greedy decode and prefill throughput of qwen_mtp against transformers on the same checkpoint.

Both run on this machine's CPU in one process, one after the other, each after a warm-up (compiles for
JAX), best of --repeats; the ratios printed at the end are measured in this one run. Without --model a
randomised Qwen3.5 text checkpoint of a small but not tiny size is built with transformers.

    python benchmarks/bench_trunk.py [--model PATH] [--prompt 512] [--new 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def build_checkpoint(folder):
    import hf_tiny

    model = hf_tiny.make_hf_model("dense", seed=0, vocab_size=4096, hidden_size=256, intermediate_size=768,
                                  num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                  linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
                                  linear_value_head_dim=32, max_position_embeddings=4096)
    model.save_pretrained(folder)
    return folder


def best(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint folder (default: build a random one)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    from qwen_mtp.extras import require
    require("benchmarks/bench_trunk.py (transformers is its baseline)", "test", ["torch", "transformers"])

    import jax
    import torch
    from transformers import AutoModelForCausalLM

    import qwen_mtp

    torch.set_num_threads(os.cpu_count())
    folder = args.model or build_checkpoint(tempfile.mkdtemp(prefix="bench_trunk_"))
    model = qwen_mtp.load(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    cfg = model.config
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, size=args.prompt)
    print(f"checkpoint {folder}: {cfg.model_type}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"vocab {cfg.vocab_size}; prompt {args.prompt}, new {args.new}; jax {jax.__version__} "
          f"on {jax.devices()[0].platform}, torch {torch.__version__} with {torch.get_num_threads()} threads")

    # qwen_mtp: warm-up (compiles), then timed runs; stats separate prefill from the decode loop
    qwen_mtp.generate(model, ids, args.new, eos_token_id=[])
    runs = [qwen_mtp.generate(model, ids, args.new, eos_token_id=[]) for _ in range(args.repeats)]
    q_prefill = max(r.stats.prefill_tokens_per_s for r in runs)
    q_decode = max(r.stats.decode_tokens_per_s for r in runs)
    q_tokens = runs[0].tokens[0]

    # transformers: prefill = one forward; decode = (generate - prefill) over new - 1 tokens
    x = torch.tensor([ids.tolist()])
    with torch.no_grad():
        hf(x)
        t_pre, _ = best(lambda: hf(x), args.repeats)
        gen = lambda: hf.generate(x, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, repetition_penalty=1.0,
                                  eos_token_id=None, pad_token_id=0)
        gen()
        t_gen, out = best(gen, args.repeats)
    h_prefill = args.prompt / t_pre
    h_decode = (args.new - 1) / max(t_gen - t_pre, 1e-9)
    same = int((out[0, args.prompt:].numpy() == q_tokens).sum())

    print(f"{'':24s}{'qwen_mtp':>12s}{'transformers':>14s}{'ratio':>8s}")
    print(f"{'prefill tokens/s':24s}{q_prefill:12.1f}{h_prefill:14.1f}{q_prefill / h_prefill:8.2f}")
    print(f"{'greedy decode tokens/s':24s}{q_decode:12.1f}{h_decode:14.1f}{q_decode / h_decode:8.2f}")
    print(f"greedy tokens identical to transformers.generate: {same}/{args.new} "
          "(transformers' cached decode drifts from its own full forward on long prompts; see tests/hf_tiny.py)")


if __name__ == "__main__":
    from qwen_mtp.extras import run_script
    sys.exit(run_script(main))
