"""One admitted request of ``lade-export serve`` (:mod:`.openai_api`) from its start to its
answer: the reader thread that runs it on the scheduler, and the answer as one JSON body
or as server-sent events.

Each running request has a thread (:class:`Run`) that reads its
:class:`lade_export.api.Stream` — the scheduler has no thread of its own: readers run
the passes, leader/follower — and hands each chunk to the event loop through an
``asyncio.Queue``, then :data:`DONE`. :func:`whole_response` gathers the chunks into one
``text_completion`` / ``chat.completion`` body; :func:`sse_events` sends them as they come
(``data: {json}`` chunks, then ``data: [DONE]``; ``stream_options.include_usage`` adds a
last chunk with the usage). Every answer (the last chunk of a stream) carries the
extension field ``lookahead``: ``{"profile", "steps", "compression"}`` — decode forward
passes and tokens per pass (Fu et al. 2023, arXiv 2402.02057: compression = new tokens /
steps).

A client that disconnects cancels its request (:meth:`Run.finish`), whether it is being
prefilled or decoding: the scheduler ends it before its next pass and frees its KV
columns. An error after a stream has begun is sent as one ``data: {"error": …}`` event
before ``data: [DONE]``; a request the server cancelled at the end of its drain
(:meth:`lade_export.serving.openai_api.OpenAIServer.end_drain`) ends with the server's
``server_shutdown`` error.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..errors import LadeError
from ..profile import GREEDY
from .openai_schema import FINISH_REASONS, APIError, Job, bad_request

#: The item a reader thread puts after a request's last chunk (or its error).
DONE = object()


class Run:
    """One admitted request: its reader thread and the queue of chunks it fills.

    Made on the event loop once the request holds a slot; :meth:`start` starts its thread,
    :meth:`finish` ends it (once, however the response ends).

    Args:
        server: the :class:`~lade_export.serving.openai_api.OpenAIServer` (its model,
            settings, metrics, the set of runs in flight and the slot it frees).
        job: the validated request.
    """

    def __init__(self, server, job: Job):
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
        server.runs.add(self)

    @property
    def shut_down(self) -> bool:
        """Ended by the end of the drain (cancelled by it, not finished on its own)."""
        return self.aborted and self.result_reason == "cancelled"

    def envelope(self, kind: str) -> dict:
        """The fields every body and chunk of this answer starts with: ``id``, ``object``
        (``kind``), ``created`` (Unix seconds), ``model``."""
        return {"id": self.id, "object": kind, "created": self.created, "model": self.server.config.model_name}

    def usage(self) -> dict:
        """OpenAI's ``usage``: prompt, completion and total tokens."""
        n = self.stats.new_tokens if self.stats else 0
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}

    def lookahead_stats(self) -> dict:
        """The extension field ``lookahead``: the profile's name (None: plain decoding), the
        decode forward passes and the tokens per pass (compression, Fu et al. 2023)."""
        prof = self.job.profile
        s = self.stats
        return {"profile": None if prof is GREEDY else prof.name, "steps": s.steps if s else 0,
                "compression": round(s.compression_ratio, 4) if s else 0.0}

    def finish(self) -> None:
        """Once, when the response ends: cancel the request if it still runs, free the slot."""
        if self.finished:
            return
        self.finished = True
        self.server.runs.discard(self)
        if self.result_reason is None and not self.refused:
            self.cancel()
            self.server.metrics.cancelled.inc()
        self.server.release()

    def cancel(self) -> None:
        """Cancel the request through its stream (the scheduler ends it at its next pass);
        before the stream exists, it is cancelled as soon as it does."""
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
            raise as_api_error(first)
        if first.final and not first.token_ids and self.shut_down:  # nothing was generated: no stream yet
            raise self.server.shutdown_error
        return first

    def _read(self) -> None:
        job, model, cfg = self.job, self.server.model, self.server.config
        m = self.server.metrics
        try:
            ids = model.encode(job.prompt, chat=job.chat)
            pool = getattr(getattr(model, "scheduler", None), "kv_tokens", None)  # the scheduler's KV pool
            room = self.server.context if pool is None else min(self.server.context, pool)
            limit = min(cfg.max_prompt_tokens or room - 1, room - 1)  # a prompt leaves room for a new token
            if len(ids) > limit:
                bound = f" (its KV pool holds {room} tokens)" if limit == room - 1 < self.server.context - 1 else ""
                raise bad_request(f"the prompt is {len(ids)} tokens; this server takes at most {limit}{bound}",
                                  "messages" if job.chat else "prompt", "context_length_exceeded")
            max_new = job.max_tokens
            if max_new is None:
                max_new = max(1, min(cfg.max_new_tokens_limit, room - len(ids)))
            elif len(ids) + max_new > self.server.context:
                raise bad_request(f"the prompt ({len(ids)} tokens) + max_tokens ({max_new}) exceed the model's "
                                  f"context of {self.server.context} tokens", "max_tokens", "context_length_exceeded")
            elif len(ids) + max_new > room:
                raise bad_request(f"the prompt ({len(ids)} tokens) + max_tokens ({max_new}) exceed the server's "
                                  f"KV pool of {room} tokens (--kv-tokens)", "max_tokens", "context_length_exceeded")
            self.prompt_tokens = len(ids)
            stream = model.stream(ids, chat=False, max_new_tokens=max_new, profile=job.profile,
                                  stop=job.stop, temperature=job.temperature,
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
        self._put(DONE)


async def whole_response(run: Run, first, endpoint: str, disconnect: asyncio.Future) -> Response:
    """The answer of a request without ``stream``: one ``text_completion`` or
    ``chat.completion`` body once the request has ended.

    Args:
        run: the started request.
        first: its first item (what :meth:`Run.start` returned).
        endpoint: the metrics label (``completions`` or ``chat``).
        disconnect: completes when the client disconnects; then the answer is a bare 499
            (the caller's :meth:`Run.finish` cancels the request).

    Returns:
        the JSON response; an error in OpenAI's schema if the request failed, or the
        server's 503 if the end of the drain cancelled it.
    """
    server, job = run.server, run.job
    texts = []
    try:
        item = first
        while True:
            if item is DONE:
                break
            if isinstance(item, BaseException):
                raise as_api_error(item)
            texts.append(item.text)
            getter = asyncio.ensure_future(run.queue.get())
            done, _ = await asyncio.wait({getter, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:  # the client went away: run.finish() cancels the request
                getter.cancel()
                return Response(status_code=499)
            item = getter.result()
    except APIError as err:
        server.metrics.requests.labels(endpoint, str(err.status)).inc()
        return err.response()
    if run.shut_down:
        err = server.shutdown_error
        server.metrics.requests.labels(endpoint, str(err.status)).inc()
        return err.response()
    server.metrics.requests.labels(endpoint, "200").inc()
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


async def sse_events(run: Run, first):
    """The server-sent events of a request with ``stream: true``, as bytes: for chat a
    first chunk with the assistant role, a chunk per piece of text, the last one with its
    ``finish_reason`` and ``lookahead``, then (``include_usage``) one with the usage, and
    ``data: [DONE]``. A failure ends the stream with an error event; so does the end of
    the drain (the text so far, then the server's ``server_shutdown`` error).

    Args:
        run: the started request.
        first: its first item (what :meth:`Run.start` returned).
    """
    job = run.job
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
    while item is not DONE:
        if isinstance(item, BaseException):
            yield event(as_api_error(item).body())
            break
        if item.final and run.shut_down:  # cancelled by the end of the drain: the text so far, the error
            if item.text:
                yield event({**run.envelope(kind), "choices": [choice(item.text)], **usage_null})
            yield event(run.server.shutdown_error.body())
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


class EventStream(StreamingResponse):
    """Server-sent events of one run; however the response ends (done, client gone,
    shutdown), the run is finished: cancelled if still going, its slot freed."""

    def __init__(self, run: Run, events):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.run = run

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.finish()


async def wait_disconnect(request: Request) -> None:
    """Return when the client of ``request`` disconnects (read once its body is)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    """The client disconnected before the awaited step completed."""


async def unless(step, disconnect: asyncio.Future):
    """``await step`` unless ``disconnect`` completes first; then ``step`` is cancelled and
    :class:`ClientGone` raised (a step done at the same moment keeps its result)."""
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
    raise ClientGone


def as_api_error(err: BaseException) -> APIError:
    """A request's failure as the error it is answered with: an :class:`APIError` as it is,
    a usage error of the package (:class:`~lade_export.errors.LadeError`) as a 400, anything
    else as a 500 ``internal_error``."""
    if isinstance(err, APIError):
        return err
    if isinstance(err, LadeError) and not getattr(err, "exit_code", 2) == 1:
        return bad_request(str(err))
    return APIError(500, f"internal error: {type(err).__name__}: {err}", "server_error", code="internal_error")
