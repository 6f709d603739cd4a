"""The OpenAI-compatible HTTP API over an Engine (FastAPI): `create_app(engine, tokenizer, ...)`.

    POST /v1/completions        prompt text or token ids -> text (stream: Server-Sent Events)
    POST /v1/chat/completions   messages rendered with the model folder's chat template -> text
    GET  /v1/models             the one model served
    GET  /health                200 while serving, 503 once shutting down
    GET  /metrics               Prometheus text (metrics.py)

Errors are OpenAI's JSON `{"error": {"message", "type", "param", "code"}}`: 400 for bad input (the field in
`param`), 401 without the API key, 404 for an unknown path or model, 413 for a body over the limit, 429 with
Retry-After when the engine's queue is full. A streaming client that disconnects has its request cancelled (its
slot freed at the engine's next segment); so has a non-streaming one (the connection is watched while it waits).
http_server.py runs the app (uvicorn) and handles SIGTERM.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from qwen_mtp.errors import ArgumentError
from qwen_mtp.serving import openai_protocol as proto
from qwen_mtp.serving.http_run import Detokenizer, Run
from qwen_mtp.serving.metrics import CONTENT_TYPE, ServerMetrics
from qwen_mtp.serving.openai_protocol import APIError

DEFAULT_MAX_BODY = 1 << 20  # bytes
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to what the context leaves
RETRY_AFTER_S = 1
_WATCH_S = 0.1  # how often a non-streaming request checks that its client is still there


def engine_snapshot(engine) -> dict:
    """The engine's figures for /metrics (metrics.py's names) from Engine.metrics(), and the accepted drafts per
    position from its counters (`passed[j]`: rounds whose drafts 1..j+1 were all accepted)."""
    m = engine.metrics()
    counters = getattr(engine, "counters", None)
    alpha = m.get("alpha_per_position") or []
    return {"running": m.get("running", 0), "waiting": m.get("waiting", 0), "spec_drafts": m.get("spec_rounds", 0),
            "spec_draft_tokens": m.get("drafts_proposed", 0), "spec_accepted_tokens": m.get("drafts_accepted", 0),
            "spec_accepted_per_pos": list(getattr(counters, "passed", ()) or ()),
            "spec_alpha": [0.0 if a is None else a for a in alpha],
            "spec_acceptance_length": m.get("acceptance_length")}


def _is_queue_full(e: BaseException) -> bool:
    return type(e).__name__ == "QueueFullError"  # qwen_mtp.errors.QueueFullError (and stand-ins in the tests)


class _Server:
    """What the routes share: the engine, tokenizer, template, limits, defaults and metrics."""

    def __init__(self, engine, tokenizer, *, model_name, max_model_len, vocab_size, chat_template, api_key,
                 max_body_bytes, defaults, params_factory, created):
        self.engine, self.tok, self.model_name = engine, tokenizer, model_name
        self.max_model_len, self.vocab_size, self.template = max_model_len, vocab_size, chat_template
        self.api_key, self.max_body, self.defaults = api_key, max_body_bytes, dict(defaults or {})
        self.params_factory, self.created = params_factory, created
        self.metrics = ServerMetrics(model_name, lambda: engine_snapshot(engine))
        self.draining = False

    # ---- checks
    def authorize(self, request):
        if not self.api_key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "a valid API key is required: Authorization: Bearer <key>", None, "invalid_api_key")

    async def body(self, request, model_cls):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise APIError(413, f"the request body is {int(length)} bytes, the limit is {self.max_body}", None,
                           "request_too_large")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.max_body:
                raise APIError(413, f"the request body is over the limit of {self.max_body} bytes", None,
                               "request_too_large")
        try:
            data = json.loads(bytes(raw))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", None, "invalid_json") from None
        req = proto.parse(model_cls, data)
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"model {req.model!r} is not served here (this server serves "
                           f"{self.model_name!r})", "model", "model_not_found")
        return req

    def prompt_ids(self, req) -> list:
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, "prompt: one prompt per request (a list of several prompts is a batch, "
                               "not supported)", "prompt", "unsupported")
            p = p[0]
        ids = self.tok.encode(p).ids if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, "prompt: empty (it must encode to at least one token)", "prompt", "invalid_value")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"prompt: token ids must be in [0, {self.vocab_size}), found {bad[0]}", "prompt",
                           "invalid_value")
        return ids

    def chat_ids(self, req) -> list:
        if self.template is None:
            raise APIError(400, "this model folder has no chat template (chat_template.jinja, or chat_template in "
                           "tokenizer_config.json): use /v1/completions", "messages", "no_chat_template")
        messages = [{"role": m.role, "content": proto.message_text(m.content), "name": m.name,
                     "reasoning_content": m.reasoning_content} for m in req.messages]
        try:
            text = self.template.render(messages, add_generation_prompt=req.add_generation_prompt,
                                        **(req.chat_template_kwargs or {}))
        except ArgumentError as e:
            raise APIError(400, f"messages: {e.found}", "messages", "invalid_value") from None
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if not ids:
            raise APIError(400, "messages: the chat template rendered them to no tokens", "messages",
                           "invalid_value")
        return ids

    def params(self, req, n_prompt: int, field: str):
        """SamplingParams for the engine: the request's values over the folder's defaults; the context checked."""
        room = self.max_model_len - n_prompt
        if room < 1:
            raise APIError(400, f"{field}: the prompt is {n_prompt} tokens, this model's context is "
                           f"{self.max_model_len} (at least one token must be left to generate)", field,
                           "context_length_exceeded")
        max_tokens = proto.max_tokens_of(req)
        param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
        if max_tokens is None:
            max_tokens = COMPLETION_MAX_TOKENS if isinstance(req, proto.CompletionRequest) else room
            max_tokens = min(max_tokens, room)
        if max_tokens > room:
            raise APIError(400, f"{param}: {max_tokens} new tokens and a prompt of {n_prompt} exceed this model's "
                           f"context of {self.max_model_len} (at most {room})", param, "context_length_exceeded")
        d = self.defaults
        pick = lambda name, default: getattr(req, name) if getattr(req, name) is not None else d.get(name, default)
        top_k = pick("top_k", 0)
        kw = {"max_tokens": max_tokens, "temperature": float(pick("temperature", 1.0)),
              "top_p": float(pick("top_p", 1.0)), "top_k": max(top_k, 0),
              "seed": (req.seed % 2 ** 63) if req.seed is not None else d.get("seed", 0),
              "repetition_penalty": float(pick("repetition_penalty", 1.0)),
              "stop_token_ids": tuple(req.stop_token_ids or ()), "ignore_eos": req.ignore_eos}
        try:
            return self.params_factory(**kw)
        except ArgumentError as e:
            raise APIError(400, f"{e.argument}: expected {e.expected}, found {e.found}", e.argument,
                           "invalid_value") from None

    async def start(self, ids, params, stops) -> Run:
        if self.draining:
            raise APIError(503, "the server is shutting down", None, "shutting_down",
                           {"Retry-After": str(RETRY_AFTER_S)})
        run = Run(self.engine, Detokenizer(self.tok, stops), asyncio.get_running_loop(), time.perf_counter())
        try:
            run.submit(ids, params)
        except ArgumentError as e:
            raise APIError(400, str(e), e.argument, "invalid_value") from None
        except Exception as e:
            if _is_queue_full(e):
                raise APIError(429, f"the server is at capacity: {e}", None, "queue_full",
                               {"Retry-After": str(RETRY_AFTER_S)}) from None
            if type(e).__name__ == "EngineStoppedError":
                raise APIError(503, "the server is shutting down", None, "shutting_down",
                               {"Retry-After": str(RETRY_AFTER_S)}) from None
            raise
        return run

    def finished(self, run: Run, n_prompt: int):
        if run.recorded:
            return
        run.recorded = True
        self.metrics.finished(prompt_tokens=n_prompt, generated=run.generated, reason=run.finish_reason or "abort",
                              arrival=run.arrival, first=run.first, last=run.last)


async def _collect(srv: _Server, run: Run, request) -> str:
    """A non-streaming answer: every delta, the client's connection watched meanwhile."""
    async def watch():
        while True:
            await asyncio.sleep(_WATCH_S)
            if await request.is_disconnected():
                run.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return "".join([d async for d in run])
    finally:
        watcher.cancel()
        run.cancel()  # a no-op once finished


