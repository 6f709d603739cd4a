"""MoE decode on this machine: a Qwen3.5-35B-A3B-shaped slice (the real 256 experts of 512, top-8, shared expert
512, hidden 2048; a reduced vocabulary; 1-2 layers) with random weights, bf16 and int4, measured in one run.

    python benchmarks/bench_moe.py [--layers 1] [--vocab 8192] [--new 16] [--batches 1,8] [--formats bf16,int4]
                                   [--repeats 5] [--budget SECONDS] [--no-grouped] [--prefill T] [--short]

Prints, per format and batch:
  * decode tokens/s through the public API (qwen_mtp.generate, greedy, plain decode);
  * the MoE block alone (trunk/mlp.py moe: router, routed experts, shared expert) against a dense SwiGLU MLP of
    the same active parameter count (intermediate top_k x expert width + shared width = 4608 at 35B-A3B; the
    router's H x E, 2% more, is the MoE block's alone), the ratio "MoE block / dense MLP" (target <= 1.5x at
    batch 1), and the grouped path it replaced at decode (lax.ragged_dot over every expert) where --no-grouped
    is not given;
  * the bytes one decode step reads (every matrix of the slice except the embedding, of which one row per
    token; the experts: one per (token, expert) pair, as the routed path reads them) against this machine's
    read bandwidth measured here (a jitted sum over a 512 MB array), as the step time that bandwidth implies.
--prefill T: also time the MoE block at T tokens (a prefill chunk) both ways, routed (forced) and grouped, to
show which is faster there on this machine (mlp.reads_routed_only sends T x top_k > num_experts to the grouped
path). --budget: stop starting new measurements past this many seconds (what was measured is printed). --short: a tiny
MoE config (hidden 64, 16 experts of 32, top-2, vocab 256), batch 1, 3 tokens, no grouped timing: the CI test of
this script (tests/test_moe_routed.py).
Random weights: qwen_mtp.trunk.random_weights; int4: quant.quantize (groups of 128) of the same weights, the
stacked experts quantized 16 at a time (the same values: scales are per expert) to bound the host memory.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def slice_config(layers: int, vocab: int, short: bool):
    from qwen_mtp.tools.real_shapes import _COMMON, REAL_CONFIGS
    from qwen_mtp.trunk.config import parse_config

    raw = {**_COMMON, **REAL_CONFIGS["Qwen3.5-35B-A3B"], "num_hidden_layers": layers, "vocab_size": vocab}
    if short:
        raw.update(vocab_size=256, hidden_size=64, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                   linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                   linear_value_head_dim=16)
    return parse_config(raw, "<bench_moe: 35B-A3B slice>")


def quantize_tree(weights, method: str, group_size: int = 128, chunk: int = 16):
    """The matrices load(quant=method) quantizes (quant.QUANTIZED_FIELDS), quantized on the host; a stacked
    expert leaf in chunks of `chunk` experts (scales are per expert: the same values as one call)."""
    import jax
    import jax.numpy as jnp

    from qwen_mtp.trunk.quant import QUANTIZED_FIELDS, QuantArray, quantize

    def one(leaf):
        if leaf.ndim < 3:
            return quantize(np.asarray(leaf.astype(jnp.float32)), method, group_size)
        parts = [quantize(np.asarray(leaf[i:i + chunk].astype(jnp.float32)), method, group_size)
                 for i in range(0, leaf.shape[0], chunk)]
        return QuantArray(q=jnp.concatenate([p.q for p in parts]), scale=jnp.concatenate([p.scale for p in parts]),
                          kind=method, shape=tuple(leaf.shape), block=parts[0].block)

    def visit(path, leaf):
        return one(leaf) if getattr(path[-1], "name", None) in QUANTIZED_FIELDS else leaf

    return jax.tree_util.tree_map_with_path(visit, weights)


def read_bandwidth(mb: int = 512, repeats: int = 5) -> float:
    """Bytes per second of a jitted sum over an f32 array of `mb` MB (best of `repeats`)."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((mb * 2 ** 20 // 4,), jnp.float32)
    f = jax.jit(lambda a: a.sum())
    return a.nbytes / _best(f, a, repeats=repeats)


def _best(f, *args, repeats=5):
    import jax

    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return min(times)


def _nbytes(tree) -> int:
    from qwen_mtp.trunk.quant import weight_bytes

    return weight_bytes(tree)["total"]


