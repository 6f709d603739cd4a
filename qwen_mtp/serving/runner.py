"""The engine's device side, driven from its loop thread: one request's chunked prefill and insertion into a slot
(`prefill_into`), one segment of the decode loop over the busy slots (`run_segment`), freeing slots
(`release`), and compiling what the engine runs ahead of time (`precompile`). The programs are slots.py's."""

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
    def prefill_into(self, slot: int, h: RequestHandle):
        """Prefill h's prompt (batch 1, chunks of chunk_size(len, prefill_chunk) as generate chunks it), choose
        its first token, fill the head's cache, and write it all into `slot`. Returns (first token, finite)."""
        e, t0 = self.e, time.perf_counter()
        cfg, weights, p = e.cfg, e.model.weights, h.params
        ids = h.prompt_ids
        L = len(ids)
        C = chunk_size(L, e.prefill_chunk)
        n = -(-L // C)
        tokens = np.zeros((1, n * C), np.int32)
        tokens[0, :L] = ids
        state = sl.one_state(cfg, e.cache_len, self.dtype, e.kv_dtype)
        last = jax.device_put(np.zeros((1, cfg.hidden_size), self.dtype))
        lens = np.array([L], np.int32)
        hiddens = []
        for c in range(n):
            start = np.array([c * C], np.int32)
            hidden, state = trunk_chunk(weights, cfg, tokens[:, c * C:(c + 1) * C], state, start,
                                        np.clip(lens - c * C, 0, C).astype(np.int32))
            last = keep_last(hidden, last, lens, start)
            if self.head is not None:
                hiddens.append(hidden)
        key = np.asarray(jax.random.PRNGKey(p.seed))[None]
        prompt = np.zeros((1, e.cache_len), np.int32)
        prompt[0, :L] = ids
        values = (np.array([p.temperature], np.float32), np.array([p.top_k], np.int32),
                  np.array([p.top_p], np.float32), np.array([p.repetition_penalty], np.float32))
        first, ok, seen = sl.first_pick(weights, last, prompt, lens, key, *values, sample=not p.greedy,
                                        penalize=p.repetition_penalty != 1.0)
        first_host, ok = int(np.asarray(first)[0]), bool(np.asarray(ok)[0])
        mcache, m1 = None, np.zeros((1, 0), self.dtype)
        if self.head is not None:  # head row t: (token t + 1, trunk hidden t); the last row's token is `first`
            window, sinks, _ = self.head
            nxt = np.zeros((1, n * C), np.int32)
            nxt[0, :L - 1] = ids[1:]
            nxt[0, L - 1] = first_host
            mcache = sl.one_head_cache(cfg, e.cache_len, e.kv_dtype, self.head)
            for c in range(n):
                out, mcache = mtp_chunk(weights, cfg, nxt[:, c * C:(c + 1) * C], hiddens[c], mcache,
                                        np.array([c * C], np.int32), window, sinks)
                if c * C <= L - 1 < (c + 1) * C:
                    m1 = take_rows(out, np.array([L - 1 - c * C], np.int32))
        stops = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(e.eos)))
        eos = np.full((1, MAX_STOP_IDS), sl.PAD, np.int32)
        eos[0, :len(stops)] = stops
        remaining = np.array([p.max_tokens - 1], np.int32)
        self.slots = sl.insert(self.slots, np.int32(slot), state, mcache, first, lens, m1, key, seen, *values, eos,
                               remaining)
        e.counters.prefill_s += time.perf_counter() - t0
        return first_host, ok

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
