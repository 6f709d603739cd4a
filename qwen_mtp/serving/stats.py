"""The engine-wide counters the server's /metrics reads (Engine.metrics()): requests by finish reason, prompt and
generation tokens, segments per mode, and speculation: rounds, drafts proposed / accepted, the accepted-draft
histogram and alpha per draft position (Wind-MTP's conditional acceptance, as decoding/stats.py defines it),
aggregated over segments that may use different k."""

from __future__ import annotations

import collections
import dataclasses
import threading

import numpy as np


@dataclasses.dataclass
class EngineCounters:
    submitted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_by_reason: dict = dataclasses.field(default_factory=lambda: collections.Counter())
    segments_by_k: dict = dataclasses.field(default_factory=lambda: collections.Counter())
    segments_by_busy: dict = dataclasses.field(default_factory=lambda: collections.Counter())  # (busy, k): n
    rounds: int = 0  # speculative (row, round) pairs
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    reached: list = dataclasses.field(default_factory=list)  # [j]: rounds whose draft j+1 was tested
    passed: list = dataclasses.field(default_factory=list)  # [j]: ... and accepted (drafts 1..j+1 all accepted)
    decode_s: float = 0.0  # seconds spent in decode segments
    prefill_s: float = 0.0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def finished(self, reason: str) -> None:
        with self._lock:
            self.finished_by_reason[reason] += 1

    def add_segment(self, k: int, hist, seconds: float, busy: int = 0) -> None:
        """One segment of k drafts per round (0: plain) over `busy` busy slots, whose accepted-draft histogram
        over busy rows is hist."""
        with self._lock:
            self.segments_by_k[k] += 1
            self.segments_by_busy[(busy, k)] += 1
            self.decode_s += seconds
            if k == 0:
                return
            hist = np.asarray(hist, np.int64)
            n_rounds = int(hist.sum())
            self.rounds += n_rounds
            self.drafts_proposed += n_rounds * k
            self.drafts_accepted += int((np.arange(k + 1) * hist).sum())
            while len(self.reached) < k:
                self.reached.append(0)
                self.passed.append(0)
            tail = np.cumsum(hist[::-1])[::-1]  # tail[n] = rounds with at least n accepted
            for j in range(k):
                self.reached[j] += int(tail[j])
                self.passed[j] += int(tail[j + 1])

    def snapshot(self) -> dict:
        with self._lock:
            alpha = [p / r if r else None for p, r in zip(self.passed, self.reached)]
            return {
                "submitted": self.submitted, "prompt_tokens": self.prompt_tokens,
                "generation_tokens": self.generation_tokens, "finished": dict(self.finished_by_reason),
                "segments_by_k": {int(k): v for k, v in self.segments_by_k.items()},
                "segments_by_busy_and_k": dict(self.segments_by_busy),
                "spec_rounds": self.rounds, "drafts_proposed": self.drafts_proposed,
                "drafts_accepted": self.drafts_accepted, "alpha_per_position": alpha,
                "acceptance_length": (1 + self.drafts_accepted / self.rounds) if self.rounds else None,
                "decode_s": self.decode_s, "prefill_s": self.prefill_s}
