"""llama.cpp's ``llama-server`` as the serving peer of the closed-loop benchmarks.

``llama-server`` is llama.cpp's HTTP server: ``-np N`` slots share one continuous batch
(every slot's next token in one ``llama_decode``), and ``--spec-type ngram-simple`` adds
its draft-model-free n-gram speculation per slot. It runs here at its best on this CPU:
the binary built by ``bench/build_llama_cpp.sh`` (``--isa best``: AVX-512, VNNI, VBMI,
BF16), the Q4_1 GGUF that ships SmolLM2 (the same weights as the lade int4 builds, quantized
by llama.cpp's own tools), ``-t``/``-tb`` = the cores, ``-c`` = 2048 tokens per slot,
flash attention as llama.cpp chooses (``auto``).

Requests are sent as **token ids** (``/completion`` takes ``"prompt": [ids]``), the ids the
lade-export runtime feeds for the same chat prompt (SmolLM2's chat template rendered by the
artifact's tokenizer), so both engines see identical prompts. Greedy: ``temperature`` 0
(llama.cpp then takes the argmax), streamed, ``cache_prompt`` false (no reuse of another
request's prefix: lade-export has none either). A request ends at ``n_predict`` tokens or at
the model's end-of-generation token, as lade-export's does.

Only the Python standard library is used (``http.client``), so the peer adds no dependency;
except :func:`chat_stream`, the client of ``bench/serve_http.py``: a streamed chat
completion through any OpenAI-compatible endpoint (llama-server's ``/v1/chat/completions``,
``lade-export serve``'s) with the official ``openai`` package (the ``test`` extra), so
both servers are timed by the same client code. There the server applies the chat
template itself (llama-server: the GGUF's, by its jinja engine);
:meth:`LlamaServer.chat_prompt_ids` says which ids that gives.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

#: llama-server's default binary (bench/build_llama_cpp.sh's output folder).
# $LADE_LLAMA_CPP names the folder of the binaries, as for `lade-export compare --peer llama.cpp-*`
# (bench/build_llama_cpp.sh prints it: PREFIX/bin)
DEFAULT_BIN = Path(os.environ.get("LADE_LLAMA_CPP") or Path.home() / ".cache/lade-export/llama.cpp/bin")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A running ``llama-server`` (a context manager: started on enter, stopped on exit).

    Args:
        gguf: the GGUF file.
        slots: ``-np``, the continuous batch's width (the benchmark's concurrency).
        threads: ``-t`` and ``-tb``.
        ngram: True adds ``--spec-type ngram-simple`` (its default sizes).
        ctx_per_slot: tokens of KV cache per slot (``-c`` = slots × this).
        binary: the ``llama-server`` executable.

    Raises:
        RuntimeError: the server exits or does not answer ``/health`` within 120 s (its
            log's last lines in the message).
    """

    def __init__(self, gguf: Path, slots: int, threads: int, ngram: bool = False, ctx_per_slot: int = 2048,
                 binary: Path | None = None):
        self.binary = Path(binary) if binary else DEFAULT_BIN / "llama-server"
        self.port = free_port()
        self.args = [str(self.binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                     "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot),
                     "--no-webui"]
        if ngram:
            self.args += ["--spec-type", "ngram-simple"]
        self.proc = None
        self.log = b""

    def describe(self) -> str:
        """The command line, for reports."""
        return " ".join(a if "/" not in a else Path(a).name for a in self.args)

    def __enter__(self) -> "LlamaServer":
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        reader = threading.Thread(target=self._drain, daemon=True)
        reader.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: "
                                   f"{self.log.decode(errors='replace')[-800:]}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return self
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise RuntimeError(f"llama-server did not become healthy in 120 s: {self.log.decode(errors='replace')[-800:]}")

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.log = (self.log + line)[-20000:]

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    @property
    def base_url(self) -> str:
        """Its OpenAI-compatible API root, ``http://127.0.0.1:PORT/v1``."""
        return f"http://127.0.0.1:{self.port}/v1"

    def _post(self, path: str, body: dict) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            raise RuntimeError(f"llama-server {path} answered {resp.status}: {data[:300]!r}")
        return json.loads(data)

    def chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        """The token ids llama-server decodes for chat ``messages`` on
        ``/v1/chat/completions``: its chat template (``POST /apply-template``), then its
        tokenizer (``POST /tokenize``, control tokens parsed, BOS as the GGUF says).

        Args:
            messages: ``[{"role", "content"}]``.

        Raises:
            RuntimeError: the server answers with another status than 200.
        """
        text = self._post("/apply-template", {"messages": messages})["prompt"]
        return [int(t) for t in self._post("/tokenize", {"content": text, "add_special": True,
                                                          "parse_special": True})["tokens"]]

    def stream(self, prompt_ids: list[int], max_new_tokens: int):
        """Stream one greedy completion; yields ``(perf_counter time, new token count)`` per
        event, the last one with the server's final counts.

        Returns (as the generator's value): the generated text's token count
        (``tokens_predicted``).
        """
        body = json.dumps({"prompt": [int(t) for t in prompt_ids], "n_predict": int(max_new_tokens),
                           "temperature": 0.0, "stream": True, "cache_prompt": False,
                           "return_tokens": True}).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"llama-server answered {resp.status}: {resp.read()[:300]!r}")
        ids: list[int] = []
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            event = json.loads(line[5:])
            tokens = event.get("tokens") or []
            ids += tokens
            yield time.perf_counter(), len(tokens)
            if event.get("stop"):
                break
        conn.close()
        return ids


