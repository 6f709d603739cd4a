"""The speculation plan: whether to speculate, and with which k, chosen by measurement on this machine.

Plan.choice[o] is the k (0 = plain decoding) a segment with o busy slots runs; Plan.rates holds what it came
from: tokens per second per busy row, for each bucket (the sub-batch size a segment runs at) and each k.
`measure(engine)` times the engine's own segment programs: for each bucket it fills that many slots with the same
greedy request, runs one segment of each k to compile it, then times `segments` segments of each, and keeps the
fastest k per bucket (every busy count o that runs in that bucket gets it: the bucket's rows cost the same busy
or not). `plan_for(engine)` reads the plan cached for this machine + model + engine settings beside the compile
cache (compiling/compile_cache.py's folder, qwen_mtp_plans/), or measures and caches it.

`generate_plan(...)` is the same for the offline `generate` at batch 1 (the CLI's generate): plain and each k
timed with generate itself, cached the same way; the CLI runs its choice unless --k is given.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import time
from pathlib import Path

import jax
import numpy as np

from qwen_mtp.compiling import compile_cache
from qwen_mtp.errors import ArgumentError

PLAN_DIR = "qwen_mtp_plans"
MARGIN = 0.05  # speculation is chosen only where it measured at least 5 % faster than plain decoding
VERSION = 1
# a text-like prompt for the engine's measurement (ids of the shipped tokenizer would do as well: acceptance
# depends on the text, so the measurement uses the model's own greedy continuation of this prompt)
DEFAULT_PROMPT_LEN = 16


@dataclasses.dataclass(frozen=True)
class Plan:
    choice: dict  # {busy slots: k}, k = 0 for plain
    rates: dict  # {bucket: {k: tokens per second per busy row}}
    key: str = ""
    measured_at: str = ""
    why: str = ""  # a choice made without measuring: the reason

    def __post_init__(self):
        if not self.choice or not all(isinstance(o, int) and o >= 1 and isinstance(k, int) and 0 <= k <= 16
                                      for o, k in self.choice.items()):
            raise ArgumentError("Plan.choice", "{busy slots >= 1: k in [0, 16]}", repr(self.choice))

    def k_for(self, busy: int) -> int:
        if busy in self.choice:
            return self.choice[busy]
        return self.choice[min(self.choice, key=lambda o: (abs(o - busy), -o))]

    def ks(self) -> list:
        return sorted(set(self.choice.values()) | {0})

    def ratio(self, busy: int) -> float | None:
        """The measured speed of the chosen k against plain decoding at this busy count's bucket."""
        rates = self._rates_for(busy)
        if not rates or 0 not in rates:
            return None
        return rates[self.k_for(busy)] / rates[0]

    def _rates_for(self, busy):
        buckets = sorted(self.rates)
        b = next((b for b in buckets if b >= busy), buckets[-1] if buckets else None)
        return self.rates.get(b)

    def note(self, busy: int = 1) -> str:
        """The choice at `busy` busy slots and the measured ratio it came from, for a stats line."""
        k, rates = self.k_for(busy), self._rates_for(busy) or {}
        if self.why:
            return f"plan {'plain' if k == 0 else f'k={k}'} ({self.why})"
        when = f"measured {self.measured_at}" if self.measured_at else "measured"
        if k:
            r = self.ratio(busy)
            return f"plan k={k}" + ("" if r is None else f" ({r:.2f}x plain decode tok/s, {when})")
        spec = {j: v for j, v in rates.items() if j}
        if not spec or not rates.get(0):
            return f"plan plain ({when})"
        j = max(spec, key=spec.get)
        return f"plan plain (best k={j} at {spec[j] / rates[0]:.2f}x plain decode tok/s, {when})"

    def describe(self) -> str:
        parts = []
        for o in sorted(self.choice):
            r = self.ratio(o)
            parts.append(f"{o}:{'plain' if self.choice[o] == 0 else 'k=' + str(self.choice[o])}"
                         + ("" if r is None else f"({r:.2f}x)"))
        return " ".join(parts)

    def to_json(self) -> dict:
        return {"version": VERSION, "key": self.key, "measured_at": self.measured_at,
                    "choice": {str(o): k for o, k in self.choice.items()},
                    "rates": {str(b): {str(k): v for k, v in r.items()} for b, r in self.rates.items()}}

    @classmethod
    def from_json(cls, d: dict) -> Plan:
        return cls({int(o): int(k) for o, k in d["choice"].items()},
                   {int(b): {int(k): float(v) for k, v in r.items()} for b, r in d["rates"].items()},
                   d.get("key", ""), d.get("measured_at", ""))


