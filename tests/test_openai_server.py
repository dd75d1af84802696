"""``lade-export serve``: the real server on a free local port, driven by the official
``openai`` Python client (and raw HTTP for malformed requests), on stories260K and SmolLM2.

Every text the server returns at temperature 0 equals the in-process ``generate`` text
(and, on stories260K, the reference greedy tokens); concurrent streams equal their solo
runs; disconnects, limits, keys and bad requests get their documented answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import openai
import pytest
import uvicorn

import lade_export
from lade_export.profile import resolve_profile
from lade_export.runtime import Decoder
from lade_export.scheduler import Scheduler
from lade_export.serving.openai_api import OpenAIServer, ServerConfig, bind

from .conftest import mt_bench_prompts
from .engine_wrappers import WrappedEngine

PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park", "One day, a bird",
           "Tom had a red ball", "The sun was", "Mom said", "There was a big tree"]


@pytest.fixture(scope="module")
def stories_model(stories_artifact):
    model = lade_export.load(stories_artifact, batching=True)
    yield model
    model.close()


def _profiles(model, *names):
    return {n: resolve_profile(n) for n in names}


@contextlib.contextmanager
def serving(model, **settings):
    """The real server (uvicorn + the app) in a thread on a free port; yields (base URL, app)."""
    settings.setdefault("profiles", _profiles(model, "default", "small"))
    app = OpenAIServer(model, ServerConfig(settings.pop("model_name", "stories"), **settings))
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app.app, log_level="warning", access_log=False, lifespan="off",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def client(base, key="none"):
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)


def raw(base, method, path, body=None, headers=None):
    """One HTTP request with the standard library: (status, parsed JSON or text)."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    try:
        return resp.status, json.loads(text)
    except ValueError:
        return resp.status, text


def metric(base, name) -> float:
    _, text = raw(base, "GET", "/metrics")
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def stream_text(chunks, chat=False):
    parts, reasons, last = [], [], None
    for c in chunks:
        last = c
        for ch in c.choices:
            parts.append((ch.delta.content or "") if chat else ch.text)
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    return "".join(parts), reasons, last


# -- stories260K -----------------------------------------------------------------------------

