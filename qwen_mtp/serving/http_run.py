"""One request's run behind the HTTP API: the engine handle read from the event loop as the engine commits
(`Run`), the ids turned into text as they arrive with stop strings cut out (`Detokenizer`), and the times and
counts the metrics and the usage block need.

A Run ends with a finish reason: "stop" (an end-of-sequence or stop id, or a stop string: the engine request is
then cancelled, its slot freed at the engine's next segment), "length" (max_tokens), or "abort" (cancelled: the
client went away, or the server is stopping). `Run.cancel()` is safe to call at any time and more than once.
No thread per request: the engine's thread wakes the request's coroutine (RequestHandle's on_update).
"""

from __future__ import annotations

import asyncio
import threading
import time


class Detokenizer:
    """Ids -> text deltas. A byte-level BPE token can end inside a UTF-8 character: such a tail (U+FFFD) is held
    back until a later token completes it; text that could be the start of a stop string is held back until it is
    known not to be one. `add(id)` -> (new text, stopped); once stopped, the text ends before the stop string."""

    def __init__(self, tokenizer, stops=()):
        self.tok, self.stops = tokenizer, [s for s in stops if s]
        self.ids, self.sent, self.text = [], 0, ""
        self.longest = max((len(s) for s in self.stops), default=0)

    def _decode(self):
        return self.tok.decode(self.ids)

    def add(self, token_id: int):
        self.ids.append(int(token_id))
        text = self._decode()
        end = len(text)
        while end > 0 and text[end - 1] == "\ufffd":
            end -= 1
        if self.stops:
            start = max(0, self.sent - self.longest)
            hits = [i for i in (text.find(s, start, end) for s in self.stops) if i >= 0]
            if hits:
                cut = min(hits)
                delta = text[self.sent:cut] if cut > self.sent else ""
                self.text = text[:max(cut, self.sent)]
                self.sent = len(self.text)
                return delta, True
            end -= self._held(text[:end])
        delta = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        self.text = text[:self.sent]
        return delta, False

    def _held(self, text: str) -> int:
        """Length of the longest tail of text that is a proper prefix of a stop string."""
        for k in range(min(self.longest - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def finish(self) -> str:
        """The text still held back (a tail that never became a stop string), at the end of the run."""
        text = self._decode()
        delta = text[self.sent:] if len(text) > self.sent else ""
        self.sent, self.text = len(text), text
        return delta


class Run:
    """A submitted engine request read from the event loop: the engine's thread calls `wake` after each commit
    (RequestHandle's on_update), which only sets an asyncio.Event; `async for delta in run` polls the handle and
    yields text deltas, then ends with `finish_reason`, `generated` and the times set."""

    def __init__(self, engine, detok: Detokenizer, loop, arrival: float):
        self.engine, self.detok, self.handle = engine, detok, None
        self.arrival, self.first, self.last = arrival, None, None
        self.generated, self.finish_reason = 0, None
        self.recorded = False  # counted in the metrics (once)
        self._event, self._loop = asyncio.Event(), loop
        self._cancelled = False
        self._lock = threading.Lock()

    def submit(self, prompt_ids, params):
        """engine.submit with this run's wake-up; the engine's refusals (a full queue, bad params) propagate."""
        self.handle = self.engine.submit(prompt_ids, params, on_update=self.wake)
        return self.handle

    def wake(self, _handle=None):
        try:
            self._loop.call_soon_threadsafe(self._event.set)
        except RuntimeError:  # the event loop is gone (the server stopped): nobody is reading
            pass

    def cancel(self):
        with self._lock:
            if self._cancelled or self.handle is None:
                return
            self._cancelled = True
        try:
            self.engine.cancel(self.handle)
        except Exception:  # noqa: BLE001, S110 - already finished: nothing to free
            pass

    def __aiter__(self):
        return self._pieces()

    async def _pieces(self):
        stopped = False
        while True:
            await self._event.wait()
            self._event.clear()
            new, finished = self.handle.poll()
            for token_id in new:
                if stopped:
                    break  # ids committed in the same segment as the stop string: not part of the answer
                now = time.perf_counter()
                self.first = self.first if self.first is not None else now
                self.last = now
                self.generated += 1
                delta, stopped = self.detok.add(token_id)
                if stopped:
                    self.finish_reason = "stop"
                    self.cancel()
                if delta:
                    yield delta
            if finished:
                break
        if self.handle.finish_reason == "error" and not stopped:
            raise self.handle.error or RuntimeError("the engine failed this request")
        if not stopped:
            tail = self.detok.finish()
            if tail:
                yield tail
            reason = self.handle.finish_reason
            self.finish_reason = reason if reason in ("stop", "length") else "abort"

    @property
    def text(self) -> str:
        return self.detok.text
