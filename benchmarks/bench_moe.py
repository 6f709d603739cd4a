"""MoE decode on this machine: a Qwen3.5-35B-A3B-shaped slice (the real 256 experts of 512, top-8, shared expert
512, hidden 2048; a reduced vocabulary; 1-2 layers) with random weights, bf16 and int4, measured in one run.

    python benchmarks/bench_moe.py [--layers 1] [--vocab 8192] [--new 16] [--batches 1,8] [--formats bf16,int4]
                                   [--repeats 5] [--budget SECONDS] [--no-grouped] [--prefill T,T,...]
                                   [--prefill-only] [--path-limit SECONDS] [--short]

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
--prefill T,T,...: also time the MoE block at each T tokens (a prefill chunk) every way it can run, in one run:
  routed      each (token, expert) pair reads its expert (quant.routed_dot, forced): what decode runs; skipped
              where its gathered experts would pass 1.5 GB per matrix;
  tiles       the grouped path as it runs on CPU (kernels_pallas/moe_grouped.py: a loop over tiles of one expert's
              rows, each reading its expert by index);
  ragged      lax.ragged_dot over every expert (the grouped path elsewhere; on CPU before 2026-12-05);
  tokamax     tokamax.ragged_dot (default implementation: on CPU XLA's ragged_dot_general) in its place, where
              tokamax imports (pip install tokamax; not a dependency: the `bench` extra names it);
and what the dispatch takes there (mlp.reads_routed_only: routed while T x top_k <= num_experts, else grouped,
which is `tiles` on CPU). --prefill-only: no decode measurements (only the prefill table). --path-limit S: a path
whose call took more than S seconds at one token count is not run at the larger ones (each path's cost grows
with the tokens; XLA's CPU ragged_dot took 65 s for one 64-token block here), saying so.
--budget: stop starting new measurements past this many seconds (what was measured is printed). --short: a tiny
MoE config (hidden 64, 16 experts of 32, top-2, vocab 256), batch 1, 3 tokens, no grouped timing: the CI test of
this script (tests/test_moe_routed.py).
Random weights: qwen_mtp.trunk.random_weights; int4: quant.quantize (groups of 128) of the same weights, the
stacked experts quantized 16 at a time (the same values: scales are per expert) to bound the host memory.
"""

from __future__ import annotations

import argparse
import contextlib
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
        with _path(False, "ragged"):
            t_grouped = _best(jax.jit(lambda x, w: mlp.moe(x, w, cfg)), x, moe_w, repeats=1)
    return t_moe, t_dense, t_grouped


@contextlib.contextmanager
def _path(routed: bool, impl: str = "ragged", ragged=None):
    """While tracing: the MoE block's dispatch forced to `routed` (or not), its grouped product's impl
    (moe_grouped IMPLS) and the function its "ragged" impl calls (default lax.ragged_dot)."""
    import functools

    import jax

    from kernels_pallas import moe_grouped
    from qwen_mtp.trunk import mlp, quant

    real = mlp.reads_routed_only, mlp.grouped_dot, moe_grouped.RAGGED
    mlp.reads_routed_only = lambda n, c: routed
    mlp.grouped_dot = functools.partial(quant.grouped_dot, impl=impl)
    moe_grouped.RAGGED = jax.lax.ragged_dot if ragged is None else ragged
    try:
        yield
    finally:
        mlp.reads_routed_only, mlp.grouped_dot, moe_grouped.RAGGED = real


