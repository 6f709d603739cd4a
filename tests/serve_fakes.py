"""A small stand-in for qwen_mtp.serving's Engine (the same submit / cancel / counters surface, the real
RequestHandle and SamplingParams), for the HTTP tests that do not need a model: it "generates" by echoing the
prompt's ids in a loop, one id per slot every `step_s` seconds, over `slots` slots and a waiting queue of
`max_waiting`; a full queue raises QueueFullError. Every request's output depends only on its own prompt."""

from __future__ import annotations

import collections
import threading
import time

from qwen_mtp.serving.requests import RequestHandle


class QueueFullError(Exception):
    """Named as qwen_mtp.errors.QueueFullError, which the server answers with 429."""


class FakeEngine:
    def __init__(self, slots=2, max_waiting=4, step_s=0.002, eos_id=None):
        self.slots, self.max_waiting, self.step_s, self.eos_id = slots, max_waiting, step_s, eos_id
        self.running, self.waiting = [], collections.deque()
        self.cond = threading.Condition()
        self.submitted = self.finished = 0
        self.cancelled_ids = []
        self.stopped = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def submit(self, prompt_ids, params, on_update=None):
        with self.cond:
            if len(self.waiting) >= self.max_waiting:
                raise QueueFullError(f"{len(self.waiting)} requests waiting (max {self.max_waiting})")
            h = RequestHandle(list(prompt_ids), params, on_update)
            self.waiting.append(h)
            self.submitted += 1
            self.cond.notify_all()
            return h

    def cancel(self, handle):
        with self.cond:
            handle.cancel_requested = True
            self.cancelled_ids.append(handle.id)

    class counters:  # the real engine's EngineCounters attribute: rounds passing draft j
        passed = (6, 4, 2)

    def metrics(self):
        with self.cond:
            return {"running": len(self.running), "waiting": len(self.waiting), "spec_rounds": 10,
                    "drafts_proposed": 30, "drafts_accepted": 12, "alpha_per_position": [0.6, 4 / 6, 0.5],
                    "acceptance_length": 2.2}

    def stop(self):
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.thread.join(5)

    def _loop(self):
        while True:
            with self.cond:
                while not self.stopped and not self.running and not self.waiting:
                    self.cond.wait()
                if self.stopped:
                    for h in [*self.running, *self.waiting]:
                        h._finish("cancelled")
                    return
                while self.waiting and len(self.running) < self.slots:
                    self.running.append(self.waiting.popleft())
                batch = list(self.running)
            time.sleep(self.step_s)
            done = []
            for h in batch:
                if h.cancel_requested:
                    h._finish("cancelled")
                    done.append(h)
                    continue
                n = h.stats.completion_tokens
                tok = h.prompt_ids[n % len(h.prompt_ids)]
                h._commit([tok])
                if self.eos_id is not None and tok == self.eos_id:
                    h._finish("stop")
                    done.append(h)
                elif n + 1 >= h.params.max_tokens:
                    h._finish("length")
                    done.append(h)
            with self.cond:
                for h in done:
                    self.running.remove(h)
                    self.finished += 1
