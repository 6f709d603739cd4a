"""The cost of one speculative round, phase by phase, as multiples of one plain decode step (one run).

    python benchmarks/bench_round.py [--model PATH] [--dtype float32] [--batch 1] [--k 1,2,3,4,5,6]
    python benchmarks/bench_round.py --rows 1,2,4,8     # what one more verified row costs

Each phase of a round (speculative.py) is compiled on its own, on the state a real prompt leaves, and timed
over many calls (median of several blocks of calls; calls are dispatched asynchronously so per-call dispatch
overlaps the work):
  draft     k draft tokens: the bridge's lm_head, then k - 1 head steps each with its lm_head
  verify    one trunk forward over k + 1 tokens keeping every GDN state, and the lm_head on its k + 1 rows
  accept    the longest agreeing prefix and the bonus token
  rollback  every GDN layer's state at the accepted count
  refill    the head over the k + 1 committed rows from the trunk's hiddens (the next bridge)
  round     the whole loop body, measured end to end inside spec_decode (decode time / rounds of a generate
            call with acceptance forced by nothing: the real drafts of the model on a held-out prompt)
The phases' sum and the measured round differ by what fusion across phases saves and by the bookkeeping
(token writes, EOS and budget checks, the accept histogram), printed as "other". "plain" is one plain step
(trunk forward of one token + lm_head + argmax) timed the same way.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _time(f, *args, calls=30, blocks=5):
    """Median seconds per call of the jitted f over `blocks` blocks of `calls` asynchronous calls."""
    import jax

    jax.block_until_ready(f(*args))
    out = []
    for _ in range(blocks):
        t = time.perf_counter()
        for _ in range(calls):
            r = f(*args)
        jax.block_until_ready(r)
        out.append((time.perf_counter() - t) / calls)
    return statistics.median(out)


def phase_functions(cfg, spec, sampling):
    """Jitted phases of one round (static config closed over)."""
    import jax
    import jax.numpy as jnp

    from qwen_mtp.decoding.rollback import select_states
    from qwen_mtp.decoding.sampling import choose
    from qwen_mtp.decoding.speculative import _accept, _draft
    from qwen_mtp.head.mtp import mtp_forward
    from qwen_mtp.trunk.forward import forward, lm_logits
    from qwen_mtp.trunk.ops import DECODE_COMPILER_OPTIONS

    k = spec.k
    jit = partial(jax.jit, compiler_options=DECODE_COMPILER_OPTIONS)  # as the decode loops are compiled

    @jit
    def plain(weights, state, tok, pos, key):
        B = tok.shape[0]
        hidden, state = forward(weights, cfg, tok[:, None], state, pos, jnp.ones((B,), jnp.int32), gdn_mode="step")
        return choose(key, lm_logits(weights, hidden[:, 0]), sampling), state

    @jit
    def draft(weights, mcache, m1, pos, key):
        return _draft(weights, cfg, mcache, m1, pos, spec, sampling, key)

    @jit
    def verify(weights, state, tokens, pos):
        B = tokens.shape[0]
        hidden, verified = forward(weights, cfg, tokens, state, pos, jnp.full((B,), k + 1, jnp.int32),
                                    gdn_mode="verify")
        return hidden, lm_logits(weights, hidden), verified

    @jit
    def accept(D, logits, key):
        return _accept(D, None, logits, sampling, key)

    @jit
    def rollback(verified, n):
        return select_states(verified, n)

    @jit
    def refill(weights, fill, hidden, mcache, pos, n):
        m_all, mcache, _ = mtp_forward(weights, cfg, fill, hidden, mcache, pos, window=spec.window, sinks=spec.sinks)
        return m_all[jnp.arange(fill.shape[0]), n], mcache

    return {"plain": plain, "draft": draft, "verify": verify, "accept": accept, "rollback": rollback, "refill": refill}


def profile(model, prompt, ks, batch, new_tokens, sampling=None):
    """{k: {phase: seconds}} plus the plain step, from the state `prompt` leaves; also the measured round from
    a real speculative generate (decode_s / rounds)."""
    import jax
    import jax.numpy as jnp

    import qwen_mtp
    from qwen_mtp.decoding.prefill import hidden_logits, mtp_prefill, prefill
    from qwen_mtp.decoding.request import round_up
    from qwen_mtp.decoding.sampling import Sampling

    sampling = sampling or Sampling()
    cfg, w = model.config, model.weights
    rows = [np.asarray(prompt)] * batch
    T = len(prompt)
    cache_len = round_up(T + 256 + 16, 128)
    state, last, hidden = prefill(model, rows, cache_len, keep_hidden=True)
    B = batch
    pos = jnp.full((B,), T, jnp.int32)
    key = jax.random.PRNGKey(0)
    first = jnp.argmax(hidden_logits(w, last), -1).astype(jnp.int32)
    out = {}
    base_fns = phase_functions(cfg, qwen_mtp.SpecConfig(k=1), sampling)
    plain_s = _time(lambda s: base_fns["plain"](w, s, first, pos, key), state)
    for k in ks:
        spec = qwen_mtp.SpecConfig(k=k)
        f = phase_functions(cfg, spec, sampling)
        nxt = np.zeros((B, hidden.shape[1]), np.int32)
        nxt[:, :T - 1] = np.asarray(prompt[1:])
        nxt[:, T - 1] = np.asarray(first)
        mout, mcache = mtp_prefill(model, nxt, hidden, cache_len, spec=spec)
        m1 = mout[:, T - 1]
        D, _, _ = f["draft"](w, mcache, m1, pos, key)
        tokens = jnp.concatenate([first[:, None], D], axis=1)
        vh, vlogits, verified = f["verify"](w, state, tokens, pos)
        n, bonus, _ = f["accept"](D, vlogits, key)
        fill = jnp.concatenate([D, bonus[:, None]], axis=1)
        t = {"draft": _time(f["draft"], w, mcache, m1, pos, key),
                 "verify": _time(f["verify"], w, state, tokens, pos),
                 "accept": _time(f["accept"], D, vlogits, key),
                 "rollback": _time(f["rollback"], verified, n),
                 "refill": _time(f["refill"], w, fill, vh, mcache, pos, n)}
        r = None
        for _ in range(3):  # compile, then best of two
            g = qwen_mtp.generate(model, rows, new_tokens, spec=spec, eos_token_id=[])
            if r is None or g.stats.decode_s / g.stats.rounds < r[0]:
                r = (g.stats.decode_s / g.stats.rounds, g.stats.acceptance_length)
        t["round"], t["AL"] = r
        out[k] = t
    loop_plain = None
    for _ in range(3):
        g = qwen_mtp.generate(model, rows, new_tokens, eos_token_id=[])
        s = g.stats.decode_s / max(int(g.lengths.max()) - 1, 1)
        loop_plain = s if loop_plain is None else min(loop_plain, s)
    return plain_s, loop_plain, out


def rows_cost(model, rows_list, cache_len=512, calls=50, blocks=5):
    """{T: seconds} of one trunk forward over T tokens at batch 1 plus its lm_head (T = 1: the plain step's
    "step" GDN form; T > 1: the verify's "verify" form and the rollback to position 0), `calls` of them chained
    inside ONE compiled fori_loop (no dispatch between them), min over `blocks` runs. What one more verified row
    costs."""
    import jax
    import jax.numpy as jnp

    from qwen_mtp.decoding.rollback import select_states
    from qwen_mtp.trunk.forward import forward, lm_logits
    from qwen_mtp.trunk.ops import DECODE_COMPILER_OPTIONS
    from qwen_mtp.trunk.state import init_state

    cfg, w = model.config, model.weights
    state = init_state(cfg, 1, cache_len, w.embed.dtype, None)
    pos = jnp.full((1,), cache_len // 4, jnp.int32)
    out = {}
    for T in rows_list:
        mode = "step" if T == 1 else "verify"

        def loop(w, state, tok, pos, T=T, mode=mode):
            def body(i, c):
                state, acc = c
                h, st = forward(w, cfg, tok + acc % 7, state, pos + i % 3, jnp.full((1,), T, jnp.int32),
                                gdn_mode=mode)
                st = select_states(st, jnp.zeros((1,), jnp.int32)) if T > 1 else st
                return st, acc + jnp.argmax(lm_logits(w, h), -1).astype(jnp.int32).sum()
            return jax.lax.fori_loop(0, calls, body, (state, jnp.int32(0)))

        f = jax.jit(loop, compiler_options=DECODE_COMPILER_OPTIONS)
        tok = jnp.ones((1, T), jnp.int32)
        jax.block_until_ready(f(w, state, tok, pos))
        best = None
        for _ in range(blocks):
            t = time.perf_counter()
            jax.block_until_ready(f(w, state, tok, pos))
            s = (time.perf_counter() - t) / calls
            best = s if best is None else min(best, s)
        out[T] = best
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the shipped model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--k", default="1,2,3,4,5,6")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rows", default=None, metavar="1,2,4,8",
                    help="instead of the phases: the trunk forward + lm_head over T tokens, for each T")
    args = ap.parse_args(argv)
    import qwen_mtp
    from checkpoints.corpus import held_out_file_ids
    from qwen_mtp.loading.folder import default_model_path, load_tokenizer

    folder = args.model or str(default_model_path())
    model = qwen_mtp.load(folder, dtype=args.dtype)
    ids = held_out_file_ids(load_tokenizer(folder), 3, 200, args.prompt)
    if args.rows:
        res = rows_cost(model, [int(x) for x in args.rows.split(",")])
        base = res.get(1) or next(iter(res.values()))
        print(f"model {folder} ({args.dtype}), batch 1: trunk forward + lm_head over T tokens, inside one loop")
        for T, s in res.items():
            print(f"T={T:<3d} {1e3 * s:7.3f} ms  {s / base:5.2f} x T=1" + (f"  (+{1e3 * (s - base) / (T - 1):.3f} ms "
                  "per extra row)" if T > 1 and 1 in res else ""))
        return
    ks = [int(x) for x in args.k.split(",")]
    plain_s, loop_plain, res = profile(model, ids, ks, args.batch, args.new)
    print(f"model {folder} ({args.dtype}), batch {args.batch}, prompt {args.prompt}, new {args.new}")
    print(f"plain step: {1e3 * plain_s:.3f} ms as a phase, {1e3 * loop_plain:.3f} ms inside the decode loop")
    cols = ("draft", "verify", "accept", "rollback", "refill", "other", "round")
    print("k   " + "".join(f"{c:>9s}" for c in cols) + "       AL  speedup   (phases in plain steps)")
    for k, t in res.items():
        other = t["round"] - sum(t[c] for c in cols[:5])
        vals = [t[c] / plain_s for c in cols[:5]] + [other / plain_s, t["round"] / loop_plain]
        print(f"{k:<4d}" + "".join(f"{v:9.2f}" for v in vals)
              + f"  {t['AL']:7.2f}  {t['AL'] / (t['round'] / loop_plain):7.2f}")


if __name__ == "__main__":
    main()
