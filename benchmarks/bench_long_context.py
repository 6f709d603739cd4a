"""Long contexts on this machine: prefill tokens/s and prefill memory, decode TPOT, native and Wind-MTP speculative
TPOT, with the blocked causal attention (kernels_pallas/causal_attention.py) and the block-diagonal decode
products (kernels_pallas/masked_attention.py), and decode reading the cache before its new row is written in place
(attention.attention_layer), against the forms they replaced: the dense masked prefill, the batched per-kv-head
decode products over a cache written first by one scatter (`--dense-max`: the contexts the old forms still run
at), all from one run. Both forms are compiled with today's loop options (ops.LOOP_COMPILER_OPTIONS).

    python benchmarks/bench_long_context.py [--contexts 8192,32768,131072] [--dtype bfloat16] [--new 32]
                                            [--dense-max 32768] [--spec-at LARGEST]

Prompts are the shipped model's held-out text (tiled where a context is longer than it). Every program is
compiled before it is timed. Memory is read from the compiled prefill-chunk program (`memory_analysis`): its
scratch (temporaries) and the KV cache it updates; the blocked form's scratch must not grow with the context.
Greedy tokens of the two forms are compared at every context the dense one runs at.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def prompt_of(ids, n):
    reps = -(-n // len(ids))
    return np.tile(ids, reps)[:n].astype(np.int32)


def chunk_memory(model, context, chunk=256):
    """(scratch bytes, KV cache bytes) of the compiled prefill-chunk program at batch 1 and `context` slots."""
    import jax
    import jax.numpy as jnp

    from qwen_mtp.decoding.prefill import trunk_chunk
    from qwen_mtp.trunk.state import init_state

    cfg = model.config
    state = jax.eval_shape(lambda: init_state(cfg, 1, context, model.weights.embed.dtype))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    compiled = trunk_chunk.lower(model.weights, cfg, i32(1, chunk), state, i32(1), i32(1)).compile()
    kv = sum(x.size * x.dtype.itemsize for layer in state if hasattr(layer, "k") for x in (layer.k, layer.v))
    return compiled.memory_analysis().temp_size_in_bytes, kv


def timed(model, ids, new, spec=None):
    import qwen_mtp

    qwen_mtp.precompile(model, [ids], new, spec=spec, eos_token_id=[])
    r = qwen_mtp.generate(model, [ids], new, spec=spec, eos_token_id=[])
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--new", type=int, default=32, help="new tokens per run (decode TPOT)")
    ap.add_argument("--dense-max", type=int, default=32768, help="the largest context the dense form runs at")
    ap.add_argument("--spec-at", default="largest", help="contexts (comma list, or 'largest', 'all', 'none') "
                    "where native and windowed speculative TPOT are measured")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--window", type=int, default=256)
    args = ap.parse_args(argv)

    import jax

    import kernels_pallas.causal_attention as ca
    import kernels_pallas.masked_attention as ma
    import qwen_mtp
    import qwen_mtp.trunk.attention as attention
    from checkpoints.corpus import held_out_ids
    from qwen_mtp.loading.folder import default_model_path, load_tokenizer

    path = default_model_path()
    model = qwen_mtp.load(path, dtype=args.dtype)
    base = held_out_ids(load_tokenizer(path))
    limit = model.config.max_position_embeddings - args.new
    contexts = [min(int(c), limit) for c in args.contexts.split(",")]
    named = {"largest": {max(contexts)}, "all": set(contexts), "none": set()}
    if args.spec_at in named:
        spec_at = named[args.spec_at]
    else:
        try:
            spec_at = {min(int(c), limit) for c in args.spec_at.split(",") if c}
        except ValueError:
            ap.error(f"--spec-at: expected 'largest', 'all', 'none' or a comma list of contexts, "
                     f"got {args.spec_at!r}")
    blocks, few = (ca.PREFILL_BLOCK, ca.DECODE_BLOCK), ma.BLOCK_DIAGONAL_ROWS
    per_row = attention.write_rows_per_row

    def dense(on: bool):
        """The old forms: every prefill chunk against the whole cache; decode and verify in batched products,
        their new rows written first (as one scatter) and read back from the cache."""
        ca.PREFILL_BLOCK, ca.DECODE_BLOCK = (1 << 30, 1 << 30) if on else blocks
        ma.BLOCK_DIAGONAL_ROWS = attention.BLOCK_DIAGONAL_ROWS = 0 if on else few
        attention.write_rows_per_row = (lambda c, u, p, as_bits=False: attention.write_rows_scatter(c, u, p)) \
            if on else per_row
        jax.clear_caches()

    print(f"{path.name} ({args.dtype}), batch 1, {args.new} new tokens per run; blocked attention: prefill blocks "
          f"of {ca.PREFILL_BLOCK} slots, decode parts of {ca.DECODE_SPLIT} x {ca.DECODE_BLOCK}; {jax.devices()[0]}")
    rows = []
    for n in contexts:
        ids = prompt_of(base, n)
        t0 = time.perf_counter()
        mem_b = chunk_memory(model, n + args.new)
        r_b = timed(model, ids, args.new)
        line = {"context": n, "prefill_b": n / r_b.stats.prefill_s, "tpot_b": r_b.stats.tpot_s,
                "scratch_b": mem_b[0], "kv": mem_b[1]}
        if n <= args.dense_max:
            dense(True)
            mem_d = chunk_memory(model, n + args.new)
            r_d = timed(model, ids, args.new)
            dense(False)
            line.update(prefill_d=n / r_d.stats.prefill_s, tpot_d=r_d.stats.tpot_s, scratch_d=mem_d[0],
                        same=bool(np.array_equal(r_b.tokens, r_d.tokens)))
        if n in spec_at:
            nat = timed(model, ids, args.new, qwen_mtp.SpecConfig(k=args.k))
            win = timed(model, ids, args.new, qwen_mtp.SpecConfig(k=args.k, window=args.window, sinks=4))
            line.update(tpot_native=nat.stats.tpot_s, al_native=nat.stats.acceptance_length,
                        tpot_window=win.stats.tpot_s, al_window=win.stats.acceptance_length,
                        spec_same=bool(np.array_equal(nat.tokens, r_b.tokens) and np.array_equal(win.tokens, r_b.tokens)))
        rows.append(line)
        print(f"  context {n}: {time.perf_counter() - t0:.0f} s", flush=True)

    mib = lambda b: f"{b / 2 ** 20:.0f} MiB"
    print("\n| context | prefill tok/s blocked | dense | blocked / dense | scratch blocked | dense | KV cache "
          "| TPOT ms now | old | old / now | greedy same |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        d = "prefill_d" in r
        print(f"| {r['context']} | {r['prefill_b']:.0f} | {r['prefill_d']:.0f} | {r['prefill_b'] / r['prefill_d']:.2f}x "
              if d else f"| {r['context']} | {r['prefill_b']:.0f} | - | - ", end="")
        print(f"| {mib(r['scratch_b'])} | {mib(r['scratch_d']) if d else '-'} | {mib(r['kv'])} "
              f"| {1e3 * r['tpot_b']:.2f} | {1e3 * r['tpot_d']:.2f} | {r['tpot_d'] / r['tpot_b']:.2f}x | {r['same']} |"
              if d else f"| {mib(r['scratch_b'])} | - | {mib(r['kv'])} | {1e3 * r['tpot_b']:.2f} | - | - | - |")
    spec_rows = [r for r in rows if "tpot_native" in r]
    if spec_rows:
        print(f"\n| context | TPOT ms plain | native k{args.k} (AL) | W{args.window} k{args.k} (AL) | native / plain "
              "| windowed / plain | identical to plain |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in spec_rows:
            print(f"| {r['context']} | {1e3 * r['tpot_b']:.2f} | {1e3 * r['tpot_native']:.2f} ({r['al_native']:.2f}) | "
                  f"{1e3 * r['tpot_window']:.2f} ({r['al_window']:.2f}) | {r['tpot_b'] / r['tpot_native']:.2f}x | "
                  f"{r['tpot_b'] / r['tpot_window']:.2f}x | {r['spec_same']} |")


if __name__ == "__main__":
    from qwen_mtp.extras import run_script

    sys.exit(run_script(main))