class _RunStream(StreamingResponse):
    """A streamed answer whose run is cancelled (and counted) however the response ends, also when the client
    left before the stream's first chunk (then the generator never starts, so its own `finally` never runs)."""

    def __init__(self, content, srv, run, n_prompt, **kw):
        super().__init__(content, **kw)
        self.srv, self.run, self.n_prompt = srv, run, n_prompt

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.cancel()
            self.srv.finished(self.run, self.n_prompt)


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()


async def _stream(srv: _Server, run: Run, n_prompt: int, req, chat: bool, rid: str, created: int):
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    m = srv.model_name
    extra = {"usage": None} if include_usage else {}
    try:
        if chat:
            yield _sse({**proto.chat_chunk(rid, m, created, {"role": "assistant", "content": ""}), **extra})
        async for delta in run:
            chunk = (proto.chat_chunk(rid, m, created, {"content": delta}) if chat
                     else proto.completion_chunk(rid, m, created, delta))
            yield _sse({**chunk, **extra})
        last = (proto.chat_chunk(rid, m, created, {}, run.finish_reason) if chat
                else proto.completion_chunk(rid, m, created, "", run.finish_reason))
        yield _sse({**last, **extra})
        if include_usage:
            obj = "chat.completion.chunk" if chat else "text_completion"
            yield _sse(proto.usage_chunk(rid, obj, m, created, n_prompt, run.generated))
        yield b"data: [DONE]\n\n"
    except Exception as e:  # noqa: BLE001 - after the headers went out: the error as one more event, then the end
        yield _sse(APIError(500, f"generation failed: {type(e).__name__}: {e}", None, "internal_error").body())
        yield b"data: [DONE]\n\n"
    finally:  # the client went away (the response task is cancelled) or the run ended: free the slot
        run.cancel()
        srv.finished(run, n_prompt)


