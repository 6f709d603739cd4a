"""Generation statistics, including speculative acceptance (Wind-MTP's definitions, SPEC.md section 3), and
what a warm-up did (compile_counts / warmup_note: programs compiled vs executables loaded from jax's persistent
compilation cache)."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np


def fmt(x, spec: str = ".2f") -> str:
    """A number for a person to read: `-` where it is undefined (NaN / Inf: a draft position never reached, a
    rate over no time), never `nan`."""
    return format(x, spec) if x is not None and math.isfinite(x) else "-"


def format_alphas(alpha, spec: str = ".2f") -> str:
    """alpha_j as 'a1 a2 ...', `-` for a position no round reached."""
    return " ".join(fmt(float(a), spec) for a in alpha)


@dataclasses.dataclass
class GenerateStats:
    batch: int
    prompt_tokens: int  # summed over rows
    new_tokens: int  # summed over rows
    prefill_s: float  # the trunk's prefill and the first token, and with spec the MTP head's prefill
    decode_s: float  # the decode loop alone
    k: int = 0  # draft length; 0 = plain decoding
    rounds: int = 0  # draft/verify rounds summed over rows
    accept_hist: np.ndarray | None = None  # H[n]: rounds with exactly n drafts accepted, n = 0..k
    position_hits: np.ndarray | None = None  # [k]: rounds where draft j passed its own test, ignoring j' < j
    tree: dict | None = None  # tree drafts (decoding/tree_loop.py tree_stats): acceptance per depth and sibling rank

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens per second of the decode loop (the first new token of each row comes from prefill)."""
        decoded = self.new_tokens - self.batch
        return decoded / self.decode_s if self.decode_s > 0 and decoded > 0 else float("nan")

    @property
    def tokens_per_s(self) -> float:
        """All new tokens over prefill + decode time."""
        total = self.prefill_s + self.decode_s
        return self.new_tokens / total if total > 0 else float("nan")

    @property
    def tpot_s(self) -> float:
        """Time per output token of the decode loop, per row: decode time / new tokens of a row."""
        per_row = (self.new_tokens - self.batch) / self.batch
        return self.decode_s / per_row if per_row > 0 else float("nan")

    @property
    def alpha(self) -> np.ndarray:
        """Conditional acceptance alpha_j = sum_{n>=j} H[n] / sum_{n>=j-1} H[n], j = 1..k."""
        if self.accept_hist is None:
            return np.zeros(0)
        tail = np.cumsum(self.accept_hist[::-1])[::-1].astype(float)  # tail[j] = sum_{n>=j} H[n]
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(tail[:-1] > 0, tail[1:] / np.maximum(tail[:-1], 1), np.nan)

    @property
    def acceptance_length(self) -> float:
        """AL = 1 + sum_j prod_{i<=j} alpha_i: expected tokens emitted per round."""
        if self.accept_hist is None or self.rounds == 0:
            return float("nan")
        a = np.nan_to_num(self.alpha)
        return float(1.0 + np.sum(np.cumprod(a)))

    @property
    def unconditional_rates(self) -> np.ndarray:
        """UPPER-BOUND VIEW, not acceptance: per draft position j, the share of rounds whose draft j passed
        its test regardless of earlier drafts. Summing these overestimates AL (a draft after a rejected one
        is never used)."""
        if self.position_hits is None or self.rounds == 0:
            return np.zeros(0)
        return self.position_hits / self.rounds

    @property
    def acceptance_length_upper_bound(self) -> float:
        """1 + sum of unconditional rates: an OVERESTIMATE of AL, kept apart and labelled as such."""
        return float(1.0 + np.sum(self.unconditional_rates)) if self.rounds else float("nan")

    def summary(self) -> str:
        """One line; what is undefined (alpha_j of a position no round reached, TPOT of one new token) is `-`."""
        s = (f"{self.new_tokens} tokens, {fmt(self.tokens_per_s, '.1f')} tok/s "
             f"(decode {fmt(self.decode_tokens_per_s, '.1f')} tok/s, TPOT {fmt(1e3 * self.tpot_s)} ms)")
        if self.k:
            s += (f", k={self.k}, AL={fmt(self.acceptance_length)}, alpha_j=[{format_alphas(self.alpha)}], "
                  f"rounds={self.rounds}")
        return s


def wilson(successes: int, trials: int, z: float = 1.96):
    """95% (z=1.96) Wilson score interval of a binomial proportion; (nan, nan) with no trials."""
    if trials <= 0:
        return float("nan"), float("nan")
    p = successes / trials
    d = 1 + z * z / trials
    c = (p + z * z / (2 * trials)) / d
    h = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / d
    return c - h, c + h


def alpha_intervals(stats):
    """Per draft position j: (alpha_j, lo, hi, successes, trials), alpha_j = rounds that accepted >= j drafts
    over rounds that accepted >= j-1."""
    tail = np.cumsum(stats.accept_hist[::-1])[::-1]
    out = []
    for j in range(1, len(tail)):
        s, n = int(tail[j]), int(tail[j - 1])
        lo, hi = wilson(s, n)
        out.append((s / n if n else float("nan"), lo, hi, s, n))
    return out


# ------------------------------------------------------------------------------------------------ warm-up
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # every XLA compile request, cache hit or not
_CACHE_HIT = "/jax/compilation_cache/cache_hits"  # one that jax's persistent cache answered


@dataclasses.dataclass
class CompileCounts:
    programs: int = 0  # executables asked of XLA (compiled or read back)
    loaded: int = 0  # of those, read back from jax's persistent compilation cache

    @property
    def compiled(self) -> int:
        return self.programs - self.loaded


@contextlib.contextmanager
def compile_counts():
    """Counts, while open, the executables jax asks XLA for and how many of them its persistent compilation
    cache answered (jax.monitoring events): yields a CompileCounts, filled as the block runs."""
    import jax

    counts = CompileCounts()

    def on_event(event, **_):
        if event == _CACHE_HIT:
            counts.loaded += 1

    def on_duration(event, duration_secs, **_):
        if event == _BACKEND_COMPILE:
            counts.programs += 1

    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_listener(on_event)
        jax.monitoring.unregister_event_duration_listener(on_duration)


def warmup_note(seconds: float, counts: CompileCounts | None = None) -> str:
    """What the warm-up before a timed run spent its time on, for the stats line: compiling programs, or (a
    second run with the compilation cache on) loading the cached executables, which is neither tracing nor
    compiling."""
    head = f"warm-up {seconds:.1f}s"
    if counts is None or counts.programs == 0:
        return f"{head} not counted"
    s = lambda n: "" if n == 1 else "s"
    parts = []
    if counts.compiled:
        parts.append(f"compiling {counts.compiled} program{s(counts.compiled)}")
    if counts.loaded:
        parts.append(f"loading {counts.loaded} cached executable{s(counts.loaded)}")
    return f"{head}, {' and '.join(parts)}, not counted"
