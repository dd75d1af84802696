"""Load benchmark of a lade-export model behind a real tritonserver (streaming gRPC).

Writes a Triton repository for ARTIFACT in a temporary folder, starts the server from
the nvidia-pytriton wheel on free local ports (lade_export.serving.local), and for each
concurrency level keeps that many streamed requests in flight (a closed loop: a new
request starts when one ends) until --requests have finished. Per level it reports:

* throughput: new tokens of all requests / wall time of the level (tokens/s);
* time to first token (TTFT): send → first response with a token, p50 and p99;
* per-token latency (TPOT): (last response − first token response) / tokens after the
  first response, per request, p50 and p99;
* compression: new tokens / decode steps (lookahead's tokens per step).

Usage (needs the serve extra and `pip install --no-deps nvidia-pytriton==0.7.0`):

    python bench/serve_load.py artifacts/smollm2 --dataset mt_bench --max-new-tokens 64 \\
        --instances 2 --concurrency 1 2 4 8 --requests 16 --out bench/results/serving-smollm2.json

Prints a markdown table; --out also keeps every request's figures as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STORY_PROMPTS = [
    "Once upon a time", "The little dog", "Lily and Tom went to the park", "One day, a bird",
    "Tim had a red ball", "There was a big tree", "Sara found a box", "The sun was hot and",
]


def percentile(values, q):
    """The q-th percentile (0-100) with linear interpolation between order statistics."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def write_report(report: dict, path) -> None:
    """Write a benchmark's JSON report to ``path`` (its folder made if missing); None: nothing."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")


def closed_loop(send, items, concurrency: int, total: int):
    """A closed loop: ``concurrency`` threads, each calling ``send(items[i % len(items)],
    state)`` for the next request index ``i`` until ``total`` requests are done (a new one
    starts as soon as one ends); returns (records in request order, wall seconds).

    ``send`` is ``(item, state) -> record`` (a dict; its ``"prompt"`` is set to
    ``i % len(items)``); ``state`` is a per-thread dict (e.g. an HTTP client kept across the
    thread's requests: ``state["client"]`` is closed when the thread ends). The first
    exception stops the run and is raised."""
    records = [None] * total
    counter = iter(range(total))
    lock = threading.Lock()
    errors = []

    def client():
        state = {}
        try:
            while not errors:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                record = send(items[i % len(items)], state)
                record["prompt"] = i % len(items)
                records[i] = record
        except BaseException as err:  # noqa: BLE001 - reported by the caller
            errors.append(err)
        finally:
            if "client" in state:
                state["client"].close()

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return records, time.perf_counter() - t0


def machine() -> dict:
    import onnxruntime

    from lade_export.evaluation.report import environment

    return {"cpu": environment()["cpu"], "cores": os.cpu_count(), "python": platform.python_version(),
            "onnxruntime": onnxruntime.__version__, "platform": platform.platform()}


async def run_level(url, model, prompts, concurrency, total, max_new_tokens, profile):
    from tritonclient.grpc.aio import InferenceServerClient

    from lade_export.serving.client import stream_generate

    client = InferenceServerClient(url)
    results = []
    sem = asyncio.Semaphore(concurrency)

    async def one(i):
        async with sem:
            out = await stream_generate(client, model, prompt=prompts[i % len(prompts)], max_new_tokens=max_new_tokens,
                                        profile=profile, request_id=f"c{concurrency}-{i}")
            results.append(out)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(total)))
    wall = time.perf_counter() - t0
    await client.close()
    errors = [r.error for r in results if r.error]
    if errors:
        raise SystemExit(f"error responses at concurrency {concurrency}: {errors[:3]}")
    tokens = sum(len(r.token_ids) for r in results)
    ttft = [r.first_token_s for r in results]
    tpot = [r.per_token_s for r in results if r.per_token_s is not None]
    steps = sum(r.stats["steps"] for r in results)
    return {
        "concurrency": concurrency, "requests": len(results), "wall_s": wall, "new_tokens": tokens,
        "throughput_tok_s": tokens / wall,
        "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "tpot_p50_ms": 1e3 * percentile(tpot, 50), "tpot_p99_ms": 1e3 * percentile(tpot, 99),
        "compression": tokens / steps if steps else 0.0,
        "instances_used": sorted({r.stats["instance"] for r in results}),
        "per_request": [{"tokens": len(r.token_ids), "ttft_s": r.first_token_s, "tpot_s": r.per_token_s,
                         "steps": r.stats["steps"], "instance": r.stats["instance"]} for r in results],
    }


def in_process_baseline(artifact, prompts, n, max_new_tokens, profile, threads) -> dict:
    """The same requests one at a time through the in-process API (no server): what the
    server's figures at concurrency 1 compare with."""
    import lade_export

    with lade_export.load(artifact, threads=threads or None) as model:
        model.generate(prompts[0], max_new_tokens=8, profile=profile)  # warm-up
        runs = []
        t0 = time.perf_counter()
        for i in range(n):
            chunks, t_send = [], time.perf_counter()
            for chunk in model.stream(prompts[i % len(prompts)], max_new_tokens=max_new_tokens, profile=profile):
                chunks.append((time.perf_counter(), len(chunk.token_ids)))
            first = next(j for j, (_, k) in enumerate(chunks) if k)
            later = sum(k for _, k in chunks[first + 1:])
            runs.append({"tokens": sum(k for _, k in chunks), "ttft_s": chunks[first][0] - t_send,
                         "tpot_s": (chunks[-1][0] - chunks[first][0]) / later if later else None})
        wall = time.perf_counter() - t0
    tpot = [r["tpot_s"] for r in runs if r["tpot_s"] is not None]
    return {"requests": n, "wall_s": wall, "new_tokens": sum(r["tokens"] for r in runs),
            "throughput_tok_s": sum(r["tokens"] for r in runs) / wall,
            "ttft_p50_ms": 1e3 * percentile([r["ttft_s"] for r in runs], 50),
            "tpot_p50_ms": 1e3 * percentile(tpot, 50)}


def render(report: dict) -> str:
    """The markdown of one run (what --out keeps, as JSON)."""
    m = report["machine"]
    lines = [f"`{report['command']}`", "",
             f"{m['cpu']}, {m['cores']} cores; Python {m['python']}, ONNX Runtime {m['onnxruntime']}; Triton "
             f"{report['triton']}; load average (1 min) {report['load_average_before'][0]:.2f} before, "
             f"{report['load_average_after'][0]:.2f} after", "",
             "| concurrency | requests | tokens | throughput (tok/s) | TTFT p50 / p99 (ms) | per-token p50 / p99 (ms) | "
             "tokens/step | instances used |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    base = report.get("in_process_baseline")
    if base:
        lines.append(f"| in-process, 1 at a time | {base['requests']} | {base['new_tokens']} | "
                     f"{base['throughput_tok_s']:.1f} | {base['ttft_p50_ms']:.1f} / – | {base['tpot_p50_ms']:.2f} / – | "
                     "– | – |")
    for lv in report["levels"]:
        lines.append(f"| {lv['concurrency']} | {lv['requests']} | {lv['new_tokens']} | {lv['throughput_tok_s']:.1f} | "
                     f"{lv['ttft_p50_ms']:.1f} / {lv['ttft_p99_ms']:.1f} | {lv['tpot_p50_ms']:.2f} / "
                     f"{lv['tpot_p99_ms']:.2f} | {lv['compression']:.2f} | {len(lv['instances_used'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", nargs="?")
    ap.add_argument("--dataset", default="stories", help="stories (built-in openings), mt_bench, humaneval, gsm8k")
    ap.add_argument("--prompts", type=int, default=16, help="distinct prompts, cycled")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--instances", type=int, default=1)
    ap.add_argument("--profile", default=None, help="profile of every request (default: the model's)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    ap.add_argument("--threads", type=int, default=0, help="engine threads per instance (0: the engine's default)")
    ap.add_argument("--baseline", type=int, default=4, help="requests run in-process first, one at a time (0: none)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--render", type=Path, default=None, help="print the markdown of a saved --out JSON and exit")
    args = ap.parse_args(argv)
    if args.render:
        print(render(json.loads(args.render.read_text())))
        return 0

    from lade_export.serving.local import LocalTritonServer
    from lade_export.serving.repository import write_model_repository

    if args.dataset == "stories":
        prompts = STORY_PROMPTS[: args.prompts]
    else:
        from lade_export.evaluation.datasets import load_prompts

        prompts = [p.text for p in load_prompts(args.dataset, limit=args.prompts)]
    load_before = os.getloadavg()
    baseline = None
    if args.baseline:
        baseline = in_process_baseline(args.artifact, prompts, args.baseline, args.max_new_tokens, args.profile,
                                       args.threads)
    work = Path(tempfile.mkdtemp(prefix="lade-serve-bench-"))
    write_model_repository(args.artifact, work / "repo", name="bench", instances=args.instances, threads=args.threads,
                           max_concurrent_requests=max(args.concurrency))
    try:
        with LocalTritonServer(work / "repo", work / "run") as server:
            with urllib.request.urlopen(server.http_url + "/v2", timeout=5) as resp:
                triton_version = json.loads(resp.read())["version"]
            asyncio.run(run_level(server.grpc_url, "bench", prompts, args.instances, 2 * args.instances,
                                  args.max_new_tokens, args.profile))  # warm-up: every instance runs twice
            levels = [asyncio.run(run_level(server.grpc_url, "bench", prompts, c, args.requests, args.max_new_tokens,
                                            args.profile)) for c in args.concurrency]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {
        "command": "python bench/serve_load.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(), "triton": triton_version, "load_average_before": load_before,
        "load_average_after": os.getloadavg(), "artifact": str(args.artifact), "dataset": args.dataset,
        "max_new_tokens": args.max_new_tokens, "instances": args.instances, "profile": args.profile or "(model default)",
        "in_process_baseline": baseline, "levels": levels,
    }
    write_report(report, args.out)
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
