"""Serving throughput against concurrency (the Wind-MTP paper's Figure 4, on our server): N concurrent clients
(default 1, 2, 4, 8, 16) against `python -m qwen_mtp serve`'s app with the shipped model, for plain decoding,
native MTP (k drafts every round), Wind-MTP (k drafts, the draft head on a window + sinks) and the measured
plan (plain or k per busy-slot count, serving/plan.py), against static batching (offline qwen_mtp.generate over
the same prompts, N at a time, plain and native MTP).

Each client sends its requests one after another, streamed (SSE, stream_options.include_usage), and times them
itself: TTFT = send -> first text chunk; TPOT = (last chunk - first chunk) / (completion tokens - 1); output
tokens/s = all completion tokens / wall time of the level. Prompts are cut from the shipped model's held-out
stdlib files (never trained on); greedy; ignore_eos, so every request runs to max_tokens and all modes do the
same work. The server runs in this process on 127.0.0.1 (an ephemeral port), its engine on its own thread.
One run measures every row: compare ratios within one run, on one machine (the table says which and its load).

    python benchmarks/bench_serve.py [--concurrency 1,2,4,8,16] [--modes plain,mtp,wind,plan] [--k 3]
        [--window 16 --sinks 4] [--slots 8] [--requests 2] [--prompt-len 64] [--new 64] [--no-static]
        [--out benchmarks/results/DIR] [--short]

--requests: requests per client at each level (so N x requests in all). --out: writes bench_serve.md (the table,
with date, machine, load and the exact command), bench_serve.json and bench_serve.png (throughput vs concurrency,
and TPOT vs throughput). --short: the CI form (tests/test_serve.py runs it): 1 client, 2 requests, plain server
and static, 16-token prompts, 8 new tokens, 3 slots in one bucket: the programs tests/test_engine.py and
test_serve.py compile (read back from the compile cache they share), no figure unless --out.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("plain", "mtp", "wind", "plan")


def _ints(text):
    return [int(s) for s in text.split(",") if s]


def _pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def prompts_for(tok, n, length):
    """n prompts of `length` ids cut from the held-out files (never trained on), cycling through them."""
    from checkpoints.corpus import HELD_OUT, held_out_file_ids

    out = []
    for i in range(n):
        ids = held_out_file_ids(tok, i % len(HELD_OUT), 200 + 97 * (i // len(HELD_OUT)), length)
        out.append(ids.tolist())
    return out


# ------------------------------------------------------------------------------------------- a client
def stream_one(host, port, prompt, max_tokens):
    """One streamed completion: (ttft_s, tpot_s or None, completion tokens)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                       "repetition_penalty": 1.0, "stream": True, "stream_options": {"include_usage": True}})
    c = http.client.HTTPConnection(host, port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    first = last = None
    tokens = 0
    for line in r:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        obj = json.loads(line[6:])
        now = time.perf_counter()
        if obj.get("usage"):
            tokens = obj["usage"]["completion_tokens"]
        if obj["choices"] and obj["choices"][0].get("text"):
            first = now if first is None else first
            last = now
    c.close()
    if first is None:
        raise RuntimeError("a request returned no text")
    return first - t0, ((last - first) / (tokens - 1) if tokens > 1 else None), tokens


def run_level(host, port, prompts, n_clients, per_client, max_tokens):
    """n_clients threads, each sending per_client requests in turn: the level's figures."""
    results, errors = [], []
    lock = threading.Lock()

    def client(c):
        for j in range(per_client):
            p = prompts[(c * per_client + j) % len(prompts)]
            try:
                res = stream_one(host, port, p, max_tokens)
            except Exception as e:  # noqa: BLE001 - reported in the table's errors column
                with lock:
                    errors.append(repr(e))
                continue
            with lock:
                results.append(res)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(n_clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return summarize([r[0] for r in results], [r[1] for r in results if r[1] is not None],
                     sum(r[2] for r in results), wall, len(errors))


def summarize(ttfts, tpots, tokens, wall, errors=0):
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall, "requests": len(ttfts), "errors": errors,
            "ttft_p50": _pct(ttfts, 50), "ttft_p90": _pct(ttfts, 90), "ttft_p99": _pct(ttfts, 99),
            "tpot_p50": _pct(tpots, 50), "tpot_p90": _pct(tpots, 90), "tpot_p99": _pct(tpots, 99)}


# ------------------------------------------------------------------------------------------- the modes
def spec_of(mode, args):
    import qwen_mtp

    return {"plain": None, "mtp": qwen_mtp.SpecConfig(k=args.k),
            "wind": qwen_mtp.SpecConfig(k=args.k, window=args.window, sinks=args.sinks), "plan": "auto"}[mode]


def max_len_of(args):
    """Every mode's engine the same context: a request's prompt + new tokens, and at least what the plan's
    measurement needs (serving/plan.py: four segments of k = max_k rounds after a 16-token prompt)."""
    return 64 if args.short else max(args.prompt_len + args.new + 1, 256)


def serve_mode(mode, model, tok, prompts, args, log):
    import qwen_mtp
    from qwen_mtp.serving.http import create_app
    from qwen_mtp.serving.http_server import ThreadServer

    max_len = max_len_of(args)
    t0 = time.perf_counter()
    extra = {"buckets": (args.slots,), "segment": 4} if args.short else {}
    engine = qwen_mtp.Engine(model, max_batch=args.slots, max_model_len=max_len, spec=spec_of(mode, args),
                             max_waiting=max(args.concurrency) + 1, max_k=args.k, **extra)
    engine.precompile()
    setup = time.perf_counter() - t0
    engine.start()
    app = create_app(engine, tok, model_name="bench", max_model_len=max_len, vocab_size=model.config.vocab_size)
    rows = {}
    with ThreadServer(app) as s:
        stream_one(s.host, s.port, prompts[0], args.new)  # warm: first-use work out of the timings
        for n in args.concurrency:
            rows[n] = run_level(s.host, s.port, prompts, n, args.requests, args.new)
            log(f"  {mode:>6} N={n:<3} {rows[n]['tok_s']:8.1f} tok/s  TTFT p50 {1e3 * rows[n]['ttft_p50']:7.1f} ms  "
                f"TPOT p50 {1e3 * rows[n]['tpot_p50']:6.2f} ms  ({rows[n]['requests']} requests, "
                f"{rows[n]['errors']} errors)")
    described = engine.describe_spec()
    engine.stop()
    return rows, {"setup_s": setup, "spec": described}


def _first_call(times):
    """A generate stream callback that records when it is first called (the first token)."""
    return lambda rows: times or times.append(time.perf_counter())


def static_mode(mode, model, prompts, args, log):
    """Offline generate over the same prompts, N at a time (a batch starts and ends together)."""
    import qwen_mtp

    spec = spec_of(mode, args)
    rows = {}
    for n in args.concurrency:
        total = n * args.requests
        batches = [[np.asarray(prompts[i % len(prompts)], np.int32) for i in range(j, min(j + n, total))]
                   for j in range(0, total, n)]
        kw = {"spec": spec, "eos_token_id": [], "repetition_penalty": 1.0}
        qwen_mtp.precompile(model, batches[0], args.new, **kw)
        qwen_mtp.generate(model, batches[0], args.new, stream=lambda rows: None, **kw)  # warm, as the server's
        ttfts, tpots, tokens = [], [], 0
        t0 = time.perf_counter()
        for b in batches:
            first = []
            tb = time.perf_counter()
            r = qwen_mtp.generate(model, b, args.new, stream=_first_call(first), **kw)
            end = time.perf_counter()
            ttft = first[0] - tb
            ttfts += [ttft] * len(b)
            tpots += [(end - first[0]) / (args.new - 1)] * len(b)
            tokens += int(r.lengths.sum())
        rows[n] = summarize(ttfts, tpots, tokens, time.perf_counter() - t0)
        log(f"  static {mode:>5} N={n:<3} {rows[n]['tok_s']:8.1f} tok/s  TTFT p50 {1e3 * rows[n]['ttft_p50']:7.1f} "
            f"ms  TPOT p50 {1e3 * rows[n]['tpot_p50']:6.2f} ms")
    return rows


# ------------------------------------------------------------------------------------------- output
def machine():
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    import jax

    dev = jax.devices()[0]
    return (f"{platform.node()}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, jax "
            f"{jax.__version__} on {dev.platform} ({dev.device_kind}); load average at start "
            f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")


def table(results, concurrency):
    head = ("| engine | mode | N | output tok/s | vs plain server | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 "
            "ms | requests |")
    lines = [head, "| --- | --- | ---: | ---: | ---: | --- | --- | ---: |"]
    plain = results.get(("server", "plain"), {})
    for (kind, mode), rows in results.items():
        for n in concurrency:
            r = rows.get(n)
            if r is None:
                continue
            base = plain.get(n, {}).get("tok_s")
            ratio = f"{r['tok_s'] / base:.2f}x" if base else "-"
            lines.append(f"| {kind} | {mode} | {n} | {r['tok_s']:.1f} | {ratio} | {1e3 * r['ttft_p50']:.0f} / "
                         f"{1e3 * r['ttft_p90']:.0f} / {1e3 * r['ttft_p99']:.0f} | {1e3 * r['tpot_p50']:.2f} / "
                         f"{1e3 * r['tpot_p90']:.2f} / {1e3 * r['tpot_p99']:.2f} | {r['requests']} |")
    return "\n".join(lines)


def plot(results, concurrency, file):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (kind, mode), rows in results.items():
        ns = [n for n in concurrency if n in rows]
        style = "-o" if kind == "server" else "--s"
        label = f"{'server' if kind == 'server' else 'static'} {mode}"
        a.plot(ns, [rows[n]["tok_s"] for n in ns], style, label=label)
        b.plot([rows[n]["tok_s"] for n in ns], [1e3 * rows[n]["tpot_p50"] for n in ns], style, label=label)
    a.set_xscale("log", base=2)
    a.set_xticks(concurrency, [str(n) for n in concurrency])
    a.set_xlabel("concurrent clients")
    a.set_ylabel("output tokens/s")
    a.set_title("throughput vs concurrency")
    b.set_xlabel("output tokens/s")
    b.set_ylabel("TPOT p50 (ms)")
    b.set_title("latency vs throughput")
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(file, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=_ints, default=[1, 2, 4, 8, 16])
    ap.add_argument("--modes", default="plain,mtp,wind,plan")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--slots", type=int, default=8, help="engine slots (max_batch)")
    ap.add_argument("--requests", type=int, default=2, help="requests per client at each level")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--no-static", action="store_true")
    ap.add_argument("--out", default=None, help="folder for bench_serve.md / .json / .png")
    ap.add_argument("--short", action="store_true", help="the CI form: tiny and fast")
    args = ap.parse_args(argv)
    if args.short:  # the engine as tests/test_engine.py and test_serve.py build it: their compiled programs serve
        args.concurrency, args.modes, args.new, args.prompt_len, args.slots, args.requests = [1], "plain", 8, \
            16, 3, 2
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes: expected some of {','.join(MODES)}, found {','.join(bad)}")
    import qwen_mtp
    from qwen_mtp.loading.folder import default_model_path, load_tokenizer

    folder = args.model or str(default_model_path())
    log = lambda text: print(text, flush=True)
    command = "python benchmarks/bench_serve.py " + " ".join(sys.argv[1:] if argv is None else argv)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    where = machine()
    log(f"{started}; {where}\n{command}")
    tok = load_tokenizer(folder)
    model = qwen_mtp.load(folder)
    prompts = prompts_for(tok, max(args.concurrency) * args.requests, args.prompt_len)
    results, info = {}, {}
    for mode in modes:
        results[("server", mode)], info[mode] = serve_mode(mode, model, tok, prompts, args, log)
    if not args.no_static:
        for mode in [m for m in modes if m in ("plain", "mtp")]:
            results[("static", mode)] = static_mode(mode, model, prompts, args, log)
    text = table(results, args.concurrency)
    log(text)
    for mode, i in info.items():
        log(f"{mode}: {i['spec']}, engine set-up (compile) {i['setup_s']:.1f}s not counted")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        plot(results, args.concurrency, out / "bench_serve.png")
        notes = "\n".join(f"- {mode}: {i['spec']}; engine set-up (compile) {i['setup_s']:.1f} s, not counted"
                          for mode, i in info.items())
        (out / "bench_serve.md").write_text(
            f"# Serving throughput against concurrency\n\n{started}; {where}\n\n`{command}`\n\n"
            f"Greedy, ignore_eos, {args.prompt_len}-token prompts from the held-out stdlib files, {args.new} new tokens "
            f"each, {args.requests} requests per client per level, {args.slots} engine slots; 'vs plain server' is "
            f"output tok/s over the plain server's at the same N, in this run.\n\n{text}\n\n{notes}\n\n"
            f"![throughput vs concurrency](bench_serve.png)\n", encoding="utf-8")
        (out / "bench_serve.json").write_text(json.dumps(
            {"started": started, "machine": where, "command": command, "info": info,
             "results": {f"{k}/{m}": rows for (k, m), rows in results.items()}}, indent=1), encoding="utf-8")
        log(f"wrote {out / 'bench_serve.md'}, bench_serve.json, bench_serve.png")
    return 0


if __name__ == "__main__":
    from qwen_mtp.extras import run_script

    sys.exit(run_script(main))
