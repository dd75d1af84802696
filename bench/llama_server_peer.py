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

Only the Python standard library is used (``http.client``), so the peer adds no dependency.
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
DEFAULT_BIN = Path(os.environ.get("LADE_LLAMA_CPP", Path.home() / ".cache/lade-export/llama.cpp")) / "bin"


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
    """One closed loop against ``server`` (as ``serve_batched.run_level``): ``concurrency``
    client threads, ``total`` requests; returns per-request records and the wall time (s)."""
    records = [None] * total
    counter = iter(range(total))
    lock = threading.Lock()

    def client():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            t_send = time.perf_counter()
            marks = []
            gen = server.stream(prompt_ids[i % len(prompt_ids)], max_new_tokens)
            ids = []
            try:
                while True:
                    marks.append(next(gen))
            except StopIteration as done:
                ids = done.value or []
            counted = [(t, k) for t, k in marks if k]
            first = counted[0][0] if counted else marks[-1][0]
            later = sum(k for _, k in counted[1:])
            records[i] = {"prompt": i % len(prompt_ids), "ids": ids, "ttft_s": first - t_send,
                          "tpot_s": (counted[-1][0] - first) / later if later else None,
                          "steps": max(len(counted), 1)}

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - t0
