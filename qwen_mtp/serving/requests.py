"""What a caller of the Engine holds: SamplingParams (one request's settings, checked on construction), the
RequestHandle submit returns (iterate it for token ids as they are committed; finish_reason, usage and stats
once it ends) and RequestStats. Everything here is thread-safe: the engine's thread commits tokens and finishes
handles while other threads iterate, poll or wait on them."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time

from qwen_mtp.decoding.sampling import Sampling
from qwen_mtp.errors import ArgumentError, is_python_int

FINISH_REASONS = ("stop", "length", "cancelled", "error")
_log = logging.getLogger(__name__)
MAX_STOP_IDS = 8  # stop_token_ids per request (beside the model's EOS ids): a fixed shape of the programs


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's settings. temperature 0 is greedy (top_k / top_p / seed then do nothing); otherwise the
    token at each position is drawn from the processed distribution with noise derived from (seed, position)
    only, so a seeded request gives the same tokens whatever else the engine runs, with or without speculation.
    repetition_penalty as generate's (1 = off). A request stops at an EOS id of the model (unless ignore_eos), at
    one of stop_token_ids (that id is the last token yielded, as generate yields its EOS), or after max_tokens
    new tokens. Stop strings are the caller's business (the HTTP server's)."""
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if not is_python_int(self.max_tokens) or self.max_tokens < 1:
            raise ArgumentError("max_tokens", "an integer >= 1", repr(self.max_tokens))
        Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                 repetition_penalty=self.repetition_penalty)  # the same checks as generate's
        if not is_python_int(self.seed) or not 0 <= self.seed < 2 ** 63:
            raise ArgumentError("seed", "an integer in [0, 2**63)", repr(self.seed))
        stops = tuple(self.stop_token_ids) if isinstance(self.stop_token_ids, (list, tuple)) else None
        if stops is None or not all(is_python_int(t) and t >= 0 for t in stops) or len(stops) > MAX_STOP_IDS:
            raise ArgumentError("stop_token_ids", f"a list of at most {MAX_STOP_IDS} token ids >= 0",
                                repr(self.stop_token_ids))
        object.__setattr__(self, "stop_token_ids", stops)
        if not isinstance(self.ignore_eos, bool):
            raise ArgumentError("ignore_eos", "a bool", repr(self.ignore_eos))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass
class RequestStats:
    """One request's figures (filled as it runs; final once the handle is finished)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    submitted_at: float = 0.0  # time.perf_counter() at submit
    started_at: float | None = None  # when its prefill began (it left the waiting queue)
    first_token_at: float | None = None
    finished_at: float | None = None
    rounds: int = 0  # speculative rounds it took part in
    drafts_accepted: int = 0
    drafts_proposed: int = 0
    plain_steps: int = 0  # plain decode steps it took part in

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: submit to the first token (queueing and prefill included)."""
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def queue_s(self) -> float | None:
        return None if self.started_at is None else self.started_at - self.submitted_at

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        if self.finished_at is None or self.first_token_at is None or self.completion_tokens < 2:
            return None
        return (self.finished_at - self.first_token_at) / (self.completion_tokens - 1)

    @property
    def acceptance_per_round(self) -> float | None:
        """Mean accepted drafts per speculative round (acceptance length minus the bonus token)."""
        return self.drafts_accepted / self.rounds if self.rounds else None


_ids = itertools.count(1)


class RequestHandle:
    """A submitted request. `for tok in handle` yields its token ids (ints) as they are committed and ends when
    the request finishes; then `finish_reason` is one of "stop" (an EOS or stop id, the last id yielded),
    "length" (max_tokens), "cancelled" (Engine.cancel, or the engine stopped) or "error" (`error` holds the
    exception). `poll()` returns what is new without blocking; `result(timeout)` waits for the end.
    on_update (submit's argument), when given, is called from the engine's thread after each commit and at the
    end (keep it short: an asyncio server hands it to loop.call_soon_threadsafe)."""

    def __init__(self, prompt_ids, params: SamplingParams, on_update=None):
        self.id = next(_ids)
        self.prompt_ids = prompt_ids
        self.params = params
        self.stats = RequestStats(prompt_tokens=len(prompt_ids), submitted_at=time.perf_counter())
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self._tokens: list = []
        self._read = 0  # what poll() handed out
        self._cond = threading.Condition()
        self._on_update = on_update
        self.cancel_requested = False
        self.slot: int | None = None  # the engine slot it was given (once admitted)

    # ---- the engine's side
    def _commit(self, ids) -> None:
        if not len(ids):
            return
        now = time.perf_counter()
        with self._cond:
            if self.stats.first_token_at is None:
                self.stats.first_token_at = now
            self._tokens.extend(int(t) for t in ids)
            self.stats.completion_tokens = len(self._tokens)
            self._cond.notify_all()
        self._notify()

    def _finish(self, reason: str, error: BaseException | None = None) -> None:
        assert reason in FINISH_REASONS, reason
        with self._cond:
            if self.finish_reason is not None:
                return
            self.finish_reason, self.error = reason, error
            self.stats.finished_at = time.perf_counter()
            self._cond.notify_all()
        self._notify()

    def _notify(self):
        if self._on_update is not None:
            try:
                self._on_update(self)
            except Exception:  # noqa: BLE001 (a caller's callback must not stop the engine: logged, not raised)
                _log.exception("on_update callback of request %s failed", self.id)

    # ---- the caller's side
    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens(self) -> list:
        """Every token id committed so far (a copy)."""
        with self._cond:
            return list(self._tokens)

    def poll(self) -> tuple:
        """(new token ids since the last poll, finished) without blocking."""
        with self._cond:
            new = self._tokens[self._read:]
            self._read = len(self._tokens)
            return new, self.finish_reason is not None

    def __iter__(self):
        i = 0
        while True:
            with self._cond:
                while i >= len(self._tokens) and self.finish_reason is None:
                    self._cond.wait()
                new = self._tokens[i:]
                ended = self.finish_reason is not None
            yield from new
            i += len(new)
            if ended and i >= len(self.tokens):
                return

    def result(self, timeout: float | None = None) -> list:
        """Wait until the request ends; its token ids. TimeoutError if it has not ended within timeout seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.finish_reason is not None, timeout):
                raise TimeoutError(f"request {self.id} still running after {timeout} s")
            return list(self._tokens)

    @property
    def usage(self) -> dict:
        """{"prompt_tokens", "completion_tokens", "total_tokens"} as the OpenAI API counts them."""
        p, c = self.stats.prompt_tokens, self.stats.completion_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def __repr__(self):
        return (f"RequestHandle(id={self.id}, prompt_tokens={self.stats.prompt_tokens}, "
                f"tokens={self.stats.completion_tokens}, finish_reason={self.finish_reason!r})")
