"""``lade-export serve``: an OpenAI-compatible HTTP server on the continuous-batching scheduler.

Endpoints (the OpenAI REST API's shapes, https://platform.openai.com/docs/api-reference):

* ``GET /v1/models`` — the one served model.
* ``POST /v1/completions`` — ``prompt`` as a string, a one-element list of strings, a list
  of token ids or a one-element list of them. The prompt is raw: control-token strings in
  it (``<|im_start|>`` …) are control tokens, as llama-server and vLLM read them.
* ``POST /v1/chat/completions`` — ``messages`` through the model's chat template;
  control-token strings inside message content are text (a user cannot forge a turn,
  :mod:`lade_export.tokenizer`).
* ``stream: true`` answers with server-sent events (``data: {json}`` chunks, then
  ``data: [DONE]``); ``stream_options.include_usage`` adds a last chunk with the usage.
* ``GET /health`` (no key needed) and ``GET /metrics`` (Prometheus text format).

Fields: ``model`` (must name the served model: 404 otherwise), ``max_tokens`` /
``max_completion_tokens``, ``stop`` (a string or up to 4), ``temperature`` (0–2; omitted:
1.0, what the OpenAI API documents — artifacts carry no generation defaults), ``top_p``,
``seed``, ``n`` = 1, ``user`` (ignored); the extensions ``top_k`` and ``lookahead``
(``{"profile": NAME}`` for one of the profiles the server was started with, ``true`` for
the first of them, ``false`` for plain decoding; omitted: the first). Fields the OpenAI API
has but this server does not implement are refused unless they hold their neutral value
(``n`` ≠ 1, ``logprobs``, ``echo``, ``best_of`` > 1, penalties ≠ 0, ``logit_bias``, tools,
``response_format`` other than text …); any other field is refused by name, so a typo is
not silently ignored. Every response (the last chunk of a stream) carries the extension
field ``lookahead``: ``{"profile", "steps", "compression"}`` — decode forward passes and
tokens per pass (Fu et al. 2023, arXiv 2402.02057: compression = new tokens / steps).

Errors use OpenAI's schema, ``{"error": {"message", "type", "param", "code"}}``, with a
one-line message: 400 bad JSON, types, ranges, over-long prompts, unknown profile or
field; 401 missing or wrong API key (compared with :func:`hmac.compare_digest`); 404
unknown model or route; 405 wrong method; 413 body over the limit; 429 queue full; 500
an internal failure (never a traceback); 503 a request the server cancelled when its drain
timeout ran out. An error after a stream has begun is sent as one ``data: {"error": …}``
event before ``data: [DONE]``.

Concurrency: at most ``max_concurrent`` requests run (the scheduler's ``max_batch``), at
most ``max_queue`` more wait; beyond that 429. Each running request has a thread that
reads its :class:`lade_export.api.Stream` (the scheduler has no thread of its own: readers
run the passes, leader/follower), handing chunks to the event loop. A client that
disconnects cancels its request, whether it is waiting for a slot, being prefilled or
decoding (the disconnect is watched once its body is read): the scheduler ends it before its
next pass and frees its KV columns.

Shutdown (:func:`run`): SIGTERM or SIGINT stops accepting connections and lets the
requests in flight finish for the drain timeout; then :meth:`OpenAIServer.end_drain`
cancels the rest through the scheduler. Each of them ends at its next pass: a stream with
an error event (type ``server_error``, code ``server_shutdown``) and ``data: [DONE]``, any
other request with a 503 of that error; a request still waiting for a slot gets the 503
at once. The error, not a ``finish_reason``: every finish reason of the OpenAI API says the
output ended as the model or the request decided, so a client would take the cut text as
complete; an error event is what OpenAI clients raise on (the ``openai`` package raises
``APIError`` from the stream), and a 503 is one they retry.

Nothing here imports PyTorch; the module needs the ``http`` extra (Starlette, uvicorn,
prometheus_client).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import math
import threading
import time
import uuid

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import LadeError
from ..profile import LookaheadProfile

#: Largest request body accepted by default, bytes.
MAX_BODY_BYTES = 1 << 20
#: Stop strings a request may give (the OpenAI API's limit).
MAX_STOP_STRINGS = 4
#: Seconds the requests cancelled at the end of the drain timeout have to send their last
#: events (each ends at its next pass) before uvicorn cancels what is left.
SHUTDOWN_GRACE_S = 10.0
#: The answer to a chat request when the model has no chat template.
NO_CHAT_TEMPLATE = ("this model has no chat template, so /v1/chat/completions cannot serve it; "
                    "send the prompt as text to /v1/completions")

#: stop reasons of :mod:`lade_export.runtime` → OpenAI's ``finish_reason``.
FINISH_REASONS = {"stop_token": "stop", "stop_string": "stop", "max_new_tokens": "length",
                  "cancelled": "stop", "timeout": "length"}


class APIError(Exception):
    """An error answered in OpenAI's error schema.

    Args:
        status: HTTP status code.
        message: one line.
        type: OpenAI's error ``type`` (``invalid_request_error``, ``authentication_error``,
            ``rate_limit_error``, ``server_error``).
        param: the request field at fault, or None.
        code: a short machine-readable code, or None.
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = " ".join(str(message).split())  # one line
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclasses.dataclass
class ServerConfig:
    """What ``lade-export serve`` was started with.

    Attributes:
        model_name: the id clients give as ``model`` (``GET /v1/models`` lists it).
        profiles: ``{name: LookaheadProfile}`` a request may pick; the first is the default.
        api_key: the key clients must send as ``Authorization: Bearer KEY``; None: no key.
        max_concurrent: requests running at once (≥ 1).
        max_queue: requests waiting for a slot (≥ 0); one more is answered 429.
        max_new_tokens_limit: the largest ``max_tokens`` a request may ask (≥ 1); also
            the default when a request gives none (capped by the context left).
        max_body_bytes: the largest request body, bytes (413 beyond).
        max_prompt_tokens: the longest prompt, tokens (None: the context less one).
    """

    model_name: str
    profiles: dict
    api_key: str | None = None
    max_concurrent: int = 8
    max_queue: int = 64
    max_new_tokens_limit: int = 2048
    max_body_bytes: int = MAX_BODY_BYTES
    max_prompt_tokens: int | None = None


