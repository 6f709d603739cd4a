"""The serving engine: continuous batching over the jitted decode loops, with slots.

Interface (what the HTTP server and a notebook use):

    engine = qwen_mtp.Engine(model, max_batch=8, max_model_len=2048, spec="auto")  # or None, SpecConfig(k=3)
    engine.start()                                # the engine's own thread runs the loop (or call engine.step())
    h = engine.submit(prompt_ids, qwen_mtp.SamplingParams(max_tokens=64, temperature=0.7, seed=1),
                      on_update=None)             # -> RequestHandle; QueueFullError when the queue is full
    for tok in h: ...                             # token ids as they are committed (blocks)
    h.finish_reason                               # "stop" | "length" | "cancelled" | "error" (h.error)
    h.poll() -> (new ids, finished)               # without blocking; h.result(timeout) waits for all of it
    h.usage, h.stats                              # prompt / completion tokens; TTFT, TPOT, rounds, accepted
    engine.cancel(h)                              # frees its slot at the next segment ("cancelled")
    engine.metrics() -> dict                      # running, waiting, totals, drafts, alpha per position, plan
    engine.stop()                                 # cancels what waits and runs, joins the thread

Threads: submit, cancel, metrics and the handles are safe from any thread. The loop runs in ONE thread: either
the engine's own (start() / stop()), or a driver that calls step() itself (not both).

How it runs: max_batch slots (slots.py), each with its own trunk KV, GDN state, head cache or Wind-MTP ring,
position, key and sampling values. step(): cancelled requests free their slots; prefill advances: a waiting
request reserves a free slot and its prompt is prefilled alone (batch 1) in chunks of chunk_size(len,
prefill_chunk) positions, at most prefill_chunk positions per step while other slots decode (a long prompt runs
one chunk per segment boundary; the busy slots decode a segment between its chunks); a prompt whose last chunk
ran is inserted into its slot with its first token. Then one segment of the decode loop runs over the busy
slots (a sub-batch of `bucket` rows, the smallest of `buckets` that holds them): `segment` plain steps, or
segment // 2 speculative rounds, k from the plan for that many busy slots (spec="auto", plan.py) or the fixed
SpecConfig. Committed tokens are handed to the handles; finished requests free their slots.

A request's tokens do not depend on what runs beside it: every row is computed on its own (no row reads
another's), greedy rows take the argmax, sampled rows the Gumbel-max draw from noise of (their seed, the
token's position) (sampling.row_scores), so plain and speculative segments commit the same tokens. In f32,
greedy output equals offline `generate` for the same prompt (tests/test_engine.py).

Compiles: at start-up (precompile()) the segment program of each (bucket, k the engine may use), greedy and
without a penalty, the prefill chunk of each bucket a prompt of max_model_len can use (16, 32, ... prefill_chunk)
and the insert / first-token programs. A sampling request, or one with a repetition penalty, compiles the
corresponding segment variants once, on first use. Nothing compiles per request.
"""

from __future__ import annotations

import collections
import threading
import time

import numpy as np

from qwen_mtp.decoding.request import DEFAULT_PREFILL_CHUNK, pow2_at_least, round_up
from qwen_mtp.decoding.speculative import SpecConfig
from qwen_mtp.errors import (
    ArgumentError,
    EngineStoppedError,
    NonFiniteError,
    QueueFullError,
    is_python_int,
)
from qwen_mtp.head.mtp import require_mtp
from qwen_mtp.serving import runner
from qwen_mtp.serving.requests import MAX_STOP_IDS, RequestHandle, SamplingParams
from qwen_mtp.serving.stats import EngineCounters
from qwen_mtp.trunk.state import resolve_kv_dtype

DEFAULT_SEGMENT = 16