def step_bytes(weights, cfg, batch: int) -> int:
    """Bytes a decode step at `batch` rows reads: every matrix but the embedding (one row per token) and the
    stacked experts, of which one expert per (token, expert) pair."""
    from qwen_mtp.trunk.weights import MoEWeights

    total = _nbytes(weights) - _nbytes(weights.embed) + batch * weights.embed.shape[1] * weights.embed.dtype.itemsize
    for layer in weights.layers:
        if isinstance(layer.mlp, MoEWeights):
            experts = _nbytes((layer.mlp.gate, layer.mlp.up, layer.mlp.down))
            total += experts * min(batch * cfg.top_k, cfg.num_experts) // cfg.num_experts - experts
    return total


def dense_equivalent(cfg, dtype, method):
    """A dense SwiGLU MLP of the MoE block's active size (intermediate top_k x I + shared I), random."""
    import jax
    import jax.numpy as jnp

    from qwen_mtp.trunk.weights import MLPWeights

    H, inter = cfg.hidden_size, cfg.top_k * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size
    k = jax.random.split(jax.random.PRNGKey(7), 3)
    draw = lambda key, s: (jax.random.normal(key, s, jnp.float32) / np.sqrt(s[0])).astype(dtype)
    w = MLPWeights(gate=draw(k[0], (H, inter)), up=draw(k[1], (H, inter)), down=draw(k[2], (inter, H)))
    return (w if method is None else quantize_tree(w, method)), inter


def block_times(moe_w, dense_w, cfg, batch, dtype, repeats, grouped: bool):
    """(MoE block s, dense MLP s, grouped MoE block s or None) at `batch` tokens, best of `repeats`."""
    import jax
    import jax.numpy as jnp

    from qwen_mtp.trunk import mlp

    x = (jax.random.normal(jax.random.PRNGKey(batch), (batch, cfg.hidden_size), jnp.float32)).astype(dtype)
    t_moe = _best(jax.jit(lambda x, w: mlp.moe(x, w, cfg)), x, moe_w, repeats=repeats)
    t_dense = _best(jax.jit(mlp.mlp), x, dense_w, repeats=repeats)
    t_grouped = None
    if grouped:
        t_grouped = _forced(lambda n, c: False, lambda x, w: mlp.moe(x, w, cfg), x, moe_w)
    return t_moe, t_dense, t_grouped


def _forced(rule, f, *args, repeats=1):
    """Seconds of f(*args) (jitted here) with mlp.reads_routed_only replaced by `rule` while it is traced."""
    import jax

    from qwen_mtp.trunk import mlp

    real = mlp.reads_routed_only
    mlp.reads_routed_only = rule
    try:
        return _best(jax.jit(f), *args, repeats=repeats)
    finally:
        mlp.reads_routed_only = real


