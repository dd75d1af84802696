"""A soak: many short requests, some dropped early, and the resident memory as they go.

Six client threads (``--clients``) send ``--requests`` short requests (4–24 new tokens, a chat
prompt of ``bench/prompts/chat.jsonl`` each, greedy or the artifact's profile), and about
``--drop`` of them stop reading after a few chunks and close their stream. Every
``--every`` requests it prints the resident set size (RSS) of the process that decodes:

* ``--mode scheduler``: this process, one ``lade_export.load(ARTIFACT, batching=True)`` model,
  streams through its scheduler (and the KV pool's bytes and columns in use);
* ``--mode http``: a ``lade-export serve ARTIFACT`` child process on a free port, streamed chat
  completions through the official ``openai`` client (the server's RSS from /proc).

What to read: whether RSS levels off after a warm-up, and by how much it still moves over the
last thousand requests (``bench/results/serving.md``). A benchmark, not a test (Linux only).

Usage:
    python bench/serve_soak.py ARTIFACT [--mode scheduler|http] [--requests 3000] [--every 100]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPTS = Path(__file__).resolve().parent / "prompts" / "chat.jsonl"


def rss_mb(pid: int | str = "self") -> float:
    """Resident set size of process ``pid`` in MiB (Linux: /proc/PID/status, VmRSS)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--mode", choices=["scheduler", "http"], default="scheduler")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--every", type=int, default=100, help="print RSS every this many requests")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--drop", type=float, default=0.4, help="share of streams closed after a few chunks")
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text(encoding="utf-8").splitlines() if line.strip()]

    from lade_export.errors import GenerationError

    server = model = None
    refused: tuple = (GenerationError,)  # a request refused or failed: the soak goes on
    if args.mode == "http":
        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "lade_export.cli", "serve", str(args.artifact), "--port",
                                   str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        print(server.stdout.readline().strip(), flush=True)  # "serving 'NAME' at http://…"
        import openai

        model_id = args.artifact.resolve().name
        pid = server.pid
        refused = (openai.APIError,)
    else:
        import lade_export

        model = lade_export.load(args.artifact, batching=True)
        pid = "self"

    lock = threading.Lock()
    started = [0]

    def report(k: int) -> None:
        if model is not None:
            gc.collect()
            pool = model.scheduler.pool
            print(f"{k} requests: RSS {rss_mb(pid):.1f} MB; KV pool {pool.nbytes / 2**20:.1f} MB, {pool.used} "
                  f"columns in use", flush=True)
        else:
            print(f"{k} requests: server RSS {rss_mb(pid):.1f} MB", flush=True)

    def client(seed: int) -> None:
        rng = random.Random(seed)
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused") if server else None
        while True:
            with lock:
                if started[0] >= args.requests:
                    return
                started[0] += 1
                k = started[0]
            prompt, new = rng.choice(prompts), rng.randint(4, 24)
            cut = rng.randint(1, 4) if rng.random() < args.drop else None
            if api is not None:
                stream = api.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompt}],
                                                     max_tokens=new, stream=True)
            else:
                stream = model.stream(prompt, max_new_tokens=new, profile=rng.choice([None, "greedy"]))
            try:
                for i, _ in enumerate(stream):
                    if cut is not None and i + 1 >= cut:
                        break
            except refused as err:
                print(f"request {k}: {err}", flush=True)
            finally:
                stream.close()
            if k % args.every == 0:
                report(k)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(args.seed + i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"{args.requests} requests in {time.perf_counter() - t0:.0f} s", flush=True)
    if server is not None:
        server.terminate()
        server.wait(timeout=60)
    else:
        model.close()


if __name__ == "__main__":
    main()
