"""``lade-export serve``: an OpenAI-compatible HTTP server on the continuous-batching scheduler.

Endpoints (the OpenAI REST API's shapes, https://platform.openai.com/docs/api-reference):

* ``GET /v1/models`` — the one served model; ``GET /v1/models/{id}`` — its object.
* ``POST /v1/completions`` — ``prompt`` as a string, a one-element list of strings, a list
  of token ids or a one-element list of them. The prompt is raw: control-token strings in
  it (``<|im_start|>`` …) are control tokens, as llama-server and vLLM read them.
* ``POST /v1/chat/completions`` — ``messages`` through the model's chat template;
  control-token strings inside message content are text (a user cannot forge a turn,
  :mod:`lade_export.tokenizer`).
* ``stream: true`` answers with server-sent events (``data: {json}`` chunks, then
  ``data: [DONE]``); ``stream_options.include_usage`` adds a last chunk with the usage.
* ``GET /health`` (no key needed) and ``GET /metrics`` (Prometheus text format).

The server is four modules: this one (the ASGI app and its routes: keys, bodies,
admission, the drain, :func:`run`), :mod:`.openai_schema` (the fields a request may hold,
their checks, the error schema), :mod:`.openai_stream` (a request's reader thread and its
answer, whole or as server-sent events) and :mod:`.openai_metrics` (``GET /metrics``).

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
import collections
import hmac
import json
import threading

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .openai_metrics import Metrics
from .openai_schema import NO_CHAT_TEMPLATE, APIError, ServerConfig, bad_request, parse_request
from .openai_stream import ClientGone, EventStream, Run, sse_events, unless, wait_disconnect, whole_response

__all__ = ["APIError", "OpenAIServer", "SHUTDOWN_GRACE_S", "ServerConfig", "bind", "run"]

#: Seconds the requests cancelled at the end of the drain timeout have to send their last
#: events (each ends at its next pass) before uvicorn cancels what is left.
SHUTDOWN_GRACE_S = 10.0


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
        #: futures of the requests waiting for a slot, oldest first (a release hands its slot to the first)
        self._queue: collections.deque = collections.deque()
        #: the admitted requests (:class:`~lade_export.serving.openai_stream.Run`) not yet finished
        self.runs: set = set()
        #: the 503 every request still in flight gets once :meth:`end_drain` ran, else None
        self.shutdown_error: APIError | None = None
        self.metrics = Metrics(self)
        routes = [Route("/health", self.health, methods=["GET"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model_id:path}", self.retrieve_model, methods=["GET"]),
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
        try:
            async for piece in request.stream():
                data += piece
                if len(data) > limit:
                    raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
        except ClientDisconnect:  # it left before its body was in: nobody to answer
            raise ClientGone() from None

        def refuse_constant(name):
            raise ValueError(f"{name} is not valid JSON")

        try:
            return json.loads(bytes(data).decode("utf-8"), parse_constant=refuse_constant)
        except UnicodeDecodeError:
            raise bad_request("the request body is not UTF-8") from None
        except RecursionError:
            raise bad_request("the request body is not valid JSON: nested too deeply") from None
        except ValueError as err:
            if "integer string conversion" in str(err):  # Python's int digit limit, not the client's concern
                raise bad_request("the request body is not valid JSON: a number has too many digits") from None
            raise bad_request(f"the request body is not valid JSON: {err}") from None

    async def _acquire(self) -> None:
        """Take a slot of ``max_concurrent``, or wait for one in arrival order: a release hands
        its slot to the request that has waited longest (raises the 429 when ``max_queue``
        requests wait, the shutdown's 503 once the drain has ended)."""
        if self.shutdown_error is not None:
            raise self.shutdown_error
        if self.running < self.config.max_concurrent and not any(not turn.done() for turn in self._queue):
            self.running += 1
            return
        if self.waiting >= self.config.max_queue:
            raise APIError(429, f"the server is at capacity ({self.running} running, {self.waiting} waiting); "
                                "try again later", "rate_limit_error", code="queue_full")
        turn = asyncio.get_running_loop().create_future()
        self._queue.append(turn)
        self.waiting += 1
        try:
            await turn  # a release handed this request its slot (running stays as it was)
        except asyncio.CancelledError:  # its client left while it waited
            if turn.done() and not turn.cancelled() and turn.exception() is None:
                self.release()  # it was handed a slot in the same moment: the next request gets it
            elif turn in self._queue:
                self._queue.remove(turn)
            raise
        finally:
            self.waiting -= 1
        if self.shutdown_error is not None:  # handed a slot as the drain ended
            self.release()
            raise self.shutdown_error

    def release(self) -> None:
        """Free a slot: the request that has waited longest gets it, else it is free
        (synchronous, so that it also runs in a cancelled task's cleanup)."""
        while self._queue:
            turn = self._queue.popleft()
            if not turn.done():  # not cancelled: its client still waits
                turn.set_result(None)
                return
        self.running -= 1

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
        for run in list(self.runs):
            run.aborted = True
            run.cancel()
        while self._queue:  # the requests still waiting for a slot get the 503 now
            turn = self._queue.popleft()
            if not turn.done():
                turn.set_exception(self.shutdown_error)

    # -- endpoints -------------------------------------------------------------------------

    async def health(self, request: Request):
        """``GET /health``: ``{"status": "ok"}`` (no key needed)."""
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request):
        """``GET /v1/models``: the served model, in OpenAI's list schema."""
        try:
            self._authorize(request)
        except APIError as err:
            return err.response()
        return JSONResponse({"object": "list", "data": [self._model_object()]})

    async def retrieve_model(self, request: Request):
        """``GET /v1/models/{id}``: the served model's object (OpenAI's retrieve schema), or 404
        ``model_not_found`` for another id."""
        try:
            self._authorize(request)
            model_id = request.path_params["model_id"]
            if not model_id:  # /v1/models/ is the list, as before this route
                return await self.models(request)
            if model_id != self.config.model_name:
                raise APIError(404, f"model {model_id!r} is not served here; this server serves "
                                    f"{self.config.model_name!r}", param="model", code="model_not_found")
        except APIError as err:
            return err.response()
        return JSONResponse(self._model_object())

    def _model_object(self) -> dict:
        return {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "lade-export"}

    async def prometheus(self, request: Request):
        """``GET /metrics``: the server's metrics in Prometheus text format (:mod:`.openai_metrics`)."""
        try:
            self._authorize(request)
        except APIError as err:
            return err.response()
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, request: Request):
        """``POST /v1/completions``."""
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request):
        """``POST /v1/chat/completions``."""
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            self._authorize(request)
            job = parse_request(await self._body(request), chat, self.config)
            if chat and not self._has_chat_template:
                raise bad_request(NO_CHAT_TEMPLATE)
        except APIError as err:
            self.metrics.requests.labels(endpoint, str(err.status)).inc()
            return err.response()
        except ClientGone:  # it left while its body was read
            self.metrics.cancelled.inc()
            return Response(status_code=499)
        # the client may leave while its request waits for a slot or is prefilled: watch for it
        disconnect = asyncio.ensure_future(wait_disconnect(request))
        try:
            try:
                await unless(self._acquire(), disconnect)
            except APIError as err:
                self.metrics.requests.labels(endpoint, str(err.status)).inc()
                return err.response()
            except ClientGone:  # it left the queue before it held a slot
                self.metrics.cancelled.inc()
                return Response(status_code=499)
            run = Run(self, job)
            try:
                first = await unless(run.start(), disconnect)
            except APIError as err:
                run.finish()
                self.metrics.requests.labels(endpoint, str(err.status)).inc()
                return err.response()
            except ClientGone:  # finish() cancels the request: it ends at its next pass
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
                return EventStream(run, sse_events(run, first))
            try:
                return await whole_response(run, first, endpoint, disconnect)
            finally:
                run.finish()
        finally:
            disconnect.cancel()


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