def prefill_times(moe_w, cfg, tokens, dtype):
    """(routed s, grouped s) of the MoE block at `tokens` tokens, one timed call each after the compile."""
    import jax
    import jax.numpy as jnp

    from qwen_mtp.trunk import mlp

    x = jax.random.normal(jax.random.PRNGKey(tokens), (tokens, cfg.hidden_size), jnp.float32).astype(dtype)
    f = lambda x, w: mlp.moe(x, w, cfg)
    return _forced(lambda n, c: True, f, x, moe_w), _forced(lambda n, c: False, f, x, moe_w)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--formats", default="bf16,int4")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget", type=float, default=None, help="seconds: start no new measurement past this")
    ap.add_argument("--no-grouped", action="store_true", help="skip timing the grouped (ragged_dot) block")
    ap.add_argument("--prefill", type=int, default=0, help="also time the block at this many tokens both ways")
    ap.add_argument("--short", action="store_true", help="tiny config, few tokens (the CI test)")
    a = ap.parse_args(argv)
    if a.short:
        a.new, a.repeats, a.batches, a.no_grouped = 3, 1, "1", True
    batches = [int(b) for b in a.batches.split(",")]
    formats = a.formats.split(",")
    for f in formats:
        if f not in ("bf16", "int8", "int4", "fp8"):
            ap.error(f"--formats: each of bf16, int8, int4, fp8, found {f!r}")
    t_start = time.perf_counter()
    over = lambda: a.budget is not None and time.perf_counter() - t_start > a.budget

    import jax
    import jax.numpy as jnp

    import qwen_mtp
    from qwen_mtp.trunk import mlp
    from qwen_mtp.trunk.quant import QuantPolicy
    from qwen_mtp.trunk.random_weights import random_weights

    cfg = slice_config(a.layers, a.vocab, a.short)
    bw = read_bandwidth(64 if a.short else 512)
    print(f"machine: {jax.devices()[0].device_kind}, {jax.device_count()} device(s); read bandwidth (jitted sum over "
          f"{64 if a.short else 512} MB f32) {bw / 1e9:.2f} GB/s", flush=True)
    print(f"slice: {len(cfg.layer_types)} layer(s) {list(cfg.layer_types)}, hidden {cfg.hidden_size}, "
          f"{cfg.num_experts} experts of {cfg.moe_intermediate_size} (top-{cfg.top_k}), shared "
          f"{cfg.shared_expert_intermediate_size}, vocab {cfg.vocab_size}", flush=True)
    t = time.perf_counter()
    base = random_weights(cfg, 0, "bfloat16", mtp=False)
    print(f"random bf16 weights in {time.perf_counter() - t:.1f} s", flush=True)
    ids = np.random.default_rng(0).integers(1, cfg.vocab_size, 16)
    rows = []
    for fmt in formats:
        if over():
            print(f"budget spent: {fmt} not measured", flush=True)
            break
        method = None if fmt == "bf16" else fmt
        t = time.perf_counter()
        weights = base if method is None else quantize_tree(base, method)
        model = qwen_mtp.Model(config=cfg, weights=weights, path="<random 35B-A3B slice>", dtype="bfloat16",
                               quant=None if method is None else QuantPolicy(method))
        dense, inter = dense_equivalent(cfg, jnp.bfloat16, method)
        print(f"{fmt}: weights {_nbytes(weights) / 1e6:.0f} MB (quantized in {time.perf_counter() - t:.1f} s); "
              f"dense MLP of the same active size: intermediate {inter}", flush=True)
        moe_w = next(layer.mlp for layer in weights.layers if hasattr(layer.mlp, "router"))
        for batch in batches:
            if over():
                print(f"budget spent: {fmt} batch {batch} not measured", flush=True)
                break
            prompts = [ids] * batch
            qwen_mtp.generate(model, prompts, a.new, eos_token_id=[])  # compiles
            runs = [qwen_mtp.generate(model, prompts, a.new, eos_token_id=[]) for _ in range(max(1, a.repeats // 2))]
            tok_s = max(r.stats.decode_tokens_per_s for r in runs)
            t_moe, t_dense, t_grouped = block_times(moe_w, dense, cfg, batch, jnp.bfloat16, a.repeats,
                                                    not a.no_grouped and not over())
            nbytes = step_bytes(weights, cfg, batch)
            step_s = batch / tok_s
            row = {"fmt": fmt, "batch": batch, "tok_s": tok_s, "moe_ms": 1e3 * t_moe, "dense_ms": 1e3 * t_dense,
                   "ratio": t_moe / t_dense, "step_mb": nbytes / 1e6, "step_ms": 1e3 * step_s,
                   "roofline_ms": 1e3 * nbytes / bw}
            rows.append(row)
            grouped = "" if t_grouped is None else (f"; grouped (ragged_dot) block {1e3 * t_grouped:.1f} ms = "
                                                    f"{t_grouped / t_moe:.1f}x the routed one")
            print(f"{fmt} batch {batch}: decode {tok_s:.2f} tok/s (step {row['step_ms']:.1f} ms); MoE block "
                  f"{row['moe_ms']:.2f} ms, dense MLP {row['dense_ms']:.2f} ms: MoE block / dense MLP "
                  f"{row['ratio']:.2f}x{grouped}; step reads {row['step_mb']:.1f} MB = {row['roofline_ms']:.1f} ms "
                  f"at {bw / 1e9:.2f} GB/s ({row['roofline_ms'] / row['step_ms']:.0%} of the step)", flush=True)
        if a.prefill and not over():
            t_r, t_g = prefill_times(moe_w, cfg, a.prefill, jnp.bfloat16)
            print(f"{fmt} MoE block at {a.prefill} tokens ({a.prefill * cfg.top_k} pairs): routed {1e3 * t_r:.0f} ms, "
                  f"grouped (ragged_dot) {1e3 * t_g:.0f} ms: grouped / routed {t_g / t_r:.2f}x; the rule takes "
                  f"{'routed' if mlp.reads_routed_only(a.prefill, cfg) else 'grouped'}", flush=True)
    print("\nsummary (MoE block / dense MLP of the same active parameter count; target <= 1.5x at batch 1):")
    for r in rows:
        flag = "" if r["batch"] != 1 else ("  (meets <= 1.5x)" if r["ratio"] <= 1.5 else "  (MISSES 1.5x)")
        print(f"  {r['fmt']:5s} B={r['batch']}: {r['tok_s']:8.2f} tok/s  MoE/dense {r['ratio']:.2f}x{flag}")
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
