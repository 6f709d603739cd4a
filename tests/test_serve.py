"""The OpenAI-compatible server (qwen_mtp/serving/http.py) on 127.0.0.1, an ephemeral port, in this process.

Against a stand-in engine (serve_fakes.FakeEngine: echoes the prompt's ids, so every answer is known): the
`openai` package as the client for completions and chat, streaming and not, usage that adds up, stop strings;
raw HTTP (http.client) for every error case; a client that disconnects mid-stream frees its slot; draining on
stop. Against the real Engine and the shipped model in f32: the load test (32 requests of mixed prompt lengths,
some prefilled in several chunks, and mixed max_tokens, from 8 client threads against 4 slots, some leaving
mid-stream; every answer equals offline generate's, slots reused, the server healthy afterwards).
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from serve_fakes import FakeEngine

from qwen_mtp.loading.folder import default_model_path, load_tokenizer
from qwen_mtp.serving.chat_template import load_chat_template
from qwen_mtp.serving.http import create_app
from qwen_mtp.serving.http_server import ThreadServer

MODEL = "qwen3_5_small"
CTX = 64
KEY = "sk-test-123"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())


def _server(tok, engine, **kw):
    kw.setdefault("chat_template", load_chat_template(default_model_path()))
    app = create_app(engine, tok, model_name=MODEL, max_model_len=CTX, vocab_size=tok.get_vocab_size(),
                     defaults={"temperature": 0.0}, **kw)
    return ThreadServer(app)


@pytest.fixture(scope="module")
def served(tok):
    engine = FakeEngine(slots=2, max_waiting=64)
    with _server(tok, engine) as s:
        yield s, engine
    engine.stop()


def _client(s, **kw):
    return openai.OpenAI(base_url=s.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0,
                         timeout=kw.pop("timeout", 30), **kw)


def _raw(s, method, path, body=None, headers=None):
    c = http.client.HTTPConnection(s.host, s.port, timeout=30)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    c.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    r = c.getresponse()
    out = r.status, dict(r.getheaders()), r.read()
    c.close()
    return out


def _echo(tok, text, n):
    """What FakeEngine answers to `text` with n tokens: its ids cycled."""
    ids = tok.encode(text).ids
    return tok.decode([ids[i % len(ids)] for i in range(n)]), ids


def test_completions_and_usage(served, tok):
    s, _ = served
    c = _client(s)
    r = c.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=9)
    want, ids = _echo(tok, "def add(a, b):", 9)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 9, len(ids) + 9)
    # token ids as the prompt, streamed, usage asked for
    chunks = list(c.completions.create(model=MODEL, prompt=ids, max_tokens=7, stream=True,
                                       stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == _echo(tok, "def add(a, b):", 7)[0]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.total_tokens == len(ids) + 7


def test_chat_and_stream(served, tok):
    s, _ = served
    c = _client(s)
    messages = [{"role": "system", "content": "Helpers."}, {"role": "user", "content": "Add two numbers."}]
    prompt = load_chat_template(default_model_path()).render(messages, add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False).ids
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == tok.decode([ids[i % len(ids)] for i in range(5)])
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 5)
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == r.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == 5
    # no max_tokens: chat gets what the context leaves
    r = c.chat.completions.create(model=MODEL, messages=messages)
    assert r.usage.total_tokens == CTX and r.choices[0].finish_reason == "length"


def test_stop_strings(served, tok):
    s, _ = served
    c = _client(s)
    # the echo of "abc = 1\nabc = 2\n" reaches "= 2" after a few tokens: cut before it, finish_reason stop
    prompt = "abc = 1\nabc = 2\n"
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=40, stop=["= 2", "zzz"])
    assert r.choices[0].text == "abc = 1\nabc " and r.choices[0].finish_reason == "stop"
    n = r.usage.completion_tokens
    assert 0 < n < 40 and tok.decode(tok.encode(prompt).ids[:n]).find("= 2") >= 0
    streamed = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=40, stop="= 2", stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == "abc = 1\nabc "
    assert streamed[-1].choices[0].finish_reason == "stop"
    # a stop string that never completes is given back whole at the end
    r = c.completions.create(model=MODEL, prompt="ab", max_tokens=3, stop="abX")
    assert r.choices[0].text == _echo(tok, "ab", 3)[0]


def test_sse_wire_format(served):
    s, _ = served
    status, headers, body = _raw(s, "POST", "/v1/completions", {"prompt": "x = 1", "max_tokens": 3, "stream": True,
                                                                "stream_options": {"include_usage": True}})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = body.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    objs = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert all(o["usage"] is None for o in objs[:-1]) and objs[-1]["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("body,param", [
    (b"{not json", None),
    ({"prompt": "x", "max_tokenz": 3}, "max_tokenz"),
    ({"prompt": "x", "max_tokens": "3"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": CTX}, "max_tokens"),
    ({"prompt": list(range(1, CTX + 1)), "max_tokens": 1}, "prompt"),
    ({"prompt": [5000]}, "prompt"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"max_tokens": 3}, "prompt"),
])
def test_bad_completion_requests_are_400_naming_the_field(served, body, param):
    s, _ = served
    status, _, raw = _raw(s, "POST", "/v1/completions", body)
    err = json.loads(raw)["error"]
    assert status == 400, raw
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    assert set(err) == {"message", "type", "param", "code"}


def test_bad_chat_requests(served, tok):
    s, _ = served
    for body, param in [({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": "x"}]},
                                                         "messages.0.role"),
                        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
                        ({"messages": [{"role": "user", "content": "x" * 400}]}, "messages")]:
        status, _, raw = _raw(s, "POST", "/v1/chat/completions", body)
        assert status == 400 and json.loads(raw)["error"]["param"] == param, raw
    status, _, raw = _raw(s, "POST", "/v1/completions", {"model": "gpt-4", "prompt": "x"})
    assert status == 404 and json.loads(raw)["error"]["param"] == "model"
    status, _, raw = _raw(s, "GET", "/v1/nothing")
    assert status == 404 and "error" in json.loads(raw)
    # a folder without a chat template: 400 on chat, completions still work
    engine = FakeEngine()
    with _server(tok, engine, chat_template=None) as bare:
        status, _, raw = _raw(bare, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
        assert status == 400 and json.loads(raw)["error"]["code"] == "no_chat_template"
        assert _raw(bare, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200
    engine.stop()


def test_models_health_metrics(served):
    s, _ = served
    assert [m.id for m in _client(s).models.list().data] == [MODEL]
    assert _raw(s, "GET", "/health")[0] == 200
    status, headers, body = _raw(s, "GET", "/metrics")
    text = body.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:time_per_output_token_seconds_bucket", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", ('vllm:spec_decode_num_accepted_tokens_per_pos_total'
                 '{model_name="qwen3_5_small",position="2"} 2.0'), ('qwen_mtp:spec_decode_acceptance_length'
                 '{model_name="qwen3_5_small"} 2.2'), ('qwen_mtp:spec_decode_alpha{model_name="qwen3_5_small",'
                 'position="0"} 0.6')):
        assert name in text, name


def test_api_key_and_body_limit(tok):
    engine = FakeEngine()
    with _server(tok, engine, api_key=KEY, max_body_bytes=2000) as s:
        assert _raw(s, "POST", "/v1/completions", {"prompt": "x"})[0] == 401
        status, _, raw = _raw(s, "POST", "/v1/completions", {"prompt": "x"}, {"Authorization": "Bearer wrong"})
        assert status == 401 and json.loads(raw)["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            _client(s, api_key="wrong").completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert _client(s, api_key=KEY).completions.create(model=MODEL, prompt="x", max_tokens=2).usage
        big = {"prompt": "x" * 3000}
        status, _, raw = _raw(s, "POST", "/v1/completions", big, {"Authorization": f"Bearer {KEY}"})
        assert status == 413 and json.loads(raw)["error"]["code"] == "request_too_large"
        assert _raw(s, "GET", "/health")[0] == 200  # health and metrics stay open
    engine.stop()


def test_full_queue_is_429_not_a_hang(tok):
    engine = FakeEngine(slots=1, max_waiting=1, step_s=0.25)
    with _server(tok, engine) as s:
        results = []

        def call():
            results.append(_raw(s, "POST", "/v1/completions", {"prompt": "x = 1", "max_tokens": 4}))

        # the first request running before the others arrive (else two can reach the one waiting place together
        # and only one request gets through: a race of the test's threads, not the server's behaviour)
        t0 = time.perf_counter()
        threads = [threading.Thread(target=call)]
        threads[0].start()
        while engine.metrics()["running"] < 1:
            assert time.perf_counter() - t0 < 10, "the first request never started"
            time.sleep(0.01)
        threads += [threading.Thread(target=call) for _ in range(4)]
        for t in threads[1:]:
            t.start()
        for t in threads:
            t.join(30)
        codes = sorted(r[0] for r in results)
        assert codes.count(200) >= 2 and codes.count(429) >= 1 and set(codes) <= {200, 429}, codes
        refused = next(r for r in results if r[0] == 429)
        assert refused[1]["retry-after"] == "1" and json.loads(refused[2])["error"]["code"] == "queue_full"
        assert time.perf_counter() - t0 < 20
    engine.stop()


def test_disconnect_mid_stream_frees_the_slot(tok):
    engine = FakeEngine(slots=1, max_waiting=4, step_s=0.01)
    with _server(tok, engine) as s:
        c = http.client.HTTPConnection(s.host, s.port, timeout=30)
        c.request("POST", "/v1/completions", json.dumps({"prompt": "x = 1", "max_tokens": 60, "stream": True}),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200 and r.read(6) == b"data: "
        c.sock.close()  # gone mid-stream
        c.close()
        deadline = time.time() + 10
        while not engine.cancelled_ids and time.time() < deadline:
            time.sleep(0.02)
        assert engine.cancelled_ids, "the server did not cancel the request of a client that left"
        # the slot is free again: the next request gets it and completes
        out = _client(s).completions.create(model=MODEL, prompt="y", max_tokens=3)
        assert out.usage.completion_tokens == 3
    engine.stop()


def test_stop_drains_running_requests(tok):
    engine = FakeEngine(slots=1, step_s=0.01)
    s = _server(tok, engine)
    result = {}

    def call():
        result["r"] = _client(s).completions.create(model=MODEL, prompt="x = 1", max_tokens=40)

    t = threading.Thread(target=call)
    t.start()
    deadline = time.time() + 10
    while not engine.running and time.time() < deadline:
        time.sleep(0.01)
    s.stop()  # what SIGTERM does: stop accepting, let the running request finish
    t.join(10)
    assert result["r"].usage.completion_tokens == 40 and result["r"].choices[0].finish_reason == "length"
    with pytest.raises(OSError):
        _raw(s, "GET", "/health")
    engine.stop()


def test_disconnect_while_waiting_for_a_whole_answer_cancels(tok):
    engine = FakeEngine(slots=1, step_s=0.02)
    with _server(tok, engine) as s:
        c = http.client.HTTPConnection(s.host, s.port, timeout=30)
        c.request("POST", "/v1/completions", json.dumps({"prompt": "x = 1", "max_tokens": 60}),
                  {"Content-Type": "application/json"})
        deadline = time.time() + 10
        while not engine.running and time.time() < deadline:
            time.sleep(0.01)
        c.sock.close()  # gone before the answer
        c.close()
        while not engine.cancelled_ids and time.time() < deadline:
            time.sleep(0.02)
        assert engine.cancelled_ids
    engine.stop()


def test_engine_failure_is_an_openai_error(tok):
    class Broken(FakeEngine):
        def _loop(self):
            while not self.stopped:
                with self.cond:
                    for h in list(self.waiting):
                        self.waiting.remove(h)
                        h._finish("error", RuntimeError("device lost"))
                    self.cond.wait(0.05)

    engine = Broken()
    with _server(tok, engine) as s:
        status, _, raw = _raw(s, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 3})
        assert status == 500 and "device lost" in json.loads(raw)["error"]["message"]
        status, _, raw = _raw(s, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": True})
        events = raw.decode().split("\n\n")
        assert status == 200 and "device lost" in events[-3] and events[-2] == "data: [DONE]"
    engine.stop()


SIGTERM_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from serve_fakes import FakeEngine
from qwen_mtp.loading.folder import default_model_path, load_tokenizer
from qwen_mtp.serving.http import create_app
from qwen_mtp.serving.http_server import serve
tok = load_tokenizer(default_model_path())
engine = FakeEngine(slots=1, step_s=0.02)
app = create_app(engine, tok, model_name="m", max_model_len=64, vocab_size=4096, defaults={{"temperature": 0.0}})
serve(app, port=0, log_level="warning", shutdown_timeout=20, on_ready=lambda p: print(p, flush=True))
engine.stop()
print("exited cleanly", flush=True)
"""