# -- request validation ----------------------------------------------------------------------

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n",
           "user", "lookahead", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs"}
_COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                          "function_call", "parallel_tool_calls", "response_format", "metadata", "store"}
_ROLES = ("system", "user", "assistant", "developer")


@dataclasses.dataclass
class Job:
    """One validated request, ready for the runtime.

    Attributes:
        chat: True for ``/v1/chat/completions``.
        prompt: the prompt as :meth:`lade_export.api.Model.encode` takes it (raw text,
            token ids, or chat messages).
        max_tokens: asked new tokens, or None (the server's default).
        stop: stop strings.
        temperature, top_p, top_k, seed: the decoding rule.
        profile: the lookahead profile, or None for plain decoding.
        stream: server-sent events.
        include_usage: a last stream chunk with the usage.
    """

    chat: bool
    prompt: object
    max_tokens: int | None
    stop: list
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    profile: LookaheadProfile | None
    stream: bool
    include_usage: bool


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _kind(v) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(v), type(v).__name__)


def _number(body, name, default, low, high, *, low_open=False):
    if name not in body or body[name] is None:
        return default
    v = body[name]
    if not _is_number(v):
        raise _bad(f"{name} must be a number, got {_kind(v)}", name)
    if not math.isfinite(v) or v > high or (v <= low if low_open else v < low):
        left = "(" if low_open else "["
        raise _bad(f"{name} must be in {left}{low:g}, {high:g}], got {v!r}", name)
    return float(v)


def _integer(body, name, low, high=None):
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise _bad(f"{name} must be an integer, got {_kind(v)}", name)
    if v < low or (high is not None and v > high):
        raise _bad(f"{name} must be an integer in [{low}, {high}], got {v}" if high is not None
                   else f"{name} must be an integer ≥ {low}, got {v}", name)
    return v


def _neutral(body, name, ok) -> None:
    """Refuse a field this server does not implement unless it holds its neutral value."""
    if name in body and not ok(body[name]):
        raise _bad(f"{name} is not supported by this server (got {json.dumps(body[name])[:60]})", name,
                   "unsupported_parameter")


