"""Wind-MTP benchmark: draft-step time and draft-KV bytes against context length, native vs windowed, and
end-to-end TPOT at a long context. Every figure is a ratio measured in this one run.

    python benchmarks/bench_window.py [--contexts 1024,4096,16384,65536] [--window 256] [--sinks 4] [--k 3]
                                      [--e2e-context 16384]

Draft step = one MTP head row (T=1) plus lm_head and argmax, at the end of a context of L rows: native attends over an L-slot cache,
Wind-MTP over its ring of sinks + window + k slots. Each is timed as 32 steps inside one jitted fori_loop
(median of 5 repeats). On the shipped model; CPU unless a GPU is present (then the Pallas kernel runs).
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import qwen_mtp
from qwen_mtp.head.mtp import init_mtp_cache, mtp_forward
from qwen_mtp.loading.folder import default_model_path, load_tokenizer
from qwen_mtp.trunk.forward import lm_logits

STEPS = 32


@partial(jax.jit, static_argnames=("cfg", "window", "sinks"))
def _draft_steps(weights, cfg, cache, hidden, tok, start, window, sinks):
    """STEPS autoregressive draft steps as in speculative.py: head row, lm_head, argmax, feed back."""
    def body(i, c):
        h, tok, cache = c
        out, cache, _ = mtp_forward(weights, cfg, tok, h, cache, start + i, window=window, sinks=sinks)
        nxt = jnp.argmax(lm_logits(weights, out), axis=-1).astype(jnp.int32)
        return out, nxt, cache
    h, _, _ = jax.lax.fori_loop(0, STEPS, body, (hidden, tok, cache))
    return h


def draft_step_ms(model, L, window, sinks, k, repeats=5):
    cfg, w = model.config, model.weights
    H = cfg.hidden_size
    if window is None:
        cache = init_mtp_cache(cfg, 1, L + STEPS, jnp.float32)
    else:
        cache = init_mtp_cache(cfg, 1, 0, jnp.float32, window=window, sinks=sinks, k=k)
    rng = np.random.default_rng(0)
    cache = cache.replace(k=jnp.asarray(rng.standard_normal(cache.k.shape), jnp.float32),
                          v=jnp.asarray(rng.standard_normal(cache.v.shape), jnp.float32))
    hidden = jnp.asarray(rng.standard_normal((1, 1, H)), jnp.float32)
    tok = jnp.asarray([[5]], jnp.int32)
    start = jnp.asarray([L], jnp.int32)
    _draft_steps(w, cfg, cache, hidden, tok, start, window, sinks).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        _draft_steps(w, cfg, cache, hidden, tok, start, window, sinks).block_until_ready()
        times.append((time.perf_counter() - t) / STEPS)
    return 1e3 * float(np.median(times)), int(cache.k.nbytes + cache.v.nbytes)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--contexts", default="1024,4096,16384,65536")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--e2e-context", type=int, default=16384)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args(argv)
    model = qwen_mtp.load(args.model)
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"{jax.default_backend()} backend, model {model.path}; window {args.window}, sinks {args.sinks}, k {args.k}")
    print("| context | native draft ms | windowed draft ms | windowed/native | native KV bytes | windowed KV bytes |")
    print("| --- | --- | --- | --- | --- | --- |")
    rows = []
    for L in contexts:
        n_ms, n_b = draft_step_ms(model, L, None, 0, args.k)
        w_ms, w_b = draft_step_ms(model, L, args.window, args.sinks, args.k)
        rows.append((L, n_ms, w_ms, n_b, w_b))
        print(f"| {L} | {n_ms:.3f} | {w_ms:.3f} | {w_ms / n_ms:.2f} | {n_b:,} | {w_b:,} |")
    (L0, n0, w0, _, _), (L1, n1, w1, nb1, wb1) = rows[0], rows[-1]
    print(f"\nwindowed draft step at {L1} over at {L0}: {w1 / w0:.2f} (goal ~1.0); native: {n1 / n0:.2f}")
    print(f"draft KV at {L1}: windowed {wb1:,} bytes = {wb1 / nb1:.4f} of native {nb1:,}")

    tok = load_tokenizer(args.model)
    from checkpoints.corpus import held_out_text
    ids = np.asarray(tok.encode(held_out_text()).ids, np.int32)
    ids = np.tile(ids, -(-args.e2e_context // ids.size))[:args.e2e_context]
    res = {}
    for name, spec in [("plain", None), ("native", qwen_mtp.SpecConfig(k=args.k)),
                       ("windowed", qwen_mtp.SpecConfig(k=args.k, window=args.window, sinks=args.sinks))]:
        qwen_mtp.generate(model, ids, args.new, spec=spec, eos_token_id=[])  # compile
        r = qwen_mtp.generate(model, ids, args.new, spec=spec, eos_token_id=[])
        res[name] = r
        extra = "" if spec is None else f", AL {r.stats.acceptance_length:.2f}"
        print(f"e2e at context {args.e2e_context}: {name:8s} TPOT {1e3 * r.stats.tpot_s:.2f} ms{extra}")
    assert np.array_equal(res["windowed"].tokens, res["plain"].tokens), "windowed output differs from plain"
    assert np.array_equal(res["native"].tokens, res["plain"].tokens), "native spec output differs from plain"
    t = {k: v.stats.tpot_s for k, v in res.items()}
    print(f"TPOT ratios at {args.e2e_context}: windowed/native {t['windowed'] / t['native']:.2f}, "
          f"windowed/plain {t['windowed'] / t['plain']:.2f}, native/plain {t['native'] / t['plain']:.2f} "
          f"(identical tokens in all three)")


if __name__ == "__main__":
    main()
