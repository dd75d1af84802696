"""The OpenAI request schema of ``lade-export serve`` (:mod:`.openai_api`): what a request
may hold, how it is checked, and the error schema every refusal is answered in.

Fields (the OpenAI REST API's, https://platform.openai.com/docs/api-reference):
``model`` (must name the served model: 404 otherwise), ``max_tokens`` /
``max_completion_tokens``, ``stop`` (a string or up to 4), ``temperature`` (0–2; omitted:
1.0, what the OpenAI API documents — artifacts carry no generation defaults), ``top_p``,
``seed``, ``n`` = 1, ``user`` (ignored); the extensions ``top_k`` and ``lookahead``
(``{"profile": NAME}`` for one of the profiles the server was started with, ``true`` for
the first of them, ``false`` for plain decoding; omitted: the first). Fields the OpenAI API
has but this server does not implement are refused unless they hold their neutral value
(``n`` ≠ 1, ``logprobs``, ``echo``, ``best_of`` > 1, penalties ≠ 0, ``logit_bias``, tools,
``response_format`` other than text …); any other field is refused by name, so a typo is
not silently ignored.

Prompts: ``/v1/completions`` takes ``prompt`` as a string, a one-element list of strings,
a list of token ids or a one-element list of them; ``/v1/chat/completions`` takes
``messages`` (``role`` system, user, assistant or developer — the last read as system —
and ``content`` a string or text parts).

Errors use OpenAI's schema, ``{"error": {"message", "type", "param", "code"}}``
(:class:`APIError`), with a one-line message.

Nothing here imports PyTorch; Starlette (the ``http`` extra) only for
:meth:`APIError.response`.
"""

from __future__ import annotations

import dataclasses
import json
import math

from starlette.responses import JSONResponse

from ..profile import GREEDY, LookaheadProfile

#: Largest request body accepted by default, bytes.
MAX_BODY_BYTES = 1 << 20
#: Stop strings a request may give (the OpenAI API's limit).
MAX_STOP_STRINGS = 4
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
        """The error as an HTTP response: :meth:`body` as JSON with status :attr:`status`,
        non-ASCII characters written as ``\\u`` escapes (RFC 8259, section 7), so a field name
        the client sent that UTF-8 cannot encode (a lone surrogate) still makes a body."""
        return _AsciiJSONResponse(self.body(), status_code=self.status)


