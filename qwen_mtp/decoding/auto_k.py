"""--k auto: time plain decoding and each k on this machine and these prompts, keep the fastest."""

from __future__ import annotations

import sys

K_AUTO_CANDIDATES = (1, 2, 3, 4, 5, 6)


def _discard(rows):
    pass


def pick_k(model, ids, max_new, sampling_kw, make_spec, candidates=K_AUTO_CANDIDATES, log=sys.stderr):
    """Measure decode time for plain decoding and each k on these prompts (one prompt, or a batch: speculation
    that wins at batch 1 can lose at a larger batch) and this machine; return the fastest (None = plain). Each
    candidate is compiled ahead of time, then run once, timed: decode seconds per token decoded (every row's
    tokens after its first, which prefill chose)."""
    from qwen_mtp.decoding.generate import generate, precompile

    timings = {}
    for k in (None, *candidates):
        spec = None if k is None else make_spec(k)
        precompile(model, ids, max_new, spec=spec, **sampling_kw)
        r = generate(model, ids, max_new, spec=spec, stream=_discard, **sampling_kw)
        timings[k] = r.stats.decode_s / max(int(r.lengths.sum()) - len(r.lengths), 1)
    best = min(timings, key=timings.get)
    row = "  ".join(f"{'plain' if k is None else f'k={k}'}: {1e3 * t:.2f}" for k, t in timings.items())
    print(f"[auto k] TPOT ms  {row}  -> {'plain' if best is None else f'k={best}'}", file=log)
    return best