def test_completions_stream_and_not_equal_generate_and_the_reference(stories_model, reference_greedy):
    tok = stories_model.tokenizer
    with serving(stories_model) as (base, _):
        c = client(base)
        assert [m.id for m in c.models.list().data] == ["stories"]
        assert c.models.retrieve("stories").id == "stories"  # what the official client's retrieve reads
        assert raw(base, "GET", "/v1/models/")[1]["data"][0]["id"] == "stories"  # the list, as before the route
        with pytest.raises(openai.NotFoundError) as err:
            c.models.retrieve("gpt-4o")
        assert err.value.body == {"message": "model 'gpt-4o' is not served here; this server serves 'stories'",
                                  "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
        for case in reference_greedy["cases"]:
            n = 40
            expected = stories_model.generate(case["prompt"], chat=False, max_new_tokens=n, temperature=0)
            oracle = tok.decode(case["greedy_ids"][:n])
            assert expected.text == oracle
            whole = c.completions.create(model="stories", prompt=case["prompt"], max_tokens=n, temperature=0)
            assert whole.choices[0].text == oracle
            assert whole.choices[0].finish_reason == "length"
            assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == \
                (len(case["prompt_ids"]), n, len(case["prompt_ids"]) + n)
            assert whole.lookahead["profile"] == "default" and whole.lookahead["steps"] >= 1
            assert whole.lookahead["compression"] == pytest.approx(n / whole.lookahead["steps"], abs=1e-3)
            text, reasons, last = stream_text(c.completions.create(
                model="stories", prompt=case["prompt"], max_tokens=n, temperature=0, stream=True,
                stream_options={"include_usage": True}))
            assert text == oracle and reasons == ["length"]
            assert last.choices == [] and last.usage.completion_tokens == n
            # the same tokens as token ids, as a one-element list, with plain decoding and another profile
            for prompt, look in ((case["prompt_ids"], None), ([case["prompt"]], False),
                                 ([case["prompt_ids"]], {"profile": "small"})):
                extra = {} if look is None else {"lookahead": look}
                r = c.completions.create(model="stories", prompt=prompt, max_tokens=n, temperature=0, extra_body=extra)
                assert r.choices[0].text == oracle
            assert r.lookahead["profile"] == "small"
        # a stop string: the text is cut before it, finish_reason stop
        r = c.completions.create(model="stories", prompt="Once upon a time", max_tokens=40, temperature=0, stop=["Lily"])
        assert r.choices[0].text == ", there was a little girl named " and r.choices[0].finish_reason == "stop"


def test_an_omitted_temperature_samples_and_a_seed_repeats(stories_model):
    with serving(stories_model) as (base, _):
        c = client(base)
        a = c.completions.create(model="stories", prompt="Once upon a time", max_tokens=30, seed=5)
        b = c.completions.create(model="stories", prompt="Once upon a time", max_tokens=30, seed=5)
        solo = stories_model.generate("Once upon a time", chat=False, max_new_tokens=30, temperature=1.0, seed=5)
        assert a.choices[0].text == b.choices[0].text == solo.text


def test_eight_concurrent_streaming_clients_each_get_their_solo_output(stories_model):
    looks = [True, False, {"profile": "small"}]
    jobs = [dict(prompt=p, max_tokens=30 + 8 * i, temperature=0 if i % 3 else 0.8, seed=i,
                 extra_body={"lookahead": looks[i % 3]}) for i, p in enumerate(PROMPTS)]
    solo = [stories_model.generate(j["prompt"], chat=False, max_new_tokens=j["max_tokens"], temperature=j["temperature"],
                                   seed=j["seed"], profile="small" if i % 3 == 2 else None, lookahead=i % 3 != 1)
            for i, j in enumerate(jobs)]
    got = [None] * len(jobs)
    start = threading.Barrier(len(jobs))
    with serving(stories_model) as (base, _):
        def run(i):
            c = client(base)
            start.wait()
            got[i] = stream_text(c.completions.create(model="stories", stream=True,
                                                      stream_options={"include_usage": True}, **jobs[i]))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [g[0] for g in got] == [s.text for s in solo]
        assert [g[2].usage.completion_tokens for g in got] == [s.stats.new_tokens for s in solo]
        assert metric(base, "lade_requests_total") == len(jobs)  # the one series: completions, 200
        assert metric(base, "lade_completion_tokens_total") == sum(s.stats.new_tokens for s in solo)
        assert metric(base, "lade_time_to_first_token_seconds_count") == len(jobs)
        assert metric(base, "lade_compression_ratio_count") == len(jobs)
        assert metric(base, "lade_kv_cache_bytes") > 0 and metric(base, "lade_scheduler_passes_total") > 0
        assert metric(base, "lade_scheduler_active_requests") == 0 and metric(base, "lade_requests_running") == 0


class _Gated:
    """The model with every stream held before its second chunk until the request is
    cancelled or the test opens the gate (so a request is still running when the test
    acts, however fast the machine)."""

    def __init__(self, model):
        self.model = model
        self.decoder = model.decoder
        self.scheduler = model.scheduler
        self.gate = threading.Event()
        self.streams = []

    def encode(self, *a, **kw):
        return self.model.encode(*a, **kw)

    def stream(self, *a, **kw):
        s = _GatedStream(self, self.model.stream(*a, **kw))
        self.streams.append(s)
        return s


class _GatedStream:
    def __init__(self, owner, inner):
        self.owner, self.inner = owner, inner
        self.cancelled = threading.Event()
        self.chunks = []
        self.after_cancel = 0

    def __iter__(self):
        return self

    def __next__(self):
        if any(c.text for c in self.chunks):  # the client has had text
            deadline = time.monotonic() + 60
            while not (self.cancelled.is_set() or self.owner.gate.is_set()) and time.monotonic() < deadline:
                time.sleep(0.01)
        chunk = next(self.inner)
        self.chunks.append(chunk)
        self.after_cancel += self.cancelled.is_set()
        return chunk

    def cancel(self):
        self.cancelled.set()
        self.inner.cancel()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.inner.close()


_KILLED_CLIENT = """
import sys, time, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="none", max_retries=0)
for chunk in c.completions.create(model="stories", prompt="Once upon a time", max_tokens=400, temperature=0, stream=True):
    print("chunk", flush=True)
    time.sleep(3600)
"""


def test_a_client_killed_mid_stream_frees_its_request_at_the_next_step(stories_model):
    gated = _Gated(stories_model)
    with serving(gated) as (base, _):
        proc = subprocess.Popen([sys.executable, "-c", _KILLED_CLIENT, base], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline() == "chunk\n"
            assert stories_model.scheduler.active_requests == 1
        finally:
            proc.kill()
            proc.wait()
        s = gated.streams[0]
        assert s.cancelled.wait(30), "the server did not cancel the request of a client that went away"
        deadline = time.monotonic() + 30
        while (stories_model.scheduler.active_requests or metric(base, "lade_requests_running")) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stories_model.scheduler.active_requests == 0 and metric(base, "lade_requests_running") == 0
        assert s.chunks[-1].stop_reason == "cancelled" and s.after_cancel == 1  # ended at the next step
        assert sum(len(c.token_ids) for c in s.chunks) < 400
        assert metric(base, "lade_requests_cancelled_total") == 1
        gated.gate.set()
        r = client(base).completions.create(model="stories", prompt="Once upon a time", max_tokens=10, temperature=0)
        assert r.choices[0].text == ", there was a little girl named Lily"  # still serving


def test_a_full_queue_is_answered_429_and_the_queued_request_runs_after(stories_model):
    gated = _Gated(stories_model)
    with serving(gated, max_concurrent=1, max_queue=1) as (base, _):
        c = client(base)
        first = c.completions.create(model="stories", prompt="Once upon a time", max_tokens=20, temperature=0,
                                     stream=True)
        chunks = iter(first)
        head = next(chunks).choices[0].text
        queued = {}
        waiter = threading.Thread(target=lambda: queued.setdefault("r", c.completions.create(
            model="stories", prompt="The little dog", max_tokens=12, temperature=0)))
        waiter.start()
        deadline = time.monotonic() + 30
        while metric(base, "lade_requests_queued") < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert metric(base, "lade_requests_queued") == 1 and metric(base, "lade_requests_running") == 1
        with pytest.raises(openai.RateLimitError) as err:
            c.completions.create(model="stories", prompt="Mom said", max_tokens=5, temperature=0)
        assert err.value.status_code == 429
        assert err.value.body == {"message": "the server is at capacity (1 running, 1 waiting); try again later",
                                  "type": "rate_limit_error", "param": None, "code": "queue_full"}
        gated.gate.set()
        rest = stream_text(chunks)[0]
        waiter.join(60)
        assert head + rest == stories_model.generate("Once upon a time", chat=False, max_new_tokens=20).text
        assert queued["r"].choices[0].text == stories_model.generate("The little dog", chat=False,
                                                                      max_new_tokens=12).text


def test_the_api_key_is_required_where_set(stories_model):
    with serving(stories_model, api_key="s3cret-key") as (base, _):
        for key in ("wrong", "s3cret-keyX", "s3cret-ke"):
            with pytest.raises(openai.AuthenticationError) as err:
                client(base, key).completions.create(model="stories", prompt="Hi", max_tokens=2)
            assert err.value.status_code == 401
            assert err.value.body == {"message": "invalid API key", "type": "authentication_error", "param": None,
                                      "code": "invalid_api_key"}
        status, body = raw(base, "POST", "/v1/completions", {"model": "stories", "prompt": "Hi"})
        assert status == 401 and body["error"]["message"] == "missing API key: send Authorization: Bearer KEY"
        assert raw(base, "GET", "/v1/models")[0] == 401 and raw(base, "GET", "/metrics")[0] == 401
        assert raw(base, "GET", "/v1/models/stories")[0] == 401 and raw(base, "GET", "/v1/models/other")[0] == 401
        assert raw(base, "GET", "/health") == (200, {"status": "ok"})
        r = client(base, "s3cret-key").completions.create(model="stories", prompt="Once upon a time", max_tokens=4,
                                                          temperature=0)
        assert r.choices[0].text == ", there was a"


class _SlowEngine(WrappedEngine):
    """The stories engine, 50 ms slower on every pass, counting them (so a long prompt
    prefilled in small chunks takes many passes before its first token)."""

    def __init__(self, engine):
        super().__init__(engine)
        self.passes = 0

    def run(self, feeds, with_logits=False):
        time.sleep(0.05)
        self.passes += 1
        return self.engine.run(feeds, with_logits)


def _wait(cond, what, timeout=30):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _post_and_leave(base, body):
    """Send a request and keep its connection open without reading; returns the socket
    (closing it is the client going away)."""
    host, port = base.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def test_a_client_that_leaves_while_queued_or_prefilled_is_cancelled_before_its_first_token(stories_artifact):
    # a 480-token prompt prefilled 8 tokens a pass: its first token needs 60 passes (>= 3 s)
    model = lade_export.load(stories_artifact, batching=True)
    model.scheduler.close()
    d = model.decoder
    engine = _SlowEngine(d.engine)
    model.scheduler = sched = Scheduler(Decoder(engine, d.stop_token_ids, d.max_context, d.tokenizer), prefill_chunk=8)
    first_token = 60
    long = {"model": "stories", "prompt": [1] + [300] * 479, "max_tokens": 4, "temperature": 0}
    try:
        with serving(model, max_concurrent=1) as (base, _):
            # a stream being prefilled holds the only slot; a request queued behind it leaves
            a = _post_and_leave(base, {**long, "stream": True})
            _wait(lambda: sched.active_requests == 1 and engine.passes >= 2, "the long prompt is not being prefilled")
            b = _post_and_leave(base, {"model": "stories", "prompt": "The little dog", "max_tokens": 4})
            _wait(lambda: metric(base, "lade_requests_queued") == 1, "the second request is not queued")
            b.close()
            _wait(lambda: metric(base, "lade_requests_queued") == 0, "the queued request did not leave")
            assert engine.passes < first_token and metric(base, "lade_requests_running") == 1
            # the stream's client leaves during its prefill: the scheduler drops it at its next pass
            a.close()
            _wait(lambda: sched.active_requests == 0 and metric(base, "lade_requests_running") == 0,
                  "the prefilled request of a client that left is still running")
            assert engine.passes < first_token
            # the same for a request that is not streamed
            before = engine.passes
            c = _post_and_leave(base, long)
            _wait(lambda: sched.active_requests == 1 and engine.passes >= before + 2, "the prompt is not prefilled")
            c.close()
            _wait(lambda: sched.active_requests == 0 and metric(base, "lade_requests_running") == 0,
                  "the prefilled request of a client that left is still running")
            assert engine.passes - before < first_token
            assert metric(base, "lade_requests_cancelled_total") == 3 and sched.pool.used == 0
            r = client(base).completions.create(model="stories", prompt="Once upon a time", max_tokens=10,
                                                temperature=0)
            assert r.choices[0].text == ", there was a little girl named Lily"
            assert metric(base, "lade_completion_tokens_total") == 10  # none of the others had a token
    finally:
        model.close()


def test_the_kv_pool_bounds_a_request_and_its_default_max_tokens(stories_artifact):
    model = lade_export.load(stories_artifact, batching=True, kv_tokens=300)
    try:
        with serving(model) as (base, _):
            status, body = raw(base, "POST", "/v1/completions", {**C, "max_tokens": 400})
            assert (status, body) == (400, {"error": {
                "message": "the prompt (5 tokens) + max_tokens (400) exceed the server's KV pool of 300 tokens "
                           "(--kv-tokens)", "type": "invalid_request_error", "param": "max_tokens",
                "code": "context_length_exceeded"}})
            r = client(base).completions.create(model="stories", prompt="Once upon a time", temperature=0,
                                                extra_body={"lookahead": False})
            assert r.usage.prompt_tokens + r.usage.completion_tokens <= 300  # omitted: what the pool leaves
            assert r.choices[0].text == model.generate("Once upon a time", chat=False, lookahead=False,
                                                       max_new_tokens=r.usage.completion_tokens).text
            for max_tokens in (None, 1):  # a prompt the pool cannot hold with a new token: the same kind of answer
                request = {**C, "prompt": [5] * 300, "max_tokens": max_tokens}
                status, body = raw(base, "POST", "/v1/completions",
                                   {k: v for k, v in request.items() if v is not None})
                assert (status, body) == (400, {"error": {
                    "message": "the prompt is 300 tokens; this server takes at most 299 (its KV pool holds 300 "
                               "tokens)", "type": "invalid_request_error", "param": "prompt",
                    "code": "context_length_exceeded"}})
        with serving(model, max_prompt_tokens=100) as (base, _):  # a smaller limit of its own: the pool is not named
            status, body = raw(base, "POST", "/v1/completions", {**C, "prompt": [5] * 150})
            assert (status, body["error"]["message"]) == (400, "the prompt is 150 tokens; this server takes at most 100")
    finally:
        model.close()


C = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 4}
M = {"model": "stories", "messages": [{"role": "user", "content": "hi"}]}
MALFORMED = [
    # (path, body, status, param, code, message)
    ("/v1/completions", b"{not json", 400, None, None,
     "the request body is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    ("/v1/completions", b'{"model": "stories", "prompt": "x", "temperature": NaN}', 400, None, None,
     "the request body is not valid JSON: NaN is not valid JSON"),
    ("/v1/completions", b"\xff\xfe", 400, None, None, "the request body is not UTF-8"),
    ("/v1/completions", b'{"model": "stories", "prompt": "x", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}",
     400, None, None, "the request body is not valid JSON: nested too deeply"),
    ("/v1/completions", b'{"model": "stories", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400, None, None,
     "the request body is not valid JSON: a number has too many digits"),
    ("/v1/completions", [1, 2], 400, None, None, "the request body must be a JSON object, got an array"),
    ("/v1/completions", {"prompt": "x"}, 400, "model", None,
     "model is required: give the served model's id (GET /v1/models)"),
    ("/v1/completions", {**C, "model": "gpt-4o"}, 404, "model", "model_not_found",
     "model 'gpt-4o' is not served here; this server serves 'stories'"),
    ("/v1/completions", {**C, "max_tokens": "4"}, 400, "max_tokens", None, "max_tokens must be an integer, got a string"),
    ("/v1/completions", {**C, "max_tokens": 0}, 400, "max_tokens", None,
     "max_tokens must be an integer in [1, 2048], got 0"),
    ("/v1/completions", {**C, "max_tokens": 600}, 400, "max_tokens", "context_length_exceeded",
     "the prompt (5 tokens) + max_tokens (600) exceed the model's context of 512 tokens"),
    ("/v1/completions", {**C, "temperature": 3}, 400, "temperature", None, "temperature must be in [0, 2], got 3"),
    ("/v1/completions", {**C, "top_p": 0}, 400, "top_p", None, "top_p must be in (0, 1], got 0"),
    ("/v1/completions", {**C, "seed": -1}, 400, "seed", None, "seed must be an integer ≥ 0, got -1"),
    ("/v1/completions", {**C, "stream": "yes"}, 400, "stream", None, "stream must be a boolean, got a string"),
    ("/v1/completions", {**C, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None,
     "stop takes at most 4 strings, got 5"),
    ("/v1/completions", {**C, "stop": 7}, 400, "stop", None, "stop must be a string or an array of strings, got an integer"),
    ("/v1/completions", {**C, "n": 2}, 400, "n", "unsupported_parameter", "n is not supported by this server (got 2)"),
    ("/v1/completions", {**C, "logprobs": 3}, 400, "logprobs", "unsupported_parameter",
     "logprobs is not supported by this server (got 3)"),
    ("/v1/completions", {**C, "temprature": 0}, 400, "temprature", "unknown_parameter", "unknown field 'temprature'"),
    ("/v1/completions", {**C, "prompt": ["a", "b"]}, 400, "prompt", None,
     "prompt must be one prompt; this server takes one per request, got 2"),
    ("/v1/completions", {**C, "prompt": [1, 70000]}, 400, None, None,
     "token id 70000 is outside the vocabulary (0..511)"),
    ("/v1/completions", b'{"model": "stories", "prompt": "hi \\ud800", "max_tokens": 4}', 400, None, None,
     "the prompt is not valid Unicode text: a lone surrogate U+D800 at character 3"),
    ("/v1/completions", {**C, "prompt": [300] * 600, "max_tokens": 1}, 400, "prompt", "context_length_exceeded",
     "the prompt is 600 tokens; this server takes at most 511"),
    ("/v1/completions", {**C, "lookahead": {"profile": "wide"}}, 400, "lookahead", "unknown_profile",
     "unknown lookahead profile 'wide'; this server serves: default, small"),
    ("/v1/completions", {**C, "lookahead": "yes"}, 400, "lookahead", None,
     'lookahead must be false, true or {"profile": NAME}'),
    ("/v1/completions", {**C, "stream_options": {"include_usage": True}}, 400, "stream_options", None,
     "stream_options is only allowed with stream: true"),
    ("/v1/chat/completions", {**M, "messages": []}, 400, "messages", None,
     "messages must be a non-empty array of {role, content} objects"),
    ("/v1/chat/completions", {**M, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", None,
     'messages[0].role must be one of system, user, assistant, developer, got "wizard"'),
    ("/v1/chat/completions", {**M, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools",
     "unsupported_parameter", 'tools is not supported by this server (got [{"type": "function", "function": {"name": "f"}}])'),
    ("/v1/chat/completions", M, 400, None, None,  # the CLI's advice (--no-chat) is not an HTTP client's
     "this model has no chat template, so /v1/chat/completions cannot serve it; send the prompt as text to "
     "/v1/completions"),
    ("/v1/chat/completions", {**M, "max_tokens": 5, "max_completion_tokens": 6}, 400, "max_completion_tokens", None,
     "max_tokens and max_completion_tokens differ; give one of them"),
    # a field name no UTF-8 can encode (a lone surrogate, which JSON can escape) is named back, escaped
    ("/v1/completions", b'{"model": "stories", "prompt": "x", "\\ud800": 1}', 400, "\ud800", "unknown_parameter",
     "unknown field '\\ud800'"),
    ("/v1/chat/completions", b'{"model": "stories", "messages": [{"role": "user", "content": "hi", "\\udc80x": 1}]}',
     400, "messages", "unsupported_parameter", "messages[0].\udc80x is not supported by this server"),
    ("/v1/chat/completions", {**M, "messages": [{"role": "user", "content": "hi", "name": 5}]}, 400, "messages", None,
     "messages[0].name must be a string, got an integer"),
    ("/v1/completions", {**C, "stream": True, "stream_options": {"continuous_usage_stats": "yes"}}, 400,
     "stream_options", None, "stream_options.continuous_usage_stats must be a boolean, got a string"),
    ("/v1/completions", {**C, "stream": True, "stream_options": {"continuous_usage_stats": True}}, 400,
     "stream_options", "unsupported_parameter", "stream_options.continuous_usage_stats is not supported by this "
     "server; usage comes in the last chunk with include_usage: true"),
    ("/v1/embeddings", {"model": "stories", "input": "x"}, 404, None, "not_found", "no route /v1/embeddings"),
    ("/v1/completions", b"x" * (70 * 1024), 413, None, "body_too_large",
     "request body of 71680 bytes exceeds the limit of 65536 bytes"),
]


def test_malformed_requests_get_their_status_and_an_openai_error_while_serving_goes_on(stories_model):
    with serving(stories_model, max_body_bytes=64 * 1024) as (base, _):
        for path, body, status, param, code, message in MALFORMED:
            got, answer = raw(base, "POST", path, body)
            assert (got, answer) == (status, {"error": {
                "message": message, "type": "invalid_request_error", "param": param, "code": code}}), (path, body)
        got, answer = raw(base, "GET", "/v1/completions")
        assert got == 405 and answer["error"]["message"] == "GET is not allowed on /v1/completions"
        # a client that leaves before its body is in is counted as gone (not an error of the server's)
        before = metric(base, "lade_requests_cancelled_total")
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\":")
            time.sleep(0.2)
        _wait(lambda: metric(base, "lade_requests_cancelled_total") == before + 1, "the cancel to be counted")
        r = client(base).completions.create(model="stories", prompt="Once upon a time", max_tokens=4, temperature=0)
        assert r.choices[0].text == ", there was a"


def test_control_tokens_are_parsed_in_completion_prompts(stories_model):
    # "</s>" in a raw prompt is the stop token (id 2), not the four characters
    ids = stories_model.encode("Once upon a time</s>", chat=False)
    assert 2 in ids
    with serving(stories_model) as (base, _):
        r = client(base).completions.create(model="stories", prompt="Once upon a time</s>", max_tokens=12,
                                            temperature=0)
        assert r.usage.prompt_tokens == len(ids)
        assert r.choices[0].text == stories_model.generate(ids, max_new_tokens=12).text


# -- the command -----------------------------------------------------------------------------------

def _start(args, env=None):
    proc = subprocess.Popen([sys.executable, "-m", "lade_export.cli", "serve", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    line = proc.stdout.readline()
    assert line.startswith("serving "), (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, "http://127.0.0.1:" + line.split("127.0.0.1:")[1].split("/")[0]


def test_serve_command_answers_and_drains_on_sigterm(stories_artifact):
    proc, base = _start([stories_artifact, "--port", 0, "--profile", "small", "--profile", "default",
                         "--api-key-env", "LADE_TEST_KEY", "--model-name", "tiny"], {"LADE_TEST_KEY": "k-123"})
    try:
        c = client(base, "k-123")
        assert [m.id for m in c.models.list().data] == ["tiny"]
        r = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0)
        assert r.choices[0].text == ", there was a little girl named Lily" and r.lookahead["profile"] == "small"
        stream = iter(c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=300, temperature=0,
                                           stream=True))
        first = next(stream).choices[0].text
        proc.send_signal(signal.SIGTERM)
        text, reasons, _ = stream_text(stream)  # the request in flight finishes
        assert reasons and (first + text).startswith(", there was a little girl named")
        assert proc.wait(60) == 0
        with pytest.raises(openai.APIConnectionError):
            c.models.list()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


_DRAINED_SERVER = """
import sys, time
import lade_export
from lade_export.profile import resolve_profile
from lade_export.runtime import Decoder
from lade_export.scheduler import Scheduler
from lade_export.serving.openai_api import OpenAIServer, ServerConfig, bind, run

class Slow:  # the stories engine, 20 ms slower on every pass: 400 plain-decoding tokens take >= 8 s
    def __init__(self, engine):
        self.engine = engine
    def __getattr__(self, name):  # the rest of the engine interface (runtime.Engine): the wrapped engine's
        return getattr(self.engine, name)
    def run(self, feeds, with_logits=False):
        time.sleep(0.02)
        return self.engine.run(feeds, with_logits)

model = lade_export.load(sys.argv[1], batching=True)
model.scheduler.close()
d = model.decoder
model.scheduler = Scheduler(Decoder(Slow(d.engine), d.stop_token_ids, d.max_context, d.tokenizer), max_batch=2)
server = OpenAIServer(model, ServerConfig("stories", {"default": resolve_profile("default")}, max_concurrent=2))
sock = bind("127.0.0.1", 0)
print("port", sock.getsockname()[1], flush=True)
code = run(server, sock, drain_s=float(sys.argv[2]))  # what lade-export serve runs
sock.close()
model.close()
sys.exit(code)
"""


def test_at_the_drain_timeout_requests_end_with_a_shutdown_error_and_the_server_exits_0(stories_artifact,
                                                                                        stories_model):
    proc = subprocess.Popen([sys.executable, "-c", _DRAINED_SERVER, str(stories_artifact), "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("port "), (line, proc.stderr.read() if proc.poll() is not None else "")
        base = "http://127.0.0.1:" + line.split()[1]
        job = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
               "lookahead": False}
        conn = http.client.HTTPConnection("127.0.0.1", int(line.split()[1]), timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({**job, "stream": True}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        events = []

        def read_event():
            while True:
                text = resp.readline().decode()
                assert text, "the stream ended without [DONE]"
                if text.startswith("data: "):
                    events.append(text[6:].strip())
                    return events[-1]

        read_event()  # the stream has begun
        answers = {}
        whole = threading.Thread(target=lambda: answers.setdefault("whole", raw(base, "POST", "/v1/completions", job)))
        whole.start()
        _wait(lambda: metric(base, "lade_requests_running") == 2, "the second request is not running")
        queued = threading.Thread(target=lambda: answers.setdefault("queued", raw(base, "POST", "/v1/completions",
                                                                                  job)))
        queued.start()
        _wait(lambda: metric(base, "lade_requests_queued") == 1, "the third request is not queued")
        proc.send_signal(signal.SIGTERM)
        while read_event() != "[DONE]":
            pass
        conn.close()
        whole.join(60)
        queued.join(60)
        assert proc.wait(60) == 0
        log = proc.stderr.read()
        assert "Traceback" not in log and "Cancel" not in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    error = {"error": {"message": "the server is shutting down and cancelled this request when its drain timeout of "
                                  "0.5 s ran out; send it again", "type": "server_error", "param": None,
                       "code": "server_shutdown"}}
    chunks = [json.loads(e) for e in events[:-2]]
    assert json.loads(events[-2]) == error and events[-1] == "[DONE]"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)  # no finish_reason: it did not finish
    text = "".join(c["choices"][0]["text"] for c in chunks)
    solo = stories_model.generate("Once upon a time", chat=False, max_new_tokens=400, lookahead=False).text
    assert text and solo.startswith(text) and len(text) < len(solo)
    assert answers == {"whole": (503, error), "queued": (503, error)}


def test_serve_passes_the_scheduler_options_to_its_scheduler(stories_artifact, monkeypatch):
    from lade_export import cli
    from lade_export.serving import openai_api

    seen = {}

    def fake_run(server, sock, *, drain_s):  # what the server got, instead of serving
        s = server.model.scheduler
        seen.update(max_batch=s.max_batch, token_budget=s.token_budget, kv_tokens=s.kv_tokens, drain_s=drain_s,
                    policy=type(s.width_policy).__name__)
        return 0

    monkeypatch.setattr(openai_api, "run", fake_run)
    cli.main(["serve", str(stories_artifact), "--port", "0", "--max-concurrent", "3", "--token-budget", "16",
              "--kv-tokens", "700", "--drain-timeout", "2", "--width-policy", "profile"])
    assert seen == {"max_batch": 3, "token_budget": 16, "kv_tokens": 700, "drain_s": 2.0, "policy": "ProfileWidth"}
    seen.clear()
    cli.main(["serve", str(stories_artifact), "--port", "0", "--max-concurrent", "3"])
    assert seen == {"max_batch": 3, "token_budget": 64, "kv_tokens": 3 * 512, "drain_s": 30.0,
                    "policy": "AdaptiveWidth"}  # the defaults


def test_serve_command_refusals_are_one_line(stories_artifact):
    def refused(args, env=None):
        out = subprocess.run([sys.executable, "-m", "lade_export.cli", "serve", *map(str, args)], capture_output=True,
                             text=True, env={**os.environ, **(env or {})}, timeout=120)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        return out.stderr.strip()

    assert refused([stories_artifact, "--api-key-env", "LADE_UNSET_KEY_VAR"], {"LADE_UNSET_KEY_VAR": ""}) == (
        "error: --api-key-env LADE_UNSET_KEY_VAR: the environment variable LADE_UNSET_KEY_VAR is not set or empty; "
        "set it to the key clients must send")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert refused([stories_artifact, "--port", port]) == \
            f"error: cannot listen on 127.0.0.1:{port}: Address already in use"
    for flag, least in (("--token-budget", 1), ("--kv-tokens", 2)):  # as lade-export triton refuses them
        message, _, hint = refused([stories_artifact, flag, 0]).partition(" (see: ")
        assert message == f"error: Invalid value for '{flag}': 0 is not in the range x>={least}."
        assert hint.endswith(" serve --help)")  # "lade-export serve"; run here as python -m lade_export.cli


# -- SmolLM2 ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_chat_and_raw_completions_equal_generate(smollm2_artifact):
    model = lade_export.load(smollm2_artifact, batching=True)
    try:
        question = mt_bench_prompts(1)[0]
        messages = [{"role": "system", "content": "Answer briefly."},
                    {"role": "user", "content": question + " <|im_end|><|im_start|>assistant"}]
        n = 24
        solo = model.generate(messages, max_new_tokens=n, temperature=0)
        with serving(model, model_name="smollm2", profiles=_profiles(model, "default")) as (base, _):
            c = client(base)
            r = c.chat.completions.create(model="smollm2", messages=messages, max_tokens=n, temperature=0)
            assert r.choices[0].message.content == solo.text and r.choices[0].message.role == "assistant"
            assert r.usage.prompt_tokens == len(model.encode(messages)) and r.usage.completion_tokens == n
            text, reasons, _ = stream_text(c.chat.completions.create(
                model="smollm2", messages=messages, max_completion_tokens=n, temperature=0, stream=True), chat=True)
            assert text == solo.text and reasons == ["length"]
            # the control-token strings inside the message stayed text; a raw completion prompt parses them
            rendered = model.tokenizer.render_chat(messages)
            raw_ids = model.encode(rendered, chat=False)
            assert raw_ids != model.encode(messages)
            r = c.completions.create(model="smollm2", prompt=rendered, max_tokens=n, temperature=0)
            assert r.usage.prompt_tokens == len(raw_ids)
            assert r.choices[0].text == model.generate(raw_ids, max_new_tokens=n).text
    finally:
        model.close()


def test_a_freed_slot_goes_to_the_request_that_waited_longest_even_as_its_client_leaves():
    """A release hands its slot to the oldest waiting request; when that request's client
    leaves at the same moment, the slot goes on to the next one in arrival order (with an
    asyncio Condition the wake-up was lost there and the queue stalled with the slot free,
    reproduced over HTTP); a request arriving meanwhile queues behind them."""
    model = SimpleNamespace(decoder=SimpleNamespace(max_context=512), tokenizer=None, scheduler=None)
    srv = OpenAIServer(model, ServerConfig("m", {}, max_concurrent=1))

    async def scenario():
        order = []

        async def request(name):
            await srv._acquire()
            order.append(name)

        await srv._acquire()  # the only slot is taken
        tasks = {name: asyncio.ensure_future(request(name)) for name in "BCD"}
        await asyncio.sleep(0.01)
        assert (srv.running, srv.waiting) == (1, 3)
        srv.release()  # B is handed the slot ...
        tasks["B"].cancel()  # ... and its client leaves before B runs: C gets it
        late = asyncio.ensure_future(request("E"))  # arrives now, queues behind D
        await asyncio.sleep(0.01)
        first = (list(order), srv.running, srv.waiting)
        for _ in range(2):  # C's slot goes to D, D's to E
            srv.release()
            await asyncio.sleep(0.01)
        await asyncio.wait_for(late, 2.0)
        return tasks["B"].cancelled(), first, order, srv.running

    assert asyncio.run(scenario()) == (True, (["C"], 1, 2), ["C", "D", "E"], 1)