def test_sigterm_finishes_running_requests_and_exits():
    """`serve` (what `python -m qwen_mtp serve` runs) in a process of its own: SIGTERM while a stream runs ->
    the stream completes, new connections are refused, the process exits 0."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).resolve().parent)
    p = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT.format(tests=tests)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        port = int(p.stdout.readline())
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("POST", "/v1/completions", json.dumps({"prompt": "x = 1", "max_tokens": 50, "stream": True}),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.read(6) == b"data: "
        p.send_signal(signal.SIGTERM)
        body = r.read().decode()
        assert body.endswith("data: [DONE]\n\n") and '"finish_reason":"length"' in body
        assert p.wait(30) == 0, p.stderr.read()
        assert p.stdout.read().strip() == "exited cleanly"
        with pytest.raises(OSError):
            http.client.HTTPConnection("127.0.0.1", port, timeout=5).request("GET", "/health")
    finally:
        if p.poll() is None:
            p.kill()


# ---------------------------------------------------------------------------------------------- the real engine
# The shipped model in f32 behind the real Engine, configured as tests/test_engine.py's (4 slots, one bucket, a
# plan that speculates with k = 2 at 1 busy slot and decodes plain at 2-4, prefill chunks of 16 positions, at
# most 16 new tokens), with a Wind-MTP window (8, 2 sinks) under that plan: the head's ring is caught up by the
# plain segments and drafted from by the speculative ones.
LOAD_REQUESTS, LOAD_CLIENTS, LOAD_LEAVERS, LOAD_SLOTS, CHUNK = 32, 8, 4, 4, 16


@pytest.fixture(scope="module")
def real(tok):
    import numpy as np

    import qwen_mtp
    from qwen_mtp.serving.plan import Plan

    model = qwen_mtp.load(default_model_path(), dtype="float32")
    plan = Plan({1: 2, 2: 0, 3: 0, 4: 0}, {4: {0: 1.0, 2: 1.0}})
    engine = qwen_mtp.Engine(model, max_batch=LOAD_SLOTS, max_model_len=64, spec=plan, buckets=(LOAD_SLOTS,),
                             segment=4, max_waiting=LOAD_CLIENTS, prefill_chunk=CHUNK, window=8, sinks=2).start()
    handles, submit = [], engine.submit  # every request the server hands the engine, to check its slot
    engine.submit = lambda *a, **kw: handles.append(submit(*a, **kw)) or handles[-1]
    rng = np.random.default_rng(11)
    # mixed prompt lengths: one chunk (3..16 tokens) and, every fourth, two or three chunks (17..44)
    prompts = [rng.integers(1, 4096, int(rng.integers(17, 45) if i % 4 == 1 else rng.integers(3, 17))).tolist()
               for i in range(LOAD_REQUESTS)]
    budgets = [int(rng.integers(9, 17)) for _ in range(LOAD_REQUESTS)]
    refs = []
    for p, n in zip(prompts, budgets):  # offline generate, each prompt alone, plain greedy: the oracle
        r = qwen_mtp.generate(model, np.asarray(p, np.int32), n, prefill_chunk=CHUNK)
        refs.append(r.tokens[0, :r.lengths[0]].tolist())
    app = create_app(engine, tok, model_name=MODEL, max_model_len=64, vocab_size=4096,
                     chat_template=load_chat_template(default_model_path()), defaults={"temperature": 0.0})
    with ThreadServer(app) as s:
        yield s, engine, prompts, budgets, refs, handles
    engine.stop()


def test_under_load_every_answer_equals_generate(real, tok):
    """32 requests of mixed prompt lengths (8 of them prefilled in 2-3 chunks between decode segments) and
    max_tokens from 8 client threads against 4 slots (Wind-MTP under the plan), 4 of them streamed and dropped
    after their first chunk:
    every completed answer is offline generate's for its prompt (none lost, duplicated or cross-wired), the
    dropped ones are cancelled, at most the 4 slots served them all (lowest free first, freed slots reused), the
    slots all free afterwards, the plan followed, the server healthy."""
    import collections
    import concurrent.futures

    s, engine, prompts, budgets, refs, handles = real
    assert len({tuple(r) for r in refs}) == LOAD_REQUESTS  # distinct answers: a cross-wired one cannot pass
    leavers = set(range(0, LOAD_REQUESTS, LOAD_REQUESTS // LOAD_LEAVERS))
    before = engine.metrics()["finished"].get("cancelled", 0)
    client = _client(s, timeout=120)  # one client for every thread (the openai package's clients are thread-safe)

    def one(i):
        if i in leavers:
            c = http.client.HTTPConnection(s.host, s.port, timeout=60)
            c.request("POST", "/v1/completions", json.dumps({"prompt": prompts[i], "max_tokens": budgets[i],
                                                             "stream": True}), {"Content-Type": "application/json"})
            r = c.getresponse()
            assert r.status == 200 and r.read(6) == b"data: "
            c.sock.close()
            c.close()
            return i, None
        r = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=budgets[i])
        return i, r

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(LOAD_CLIENTS) as pool:
        answers = dict(pool.map(one, range(LOAD_REQUESTS)))
    assert len(answers) == LOAD_REQUESTS
    for i, r in answers.items():
        if r is None:
            continue
        ref = refs[i]
        assert r.choices[0].text == tok.decode(ref), f"request {i}: not generate's answer for its prompt"
        assert r.usage.completion_tokens == len(ref) and r.usage.prompt_tokens == len(prompts[i])
        assert r.choices[0].finish_reason == ("length" if len(ref) == budgets[i] else "stop")
    deadline = time.time() + 30
    while (engine.running or engine.waiting) and time.time() < deadline:
        time.sleep(0.05)
    m = engine.metrics()
    assert m["running"] == 0 and m["waiting"] == 0 and m["free_slots"] == LOAD_SLOTS
    assert m["finished"].get("cancelled", 0) - before >= 1  # the clients that left freed their slots early
    assert len(handles) == LOAD_REQUESTS and all(h.finished for h in handles)  # one engine request per request
    assert sorted(len(h.prompt_ids) for h in handles) == sorted(len(p) for p in prompts)
    assert engine.dev.slots.mcache.k.shape[1] == 2 + 8 + 2  # the ring: sinks + window + k slots
    by_busy = m["segments_by_busy_and_k"]
    # the plan followed in both of its modes: k = 2 alone, plain with company (how many slots are busy at once
    # beyond that depends on the clients' timing: 2, 3 or 4; test_engine fills all 4 deterministically)
    busy_seen = {b for b, _ in by_busy}
    assert all(k == (2 if busy == 1 else 0) for busy, k in by_busy) and 1 in busy_seen and max(busy_seen) >= 2, by_busy
    # the slots that served: the lowest free one each time, so slots 0..n-1 for the most ever held at once (at
    # least as many as any segment had busy), n <= 4, and freed slots reused (32 requests)
    per_slot = collections.Counter(h.slot for h in handles)
    assert set(per_slot) == set(range(len(per_slot))) and max(busy_seen) <= len(per_slot) <= LOAD_SLOTS, per_slot
    assert _raw(s, "GET", "/health")[0] == 200
    assert _client(s).completions.create(model=MODEL, prompt=prompts[1], max_tokens=budgets[1]).choices[0].text \
        == tok.decode(refs[1])
    assert time.perf_counter() - t0 < 300


def test_bench_serve_short_form_runs(tmp_path):
    """benchmarks/bench_serve.py --short: the server and static batching measured, the table and figure written."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_serve.py"), "--short", "--out",
                          str(tmp_path)], capture_output=True, text=True, cwd=root, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    table = (tmp_path / "bench_serve.md").read_text()
    assert "| server | plain | 1 |" in table and "| static | plain | 1 |" in table, table
    assert (tmp_path / "bench_serve.png").stat().st_size > 1000
    rows = json.loads((tmp_path / "bench_serve.json").read_text())["results"]
    assert rows["server/plain"]["1"]["errors"] == 0 and rows["server/plain"]["1"]["tokens"] == 2 * 8
