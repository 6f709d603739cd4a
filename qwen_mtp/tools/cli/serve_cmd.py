"""`python -m qwen_mtp serve`: the OpenAI-compatible HTTP server (qwen_mtp/serving/http.py) over an Engine with
slots (qwen_mtp/serving/engine.py). Loads the model, builds the engine (speculation: the measured plan by
default), compiles what it runs, and serves on 127.0.0.1:8000 until SIGTERM / Ctrl-C (docs/serving.md)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from qwen_mtp.errors import ArgumentError
from qwen_mtp.tools.cli.args import nonneg_int, pos_int
from qwen_mtp.trunk.state import KV_DTYPE_NAMES

API_KEY_ENV = "QWEN_MTP_API_KEY"
SERVE_MODULES = ("fastapi", "uvicorn", "jinja2", "prometheus_client")


def _spec_arg(text: str):
    """--spec: 'auto' (the measured plan), 'off' (plain decoding) or k (that many drafts every round)."""
    if text in ("auto", "off"):
        return text
    try:
        k = int(text)
    except ValueError:
        k = 0
    if not 1 <= k <= 16:
        raise argparse.ArgumentTypeError(f"expected auto, off, or a number of drafts in [1, 16], found {text!r}")
    return k


def add_serve_command(sub) -> None:
    """The `serve` subcommand's flags (registered by parser.build_parser)."""
    s = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API (continuous batching)",
                       description="Serve the model over HTTP: /v1/completions, /v1/chat/completions, /v1/models, "
                       "/health, /metrics (docs/serving.md). Binds 127.0.0.1 unless --host says otherwise.")
    s.add_argument("--model", default=None, metavar="DIR", help="model folder (default: the shipped "
                   "checkpoints/qwen3_5_small)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only; "
                   "0.0.0.0 exposes it to the network)")
    s.add_argument("--port", type=nonneg_int, default=8000, help="port (default 8000; 0 picks a free one)")
    s.add_argument("--served-model-name", default=None, metavar="NAME", help="the model id clients name "
                   "(default: the folder's name)")
    s.add_argument("--max-batch", type=pos_int, default=8, help="engine slots: requests decoded together "
                   "(default 8)")
    s.add_argument("--max-model-len", type=pos_int, default=None, metavar="N", help="longest prompt + "
                   "max_tokens of a request (default: min(4096, the model's))")
    s.add_argument("--max-waiting", type=nonneg_int, default=64, help="requests waiting for a slot before new "
                   "ones get 429 (default 64)")
    s.add_argument("--spec", type=_spec_arg, default="auto", metavar="auto|off|K", help="speculation: 'auto' "
                   "(default) plain or k per busy-slot count as measured on this machine (cached), 'off' plain "
                   "decoding, K drafts per round always")
    s.add_argument("--window", type=pos_int, default=None, help="with --spec K or auto: Wind-MTP, the draft head "
                   "attends to the last WINDOW positions plus the sinks (default: native full attention)")
    s.add_argument("--sinks", type=nonneg_int, default=0, help="with --window: positions always visible")
    s.add_argument("--quant", choices=["int8", "int4", "fp8"], default=None, help="quantize the weights as they "
                   "load (default: as stored)")
    s.add_argument("--kv-dtype", choices=list(KV_DTYPE_NAMES), default=None, help="dtype of the KV caches (default: the compute dtype)")
    s.add_argument("--api-key", default=None, metavar="KEY", help=f"require 'Authorization: Bearer KEY' on /v1/* "
                   f"(default: ${API_KEY_ENV} if set, else no key)")
    s.add_argument("--max-body-bytes", type=pos_int, default=1 << 20, help="largest request body (default 1 MiB; "
                   "larger: 413)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, help="on SIGTERM, seconds running requests "
                   "may take to finish before they are cancelled (default 30)")
    s.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="info",
                   help="the server's log level")
    s.add_argument("--compile-cache", default=None, metavar="DIR|off", help="jax's persistent compilation cache "
                   "folder (as for generate; default: $QWEN_MTP_COMPILE_CACHE, else ~/.cache/qwen_mtp/jax)")
    s.set_defaults(func=cmd_serve)


def _spec(args, model):
    from qwen_mtp.decoding.speculative import SpecConfig

    if args.window is None and args.sinks:
        raise ArgumentError("--sinks", "0 without --window", str(args.sinks))
    if args.window is not None and args.spec == "off":
        raise ArgumentError("--window", "--spec K or auto with it (a window applies to the draft head)", "--spec off")
    if args.spec == "off":
        return None
    if not model.has_mtp:
        if args.spec == "auto":
            return None
        raise ArgumentError("--spec", "off for a checkpoint without an MTP head (mtp.* tensors)", str(args.spec))
    if args.spec == "auto":
        return "auto"
    return SpecConfig(k=args.spec, window=args.window, sinks=args.sinks)


def _warm_defaults(engine, defaults: dict) -> None:
    """The engine precompiles greedy programs without a penalty; a request with the folder's defaults (a
    repetition penalty, sampling) compiles its variant on first use: do that now, not in a client's request."""
    from qwen_mtp.serving.requests import SamplingParams

    keys = ("temperature", "top_p", "top_k", "repetition_penalty")
    kw = {k: defaults[k] for k in keys if k in defaults}
    if kw:
        engine.submit([1, 2, 3], SamplingParams(max_tokens=2, **kw)).result(timeout=1800)


def cmd_serve(args) -> int:
    from qwen_mtp.extras import require

    require("python -m qwen_mtp serve", "serve", SERVE_MODULES)
    from qwen_mtp import load
    from qwen_mtp.loading.folder import default_model_path, load_tokenizer
    from qwen_mtp.serving.chat_template import load_chat_template
    from qwen_mtp.serving.engine import Engine
    from qwen_mtp.serving.http import create_app
    from qwen_mtp.serving.http_server import folder_defaults, serve

    path = Path(args.model) if args.model else default_model_path()
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    tok = load_tokenizer(path)
    template = load_chat_template(path)
    defaults = folder_defaults(path)
    t0 = time.perf_counter()
    model = load(path, quant=args.quant)
    spec = _spec(args, model)
    wind = {"window": args.window, "sinks": args.sinks} if spec == "auto" else {}  # a SpecConfig carries its own
    engine = Engine(model, max_batch=args.max_batch, max_model_len=args.max_model_len, spec=spec,
                    kv_dtype=args.kv_dtype, max_waiting=args.max_waiting, **wind)
    compile_s = engine.precompile()
    name = args.served_model_name or path.name
    app = create_app(engine, tok, model_name=name, max_model_len=engine.max_model_len,
                     vocab_size=model.config.vocab_size, chat_template=template, api_key=api_key,
                     max_body_bytes=args.max_body_bytes, defaults=defaults)
    try:
        engine.start()
        _warm_defaults(engine, defaults)
        print(f"[{name}] {args.max_batch} slots, context {engine.max_model_len}, speculation: "
              f"{engine.describe_spec()}; chat template: {'yes' if template else 'none (chat endpoint answers 400)'}"
              f"; API key: {'required' if api_key else 'none'}; ready in {time.perf_counter() - t0:.1f}s "
              f"(compile {compile_s:.1f}s)", file=sys.stderr, flush=True)
        serve(app, host=args.host, port=args.port, log_level=args.log_level,
              shutdown_timeout=args.shutdown_timeout,
              on_ready=lambda port: print(f"serving on http://{args.host}:{port}/v1 (SIGTERM or Ctrl-C stops)",
                                          file=sys.stderr, flush=True))
    finally:
        engine.stop()
    return 0
