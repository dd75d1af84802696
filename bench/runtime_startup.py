"""Start-up and concurrency of the embeddable runtime (a benchmark, not a test).

Measures, for a built artifact (SmolLM2 by default in bench/runtime_startup.sh):

1. cold-process time to first token: ``lade-export generate ART --max-new-tokens 1``
   from process spawn to the first byte of text on stdout, for each interpreter given
   (the thin install and the full one), median of several runs;
2. the runtime's import time (``import lade_export.api``) and resident memory after
   loading the artifact and generating, per interpreter, next to what importing torch and
   transformers would add (the full interpreter only);
3. aggregate decode tokens/s of 1, 2 and 4 concurrent requests on one loaded engine
   (threads in one process, greedy and lookahead), with the same prompts each time.

Usage:
    python bench/runtime_startup.py ART --python thin=/tmp/thin/bin/python --python full=.venv/bin/python \
        [--runs 5] [--max-new-tokens 128] [--out bench/results/runtime.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = ["Name three rivers in Europe and one fact about each.", "Explain what a hash map is in two sentences.",
           "Write a haiku about autumn.", "Give me a recipe for pancakes.", "What causes the seasons on Earth?",
           "List four prime numbers and explain why they are prime.", "Describe the water cycle briefly.",
           "What is the difference between weather and climate?"]

PROBE = r"""
import json, os, sys, time
t0 = time.perf_counter()
import lade_export.api
t_import = time.perf_counter() - t0
heavy = None
if sys.argv[2] == "heavy":
    t1 = time.perf_counter()
    import torch, transformers  # noqa: F401  what a torch-based runtime would pay on top
    heavy = time.perf_counter() - t1
t2 = time.perf_counter()
model = lade_export.api.load(sys.argv[1])
t_load = time.perf_counter() - t2
model.generate("Hello!", max_new_tokens=16)
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
kb = lambda key: int(status[key].split()[0])
print(json.dumps({"import_s": t_import, "heavy_import_s": heavy, "load_s": t_load, "rss_mb": kb("VmRSS") / 1024,
                  "peak_rss_mb": kb("VmHWM") / 1024, "torch_loaded": "torch" in sys.modules,
                  "transformers_loaded": "transformers" in sys.modules}))
"""


def cold_first_token(python: str, artifact: str) -> tuple[float, float]:
    """Seconds from spawn to the first stdout byte, and to exit, of a one-token generate."""
    cli = [python, "-m", "lade_export.cli", "generate", artifact, "--max-new-tokens", "1", "--prompt", "Hi", "--greedy"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    first = proc.stdout.read(1)
    t_first = time.perf_counter() - t0
    proc.stdout.read()
    proc.wait()
    if proc.returncode != 0 or not first:
        raise SystemExit(f"{python}: generate failed (exit {proc.returncode})")
    return t_first, time.perf_counter() - t0


def concurrency(artifact: str, max_new_tokens: int, profile) -> list[dict]:
    """Aggregate decode tokens/s for 1, 2, 4 concurrent requests on one engine (this process)."""
    import threading

    import lade_export

    model = lade_export.load(artifact)
    model.generate(PROMPTS[0], max_new_tokens=8)  # warm up
    rows = []
    for n in (1, 2, 4):
        results = [None] * n
        barrier = threading.Barrier(n)

        def work(i):
            barrier.wait()
            results[i] = model.generate(PROMPTS[i % len(PROMPTS)], max_new_tokens=max_new_tokens, profile=profile,
                                        lookahead=profile is not None)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        tokens = sum(r.stats.new_tokens for r in results)
        rows.append({"requests": n, "tokens": tokens, "wall_s": wall, "aggregate_tok_s": tokens / wall,
                     "mean_request_tok_s": statistics.mean(r.stats.tokens_per_s for r in results)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("--python", action="append", default=[], metavar="LABEL=PATH",
                    help="interpreter to measure (repeatable), e.g. thin=/tmp/thin/bin/python")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None, help="write a markdown report here")
    args = ap.parse_args()
    pythons = [p.split("=", 1) for p in args.python] or [["this", sys.executable]]
    lines = ["# Runtime start-up and concurrency", "",
             f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine: {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} cores; python {platform.python_version()}",
             f"- artifact: {args.artifact}",
             f"- command: `python bench/runtime_startup.py {' '.join(sys.argv[1:])}`", "",
             "## Cold process, `generate --max-new-tokens 1 --greedy` (median of "
             f"{args.runs}; spawn → first byte of text on stdout)", "",
             "| install | first token s | exit s | import lade_export.api s | load s | RSS MB | peak RSS MB | torch / transformers imported |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    heavy = None
    for label, python in pythons:
        cold = [cold_first_token(python, args.artifact) for _ in range(args.runs)]
        probes = [json.loads(subprocess.run([python, "-c", PROBE, args.artifact, "light"], capture_output=True, text=True,
                                            check=True).stdout) for _ in range(args.runs)]
        med = lambda key, rows=probes: statistics.median(r[key] for r in rows)  # noqa: E731
        lines.append(f"| {label} | {statistics.median(c[0] for c in cold):.2f} | {statistics.median(c[1] for c in cold):.2f} | "
                     f"{med('import_s'):.3f} | {med('load_s'):.2f} | {med('rss_mb'):.0f} | {med('peak_rss_mb'):.0f} | "
                     f"{probes[0]['torch_loaded']} / {probes[0]['transformers_loaded']} |")
        if heavy is None:
            try:
                heavy = json.loads(subprocess.run([python, "-c", PROBE, args.artifact, "heavy"], capture_output=True,
                                                  text=True, check=True).stdout)
            except subprocess.CalledProcessError:
                pass  # the thin install has no torch
    if heavy is not None and heavy["heavy_import_s"] is not None:
        lines += ["", f"For reference, importing torch and transformers on top costs {heavy['heavy_import_s']:.2f} s and "
                      f"brings the resident memory to {heavy['rss_mb']:.0f} MB (same artifact, same generation)."]
    lines += ["", f"## Concurrent requests on one engine ({args.max_new_tokens} new tokens each, threads in one process)", "",
              "| decoding | requests | tokens | wall s | aggregate tok/s | ratio vs 1 request | mean per-request tok/s |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, profile in (("greedy", None), ("lookahead default", "default")):
        rows = concurrency(args.artifact, args.max_new_tokens, profile)
        for r in rows:
            lines.append(f"| {label} | {r['requests']} | {r['tokens']} | {r['wall_s']:.2f} | {r['aggregate_tok_s']:.1f} | "
                         f"{r['aggregate_tok_s'] / rows[0]['aggregate_tok_s']:.2f}× | {r['mean_request_tok_s']:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