def plausible(k: int, rate: float, plain: float | None) -> bool:
    """A round of k drafts commits at most k + 1 tokens and costs at least one plain step (its verify is a trunk
    forward over k + 1 rows), so k can be at most k + 1 times as fast as plain decoding: a measured ratio above
    that is the machine's load changing between the timings, not speed."""
    return plain is None or k == 0 or rate <= (k + 1) * plain


def choose(rates: dict, margin: float = MARGIN) -> int:
    """The k to run from measured rates {k: tokens/s} (0 = plain): the fastest k > 0 if it beat plain by at least
    `margin`, else plain (a gain inside the timing noise is not worth the risk of decoding slower). A k whose
    ratio is impossible (`plausible`) is not chosen."""
    spec = {k: v for k, v in rates.items() if k and plausible(k, v, rates.get(0))}
    if 0 not in rates:
        return max(spec, key=lambda k: (spec[k], -k))
    if not spec:
        return 0
    k = max(spec, key=lambda k: (spec[k], -k))
    return k if spec[k] >= (1 + margin) * rates[0] else 0


# ------------------------------------------------------------------------------------------------ caching
def machine_id() -> str:
    d = jax.devices()[0]
    return f"{platform.node()}|{platform.machine()}|{os.cpu_count()}|{d.platform}|{d.device_kind}|{jax.__version__}"


def model_id(model) -> str:
    """The model's config and a checksum of its embedding and head (a retrained folder gets its own plan)."""
    w = model.weights
    h = hashlib.sha256(repr(model.config).encode())
    for leaf in (w.embed, getattr(w, "lm_head", None)):
        if leaf is not None and hasattr(leaf, "shape"):
            h.update(np.asarray(leaf[:8], np.float32).tobytes())
    dv = getattr(w, "draft_vocab", None)
    h.update(f"draft_vocab={None if dv is None else int(dv.ids.shape[0])}|mtp={w.mtp is not None}".encode())
    return h.hexdigest()[:16]


def plan_key(model, settings: dict) -> str:
    text = json.dumps(dict(machine=machine_id(), model=model_id(model), version=VERSION, **settings),
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def plan_dir() -> Path | None:
    """<the compile cache folder>/qwen_mtp_plans, or None when the compile cache is off."""
    folder = compile_cache.resolve()
    return None if folder is None else folder / PLAN_DIR


def load_cached(key: str) -> Plan | None:
    folder = plan_dir()
    path = None if folder is None else folder / f"{key}.json"
    if path is None or not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
        plan = Plan.from_json(d) if d.get("version") == VERSION and d.get("key") == key else None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable: measured again and rewritten
    if plan is not None and not all(plausible(k, v, r.get(0)) for r in plan.rates.values() for k, v in r.items()):
        return None  # measured while the machine's load changed (an impossible ratio): measured again
    return plan


def save_cached(plan: Plan) -> Path | None:
    folder = plan_dir()
    if folder is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{plan.key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(plan.to_json(), indent=1))
        tmp.replace(folder / f"{plan.key}.json")
        return folder / f"{plan.key}.json"
    except OSError:
        return None  # a read-only cache folder: the plan is used, not kept


def _now():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# ------------------------------------------------------------------------------------------------ the engine
def engine_settings(engine) -> dict:
    return {"kind": "engine", "max_batch": engine.max_batch, "buckets": list(engine.buckets), "segment": engine.segment,
                "kv_dtype": str(engine.kv_dtype), "window": engine.window, "sinks": engine.sinks, "max_k": engine.max_k,
                "cache_len": engine.cache_len, "dtype": str(engine.model.weights.embed.dtype)}


def plan_for(engine, prompt_ids=None, segments: int = 3) -> Plan:
    """The cached plan for this engine, or a new measurement (then cached)."""
    key = plan_key(engine.model, engine_settings(engine))
    cached = load_cached(key)
    if cached is not None:
        return cached
    plan = measure(engine, prompt_ids, segments=segments, key=key)
    save_cached(plan)
    return plan


def _prompt(engine, prompt_ids):
    if prompt_ids is not None:
        return np.asarray(prompt_ids, np.int32)
    V = engine.cfg.vocab_size
    rng = np.random.default_rng(0)
    return rng.integers(1, V, DEFAULT_PROMPT_LEN).astype(np.int32)


def measure(engine, prompt_ids=None, ks=None, segments: int = 3, key: str = "", repeats: int = 2) -> Plan:
    """Time the engine's segments: for each bucket b and each k in ks (default 0..engine.max_k), b slots busy
    with the same greedy request; tokens per second per row over `segments` timed segments (after one that
    compiles), `repeats` times interleaved, each k's best; per bucket, `choose`. The engine must be idle; its
    slots are freed afterwards."""
    from qwen_mtp.serving.requests import RequestHandle, SamplingParams

    dev = engine.dev
    if engine.busy_slots():
        raise RuntimeError("plan.measure needs an idle engine")
    ks = list(range(engine.max_k + 1)) if ks is None else sorted(set(ks))
    prompt = _prompt(engine, prompt_ids)
    budget = engine.max_model_len - len(prompt)
    rates = {}
    for bucket in engine.buckets:
        order = list(range(bucket)) if bucket < engine.max_batch else list(range(engine.max_batch))
        full = bucket == engine.max_batch
        best = {k: 0.0 for k in ks}
        for r in range(repeats):  # interleaved, each k's best rate: robust to a busy machine
            for k in ks[r % len(ks):] + ks[:r % len(ks)]:
                steps = engine.segment if k == 0 else max(1, engine.segment // 2)
                need = (segments + 1) * steps * (k + 1) + 1
                if need > budget:
                    raise ArgumentError("max_model_len", f"room for the plan's measurement ({len(prompt)} + {need})",
                                        str(engine.max_model_len))
                for s in range(bucket):
                    dev.prefill_into(s, RequestHandle(prompt, SamplingParams(max_tokens=budget)))
                dev.slots = dev.segment_call(k, bucket, order, full, False, False)[0]  # compile, warm
                jax.block_until_ready(dev.slots.tok)
                t0, tokens = time.perf_counter(), 0
                for _ in range(segments):
                    res = dev.segment_call(k, bucket, order, full, False, False)
                    dev.slots = res[0]
                    tokens += int(np.asarray(res[2])[:bucket].sum())
                best[k] = max(best[k], tokens / bucket / (time.perf_counter() - t0))
                dev.release(range(bucket))
        rates[bucket] = best
    choice = {}
    for o in range(1, engine.max_batch + 1):
        choice[o] = choose(rates[next(b for b in engine.buckets if b >= o)])
    return Plan(choice, rates, key, _now())


# ------------------------------------------------------------------------------------------------ generate
CLI_NEW_TOKENS = 32  # the generate plan's measurement length (whatever the run's own max_new_tokens)
CLI_CANDIDATES = (1, 2, 3)
CLI_MIN_NEW = 16  # a run of fewer new tokens decodes plain, unmeasured: its head prefill cannot pay off


def generate_plan(model, ids, max_new: int, sampling_kw: dict, make_spec, candidates=CLI_CANDIDATES, log=None,
                  repeats: int = 3) -> Plan:
    """The CLI's plan (generate at batch 1): cached per machine + model + settings (sampling, kv_dtype, window,
    mesh); else measured: plain and each candidate k compiled ahead of time, then timed once with generate itself
    on these ids for CLI_NEW_TOKENS new tokens (no EOS stop), `repeats` times interleaved, each candidate's
    fastest decode time per token after the first; then cached. The choice: `choose`. A run of fewer than
    CLI_MIN_NEW new tokens decodes plain without measuring."""
    from qwen_mtp.decoding.generate import generate, precompile

    if max_new < CLI_MIN_NEW:
        return Plan({1: 0}, {}, why=f"runs of under {CLI_MIN_NEW} new tokens decode plain, unmeasured")
    spec = make_spec(1)
    mesh = getattr(model, "mesh", None)
    settings = {"kind": "generate", "window": spec.window, "sinks": spec.sinks, "candidates": list(candidates),
                "new_tokens": CLI_NEW_TOKENS, "mesh": None if mesh is None else dict(mesh.shape),
                **{k: v for k, v in sampling_kw.items() if k != "seed"}}
    key = plan_key(model, settings)
    cached = load_cached(key)
    if cached is not None:
        return cached
    kw = {**sampling_kw, "eos_token_id": []}
    specs = {k: None if k == 0 else make_spec(k) for k in (0, *candidates)}
    for k, spec in specs.items():
        precompile(model, ids, CLI_NEW_TOKENS, spec=spec, **kw)
    best_s = {k: float("inf") for k in specs}
    for r in range(repeats):  # interleaved, each candidate's fastest run: robust to a busy machine
        order = list(specs)[r % len(specs):] + list(specs)[:r % len(specs)]
        for k in order:
            res = generate(model, ids, CLI_NEW_TOKENS, spec=specs[k], stream=lambda rows: None, **kw)
            best_s[k] = min(best_s[k], res.stats.decode_s / max(int(res.lengths.sum()) - len(res.lengths), 1))
    rates = {k: 1.0 / max(t, 1e-9) for k, t in best_s.items()}
    if log is not None:
        row = "  ".join(f"{'plain' if k == 0 else f'k={k}'}: {v:.1f}" for k, v in rates.items())
        print(f"[plan] decode tok/s  {row} (measured once, cached for this machine, model and settings)", file=log)
    best = choose(rates)
    plan = Plan({1: best}, {1: rates}, key, _now())
    save_cached(plan)
    return plan