def create_app(engine, tokenizer, *, model_name: str, max_model_len: int, vocab_size: int, chat_template=None,
               api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY, defaults: dict | None = None,
               params_factory=None):
    """The FastAPI app serving `engine` (started and stopped by the caller). defaults: sampling values used when a
    request leaves a field out (temperature, top_p, top_k, repetition_penalty: the model folder's
    generation_config.json, see http_server.folder_defaults). params_factory builds the engine's SamplingParams."""
    if params_factory is None:
        from qwen_mtp.serving.requests import SamplingParams as params_factory
    srv = _Server(engine, tokenizer, model_name=model_name, max_model_len=max_model_len, vocab_size=vocab_size,
                  chat_template=chat_template, api_key=api_key, max_body_bytes=max_body_bytes, defaults=defaults,
                  params_factory=params_factory, created=proto.now())
    app = FastAPI(title="qwen-mtp", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv

    def error_response(e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def _api_error(request, e):
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e):
        return error_response(APIError(e.status_code, str(e.detail), None, None))

    @app.exception_handler(Exception)
    async def _internal(request, e):  # an engine failure (RequestHandle "error"), a bug: still OpenAI's shape
        return error_response(APIError(500, f"{type(e).__name__}: {e}", None, "internal_error"))

    @app.exception_handler(RequestValidationError)
    async def _validation(request, e):
        return error_response(APIError(400, str(e), None, "invalid_request"))

    async def answer(request, chat: bool):
        srv.authorize(request)
        req = await srv.body(request, proto.ChatCompletionRequest if chat else proto.CompletionRequest)
        ids = srv.chat_ids(req) if chat else srv.prompt_ids(req)
        params = srv.params(req, len(ids), "messages" if chat else "prompt")
        run = await srv.start(ids, params, proto.stop_strings(req))
        rid, created = proto.new_id("chatcmpl" if chat else "cmpl"), proto.now()
        if req.stream:
            return _RunStream(_stream(srv, run, len(ids), req, chat, rid, created), srv, run, len(ids),
                              media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            text = await _collect(srv, run, request)
        finally:
            srv.finished(run, len(ids))
        build = proto.chat_completion if chat else proto.completion
        return JSONResponse(build(rid, srv.model_name, created, text, run.finish_reason, len(ids), run.generated))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        srv.authorize(request)
        return JSONResponse(proto.models_list(srv.model_name, srv.created, srv.max_model_len))

    @app.get("/health")
    async def health():
        if srv.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics():
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE)

    return app