class Engine:
    """Continuous batching over `max_batch` slots (the module docstring has the interface).

    max_model_len: the longest prompt + max_tokens of one request (default min(4096, the config's)).
    spec: None (plain decoding), a SpecConfig (that k always), "auto" (the measured plan of plan.py: plain or
    k per busy-slot count; cached per machine, model and settings), or a plan.Plan. Default: "auto" when the
    model has an MTP head, else None. kv_dtype: as generate's. prefill_chunk: the largest prefill chunk, and the
    prompt positions one step prefills while slots decode. max_waiting: the waiting queue's bound (submit raises
    QueueFullError beyond it). segment: plain steps per segment (speculative rounds: segment // 2). buckets: the
    sub-batch sizes segments run at (default powers of two up to max_batch, and max_batch). eos_token_id: as
    generate's (None: the config's). max_k: the largest k spec="auto" measures (its plan is measured at
    construction unless cached: every bucket x k = 0..max_k segment program is compiled and timed, minutes on a
    CPU the first time). window, sinks: Wind-MTP for spec="auto" or a Plan (a fixed SpecConfig carries its own):
    the head's ring holds sinks + window + max_k slots, which every k of the plan uses. Not yet: a model on a
    mesh (ArgumentError), tree drafts (ArgumentError), prefix caching, n > 1."""

    def __init__(self, model, max_batch: int = 8, max_model_len: int | None = None, spec="auto", kv_dtype=None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, max_waiting: int = 64, segment: int = DEFAULT_SEGMENT,
                 buckets=None, eos_token_id=None, max_k: int = 3, window: int | None = None, sinks: int = 0):
        from qwen_mtp.decoding.checks import check_chunk, eos_ids
        from qwen_mtp.serving import plan as plan_mod

        cfg = model.config
        if getattr(model, "mesh", None) is not None:
            raise ArgumentError("model", "a model on one device (the engine does not run on a mesh yet)",
                                "a model sharded over a mesh")
        for name, v, lo in (("max_batch", max_batch, 1), ("max_waiting", max_waiting, 0), ("segment", segment, 2),
                            ("max_k", max_k, 1)):
            if not is_python_int(v) or v < lo:
                raise ArgumentError(name, f"an integer >= {lo}", repr(v))
        if max_model_len is None:
            max_model_len = min(4096, cfg.max_position_embeddings)
        if not is_python_int(max_model_len) or not 2 <= max_model_len <= cfg.max_position_embeddings:
            raise ArgumentError("max_model_len", f"an integer in [2, {cfg.max_position_embeddings}]",
                                repr(max_model_len))
        self.model, self.cfg = model, cfg
        self.max_batch, self.max_model_len, self.segment = max_batch, max_model_len, segment
        self.prefill_chunk = check_chunk(prefill_chunk)
        self.kv_dtype = resolve_kv_dtype(kv_dtype, model.weights.embed.dtype)
        self.eos = tuple(eos_ids(cfg, eos_token_id))
        if len(self.eos) > MAX_STOP_IDS:
            raise ArgumentError("eos_token_id", f"at most {MAX_STOP_IDS} ids", repr(self.eos))
        if buckets is None:
            buckets = sorted({min(pow2_at_least(n), max_batch) for n in range(1, max_batch + 1)})
        buckets = tuple(sorted(set(buckets)))
        if not buckets or not all(is_python_int(b) and 1 <= b <= max_batch for b in buckets) or \
                buckets[-1] != max_batch:
            raise ArgumentError("buckets", f"sizes in [1, {max_batch}] including max_batch", repr(buckets))
        self.buckets = buckets
        if isinstance(spec, str) and spec == "auto" and not model.has_mtp:
            spec = None
        self.plan = None
        if isinstance(spec, plan_mod.Plan):
            self.plan, spec = spec, "plan"
        elif not (spec is None or isinstance(spec, SpecConfig) or (isinstance(spec, str) and spec == "auto")):
            raise ArgumentError("spec", "None, a SpecConfig, 'auto' or a serving.plan.Plan", repr(spec))
        if spec is not None:
            require_mtp(model.weights)
        self.spec_mode = spec  # None | SpecConfig | "auto" | "plan"
        fixed = spec if isinstance(spec, SpecConfig) else None
        if (window is not None or sinks) and (spec is None or fixed is not None):
            raise ArgumentError("window", "None with spec None or a SpecConfig (a SpecConfig carries its window)",
                                repr(window))
        SpecConfig(k=1, window=window, sinks=sinks)  # validates them
        if getattr(fixed, "tree", None) is not None:
            raise ArgumentError("spec", "a chain SpecConfig (tree=None): the engine runs no tree drafts", "a tree")
        self.window = fixed.window if fixed else window
        self.sinks = fixed.sinks if fixed else sinks
        self.max_k = fixed.k if fixed else (max(self.plan.ks()) if self.plan else max_k)
        self.uses_head = spec is not None
        kmax = self.max_k if self.uses_head else 0
        # cache rows: a request's prompt and tokens, the last round's drafts, whole prefill chunks
        self.cache_len = round_up(max(max_model_len + kmax + 1, round_up(max_model_len, self.prefill_chunk)), 128)
        self.counters = EngineCounters()
        self._lock = threading.Lock()  # submit / cancel / the queues
        self._wake = threading.Condition(self._lock)
        self._waiting: collections.deque = collections.deque()
        self._max_waiting = max_waiting
        self._running: dict = {}  # slot -> RequestHandle
        self._job = None  # the PrefillJob in progress (its slot is reserved), or None
        self._thread = None
        self._stopping = False
        self._step_lock = threading.Lock()  # one loop at a time
        self.dev = runner.SlotRunner(self)
        if spec == "auto":
            self.plan = plan_mod.plan_for(self)

    # ------------------------------------------------------------------------------------------ public
    def submit(self, prompt_ids, params: SamplingParams | None = None, on_update=None) -> RequestHandle:
        """Queue a request; its handle. ArgumentError for bad ids or a request longer than max_model_len;
        QueueFullError when max_waiting requests already wait; EngineStoppedError after stop()."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ArgumentError("params", "a qwen_mtp.SamplingParams", repr(params))
        ids = np.asarray(prompt_ids)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ArgumentError("prompt_ids", "a non-empty 1-D sequence of token ids", f"shape {ids.shape} "
                                f"dtype {ids.dtype}")
        if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
            raise ArgumentError("prompt_ids", f"token ids in [0, {self.cfg.vocab_size})",
                                f"ids in [{ids.min()}, {ids.max()}]")
        if ids.size + params.max_tokens > self.max_model_len:
            raise ArgumentError("max_tokens", f"prompt tokens + max_tokens <= max_model_len ({self.max_model_len})",
                                f"{ids.size} + {params.max_tokens}")
        if len(set(params.stop_token_ids) | set(self.eos)) > MAX_STOP_IDS:
            raise ArgumentError("stop_token_ids", f"at most {MAX_STOP_IDS} ids with the model's EOS ids",
                                repr(params.stop_token_ids))
        if any(t >= self.cfg.vocab_size for t in params.stop_token_ids):
            raise ArgumentError("stop_token_ids", f"token ids in [0, {self.cfg.vocab_size})",
                                repr(params.stop_token_ids))
        handle = RequestHandle(ids.astype(np.int32), params, on_update)
        with self._lock:
            if self._stopping:
                raise EngineStoppedError("the engine is stopping or stopped: submit refused")
            if len(self._waiting) >= self._max_waiting:
                raise QueueFullError(len(self._waiting), self._max_waiting)
            self._waiting.append(handle)
            self.counters.submitted += 1
            self._wake.notify_all()
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """Stop a request: a waiting one finishes now, a running one at the next segment ("cancelled"). Nothing
        happens to one already finished."""
        with self._lock:
            handle.cancel_requested = True
            if handle in self._waiting:
                self._waiting.remove(handle)
                self._finish(handle, "cancelled")
            self._wake.notify_all()

    def start(self) -> Engine:
        """Run the loop in the engine's own (daemon) thread until stop()."""
        with self._lock:
            if self._thread is not None:
                return self
            self._thread = threading.Thread(target=self._loop, name="qwen_mtp-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new requests, cancel every waiting and running one, and end the engine's thread."""
        with self._lock:
            self._stopping = True
            for h in list(self._waiting):
                self._finish(h, "cancelled")
            self._waiting.clear()
            for h in self._running.values():
                h.cancel_requested = True
            self._wake.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        with self._step_lock:
            self._reap(cancel_all=True)

    def step(self) -> bool:
        """One turn of the loop (admit waiting requests, run one segment, deliver its tokens) in the caller's
        thread. Returns whether there was anything to do."""
        with self._step_lock:
            self._reap()
            admitted = self._prefill()
            self._reap()  # a request that ended with its first token frees its slot before any segment
            if not self._running:
                return admitted or self._job is not None
            self.dev.run_segment()
            self._reap()
            return True

    def precompile(self) -> float:
        """Compile (or read back from the compile cache) what the engine runs (the module docstring)."""
        return self.dev.precompile()

    def metrics(self) -> dict:
        """A snapshot of the engine-wide figures (for /metrics): running, waiting, free_slots, totals, speculation
        (drafts proposed / accepted, alpha per position, acceptance length), the plan."""
        with self._lock:
            running, waiting = len(self._running) + (self._job is not None), len(self._waiting)
        snap = self.counters.snapshot()
        snap.update(running=running, waiting=waiting, free_slots=self.max_batch - running, max_batch=self.max_batch,
                    plan=None if self.plan is None else self.plan.describe(), spec=self.describe_spec())
        return snap

    def describe_spec(self) -> str:
        wind = "" if self.window is None else f" Wind-MTP window {self.window} sinks {self.sinks}"
        if self.spec_mode is None:
            return "plain"
        fixed = isinstance(self.spec_mode, SpecConfig)
        return (f"k={self.spec_mode.k}" if fixed else "plan " + self.plan.describe()) + wind

    def possible_ks(self) -> list:
        """Every k (0 = plain) a segment of this engine may run."""
        if self.spec_mode is None or isinstance(self.spec_mode, SpecConfig):
            return [self.k_for(1)]
        return self.plan.ks() if self.plan is not None else list(range(self.max_k + 1))

    def k_for(self, busy: int) -> int:
        """The k (0 = plain) a segment with `busy` busy slots runs."""
        if self.spec_mode is None:
            return 0
        if isinstance(self.spec_mode, SpecConfig):
            return self.spec_mode.k
        return self.plan.k_for(busy)

    @property
    def running(self) -> int:  # requests holding a slot: decoding, or being prefilled
        with self._lock:
            return len(self._running) + (self._job is not None)

    def prefilling(self):
        """(handle, chunks run, chunks in all) of the prefill in progress, or None."""
        return None if (job := self._job) is None else (job.h, job.done, job.n)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    # ------------------------------------------------------------------------------------------ the loop
    def _loop(self):
        while True:
            with self._lock:
                while not self._stopping and not self._waiting and not self._running and self._job is None:
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 (a device failure ends every request with "error", not a hang)
                self._fail_all(e)

    def _fail_all(self, e):
        with self._step_lock, self._lock:
            for h in list(self._running.values()) + list(self._waiting) + ([self._job.h] if self._job else []):
                self._finish(h, "error", e)
            self._running.clear()
            self._waiting.clear()
            self._job = None
            self.dev.reset()

    def _finish(self, handle, reason, error=None):
        if handle.finish_reason is None:
            self.counters.finished(reason)
        handle._finish(reason, error)

    def _reap(self, cancel_all=False):
        """Free the slots of finished and cancelled requests."""
        free = []
        with self._lock:
            for slot, h in list(self._running.items()):
                if h.finished or h.cancel_requested or cancel_all:
                    if not h.finished:
                        self._finish(h, "cancelled")
                    free.append(slot)
                    del self._running[slot]
            job = self._job
            if job is not None and (job.h.cancel_requested or cancel_all):  # its slot was never written
                self._finish(job.h, "cancelled")
                self._job = None
        if free:
            self.dev.release(free)

    def _prefill(self) -> bool:
        """Advance prefill: chunks of waiting requests' prompts, each request in a free slot it reserves, until
        prefill_chunk positions ran while some slot decodes (at least one chunk: a long prompt takes one chunk per
        segment boundary, never holding the running slots up for more), or until no request waits or no slot is
        free while none decodes. A request whose last chunk ran is inserted with its first token."""
        spent, did = 0, False
        while True:
            with self._lock:
                if self._running and spent >= self.prefill_chunk:
                    return did
                if self._job is None:
                    taken = set(self._running)
                    free = [s for s in range(self.max_batch) if s not in taken]
                    if not free or not self._waiting:
                        return did
                    h = self._waiting.popleft()
                    h.stats.started_at, h.slot = time.perf_counter(), free[0]
                    self._job = self.dev.begin_prefill(free[0], h)  # the slot is reserved
                job = self._job
            did = True
            try:
                spent += job.C
                if not job.advance():
                    continue
                first, ok = self.dev.finish_prefill(job)
            except Exception as e:  # noqa: BLE001 (this request fails; the others go on)
                with self._lock:
                    self._job = None
                self._finish(job.h, "error", e)
                continue
            h = job.h
            with self._lock:
                self._job = None
                self._running[job.slot] = h  # a cancel from now on finds it running
            self.counters.prompt_tokens += len(h.prompt_ids)
            if not ok:
                self._finish(h, "error", NonFiniteError(0, 0, "prefill's logits"))
                continue
            self._deliver(h, [first], done=False)
            if h.finished:
                continue
            if first in self._stops(h):
                self._finish(h, "stop")
            elif h.params.max_tokens <= 1:
                self._finish(h, "length")

    def _stops(self, h) -> set:
        return set(h.params.stop_token_ids) | (set() if h.params.ignore_eos else set(self.eos))

    def _deliver(self, h, ids, done: bool, bad: bool = False):
        """Hand a request its new ids; finish it when its segment said so."""
        self.counters.generation_tokens += len(ids)
        h._commit(ids)
        if bad:
            self._finish(h, "error", NonFiniteError(0, h.stats.completion_tokens, "decode logits"))
        elif done:
            last = h.tokens[-1] if h.stats.completion_tokens else None
            self._finish(h, "stop" if last in self._stops(h) else "length")

    def busy_slots(self) -> list:
        with self._lock:
            return sorted(self._running)

    def handle_in(self, slot):
        with self._lock:
            return self._running.get(slot)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
