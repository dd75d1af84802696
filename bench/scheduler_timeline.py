"""Where the wall time of a closed-loop run through the scheduler goes, pass by pass.

Runs the closed loop of ``bench/serve_batched.py`` (chat prompts, N client threads keeping
N requests in flight until --requests have finished) on one artifact through a
:class:`lade_export.scheduler.Scheduler` whose timeline is on (``timeline=True``: one
:class:`lade_export.scheduler.PassRecord` per pass), and splits the level's wall time into

* **engine** — the engine's runs, split by pass kind: decode-only passes, mixed passes
  (decode steps and prompt chunks), prefill-only passes;
* **host in the pass** — before the engine: ``plan`` (admission, every decode step's
  ``prepare``, the width choice) and ``pack`` (mask, ids, positions, the pool's cache
  views); after it: ``update`` (every request's verification, stop rules, detokenized
  text, chunks handed to their readers) and ``commit`` (the pool keeps the rows, finished
  requests get their last chunk);
* **between passes** — time when no pass runs, split by whether the same reader thread
  led the next pass or the lead passed to another one (a hand-off: readers waking, the
  GIL); before the first pass and after the last one (clients starting, the last reader
  leaving).

It also gives the mean decode steps per pass against the level's concurrency (passes that
carry fewer requests than are in flight: requests waiting for admission or still
prefilling, the ramp between closed-loop waves) and the process's CPU seconds per wall
second (both cores busy: 2.0). The sum of the parts equals the wall time (the residue is
printed). Every output is compared with the same request's solo run.

Usage:
    python bench/scheduler_timeline.py /work/artifacts/smollm2-lade-int8-skip --concurrency 4 8 \\
        --requests 16 --max-new-tokens 128 [--decoding greedy default] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serve_batched import chat_prompts, run_level  # noqa: E402
from serve_load import write_report  # noqa: E402


def account(timeline: list, t0: float, t1: float, concurrency: int) -> dict:
    """Split the wall time ``[t0, t1]`` of one level over its passes (``PassRecord`` list, in order).

    Returns seconds per part (``engine_decode``, ``engine_mixed``, ``engine_prefill``,
    ``plan``, ``pack``, ``update``, ``commit``, ``gap_same``, ``gap_handoff``, ``before``,
    ``after``), their ``sum`` and ``wall``, and per-pass figures."""
    parts = dict.fromkeys(("engine_decode", "engine_mixed", "engine_prefill", "plan", "pack", "update", "commit",
                           "gap_same", "gap_handoff", "before", "after"), 0.0)
    gaps = []
    for k, p in enumerate(timeline):
        kind = "engine_prefill" if not p.steps else "engine_mixed" if p.chunks else "engine_decode"
        parts[kind] += p.engine_end - p.engine
        parts["plan"] += p.planned - p.start
        parts["pack"] += p.engine - p.planned
        parts["update"] += p.updated - p.engine_end
        parts["commit"] += p.end - p.updated
        if k:
            q = timeline[k - 1]
            gap = p.start - q.end
            gaps.append(gap)
            parts["gap_same" if p.leader == q.leader else "gap_handoff"] += gap
    if timeline:
        parts["before"] = timeline[0].start - t0
        parts["after"] = t1 - timeline[-1].end
    decode = [p for p in timeline if p.steps]
    n = max(len(timeline), 1)
    return {"wall": t1 - t0, "sum": sum(parts.values()), **parts,
            "passes": len(timeline), "decode_passes": len(decode),
            "mixed_passes": sum(1 for p in decode if p.chunks),
            "prefill_passes": len(timeline) - len(decode),
            "steps_per_decode_pass": sum(p.steps for p in decode) / max(len(decode), 1),
            "full_passes": sum(1 for p in decode if p.steps >= concurrency) / max(len(decode), 1),
            "decode_rows": sum(p.decode_rows for p in timeline), "prefill_rows": sum(p.prefill_rows for p in timeline),
            "tokens": sum(p.tokens for p in timeline),
            "handoffs": sum(1 for a, b in zip(timeline, timeline[1:]) if a.leader != b.leader),
            "gap_p50_ms": 1e3 * statistics.median(gaps) if gaps else 0.0,
            "gap_max_ms": 1e3 * max(gaps) if gaps else 0.0,
            "engine_ms_per_decode_pass": 1e3 * parts["engine_decode"] / max(len(decode) - sum(
                1 for p in decode if p.chunks), 1),
            "host_ms_per_pass": 1e3 * (parts["plan"] + parts["pack"] + parts["update"] + parts["commit"]) / n}


ORDER = ("engine_decode", "engine_mixed", "engine_prefill", "plan", "pack", "update", "commit", "gap_same",
         "gap_handoff", "before", "after")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--decoding", nargs="+", default=["greedy"], help="greedy and/or default (the model's profile) "
                    "or a profile name")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--first-prompt", type=int, default=12)
    ap.add_argument("--width-policy", default="adaptive", choices=["adaptive", "profile"])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-check", action="store_true", help="skip the solo runs the outputs are compared with")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import lade_export
    from lade_export.scheduler import Scheduler

    prompts = chat_prompts(args.first_prompt, args.requests)
    model = lade_export.load(args.artifact, threads=args.threads or None)
    scheduler = Scheduler(model.decoder, width_policy=args.width_policy, timeline=True)
    report = {"command": "python bench/scheduler_timeline.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "cores": os.cpu_count(), "load_average_before": os.getloadavg(), "levels": []}
    print(f"{args.artifact}: {len(prompts)} chat prompts, {args.max_new_tokens} new tokens; "
          f"load average {os.getloadavg()[0]:.2f}")
    print("| decoding | c | tok/s | CPU s / wall s | passes (mixed, prefill) | steps/pass | full | engine ms/decode "
          "pass | host ms/pass | hand-offs | gap p50 / max (ms) | " + " | ".join(ORDER) + " | residue | = solo |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | " + " | ".join(
        "---:" for _ in ORDER) + " | ---: | ---: |")
    for decoding in args.decoding:
        lookahead = decoding != "greedy"
        profile = None if decoding in ("greedy", "default") else decoding
        model.scheduler = None
        model.generate(prompts[0], max_new_tokens=8, profile=profile, lookahead=lookahead)  # warm-up
        reference = None
        if not args.no_check:
            solo, _ = run_level(model, prompts, 1, len(prompts), args.max_new_tokens, profile, lookahead)
            reference = {r["prompt"]: r["ids"] for r in solo}
        model.scheduler = scheduler
        for c in args.concurrency:
            for _ in range(args.rounds):
                scheduler.timeline.clear()
                cpu0, t0 = time.process_time(), time.perf_counter()
                records, _ = run_level(model, prompts, c, args.requests, args.max_new_tokens, profile, lookahead)
                t1, cpu1 = time.perf_counter(), time.process_time()
                a = account(list(scheduler.timeline), t0, t1, c)
                a["cpu_per_wall"] = (cpu1 - cpu0) / (t1 - t0)
                a["throughput_tok_s"] = sum(len(r["ids"]) for r in records) / (t1 - t0)
                a["equal_to_solo"] = (sum(r["ids"] == reference[r["prompt"]] for r in records)
                                      if reference is not None else None)
                report["levels"].append({"decoding": decoding, "concurrency": c, **a})
                share = " | ".join(f"{100 * a[k] / a['wall']:.1f}%" for k in ORDER)
                same = f"{a['equal_to_solo']}/{len(records)}" if reference is not None else "–"
                print(f"| {decoding} | {c} | {a['throughput_tok_s']:.1f} | {a['cpu_per_wall']:.2f} | "
                      f"{a['passes']} ({a['mixed_passes']}, {a['prefill_passes']}) | "
                      f"{a['steps_per_decode_pass']:.2f} | {100 * a['full_passes']:.0f}% | "
                      f"{a['engine_ms_per_decode_pass']:.2f} | {a['host_ms_per_pass']:.2f} | {a['handoffs']} | "
                      f"{a['gap_p50_ms']:.2f} / {a['gap_max_ms']:.1f} | {share} | "
                      f"{1e3 * (a['wall'] - a['sum']):.1f} ms | {same} |", flush=True)
    model.scheduler = None
    scheduler.close()
    model.close()
    report["load_average_after"] = os.getloadavg()
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