def run_level(server: LlamaServer, prompt_ids: list[list[int]], concurrency: int, total: int, max_new_tokens: int):
    """One closed loop against ``server`` (:func:`serve_load.closed_loop`, as
    ``serve_batched.run_level``): returns per-request records and the wall time (s)."""
    from serve_load import closed_loop

    def send(ids_in, _state):
        t_send = time.perf_counter()
        marks = []
        gen = server.stream(ids_in, max_new_tokens)
        ids = []
        try:
            while True:
                marks.append(next(gen))
        except StopIteration as done:
            ids = done.value or []
        counted = [(t, k) for t, k in marks if k]
        first = counted[0][0] if counted else marks[-1][0]
        later = sum(k for _, k in counted[1:])
        return {"ids": ids, "ttft_s": first - t_send, "tpot_s": (counted[-1][0] - first) / later if later else None,
                "steps": max(len(counted), 1)}

    return closed_loop(send, prompt_ids, concurrency, total)



def chat_stream(client, model: str, messages: list[dict], max_tokens: int, extra_body: dict | None = None) -> dict:
    """One streamed greedy chat completion (``temperature`` 0) through an OpenAI-compatible
    ``/v1/chat/completions``, timed on the client.

    Args:
        client: an ``openai.OpenAI`` client whose ``base_url`` is the server's ``/v1``.
        model: the ``model`` field (the served id; llama-server takes any).
        messages: ``[{"role", "content"}]``; the server applies its chat template.
        max_tokens: the request's ``max_tokens``.
        extra_body: fields outside the OpenAI schema (``{"lookahead": ...}`` for
            lade-export serve, ``{"cache_prompt": False}`` for llama-server).

    Returns:
        dict: ``text`` (the streamed content, joined); ``ttft_s`` (seconds from sending
        the request to the first chunk with non-empty content); ``tpot_s`` (per-token
        latency: seconds from that chunk to the chunk carrying ``finish_reason``, over
        ``completion_tokens`` − 1; None for a one-token answer); ``completion_tokens`` and
        ``prompt_tokens`` (the server's ``usage``, asked for by
        ``stream_options.include_usage``); ``finish_reason``; ``chunks`` (content chunks);
        ``lookahead`` (lade-export's extension field of the last chunk, else None).

    Raises:
        RuntimeError: the stream ends without a finish reason or without usage.
        openai.APIError: the server refuses the request or the connection fails.
    """
    t_send = time.perf_counter()
    parts: list[str] = []
    t_first = t_end = None
    usage = reason = lookahead = None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=int(max_tokens),
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body=extra_body or None)
    with stream:
        for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage
            extension = getattr(chunk, "lookahead", None)
            if extension is not None:
                lookahead = extension
            for choice in chunk.choices:
                content = choice.delta.content if choice.delta is not None else None
                if content:
                    parts.append(content)
                    if t_first is None:
                        t_first = now
                if choice.finish_reason is not None:
                    reason, t_end = choice.finish_reason, now
    if reason is None or usage is None:
        raise RuntimeError(f"the stream from {client.base_url} ended without "
                           f"{'a finish_reason' if reason is None else 'usage'}")
    n = int(usage.completion_tokens)
    if t_first is None:  # nothing but empty text (e.g. only a stop token)
        t_first = t_end
    return {"text": "".join(parts), "ttft_s": t_first - t_send,
            "tpot_s": (t_end - t_first) / (n - 1) if n > 1 else None, "completion_tokens": n,
            "prompt_tokens": int(usage.prompt_tokens), "finish_reason": reason, "chunks": len(parts),
            "lookahead": lookahead}
