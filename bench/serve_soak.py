"""A soak: many short requests, some dropped early, and the resident memory as they go.

Six client threads (``--clients``) send ``--requests`` short requests (4–24 new tokens, a chat
prompt of ``bench/prompts/chat.jsonl`` each), and about ``--drop`` of them stop reading after a
few chunks and close their stream. Every ``--every`` requests it prints the resident set size
(RSS, MiB) of the process that decodes:

* ``--mode scheduler``: this process, one ``lade_export.load(ARTIFACT, batching=True)`` model,
  streams through its scheduler, greedy or the artifact's profile at random (and the KV pool's
  MiB and columns in use);
* ``--mode http``: a ``lade-export serve ARTIFACT`` child process on a free port (its output
  to ``serve-soak-server.log`` in the working folder), streamed chat completions through the
  official ``openai`` client, the server's default profile (the server's RSS from /proc).

A request that fails is printed and counted; the run exits 1 if any did or the server died.

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--mode", choices=["scheduler", "http"], default="scheduler")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--every", type=int, default=100, help="print RSS every this many requests (≥ 1)")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--drop", type=float, default=0.4, help="share of streams closed after a few chunks")
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    if args.every < 1 or args.requests < 1 or args.clients < 1:
        parser.error("--every, --requests and --clients must be ≥ 1")
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text(encoding="utf-8").splitlines() if line.strip()]

    from lade_export.errors import GenerationError

    server = model = log = None
    refused: tuple = (GenerationError,)  # a request refused or failed: counted, the soak goes on
    if args.mode == "http":
        import openai  # before the server starts: a missing client leaves no server behind

        refused = (openai.APIError,)
        from lade_export.serving.local import free_ports

        [port] = free_ports(1)
        log = open("serve-soak-server.log", "w")
        server = subprocess.Popen([sys.executable, "-m", "lade_export.cli", "serve", str(args.artifact), "--port",
                                   str(port)], stdout=log, stderr=subprocess.STDOUT, text=True)
        model_id = args.artifact.resolve().name
        pid = server.pid
    else:
        import lade_export

        model = lade_export.load(args.artifact, batching=True)
        pid = "self"

    lock = threading.Lock()
    started, ended, failed = [0], [0], [0]

    def report(k: int) -> None:
        if model is not None:
            gc.collect()
            pool = model.scheduler.pool
            print(f"{k} requests: RSS {rss_mb(pid):.1f} MiB; KV pool {pool.nbytes / 2**20:.1f} MiB, {pool.used} "
                  f"columns in use", flush=True)
        else:
            print(f"{k} requests: server RSS {rss_mb(pid):.1f} MiB", flush=True)

    def client(seed: int) -> None:
        rng = random.Random(seed)
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused") if server else None
        try:
            while True:
                with lock:
                    if started[0] >= args.requests:
                        return
                    started[0] += 1
                    k = started[0]
                prompt, new = rng.choice(prompts), rng.randint(4, 24)
                cut = rng.randint(1, 4) if rng.random() < args.drop else None
                stream = None
                try:
                    if api is not None:
                        stream = api.chat.completions.create(model=model_id, max_tokens=new, stream=True,
                                                             messages=[{"role": "user", "content": prompt}])
                    else:
                        stream = model.stream(prompt, max_new_tokens=new, profile=rng.choice([None, "greedy"]))
                    for i, _ in enumerate(stream):
                        if cut is not None and i + 1 >= cut:
                            break
                except refused as err:
                    with lock:
                        failed[0] += 1
                    print(f"request {k}: {type(err).__name__}: {err}", flush=True)
                finally:
                    if stream is not None:
                        stream.close()
                with lock:
                    ended[0] += 1
                if k % args.every == 0:
                    report(k)
        finally:
            if api is not None:
                api.close()

    try:
        if server is not None:  # ready when its port takes connections (or the server is gone)
            deadline = time.monotonic() + 120
            while server.poll() is None and time.monotonic() < deadline:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=1):
                        break
                except OSError:
                    time.sleep(0.2)
            if server.poll() is not None:
                log.flush()
                sys.exit(f"the server exited with status {server.returncode} before serving; see serve-soak-server.log")
        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(args.seed + i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        died = server is not None and server.poll() is not None
        print(f"{ended[0]} requests in {time.perf_counter() - t0:.0f} s, {failed[0]} failed"
              + ("; the server died" if died else ""), flush=True)
        code = 1 if failed[0] or died else 0
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
            log.close()
        if model is not None:
            model.close()
    sys.exit(code)


if __name__ == "__main__":
    main()