def parse_request(body, chat: bool, config: ServerConfig) -> Job:
    """Validate an OpenAI request body.

    Args:
        body: the parsed JSON body.
        chat: ``/v1/chat/completions`` (else ``/v1/completions``).
        config: the server's settings (model name, profiles, limits).

    Returns:
        Job: the request for the runtime.

    Raises:
        APIError: 400 for a wrong type, an out-of-range value, an unknown field or
            profile, an unsupported feature; 404 for another model.
    """
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {_kind(body)}")
    allowed = _CHAT_FIELDS if chat else _COMPLETION_FIELDS
    for name in body:
        if name not in allowed:
            raise _bad(f"unknown field {name!r}", name, "unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("model is required: give the served model's id (GET /v1/models)" if model is None
                   else f"model must be a string, got {_kind(model)}", "model")
    if model != config.model_name:
        raise APIError(404, f"model {model!r} is not served here; this server serves {config.model_name!r}",
                       param="model", code="model_not_found")

    _neutral(body, "n", lambda v: v is None or v == 1)
    if "n" in body and body["n"] is not None and not _is_int(body["n"]):
        raise _bad(f"n must be an integer, got {_kind(body['n'])}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        _neutral(body, name, lambda v: v is None or (_is_number(v) and v == 0))
    _neutral(body, "logit_bias", lambda v: v is None or v == {})
    if chat:
        _neutral(body, "logprobs", lambda v: v is None or v is False)
        _neutral(body, "top_logprobs", lambda v: v is None)
        _neutral(body, "tools", lambda v: v is None or v == [])
        _neutral(body, "functions", lambda v: v is None or v == [])
        _neutral(body, "tool_choice", lambda v: v is None or v == "none")
        _neutral(body, "function_call", lambda v: v is None or v == "none")
        _neutral(body, "parallel_tool_calls", lambda v: v is None or isinstance(v, bool))
        _neutral(body, "response_format", lambda v: v is None or v == {"type": "text"})
        _neutral(body, "store", lambda v: v is None or v is False)
        _neutral(body, "metadata", lambda v: v is None or isinstance(v, dict))
    else:
        _neutral(body, "logprobs", lambda v: v is None)
        _neutral(body, "echo", lambda v: v is None or v is False)
        _neutral(body, "best_of", lambda v: v is None or v == 1)
        _neutral(body, "suffix", lambda v: v is None or v == "")
    if "user" in body and body["user"] is not None and not isinstance(body["user"], str):
        raise _bad(f"user must be a string, got {_kind(body['user'])}", "user")

    prompt = _messages(body) if chat else _prompt(body)

    max_tokens = _integer(body, "max_tokens", 1, config.max_new_tokens_limit)
    if chat:
        mct = _integer(body, "max_completion_tokens", 1, config.max_new_tokens_limit)
        if mct is not None and max_tokens is not None and mct != max_tokens:
            raise _bad("max_tokens and max_completion_tokens differ; give one of them", "max_completion_tokens")
        max_tokens = mct if mct is not None else max_tokens

    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = _integer(body, "top_k", 0) or 0
    seed = _integer(body, "seed", 0)

    stop = body.get("stop")
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise _bad(f"stop must be a string or an array of strings, got {_kind(stop)}", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    if any(s == "" for s in stops):
        raise _bad("stop strings must not be empty", "stop")

    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad(f"stream must be a boolean, got {_kind(stream)}", "stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise _bad("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise _bad("stream_options must be an object with include_usage (a boolean)", "stream_options")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise _bad(f"stream_options.include_usage must be a boolean, got {_kind(include_usage)}",
                       "stream_options")

    return Job(chat, prompt, max_tokens, stops, temperature, top_p, top_k, seed, _profile(body, config), stream,
               include_usage)


def _profile(body, config: ServerConfig) -> LookaheadProfile | None:
    value = body.get("lookahead", True)
    served = ", ".join(config.profiles) or "none"
    if value is None or value is True:
        return next(iter(config.profiles.values()), None)
    if value is False:
        return None
    if not isinstance(value, dict) or set(value) - {"profile"} or not isinstance(value.get("profile"), str):
        raise _bad('lookahead must be false, true or {"profile": NAME}', "lookahead")
    name = value["profile"]
    if name not in config.profiles:
        raise _bad(f"unknown lookahead profile {name!r}; this server serves: {served}", "lookahead",
                   "unknown_profile")
    return config.profiles[name]


def _prompt(body):
    if "prompt" not in body:
        raise _bad("prompt is required", "prompt")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(_is_int(t) for t in p):
        return [int(t) for t in p]
    if isinstance(p, list) and (len(p) > 1 and all(isinstance(x, (str, list)) for x in p)):
        raise _bad(f"prompt must be one prompt; this server takes one per request, got {len(p)}", "prompt")
    raise _bad("prompt must be a string, an array of one string, or an array of token ids", "prompt")


def _messages(body):
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages must be a non-empty array of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where} must be an object, got {_kind(m)}", "messages")
        role = m.get("role")
        if role not in _ROLES:
            raise _bad(f"{where}.role must be one of {', '.join(_ROLES)}, got {json.dumps(role)}", "messages")
        if set(m) - {"role", "content", "name"}:
            extra = sorted(set(m) - {"role", "content", "name"})[0]
            raise _bad(f"{where}.{extra} is not supported by this server", "messages", "unsupported_parameter")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise _bad(f"{where}.content: only text parts are supported", "messages")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise _bad(f"{where}.content must be a string or an array of text parts, got {_kind(content)}",
                       "messages")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


# -- metrics ------------------------------------------------------------------------------------

class _SchedulerCollector:
    """Scheduler and admission values read at scrape time."""

    def __init__(self, server: "OpenAIServer"):
        self.server = server

    def collect(self):
        s = self.server
        sched = getattr(s.model, "scheduler", None)
        yield GaugeMetricFamily("lade_requests_running", "Requests holding a slot of the server (max_concurrent).",
                                value=s.running)
        yield GaugeMetricFamily("lade_requests_queued", "Requests waiting for a slot.", value=s.waiting)
        if sched is not None:
            yield GaugeMetricFamily("lade_scheduler_active_requests", "Requests admitted by the scheduler.",
                                    value=sched.active_requests)
            yield GaugeMetricFamily("lade_kv_cache_bytes", "Bytes of the scheduler's KV pool.", value=sched.pool.nbytes)
            yield CounterMetricFamily("lade_scheduler_passes", "Forward passes the scheduler ran.", value=sched.passes)
            shapes = dict(sched.pass_shapes)
            passes = sum(shapes.values())
            rows = sum(r * n for (_, r), n in shapes.items())
            reqs = sum(q * n for (q, _), n in shapes.items())
            yield CounterMetricFamily("lade_scheduler_pass_rows", "Token rows over all passes.", value=rows)
            yield GaugeMetricFamily("lade_scheduler_requests_per_pass", "Mean requests in a pass.",
                                    value=reqs / passes if passes else 0.0)


class _Metrics:
    def __init__(self, server: "OpenAIServer"):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("lade_requests", "HTTP requests by endpoint and status.", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("lade_prompt_tokens", "Prompt tokens of served requests.", registry=r)
        self.completion_tokens = Counter("lade_completion_tokens", "Tokens generated.", registry=r)
        self.cancelled = Counter("lade_requests_cancelled", "Requests cancelled by a client disconnect.", registry=r)
        self.ttft = Histogram("lade_time_to_first_token_seconds", "Seconds from admission to the first token.",
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30), registry=r)
        self.tpot = Histogram("lade_time_per_output_token_seconds", "Seconds per generated token after the first.",
                              buckets=(.001, .0025, .005, .01, .02, .04, .08, .16, .32, .64, 1.28), registry=r)
        self.compression = Histogram("lade_compression_ratio", "Tokens per decode forward pass of a request.",
                                     buckets=(1, 1.25, 1.5, 1.75, 2, 2.5, 3, 4, 6, 8), registry=r)
        r.register(_SchedulerCollector(server))


# -- the server -------------------------------------------------------------------------------

_DONE = object()


class OpenAIServer:
    """The ASGI application of ``lade-export serve`` (:attr:`app`).

    Args:
        model: a :class:`lade_export.api.Model`, loaded with ``batching=True`` for
            continuous batching (any object with its ``encode``, ``stream`` and
            ``decoder`` works).
        config: :class:`ServerConfig`.
    """

    def __init__(self, model, config: ServerConfig):
        self.model = model
        self.config = config
        self.context = model.decoder.max_context
        tokenizer = getattr(model, "tokenizer", None)
        self._has_chat_template = getattr(tokenizer, "has_chat_template", True)
        self.running = 0
        self.waiting = 0
        self._slots: asyncio.Condition | None = None
        self._runs: set = set()  # the admitted requests (_Run) not yet finished
        #: the 503 every request still in flight gets once :meth:`end_drain` ran, else None
        self.shutdown_error: APIError | None = None
        self.metrics = _Metrics(self)
        routes = [Route("/health", self.health, methods=["GET"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/metrics", self.prometheus, methods=["GET"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"])]
        self.app = Starlette(routes=routes, exception_handlers={HTTPException: self._http_error,
                                                                Exception: self._internal_error})

    # -- plumbing --------------------------------------------------------------------------

    async def _http_error(self, request, exc):
        status = exc.status_code
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"
                   }.get(status, str(exc.detail))
        return APIError(status, message, code={404: "not_found", 405: "method_not_allowed"}.get(status)).response()

    async def _internal_error(self, request, exc):
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error",
                        code="internal_error").response()

    def _authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if not given:
            raise APIError(401, "missing API key: send Authorization: Bearer KEY", "authentication_error",
                           code="invalid_api_key")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "invalid API key", "authentication_error", code="invalid_api_key")

    async def _body(self, request: Request):
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise APIError(413, f"request body of {int(length)} bytes exceeds the limit of {limit} bytes",
                           code="body_too_large")
        data = bytearray()
        async for piece in request.stream():
            data += piece
            if len(data) > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")

        def refuse_constant(name):
            raise ValueError(f"{name} is not valid JSON")

        try:
            return json.loads(bytes(data).decode("utf-8"), parse_constant=refuse_constant)
        except UnicodeDecodeError:
            raise _bad("the request body is not UTF-8") from None
        except RecursionError:
            raise _bad("the request body is not valid JSON: nested too deeply") from None
        except ValueError as err:
            if "integer string conversion" in str(err):  # Python's int digit limit, not the client's concern
                raise _bad("the request body is not valid JSON: a number has too many digits") from None
            raise _bad(f"the request body is not valid JSON: {err}") from None

    async def _acquire(self) -> None:
        if self._slots is None:
            self._slots = asyncio.Condition()
        async with self._slots:
            if self.shutdown_error is not None:
                raise self.shutdown_error
            if self.running >= self.config.max_concurrent:
                if self.waiting >= self.config.max_queue:
                    raise APIError(429, f"the server is at capacity ({self.running} running, {self.waiting} waiting); "
                                        "try again later", "rate_limit_error", code="queue_full")
                self.waiting += 1
                try:
                    await self._slots.wait_for(lambda: self.running < self.config.max_concurrent
                                               or self.shutdown_error is not None)
                finally:
                    self.waiting -= 1
                if self.shutdown_error is not None:
                    raise self.shutdown_error
            self.running += 1

    def _release(self) -> None:
        """Free a slot (synchronous, so that it also runs in a cancelled task's cleanup)."""
        self.running -= 1
        asyncio.ensure_future(self._notify())

    async def _notify(self, every: bool = False) -> None:
        async with self._slots:
            self._slots.notify_all() if every else self._slots.notify()

    def end_drain(self, drain_s: float) -> None:
        """End the shutdown's drain (its timeout ran out): cancel every request still in
        flight through the scheduler, and answer those waiting for a slot, and any that
        arrives later, with a 503 (``server_error`` / ``server_shutdown``).

        A cancelled request ends at its next pass: a stream with that error as its last
        event before ``data: [DONE]``, a non-streamed request with the 503 (see the module
        docstring for why an error and not a ``finish_reason``). A request that finishes
        on its own at the same pass keeps its normal answer. Call it on the event loop.

        Args:
            drain_s: the drain timeout that ran out, seconds (for the message).
        """
        if self.shutdown_error is not None:
            return
        self.shutdown_error = APIError(
            503, f"the server is shutting down and cancelled this request when its drain timeout of {drain_s:g} s "
                 "ran out; send it again", "server_error", code="server_shutdown")
        for run in list(self._runs):
            run.aborted = True
            run.cancel()
        if self._slots is not None:
            asyncio.ensure_future(self._notify(every=True))

    # -- endpoints -------------------------------------------------------------------------

    async def health(self, request: Request):
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request):
        try:
            self._authorize(request)
        except APIError as err:
            return err.response()
        return JSONResponse({"object": "list", "data": [
            {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "lade-export"}]})

    async def prometheus(self, request: Request):
        try:
            self._authorize(request)
        except APIError as err:
            return err.response()
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, request: Request):
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request):
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            self._authorize(request)
            job = parse_request(await self._body(request), chat, self.config)
            if chat and not self._has_chat_template:
                raise _bad(NO_CHAT_TEMPLATE)
        except APIError as err:
            self.metrics.requests.labels(endpoint, str(err.status)).inc()
            return err.response()
        # the client may leave while its request waits for a slot or is prefilled: watch for it
        disconnect = asyncio.ensure_future(_wait_disconnect(request))
        try:
            try:
                await _unless(self._acquire(), disconnect)
            except APIError as err:
                self.metrics.requests.labels(endpoint, str(err.status)).inc()
                return err.response()
            except _ClientGone:  # it left the queue before it held a slot
                self.metrics.cancelled.inc()
                return Response(status_code=499)
            run = _Run(self, job)
            try:
                first = await _unless(run.start(), disconnect)
            except APIError as err:
                run.finish()
                self.metrics.requests.labels(endpoint, str(err.status)).inc()
                return err.response()
            except _ClientGone:  # finish() cancels the request: it ends at its next pass
                run.finish()
                return Response(status_code=499)
            except BaseException:
                run.finish()
                raise
            if job.stream:
                if disconnect.done():  # gone as its first chunk came
                    run.finish()
                    return Response(status_code=499)
                disconnect.cancel()  # the streaming response watches from here on
                self.metrics.requests.labels(endpoint, "200").inc()
                return _EventStream(run, self._sse(run, first, job))
            try:
                return await self._whole(run, first, job, endpoint, disconnect)
            finally:
                run.finish()
        finally:
            disconnect.cancel()

    async def _whole(self, run: "_Run", first, job: Job, endpoint: str, disconnect: asyncio.Future):
        texts = []
        try:
            item = first
            while True:
                if item is _DONE:
                    break
                if isinstance(item, BaseException):
                    raise _as_api_error(item)
                texts.append(item.text)
                getter = asyncio.ensure_future(run.queue.get())
                done, _ = await asyncio.wait({getter, disconnect}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:  # the client went away: run.finish() cancels the request
                    getter.cancel()
                    return Response(status_code=499)
                item = getter.result()
        except APIError as err:
            self.metrics.requests.labels(endpoint, str(err.status)).inc()
            return err.response()
        if run.shut_down:
            err = self.shutdown_error
            self.metrics.requests.labels(endpoint, str(err.status)).inc()
            return err.response()
        self.metrics.requests.labels(endpoint, "200").inc()
        text = "".join(texts)
        body = run.envelope("chat.completion" if job.chat else "text_completion")
        reason = FINISH_REASONS[run.result_reason]
        if job.chat:
            body["choices"] = [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                                "finish_reason": reason}]
        else:
            body["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]
        body["usage"] = run.usage()
        body["lookahead"] = run.lookahead_stats()
        return JSONResponse(body)

    async def _sse(self, run: "_Run", first, job: Job):
        kind = "chat.completion.chunk" if job.chat else "text_completion"
        usage_null = {"usage": None} if job.include_usage else {}

        def event(obj) -> bytes:
            return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"

        def choice(text, reason=None, role=False):
            if job.chat:
                delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

        if job.chat:
            yield event({**run.envelope(kind), "choices": [choice("", role=True)], **usage_null})
        item = first
        while item is not _DONE:
            if isinstance(item, BaseException):
                yield event(_as_api_error(item).body())
                break
            if item.final and run.shut_down:  # cancelled by the end of the drain: the text so far, the error
                if item.text:
                    yield event({**run.envelope(kind), "choices": [choice(item.text)], **usage_null})
                yield event(self.shutdown_error.body())
                break
            if item.final:
                last = {**run.envelope(kind), "choices": [choice(item.text, FINISH_REASONS[item.stop_reason])],
                        **usage_null, "lookahead": run.lookahead_stats()}
                yield event(last)
                if job.include_usage:
                    yield event({**run.envelope(kind), "choices": [], "usage": run.usage()})
            elif item.text:
                yield event({**run.envelope(kind), "choices": [choice(item.text)], **usage_null})
            item = await run.queue.get()
        yield b"data: [DONE]\n\n"


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _ClientGone(Exception):
    """The client disconnected before the awaited step completed."""


async def _unless(step, disconnect: asyncio.Future):
    """``await step`` unless ``disconnect`` completes first; then ``step`` is cancelled and
    :class:`_ClientGone` raised (a step done at the same moment keeps its result)."""
    task = asyncio.ensure_future(step)
    try:
        await asyncio.wait({task, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this request's own task is cancelled: so is its step
        task.cancel()
        raise
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait({task})
    raise _ClientGone


def _as_api_error(err: BaseException) -> APIError:
    if isinstance(err, APIError):
        return err
    if isinstance(err, LadeError) and not getattr(err, "exit_code", 2) == 1:
        return _bad(str(err))
    return APIError(500, f"internal error: {type(err).__name__}: {err}", "server_error", code="internal_error")


class _EventStream(StreamingResponse):
    """Server-sent events of one run; however the response ends (done, client gone,
    shutdown), the run is finished: cancelled if still going, its slot freed."""

    def __init__(self, run: "_Run", events):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.run = run

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.finish()


class _Run:
    """One admitted request: its reader thread and the queue of chunks it fills."""

    def __init__(self, server: OpenAIServer, job: Job):
        self.server = server
        self.job = job
        self.id = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.stream = None
        self.cancelled = threading.Event()
        self.prompt_tokens = 0
        self.stats = None
        self.result_reason = None
        self.t0 = time.perf_counter()
        self.finished = False
        self.refused = False
        self.aborted = False  # cancelled by OpenAIServer.end_drain
        server._runs.add(self)

    @property
    def shut_down(self) -> bool:
        """Ended by the end of the drain (cancelled by it, not finished on its own)."""
        return self.aborted and self.result_reason == "cancelled"

    def envelope(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.server.config.model_name}

    def usage(self) -> dict:
        n = self.stats.new_tokens if self.stats else 0
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}

    def lookahead_stats(self) -> dict:
        prof = self.job.profile
        s = self.stats
        return {"profile": prof.name if prof is not None else None, "steps": s.steps if s else 0,
                "compression": round(s.compression_ratio, 4) if s else 0.0}

    def finish(self) -> None:
        """Once, when the response ends: cancel the request if it still runs, free the slot."""
        if self.finished:
            return
        self.finished = True
        self.server._runs.discard(self)
        if self.result_reason is None and not self.refused:
            self.cancel()
            self.server.metrics.cancelled.inc()
        self.server._release()

    def cancel(self) -> None:
        self.cancelled.set()
        stream = self.stream
        if stream is not None:
            stream.cancel()

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown)
            self.cancel()

    async def start(self):
        """Start the reader thread; return the first item (a chunk), or raise the request's
        refusal as an :class:`APIError` (nothing was sent yet)."""
        threading.Thread(target=self._read, name=f"serve-{self.id}", daemon=True).start()
        first = await self.queue.get()
        if isinstance(first, BaseException):
            raise _as_api_error(first)
        if first.final and not first.token_ids and self.shut_down:  # nothing was generated: no stream yet
            raise self.server.shutdown_error
        return first

    def _read(self) -> None:
        job, model, cfg = self.job, self.server.model, self.server.config
        m = self.server.metrics
        try:
            ids = model.encode(job.prompt, chat=job.chat)
            limit = cfg.max_prompt_tokens or self.server.context - 1
            if len(ids) > limit:
                raise _bad(f"the prompt is {len(ids)} tokens; this server takes at most {limit}",
                           "messages" if job.chat else "prompt", "context_length_exceeded")
            max_new = job.max_tokens
            pool = getattr(getattr(model, "scheduler", None), "kv_tokens", None)  # the scheduler's KV pool
            room = self.server.context if pool is None else min(self.server.context, pool)
            if max_new is None:
                max_new = max(1, min(cfg.max_new_tokens_limit, room - len(ids)))
            elif len(ids) + max_new > self.server.context:
                raise _bad(f"the prompt ({len(ids)} tokens) + max_tokens ({max_new}) exceed the model's context of "
                           f"{self.server.context} tokens", "max_tokens", "context_length_exceeded")
            elif len(ids) + max_new > room:
                raise _bad(f"the prompt ({len(ids)} tokens) + max_tokens ({max_new}) exceed the server's KV pool of "
                           f"{room} tokens (--kv-tokens)", "max_tokens", "context_length_exceeded")
            self.prompt_tokens = len(ids)
            stream = model.stream(ids, chat=False, max_new_tokens=max_new, profile=job.profile,
                                  lookahead=job.profile is not None, stop=job.stop, temperature=job.temperature,
                                  top_k=job.top_k, top_p=job.top_p, seed=job.seed)
        except BaseException as err:  # refused before any work
            self.refused = True
            self._put(err)
            return
        self.stream = stream
        if self.cancelled.is_set():
            stream.cancel()
        last = None
        first_seen = False
        try:
            with stream:
                for chunk in stream:
                    now = time.perf_counter()
                    if chunk.token_ids:
                        if not first_seen:
                            m.ttft.observe(now - self.t0)
                            first_seen = True
                        elif last is not None:
                            per = (now - last) / len(chunk.token_ids)
                            for _ in chunk.token_ids:
                                m.tpot.observe(per)
                        last = now
                    if chunk.final:
                        self.stats = chunk.stats
                        self.result_reason = chunk.stop_reason
                        m.prompt_tokens.inc(self.prompt_tokens)
                        m.completion_tokens.inc(chunk.stats.new_tokens)
                        if chunk.stats.steps:
                            m.compression.observe(chunk.stats.compression_ratio)
                    self._put(chunk)
        except BaseException as err:
            self.refused = True  # failed, not cancelled
            self._put(err)
        self._put(_DONE)


# -- running it ---------------------------------------------------------------------------------

def bind(host: str, port: int):
    """A listening TCP socket on ``host:port`` (port 0: a free one).

    Raises:
        ServingError: the address cannot be bound (in use, not this machine's, no permission).
    """
    import socket

    from ..errors import ServingError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as err:
        sock.close()
        raise ServingError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    sock.set_inheritable(True)
    return sock


def run(server: OpenAIServer, sock, *, drain_s: float = 30.0) -> int:
    """Serve on a bound socket until SIGTERM or SIGINT.

    Either signal stops accepting connections at once and lets the requests in flight
    finish for up to ``drain_s`` seconds; then :meth:`OpenAIServer.end_drain` cancels the
    rest through the scheduler (each ends at its next pass with a ``server_shutdown``
    error: the last event of a stream before ``data: [DONE]``, else a 503), and once they
    have sent their answers (at most :data:`SHUTDOWN_GRACE_S` more seconds: uvicorn then
    cancels a response its client does not read) it returns. Returns the exit status: 0
    after SIGTERM, 130 after SIGINT.
    """
    import contextlib
    import signal

    import uvicorn

    got = []

    class _Uvicorn(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # drain, then return (uvicorn would re-raise the signal afterwards)
            def handler(sig, frame):
                got.append(sig)
                self.handle_exit(sig, frame)

            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

        async def shutdown(self, sockets=None):  # the drain: at its timeout, cancel through the scheduler
            timer = asyncio.get_running_loop().call_later(drain_s, server.end_drain, drain_s)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    config = uvicorn.Config(server.app, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=drain_s + SHUTDOWN_GRACE_S)
    _Uvicorn(config).run(sockets=[sock])
    return 130 if got and got[-1] == signal.SIGINT else 0