class _AsciiJSONResponse(JSONResponse):
    """A JSON response whose text is ASCII (``json.dumps(ensure_ascii=True)``): every string is
    encodable, lone surrogates included, and clients read the same characters."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error`` (:class:`APIError`) about ``param``."""
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
        max_prompt_tokens: the longest prompt, tokens (None: the context less one, or the
            scheduler's KV pool less one where that is smaller; never more than that).
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
        profile: the lookahead profile (:data:`lade_export.profile.GREEDY` for plain decoding).
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
    profile: LookaheadProfile
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
        raise bad_request(f"{name} must be a number, got {_kind(v)}", name)
    if not math.isfinite(v) or v > high or (v <= low if low_open else v < low):
        left = "(" if low_open else "["
        raise bad_request(f"{name} must be in {left}{low:g}, {high:g}], got {v!r}", name)
    return float(v)


def _integer(body, name, low, high=None):
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise bad_request(f"{name} must be an integer, got {_kind(v)}", name)
    if v < low or (high is not None and v > high):
        raise bad_request(f"{name} must be an integer in [{low}, {high}], got {v}" if high is not None
                          else f"{name} must be an integer ≥ {low}, got {v}", name)
    return v


def _neutral(body, name, ok) -> None:
    """Refuse a field this server does not implement unless it holds its neutral value."""
    if name in body and not ok(body[name]):
        raise bad_request(f"{name} is not supported by this server (got {json.dumps(body[name])[:60]})", name,
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
        raise bad_request(f"the request body must be a JSON object, got {_kind(body)}")
    allowed = _CHAT_FIELDS if chat else _COMPLETION_FIELDS
    for name in body:
        if name not in allowed:
            raise bad_request(f"unknown field {name!r}", name, "unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str):
        raise bad_request("model is required: give the served model's id (GET /v1/models)" if model is None
                          else f"model must be a string, got {_kind(model)}", "model")
    if model != config.model_name:
        raise APIError(404, f"model {model!r} is not served here; this server serves {config.model_name!r}",
                       param="model", code="model_not_found")

    _neutral(body, "n", lambda v: v is None or v == 1)
    if "n" in body and body["n"] is not None and not _is_int(body["n"]):
        raise bad_request(f"n must be an integer, got {_kind(body['n'])}", "n")
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
        raise bad_request(f"user must be a string, got {_kind(body['user'])}", "user")

    prompt = _messages(body) if chat else _prompt(body)

    max_tokens = _integer(body, "max_tokens", 1, config.max_new_tokens_limit)
    if chat:
        mct = _integer(body, "max_completion_tokens", 1, config.max_new_tokens_limit)
        if mct is not None and max_tokens is not None and mct != max_tokens:
            raise bad_request("max_tokens and max_completion_tokens differ; give one of them",
                              "max_completion_tokens")
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
        raise bad_request(f"stop must be a string or an array of strings, got {_kind(stop)}", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    if any(s == "" for s in stops):
        raise bad_request("stop strings must not be empty", "stop")

    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request(f"stream must be a boolean, got {_kind(stream)}", "stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise bad_request("stream_options must be an object with include_usage (a boolean)", "stream_options")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise bad_request(f"stream_options.include_usage must be a boolean, got {_kind(include_usage)}",
                              "stream_options")
        continuous = options.get("continuous_usage_stats", False)
        if not isinstance(continuous, bool):
            raise bad_request(f"stream_options.continuous_usage_stats must be a boolean, got {_kind(continuous)}",
                              "stream_options")
        if continuous:  # usage in every chunk: not served (the last chunk has it with include_usage)
            raise bad_request("stream_options.continuous_usage_stats is not supported by this server; usage comes "
                              "in the last chunk with include_usage: true", "stream_options", "unsupported_parameter")

    return Job(chat, prompt, max_tokens, stops, temperature, top_p, top_k, seed, _profile(body, config), stream,
               include_usage)


def _profile(body, config: ServerConfig) -> LookaheadProfile:
    value = body.get("lookahead", True)
    served = ", ".join(config.profiles) or "none"
    if value is None or value is True:
        return next(iter(config.profiles.values()), GREEDY)
    if value is False:
        return GREEDY
    if not isinstance(value, dict) or set(value) - {"profile"} or not isinstance(value.get("profile"), str):
        raise bad_request('lookahead must be false, true or {"profile": NAME}', "lookahead")
    name = value["profile"]
    if name not in config.profiles:
        raise bad_request(f"unknown lookahead profile {name!r}; this server serves: {served}", "lookahead",
                          "unknown_profile")
    return config.profiles[name]


def _prompt(body):
    if "prompt" not in body:
        raise bad_request("prompt is required", "prompt")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(_is_int(t) for t in p):
        return [int(t) for t in p]
    if isinstance(p, list) and (len(p) > 1 and all(isinstance(x, (str, list)) for x in p)):
        raise bad_request(f"prompt must be one prompt; this server takes one per request, got {len(p)}", "prompt")
    raise bad_request("prompt must be a string, an array of one string, or an array of token ids", "prompt")


def _messages(body):
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("messages must be a non-empty array of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object, got {_kind(m)}", "messages")
        role = m.get("role")
        if role not in _ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}, got {json.dumps(role)}",
                              "messages")
        if set(m) - {"role", "content", "name"}:
            extra = sorted(set(m) - {"role", "content", "name"})[0]
            raise bad_request(f"{where}.{extra} is not supported by this server", "messages",
                              "unsupported_parameter")
        if "name" in m and not isinstance(m["name"], str):
            raise bad_request(f"{where}.name must be a string, got {_kind(m['name'])}", "messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad_request(f"{where}.content: only text parts are supported", "messages")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad_request(f"{where}.content must be a string or an array of text parts, got {_kind(content)}",
                              "messages")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out