def prefill_times(moe_w, cfg, tokens, dtype, paths=("routed", "tiles", "ragged", "tokamax"), skip=None):
    """{path: seconds or why not} of the MoE block at `tokens` tokens (module doc), one timed call each after the
    compile, and the largest relative difference of each path from `tiles`."""
    import jax
    import jax.numpy as jnp

    from qwen_mtp.extras import tokamax_or_reason
    from qwen_mtp.trunk import mlp
    from qwen_mtp.trunk.quant import QuantArray

    x = jax.random.normal(jax.random.PRNGKey(tokens), (tokens, cfg.hidden_size), jnp.float32).astype(dtype)

    # the gather's copy per pair: the expert's values (quantized ones: dequantized in float32)
    per_expert = cfg.hidden_size * cfg.moe_intermediate_size * (4 if isinstance(moe_w.gate, QuantArray) else
                                                                 jnp.dtype(moe_w.gate.dtype).itemsize)
    out, got = {}, {}
    for path in paths:
        if skip and path in skip:
            out[path] = skip[path]
            continue
        if path == "routed" and tokens * cfg.top_k * per_expert > 1.5e9:
            out[path] = f"not run ({tokens * cfg.top_k * per_expert / 1e9:.1f} GB of gathered experts per matrix)"
            continue
        ragged = None
        if path == "tokamax":
            tk = tokamax_or_reason()
            if isinstance(tk, str):
                out[path] = tk
                continue
            ragged = tk.ragged_dot
        try:
            with _path(path == "routed", "tiles" if path == "tiles" else "ragged", ragged):
                f = jax.jit(lambda x, w: mlp.moe(x, w, cfg))  # traced (the first call) under the forced path
                got[path] = np.asarray(f(x, moe_w).astype(jnp.float32))
            t = time.perf_counter()
            jax.block_until_ready(f(x, moe_w))
            out[path] = time.perf_counter() - t
        except Exception as e:  # noqa: BLE001 - a path that does not run here says why, the others still run
            out[path] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    ref = got.get("tiles")
    diff = {} if ref is None else {p: float(np.max(np.abs(g - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
                                   for p, g in got.items()}
    return out, diff


def print_prefill(fmt, cfg, tokens, times, diff):
    from qwen_mtp.trunk import mlp

    done = {p: t for p, t in times.items() if isinstance(t, float)}
    best = min(done, key=done.get) if done else None
    rule = "routed" if mlp.reads_routed_only(tokens, cfg) else "tiles"
    cells = []
    for p, t in times.items():
        if isinstance(t, float):
            rel = f", {t / done[best]:.2f}x the fastest" if best and p != best else " (fastest)"
            cells.append(f"{p} {1e3 * t:.1f} ms{rel}" + (f" [max_rel vs tiles {diff[p]:.1e}]" if p in diff and
                                                           p != "tiles" else ""))
        else:
            cells.append(f"{p}: {t}")
    print(f"{fmt} MoE block at {tokens} tokens ({tokens * cfg.top_k} pairs): " + "; ".join(cells) +
          f"; the dispatch takes {rule}" + ("" if best is None else f" ({'=' if rule == best else '!='} fastest)"),
          flush=True)
    return {"fmt": fmt, "tokens": tokens, "best": best, "rule": rule, **{p: t for p, t in done.items()}}


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
    ap.add_argument("--prefill", default="", help="comma-separated token counts: time the block every way there")
    ap.add_argument("--prefill-only", action="store_true", help="only the prefill table (no decode runs)")
    ap.add_argument("--path-limit", type=float, default=None,
                    help="seconds: a prefill path slower than this at one token count is not run at larger ones")
    ap.add_argument("--short", action="store_true", help="tiny config, few tokens (the CI test)")
    a = ap.parse_args(argv)
    if a.short:
        a.new, a.repeats, a.batches, a.no_grouped = 3, 1, "1", True
    batches = [] if a.prefill_only else [int(b) for b in a.batches.split(",")]
    prefill = sorted(int(t) for t in a.prefill.split(",") if t.strip())
    if a.prefill_only and not prefill:
        ap.error("--prefill-only needs --prefill T,T,...")
    formats = a.formats.split(",")
    for f in formats:
        if f not in ("bf16", "int8", "int4", "fp8"):
            ap.error(f"--formats: each of bf16, int8, int4, fp8, found {f!r}")
    t_start = time.perf_counter()
    over = lambda: a.budget is not None and time.perf_counter() - t_start > a.budget

    import jax
    import jax.numpy as jnp

    import qwen_mtp
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
    rows, prows = [], []
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
        skip = {}
        for tokens in prefill:
            if over():
                print(f"budget spent: {fmt} prefill at {tokens} tokens not measured", flush=True)
                break
            times, diff = prefill_times(moe_w, cfg, tokens, jnp.bfloat16, skip=skip)
            for p, t in times.items():
                if a.path_limit is not None and isinstance(t, float) and t > a.path_limit:
                    skip[p] = f"not run (--path-limit: {t:.0f} s at {tokens} tokens)"
            prows.append(print_prefill(fmt, cfg, tokens, times, diff))
    print("\nsummary (MoE block / dense MLP of the same active parameter count; target <= 1.5x at batch 1):")
    for r in rows:
        flag = "" if r["batch"] != 1 else ("  (meets <= 1.5x)" if r["ratio"] <= 1.5 else "  (MISSES 1.5x)")
        print(f"  {r['fmt']:5s} B={r['batch']}: {r['tok_s']:8.2f} tok/s  MoE/dense {r['ratio']:.2f}x{flag}")
    if prows:
        print("\nprefill summary (the MoE block; fastest path per format and token count, and the dispatch's):")
        for r in prows:
            print(f"  {r['fmt']:5s} T={r['tokens']:4d}: fastest {r['best']}, dispatch {r['rule']}" +
                  "".join(f"  {p} {1e3 * r[p]:.1f} ms" for p in ("routed", "tiles", "ragged", "tokamax") if p in r))
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
