"""The engine's device side, driven from its loop thread: one request's chunked prefill (a PrefillJob, one chunk
per call, so the engine runs it between decode segments) and its insertion into a slot (`begin_prefill`,
`finish_prefill`; `prefill_into` runs it all at once), one segment of the decode loop over the busy slots
(`run_segment`), freeing slots (`release`), and compiling what the engine runs ahead of time (`precompile`).
The programs are slots.py's."""

from __future__ import annotations

import time

import jax
import numpy as np

from qwen_mtp.decoding.nonfinite import BIG
from qwen_mtp.decoding.prefill import keep_last, mtp_chunk, take_rows, trunk_chunk
from qwen_mtp.decoding.request import chunk_size
from qwen_mtp.serving import slots as sl
from qwen_mtp.serving.requests import MAX_STOP_IDS, RequestHandle, SamplingParams


class SlotRunner:
    def __init__(self, engine):
        self.e = engine
        self.head = (engine.window, engine.sinks, engine.max_k) if engine.uses_head else None
        self.dtype = engine.model.weights.embed.dtype
        self.reset()

    def reset(self):
        e = self.e
        self.slots = sl.init_slots(e.cfg, e.max_batch, e.cache_len, self.dtype, e.kv_dtype, self.head,
                                   MAX_STOP_IDS)

    def release(self, free):
        mask = np.zeros(self.e.max_batch, bool)
        mask[list(free)] = True
        self.slots = sl.release(self.slots, mask)

    # ---------------------------------------------------------------------------------------- prefill
    def begin_prefill(self, slot: int, h: RequestHandle) -> PrefillJob:
        """A prefill of h's prompt for `slot`, run one chunk per PrefillJob.advance() (the engine's loop calls it
        between segments); the slot is written by `finish_prefill` once every chunk has run."""
        return PrefillJob(self, slot, h)

    def finish_prefill(self, job: PrefillJob):
        """After job's last chunk: its first token, the head's last chunk, and the whole request written into its
        slot. Returns (first token, finite)."""
        first_host, ok = job.finish()
        self.slots = sl.insert(self.slots, np.int32(job.slot), *job.insert_args)
        return first_host, ok

    def prefill_into(self, slot: int, h: RequestHandle):
        """The whole prefill of h's prompt into `slot` at once (precompile, plan.measure). (first token, finite)"""
        job = self.begin_prefill(slot, h)
        while not job.advance():
            pass
        return self.finish_prefill(job)

    # ---------------------------------------------------------------------------------------- decode
    def plan_segment(self, busy: list):
        """(k, bucket, row order: the slot of each row of the sub-batch, full) for these busy slots."""
        e = self.e
        o = len(busy)
        k = e.k_for(o)
        bucket = next(b for b in e.buckets if b >= o)
        if bucket == e.max_batch:
            return k, bucket, list(range(e.max_batch)), True
        free = [s for s in range(e.max_batch) if s not in busy]
        return k, bucket, list(busy) + free[:bucket - o], False

    def segment_call(self, k, bucket, order, full, sample, penalize):
        e = self.e
        steps = e.segment if k == 0 else max(1, e.segment // 2)
        spec = sl.spec_for(max(k, 1), e.window, e.sinks) if e.uses_head else None
        prog = sl.segment_program(bucket, k)
        return prog(e.model.weights, e.cfg, self.slots, np.asarray(order, np.int32), k=k,
                    spec=spec if k else (spec if e.uses_head else None), steps=steps, full=full, sample=sample,
                    penalize=penalize, catch_up=e.uses_head and k == 0)

    def run_segment(self):
        """One segment over the busy slots; commits its tokens to the handles."""
        e = self.e
        busy = e.busy_slots()
        handles = {s: e.handle_in(s) for s in busy}
        k, bucket, order, full = self.plan_segment(busy)
        live = [h for h in handles.values() if h is not None]
        sample = any(not h.params.greedy for h in live)
        penalize = any(h.params.repetition_penalty != 1.0 for h in live)
        t0 = time.perf_counter()
        self.slots, out, n_out, done, bad, rounds, accepted, hist, _hits = self.segment_call(
            k, bucket, order, full, sample, penalize)
        out, n_out, done, bad = np.asarray(out), np.asarray(n_out), np.asarray(done), np.asarray(bad)
        rounds, accepted = np.asarray(rounds), np.asarray(accepted)
        e.counters.add_segment(k, np.asarray(hist), time.perf_counter() - t0, len(busy))
        for row, slot in enumerate(order):
            h = handles.get(slot)
            if h is None or h.finished or h.cancel_requested:
                continue
            if k:
                h.stats.rounds += int(rounds[row])
                h.stats.drafts_accepted += int(accepted[row])
                h.stats.drafts_proposed += int(rounds[row]) * k
            else:
                h.stats.plain_steps += int(n_out[row])
            e._deliver(h, out[row, :n_out[row]].tolist(), done=bool(done[row]), bad=bool(bad[row] < BIG))
        return k, bucket

    # ---------------------------------------------------------------------------------------- start-up
    def precompile(self, ks=None) -> float:
        """Compile every segment program (bucket x k, greedy, no penalty) and the prefill programs of every chunk
        size a prompt up to max_model_len uses, running them on free slots / a scratch slot. Seconds taken."""
        e, t0 = self.e, time.perf_counter()
        if e.busy_slots():
            raise RuntimeError("precompile runs on an idle engine (before start or submit)")
        ks = ks if ks is not None else e.possible_ks()
        for bucket in e.buckets:
            order = list(range(bucket)) if bucket < e.max_batch else list(range(e.max_batch))
            for k in ks:  # every slot is free: the loop exits at once, the program is compiled
                self.slots = self.segment_call(k, bucket, order, bucket == e.max_batch, False, False)[0]
        size, sizes = 16, set()
        while True:
            sizes.add(chunk_size(size, e.prefill_chunk))
            if size >= min(e.max_model_len, e.prefill_chunk):
                break
            size *= 2
        for C in sorted(sizes):
            h = RequestHandle(np.ones(min(C, e.max_model_len - 1), np.int32), SamplingParams(max_tokens=1))
            self.prefill_into(0, h)
        self.release([0])
        return time.perf_counter() - t0


class PrefillJob:
    """One request's chunked prefill at batch 1, as generate chunks it (chunk_size(len, prefill_chunk) positions
    per program call, so chunk programs are bucketed: 16, 32, ... prefill_chunk): `advance()` runs the next
    chunk of the trunk and, for every chunk but the last, the head's chunk over the same positions (head row t:
    the token t + 1 and the trunk hidden t, all prompt ids); `finish()` picks the first token from the last
    position's hidden, runs the head's last chunk (its last row's token is that first token) and gathers what
    `slots.insert` writes. The same programs in the same order as a prefill run all at once: the same numbers."""

    def __init__(self, runner: SlotRunner, slot: int, h: RequestHandle):
        e = runner.e
        self.r, self.slot, self.h = runner, slot, h
        ids = h.prompt_ids
        self.L = L = len(ids)
        self.C = C = chunk_size(L, e.prefill_chunk)
        self.n = -(-L // C)
        self.done = 0  # chunks run
        self.tokens = np.zeros((1, self.n * C), np.int32)
        self.tokens[0, :L] = ids
        self.nxt = np.zeros((1, self.n * C), np.int32)  # the head's tokens: the prompt shifted by one
        self.nxt[0, :L - 1] = ids[1:]
        self.lens = np.array([L], np.int32)
        self.state = sl.one_state(e.cfg, e.cache_len, runner.dtype, e.kv_dtype)
        self.last = jax.device_put(np.zeros((1, e.cfg.hidden_size), runner.dtype))
        self.mcache = None if runner.head is None else sl.one_head_cache(e.cfg, e.cache_len, e.kv_dtype, runner.head)
        self.hidden = None  # the last chunk's trunk hiddens, for the head's last chunk
        self.insert_args = None

    def _head_chunk(self, c, hidden):
        e = self.r.e
        window, sinks, _ = self.r.head
        C = self.C
        out, self.mcache = mtp_chunk(e.model.weights, e.cfg, self.nxt[:, c * C:(c + 1) * C], hidden, self.mcache,
                                     np.array([c * C], np.int32), window, sinks)
        return out

    def advance(self) -> bool:
        """Run the next chunk; whether every chunk has run."""
        e, t0, c, C = self.r.e, time.perf_counter(), self.done, self.C
        start = np.array([c * C], np.int32)
        hidden, self.state = trunk_chunk(e.model.weights, e.cfg, self.tokens[:, c * C:(c + 1) * C], self.state,
                                         start, np.clip(self.lens - c * C, 0, C).astype(np.int32))
        self.last = keep_last(hidden, self.last, self.lens, start)
        self.done += 1
        if self.r.head is not None:
            if self.done < self.n:
                self._head_chunk(c, hidden)
            else:
                self.hidden = hidden
        e.counters.prefill_s += time.perf_counter() - t0
        return self.done == self.n

    def finish(self):
        e, t0, p = self.r.e, time.perf_counter(), self.h.params
        L, C = self.L, self.C
        key = np.asarray(jax.random.PRNGKey(p.seed))[None]
        prompt = np.zeros((1, e.cache_len), np.int32)
        prompt[0, :L] = self.h.prompt_ids
        values = (np.array([p.temperature], np.float32), np.array([p.top_k], np.int32),
                  np.array([p.top_p], np.float32), np.array([p.repetition_penalty], np.float32))
        first, ok, seen = sl.first_pick(e.model.weights, self.last, prompt, self.lens, key, *values,
                                        sample=not p.greedy, penalize=p.repetition_penalty != 1.0)
        first_host, ok = int(np.asarray(first)[0]), bool(np.asarray(ok)[0])
        m1 = np.zeros((1, 0), self.r.dtype)
        if self.r.head is not None:  # the last chunk holds position L - 1, whose head token is `first`
            self.nxt[0, L - 1] = first_host
            out = self._head_chunk(self.n - 1, self.hidden)
            m1 = take_rows(out, np.array([L - 1 - (self.n - 1) * C], np.int32))
        stops = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(e.eos)))
        eos = np.full((1, MAX_STOP_IDS), sl.PAD, np.int32)
        eos[0, :len(stops)] = stops
        remaining = np.array([p.max_tokens - 1], np.int32)
        self.insert_args = (self.state, self.mcache, first, self.lens, m1, key, seen, *values, eos, remaining)
        self.state = self.mcache = self.hidden = None
        e.counters.prefill_s += time.perf_counter() - t0
        return first_host, ok
