"""The OpenAI API's request bodies (pydantic models: strict types, unknown fields refused) and response bodies
(plain dicts), and the error object every refusal is answered with.

A request that fails validation is an APIError(400) whose `param` names the field ("max_tokens",
"messages.0.role", ...). Fields of the OpenAI API this server does not implement are accepted only at their
neutral values (n = 1, logprobs off, echo off, no penalties besides repetition_penalty, no tools), so a client
that sends its defaults works and one that asks for more is told which field.
"""

from __future__ import annotations

import time
import uuid
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 256


class APIError(Exception):
    """An OpenAI-style error answer: HTTP status, message, type, param (the field at fault) and code."""

    TYPES: ClassVar[dict] = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                             503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None


class _Sampling(_Strict):
    """The fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=-(2 ** 63), lt=2 ** 64)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False  # vLLM's extension: run to max_tokens (benchmarks)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    user: str | None = None
    # OpenAI fields accepted at their neutral value only (checked in neutral_fields)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | int | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict"}


def _loc(loc) -> str:
    """A pydantic error location as a field path, without the tags of union members ("str", "list[int]")."""
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS)))


def parse(model_cls, data):
    """data (decoded JSON) -> model_cls, or APIError(400) naming the first field at fault."""
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, found {type(data).__name__}", None,
                       "invalid_json")
    try:
        req = model_cls.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        err = errors[0]
        param = _loc(err["loc"]) or None
        kind = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        if sum(_loc(x["loc"]) == param for x in errors) > 1:  # a union: every member refused it
            kind = "none of the accepted types (see the OpenAI API reference)"
        found = "" if err["type"] == "extra_forbidden" else f" (found {str(err.get('input'))[:60]!r})"
        raise APIError(400, f"{param}: {kind}{found}", param, err["type"]) from None
    neutral_fields(req)
    return req


def neutral_fields(req) -> None:
    """The implemented subset of the API: refuse what would change the answer in a way not implemented."""
    checks = [("n", req.n == 1, "only n = 1 is supported"),
              ("presence_penalty", not req.presence_penalty, "only 0 is supported (use repetition_penalty)"),
              ("frequency_penalty", not req.frequency_penalty, "only 0 is supported (use repetition_penalty)"),
              ("logit_bias", not req.logit_bias, "is not supported"),
              ("logprobs", not req.logprobs, "is not supported"),
              ("stream_options", req.stream_options is None or req.stream, "is only allowed with stream = true")]
    if isinstance(req, CompletionRequest):
        checks += [("echo", not req.echo, "is not supported"),
                   ("best_of", req.best_of in (None, 1), "only best_of = 1 is supported"),
                   ("suffix", not req.suffix, "is not supported")]
    else:
        checks += [("top_logprobs", not req.top_logprobs, "is not supported"),
                   ("tools", not req.tools, "tools are not supported"),
                   ("tool_choice", req.tool_choice in (None, "none", "auto"), "tools are not supported"),
                   ("response_format", req.response_format in (None, {"type": "text"}), "only text is supported")]
    for param, ok, why in checks:
        if not ok:
            raise APIError(400, f"{param}: {why}", param, "unsupported")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOP or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise APIError(400, f"stop: at most {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters",
                       "stop", "invalid_value")


def stop_strings(req) -> list:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def max_tokens_of(req):
    return getattr(req, "max_completion_tokens", None) or req.max_tokens


def message_text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(p.text for p in content)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(rid, model, created, text, finish_reason, n_prompt, n_out) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage(n_prompt, n_out)}


def completion_chunk(rid, model, created, text, finish_reason=None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_completion(rid, model, created, text, finish_reason, n_prompt, n_out) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage(n_prompt, n_out)}


def chat_chunk(rid, model, created, delta: dict, finish_reason=None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(rid, obj, model, created, n_prompt, n_out) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(n_prompt, n_out)}


def models_list(model_id: str, created: int, max_model_len: int) -> dict:
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                        "owned_by": "qwen-mtp", "max_model_len": max_model_len}]}


def now() -> int:
    return int(time.time())
