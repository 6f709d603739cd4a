"""Wind-MTP analysis: window dose-response, per-position alpha_j with Wilson intervals, an A/B probe of the
windowed vs the native head, and the native head's attention mass inside sinks + window.

Used by `python -m qwen_mtp analyze-window` and notebooks/acceptance.ipynb.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from qwen_mtp.decoding.generate import generate
from qwen_mtp.decoding.prefill import prefill
from qwen_mtp.decoding.speculative import SpecConfig
from qwen_mtp.decoding.stats import alpha_intervals, fmt
from qwen_mtp.head.mtp import init_mtp_cache, mtp_forward
from qwen_mtp.head.ring import visible
from qwen_mtp.trunk.attention import project_qkv


def run_window(model, prompts, new, k, window, sinks=0, reference=None):
    """One speculative greedy run (compiled by a first, untimed run). Checks the output equals `reference`
    (plain greedy tokens) when given: a window must never change the output."""
    spec = SpecConfig(k=k, window=window, sinks=sinks if window is not None else 0)
    generate(model, prompts, new, spec=spec, eos_token_id=[])
    t = time.perf_counter()
    r = generate(model, prompts, new, spec=spec, eos_token_id=[])
    wall = time.perf_counter() - t
    if reference is not None and not np.array_equal(r.tokens, reference):
        raise AssertionError(f"window={window}: speculative output differs from plain greedy output")
    return dict(window=window, sinks=spec.sinks, k=k, al=r.stats.acceptance_length, alpha=alpha_intervals(r.stats),
                tpot_ms=1e3 * r.stats.tpot_s, wall_s=wall, rounds=r.stats.rounds, stats=r.stats)


def dose_response(model, prompts, new, k, windows, sinks=0):
    """run_window for each window (None = native), all checked against one plain greedy run."""
    plain = generate(model, prompts, new, eos_token_id=[])
    return [run_window(model, prompts, new, k, w, sinks, plain.tokens) for w in windows], plain


def _head_rows(model, ids):
    """Teacher-forced head inputs over a 1-D sequence: the trunk's hiddens and the head's attention input."""
    cfg, w = model.config, model.weights
    T = len(ids)
    _, _, hidden = prefill(model, [np.asarray(ids)], -(-T // 256) * 256 + 256, keep_hidden=True)
    toks = jnp.asarray(np.asarray(ids)[None, 1:])
    return toks, hidden[:, :T - 1]


def ab_probe(model, ids, window, sinks=0):
    """Same sequence, same rows: the native head's vs the windowed head's top-1 draft. Counted over the rows
    where the window hides something (row >= sinks + window). Returns share of rows whose top-1 is the same,
    and the native top1-top2 probability margin at flips and overall."""
    from qwen_mtp.decoding.generate import mtp_logits

    native = mtp_logits(model, ids)
    windowed = mtp_logits(model, ids, window=window, sinks=sinks)
    rows = slice(sinks + window, None)
    a, b = native[rows], windowed[rows]
    if a.shape[0] == 0:
        raise ValueError(f"sequence of {len(ids)} tokens is too short for window {window} + sinks {sinks}")
    p = jax.nn.softmax(jnp.asarray(a), axis=-1)
    top2 = np.asarray(jax.lax.top_k(p, 2)[0])
    margin = top2[:, 0] - top2[:, 1]
    flip = np.argmax(a, -1) != np.argmax(b, -1)
    return dict(rows=int(a.shape[0]), same_top1=float(1 - flip.mean()), flips=int(flip.sum()),
                margin_at_flips=float(margin[flip].mean()) if flip.any() else float("nan"),
                margin_overall=float(margin.mean()))


def attention_mass(model, ids, window, sinks=0):
    """Share of the NATIVE head's attention probability (mean over heads and rows >= sinks + window) that
    falls on the rows a Wind-MTP window would keep."""
    cfg, w = model.config, model.weights
    toks, hid = _head_rows(model, ids)
    T = toks.shape[1]
    _, _, st = mtp_forward(w, cfg, toks, hid, init_mtp_cache(cfg, 1, T, hid.dtype), jnp.zeros((1,), jnp.int32),
                           trace=True)
    rows = jnp.arange(T)
    q, k, _, _ = project_qkv(st["ah"], w.mtp.layer.mixer, cfg, (rows + 1)[None])
    rep = cfg.num_heads // cfg.num_kv_heads
    k = jnp.repeat(k, rep, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k, precision=jax.lax.Precision.HIGHEST) * cfg.head_dim ** -0.5
    causal = rows[None, :] <= rows[:, None]
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    keep = visible(rows[None, :], rows[:, None], window, sinks)
    mass = jnp.sum(jnp.where(keep, probs, 0.0), axis=-1)[0]  # [heads, T]
    bound = np.asarray(mass)[:, sinks + window:]
    if bound.size == 0:
        raise ValueError(f"sequence of {len(ids)} tokens is too short for window {window} + sinks {sinks}")
    return float(bound.mean())


def format_dose_response(results) -> str:
    k = results[0]["k"]
    head = " | ".join(f"a{j}" for j in range(1, k + 1))
    lines = [f"| window | sinks | AL | TPOT ms | {head} |", "|" + " --- |" * (4 + k)]
    for r in results:
        a = " | ".join(fmt(x[0]) for x in r["alpha"])
        name = "native" if r["window"] is None else str(r["window"])
        lines.append(f"| {name} | {r['sinks']} | {fmt(r['al'])} | {fmt(r['tpot_ms'])} | {a} |")
    return "\n".join(lines)


def format_alpha_intervals(results) -> str:
    lines = ["| window | j | alpha_j | 95% Wilson | accepted / reached |", "| --- | --- | --- | --- | --- |"]
    for r in results:
        name = "native" if r["window"] is None else str(r["window"])
        for j, (a, lo, hi, s, n) in enumerate(r["alpha"], 1):
            wilson = f"[{lo:.3f}, {hi:.3f}]" if n else "-"
            lines.append(f"| {name} | {j} | {fmt(a, '.3f')} | {wilson} | {s} / {n} |")
    return "\n".join(lines)


def plot_results(results, path=None):
    """Two panels: AL and TPOT per window; alpha_j with Wilson intervals per window. Returns the figure."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["native" if r["window"] is None else str(r["window"]) for r in results]
    ax1.plot(names, [r["al"] for r in results], "o-", label="AL")
    ax1.set_xlabel("draft window W")
    ax1.set_ylabel("acceptance length")
    ax1b = ax1.twinx()
    ax1b.plot(names, [r["tpot_ms"] for r in results], "s--", color="tab:red", label="TPOT")
    ax1b.set_ylabel("TPOT (ms)")
    ax1.set_title("dose-response (AL solid, TPOT dashed)")
    for i, r in enumerate(results):
        j = np.arange(1, len(r["alpha"]) + 1) + (i - len(results) / 2) * 0.05
        a = np.array([x[0] for x in r["alpha"]])
        lo = np.array([x[1] for x in r["alpha"]])
        hi = np.array([x[2] for x in r["alpha"]])
        ax2.errorbar(j, a, yerr=[a - lo, hi - a], fmt="o-", capsize=3, label=names[i])
    ax2.set_xticks(range(1, max(len(r["alpha"]) for r in results) + 1))
    ax2.set_xlabel("draft position j")
    ax2.set_ylabel("alpha_j (95% Wilson)")
    ax2.set_ylim(0, 1)
    ax2.legend()
    ax2.set_title("per-position acceptance")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig
