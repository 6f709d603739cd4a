"""The serving engine (qwen_mtp/serving/): requests joining and leaving a running batch give, token for token, what
offline `generate` gives for each prompt alone (f32 greedy; the oracle is generate's checked path, which
tests/test_spec_lossless.py holds to transformers); a long prompt is prefilled one chunk per segment boundary
while a running request keeps decoding, both answers generate's (tests/test_serve.py's load test runs the engine
with a Wind-MTP window under the plan); a plan that speculates at low occupancy and decodes plain at
high occupancy is followed as slots fill and empty, output unchanged; freed slots are reused; cancellation; a
seeded sampled request gives the same tokens alone and among others, in plain and speculative segments;
per-row sampling values are respected (top_k, greedy rows, a row's own repetition penalty against generate's); a full queue is a typed error; the engine's own thread.

Compiles are kept few: one engine for the module (4 slots, one bucket, plan k in {0, 2}, prefill chunks of 16
positions), at most 16 new tokens (one generate program); the long prompt's reference is generate's with the
same 16-position chunks (its programs are the short prompts')."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import qwen_mtp
from qwen_mtp import Engine, SamplingParams
from qwen_mtp.errors import ArgumentError, QueueFullError
from qwen_mtp.serving import plan as plan_mod
from qwen_mtp.serving.plan import Plan

SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "qwen3_5_small"
LENS = (5, 12, 9, 16, 3, 7)
MAX_TOKENS = (16, 5, 12, 9, 14, 16)
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # every XLA compile (jax.monitoring)
PLAN = Plan({1: 2, 2: 0, 3: 0, 4: 0}, {4: {0: 1.0, 2: 1.0}})  # speculate (k=2) with 1 busy slot, plain with 2-4
CHUNK = 16  # prefill chunk: a prompt of 17..48 tokens takes 2..3 chunks


@pytest.fixture(scope="module")
def model():
    return qwen_mtp.load(SHIPPED, dtype="float32")


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(1, 4096, n).astype(np.int32) for n in LENS]


@pytest.fixture(scope="module")
def reference(model, prompts):
    """Offline generate, each prompt alone, plain greedy: the ids up to its EOS or max_tokens."""
    out = []
    for p, n in zip(prompts, MAX_TOKENS):
        r = qwen_mtp.generate(model, p, n)
        out.append(r.tokens[0, :r.lengths[0]].tolist())
    return out


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, max_batch=4, max_model_len=64, spec=PLAN, buckets=(4,), segment=4, max_waiting=4,
                  prefill_chunk=CHUNK)


def drain(engine, limit=500):
    for _ in range(limit):
        if not engine.step():
            return
    raise AssertionError("the engine did not finish its requests")


def test_joining_and_leaving_equals_generate_and_follows_the_plan(engine, prompts, reference):
    before = dict(engine.metrics()["segments_by_k"])
    step = engine.step
    h = [engine.submit(prompts[0], SamplingParams(max_tokens=MAX_TOKENS[0]))]
    step()  # admitted alone: 1 busy slot -> k = 2
    step()
    h += [engine.submit(prompts[i], SamplingParams(max_tokens=MAX_TOKENS[i])) for i in (1, 2, 3, 4)]
    step()  # one prompt chunk per step while slots decode: 2 busy -> plain
    step()
    h.append(engine.submit(prompts[5], SamplingParams(max_tokens=MAX_TOKENS[5])))
    assert engine.waiting >= 2  # these wait for the prefill of those before them, then for a slot to free
    while h[5].stats.completion_tokens < 3:
        step()
    engine.cancel(h[5])  # leaves mid-way
    drain(engine)
    for i, (handle, ref) in enumerate(zip(h, reference)):
        if i == 5:
            assert handle.finish_reason == "cancelled" and handle.tokens == ref[:len(handle.tokens)], i
            continue
        assert handle.tokens == ref, (i, handle.tokens, ref)
        assert handle.finish_reason == ("stop" if len(ref) < MAX_TOKENS[i] else "length"), i
        assert handle.usage == {"prompt_tokens": LENS[i], "completion_tokens": len(ref),
                                "total_tokens": LENS[i] + len(ref)}
        assert handle.stats.ttft_s is not None and handle.stats.ttft_s >= 0
    slots = [x.slot for x in h]
    assert set(slots) <= {0, 1, 2, 3} and len(set(slots)) < len(h), slots  # freed slots were reused
    done = engine.metrics()["segments_by_k"]
    assert done.get(0, 0) > before.get(0, 0) and done.get(2, 0) > before.get(2, 0), done  # both modes ran
    by_busy = engine.metrics()["segments_by_busy_and_k"]
    assert all(k == PLAN.k_for(busy) for busy, k in by_busy), by_busy  # every segment ran the plan's k
    busy = {busy for busy, _ in by_busy}
    assert 1 in busy and max(busy) >= 3, by_busy  # as slots filled and emptied
    m = engine.metrics()
    assert m["running"] == 0 and m["waiting"] == 0 and m["drafts_proposed"] >= m["drafts_accepted"] > 0
    assert all(a is None or 0 <= a <= 1 for a in m["alpha_per_position"])
    assert sum(x.stats.rounds for x in h) > 0 and all(x.stats.drafts_accepted <= x.stats.drafts_proposed for x in h)


def test_every_slot_fills_and_a_freed_one_is_reused(engine, model, prompts):
    """Five requests of 40 new tokens queued (four, then one more once a place in the queue frees) against 4
    slots: they are admitted one per segment into the
    lowest free slot until all 4 decode together (segments at 4 busy, plain under the plan), the fifth waits for
    the first slot to free and takes it, and every answer is generate's. Deterministic (the engine stepped by
    hand), so the load test in test_serve need not catch a full batch by its clients' timing."""
    n = 40  # prompt (<= 16) + 40 <= max_model_len 64; no slot frees before the fourth is admitted
    want = []
    for p in prompts[:5]:
        r = qwen_mtp.generate(model, p, n)
        want.append(r.tokens[0, :r.lengths[0]].tolist())
    assert all(len(w) == n for w in want), [len(w) for w in want]  # no early EOS: every slot stays busy
    before = dict(engine.metrics()["segments_by_busy_and_k"])
    h = [engine.submit(prompts[i], SamplingParams(max_tokens=n)) for i in range(4)]  # max_waiting is 4
    engine.step()
    seen = [engine.busy_slots()]
    h.append(engine.submit(prompts[4], SamplingParams(max_tokens=n)))
    while not h[4].tokens:
        engine.step()
        seen.append(engine.busy_slots())
    assert [0, 1, 2, 3] in seen and h[4].slot in {x.slot for x in h[:4]}, (seen, [x.slot for x in h])
    assert [x.slot for x in h[:4]] == [0, 1, 2, 3]  # lowest free slot first
    drain(engine)
    assert [x.tokens for x in h] == want
    by_busy = engine.metrics()["segments_by_busy_and_k"]
    assert by_busy.get((4, 0), 0) > before.get((4, 0), 0), by_busy  # segments ran with all 4 slots busy
    assert engine.metrics()["free_slots"] == 4


def test_long_prompt_is_prefilled_between_segments(engine, model, prompts, reference):
    """A 40-token prompt (3 chunks of 16) joins while another request decodes: one chunk per step, with a segment
    of the running request after each (its tokens keep arriving), and then both answers are generate's. The old
    engine, which prefilled a prompt whole at admission, fails the chunk-by-chunk checks (the control)."""
    long = np.random.default_rng(3).integers(1, 4096, 40).astype(np.int32)
    r = qwen_mtp.generate(model, long, 16, prefill_chunk=CHUNK)
    want = r.tokens[0, :r.lengths[0]].tolist()
    a = engine.submit(prompts[0], SamplingParams(max_tokens=MAX_TOKENS[0]))
    b = engine.submit(long, SamplingParams(max_tokens=16))
    engine.step()  # nothing decoded: a is prefilled (one chunk), inserted, decodes a segment; b waits
    assert engine.prefilling() is None and b.stats.started_at is None and len(a.tokens) > 1
    progress = []
    while not b.tokens:
        n = len(a.tokens)
        engine.step()
        job = engine.prefilling()
        progress.append((None if job is None else job[1:], len(a.tokens) - n))
    assert [p for p, _ in progress] == [(1, 3), (2, 3), None], progress  # one chunk per segment boundary
    assert all(gain > 0 for _, gain in progress[:2]), progress  # a decoded while b's chunks ran
    drain(engine)
    assert a.tokens == reference[0] and b.tokens == want, (a.tokens, b.tokens, want)
    assert b.stats.ttft_s > 0 and b.usage["prompt_tokens"] == 40
    # cancelled mid-prefill: its reserved slot is free again at the next step, the running request unaffected
    a = engine.submit(prompts[0], SamplingParams(max_tokens=MAX_TOKENS[0]))
    c = engine.submit(long, SamplingParams(max_tokens=16))
    engine.step()
    engine.step()
    assert engine.prefilling()[0] is c and engine.running == 2
    engine.cancel(c)
    engine.step()
    assert c.finish_reason == "cancelled" and c.tokens == [] and engine.prefilling() is None
    assert engine.running == (0 if a.finished else 1)
    drain(engine)
    assert a.tokens == reference[0] and engine.running == 0


def test_seeded_sampling_is_reproducible_per_request(engine, prompts, reference):
    sampled = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=40, seed=11)
    alone = engine.submit(prompts[0], sampled)
    drain(engine)  # alone: speculative segments (k = 2)
    segs = dict(engine.metrics()["segments_by_k"])
    # the penalized greedy row first (alone: k = 2), then the sampled ones join (plain, sampling and the penalty
    # in one segment variant): the fewest segment variants to compile
    crowd = [engine.submit(prompts[2], SamplingParams(max_tokens=MAX_TOKENS[2], repetition_penalty=1.3)),
             engine.submit(prompts[0], sampled),
             engine.submit(prompts[1], SamplingParams(max_tokens=MAX_TOKENS[1], temperature=0.7, top_k=1, seed=3))]
    drain(engine)  # among others: plain segments
    other_seed = engine.submit(prompts[0], SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=40,
                                                          seed=12))
    drain(engine)
    assert engine.metrics()["segments_by_k"][0] > segs.get(0, 0)
    assert alone.tokens == crowd[1].tokens and len(alone.tokens) >= 8, (alone.tokens, crowd[1].tokens)
    assert alone.tokens != reference[0]  # it did sample (the control: greedy would give the reference)
    assert other_seed.tokens != alone.tokens  # the seed matters
    assert crowd[2].tokens == reference[1]  # top_k = 1: the argmax, whatever the temperature
    # a greedy row with its own repetition penalty among sampled ones: generate's output under that penalty
    r = qwen_mtp.generate(engine.model, prompts[2], MAX_TOKENS[2], repetition_penalty=1.3)
    assert crowd[0].tokens == r.tokens[0, :r.lengths[0]].tolist()
    assert crowd[0].tokens != reference[2]  # the penalty changed this prompt's output (the control)


def test_queue_full_is_a_typed_error_and_bad_input_names_the_argument(engine, prompts):
    waiting = [engine.submit(prompts[4], SamplingParams(max_tokens=2)) for _ in range(4)]
    with pytest.raises(QueueFullError, match="max_waiting=4"):
        engine.submit(prompts[4], SamplingParams(max_tokens=2))
    for h in waiting:
        engine.cancel(h)
    assert [h.finish_reason for h in waiting] == ["cancelled"] * 4 and engine.waiting == 0
    with pytest.raises(ArgumentError, match="max_tokens"):
        engine.submit(prompts[3], SamplingParams(max_tokens=60))  # 16 + 60 > max_model_len 64
    with pytest.raises(ArgumentError, match="prompt_ids"):
        engine.submit([5000], SamplingParams())
    with pytest.raises(ArgumentError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ArgumentError, match="window"):  # a window applies to speculation only
        Engine(engine.model, max_batch=4, spec=None, window=8)


def test_plan_is_measured_and_cached(engine, prompts, tmp_path, monkeypatch):
    """plan.measure times the engine's own segment programs (here the two the module already compiled); the
    plan is kept beside the compile cache and read back; choose keeps plain unless speculation won clearly."""
    monkeypatch.setenv("QWEN_MTP_COMPILE_CACHE", str(tmp_path))
    measured = plan_mod.measure(engine, prompts[3], ks=(0, 2), segments=2, key="test-key", repeats=1)
    assert set(measured.rates) == {4} and set(measured.rates[4]) == {0, 2}
    assert all(v > 0 for v in measured.rates[4].values()) and engine.running == 0
    assert measured.choice == {o: plan_mod.choose(measured.rates[4]) for o in (1, 2, 3, 4)}
    assert plan_mod.save_cached(measured) == tmp_path / plan_mod.PLAN_DIR / "test-key.json"
    assert plan_mod.load_cached("test-key") == measured
    assert plan_mod.choose({0: 100.0, 1: 104.0, 2: 90.0}) == 0 and plan_mod.choose({0: 100.0, 2: 120.0}) == 2
    # an impossible ratio (k = 1 at 3.96x plain: a round commits at most 2 tokens) is load noise, never chosen, and a
    # cached plan holding one is measured again (bench_serve met one measured under load 14-21)
    assert plan_mod.choose({0: 100.0, 1: 396.0}) == 0 and plan_mod.choose({0: 100.0, 1: 396.0, 2: 150.0}) == 2
    noisy = Plan({1: 1}, {1: {0: 100.0, 1: 396.0}}, key="noisy-key")
    assert plan_mod.save_cached(noisy) is not None and plan_mod.load_cached("noisy-key") is None
    sane = Plan({1: 1}, {1: {0: 100.0, 1: 150.0}}, key="sane-key")
    assert plan_mod.save_cached(sane) is not None and plan_mod.load_cached("sane-key") == sane  # the control
    assert "k=2" in Plan({1: 2}, {1: {0: 1.0, 2: 1.5}}).note() and "1.50x" in Plan({1: 2}, {1: {0: 1.0, 2: 1.5}}).note()


def test_engine_thread_serves_concurrent_submitters(engine, prompts, reference):
    results = {}

    def client(i):
        for _ in range(600):  # a full queue is a retry later (as the server's 429)
            try:
                results[i] = list(engine.submit(prompts[i], SamplingParams(max_tokens=MAX_TOKENS[i])))
                return
            except QueueFullError:
                time.sleep(0.05)

    compiled = []
    listener = lambda event, duration_secs, **_: compiled.append(event) if event == COMPILE_EVENT else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    engine.start()
    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    finally:
        engine.stop()
        jax.monitoring.unregister_event_duration_listener(listener)
    assert [results.get(i) for i in range(5)] == reference[:5]
    assert compiled == []  # requests of shapes seen before compile nothing: no program depends on a request
