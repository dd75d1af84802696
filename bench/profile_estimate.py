"""Lookahead profiles priced on an engine's step-cost curve: tokens per step, rows per step and
the speedup over greedy they imply, from deterministic counts rather than a wall clock.

Decoding is exact and deterministic, so what a profile does on a prompt — how many tokens each
step accepts and how many rows each forward pass carries — does not depend on the machine's
load. This script decodes the prompts greedily and with every candidate profile (each output
checked against greedy), records the width of every forward pass (the decoder's ``engine.run``
wrapped), and prices the passes on a step-cost curve measured once at the start (one-token step =
1; wall clock, ``--threads`` threads, rows interleaved, median of ``--repeats`` at ``--past``
cached tokens; linear between measured widths): estimated speedup = new tokens / Σ over decode
passes of cost(rows). A wall-clock ``compare`` of the leaders on held-out prompts is the check.

Profiles are given as ``W,N,G,K,M[,B]`` (window, n-gram size, guesses, history-lookup tokens, shortest
suffix match, history candidates) or a bundled name / TOML path.

Usage:
    python bench/profile_estimate.py /work/artifacts/smollm2-lade-int8 --dataset mt_bench --first 16 \\
        --limit 8 --dataset bench/prompts/chat.jsonl --limit 8 --profile default-int4 --profile 0,2,0,6,2 \\
        [--max-new-tokens 256] [--past 256] [--threads 2] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import time
from pathlib import Path

SIZES = (1, 2, 3, 4, 5, 6, 8, 11, 13, 16, 24, 32)


def candidate(text: str):
    """A :class:`lade_export.profile.LookaheadProfile` from ``W,N,G,K,M[,B]`` or a name/path."""
    from lade_export.profile import LookaheadProfile, resolve_profile

    parts = text.split(",")
    if len(parts) in (5, 6) and all(p.strip().isdigit() for p in parts):
        w, n, g, k, m, b = (*(int(p) for p in parts), 1)[:6]
        return LookaheadProfile(w, n, g, name=f"w{w}n{n}g{g}k{k}m{m}" + (f"b{b}" if b > 1 else ""), lookup=k,
                                lookup_min_match=m, lookup_branches=b)
    return resolve_profile(text)


def step_curve(engine, past: int, repeats: int, burst: int = 1) -> dict[int, float]:
    """Median wall time of a forward pass per width, relative to a one-token pass (widths interleaved).
    ``burst``: passes of one width back to back per measurement, timed by the median of the second
    half — the steady state of a decoding loop (``bench/step_costs.py --burst``); 1: one pass after a
    pause, which starts cold and flattens the curve."""
    from lade_export.feeds import example_feeds

    feeds = {s: example_feeds(engine.dims, step=s, past=past, kv_layout=engine.kv_layout, dtype=engine.kv_dtype)
             for s in SIZES if past + s <= engine.dims.max_context}
    for f in feeds.values():
        engine.run(f)
    times = {s: [] for s in feeds}
    order = list(feeds)
    for r in range(repeats):
        for s in order[r % len(order):] + order[:r % len(order)]:
            time.sleep(0.01)
            passes = []
            for _ in range(burst):
                t = time.perf_counter()
                engine.run(feeds[s])
                passes.append(time.perf_counter() - t)
            times[s].append(statistics.median(passes[burst // 2:]))
    base = statistics.median(times[1])
    return {s: statistics.median(v) / base for s, v in times.items()}


def price(curve: dict[int, float], rows: int) -> float:
    """cost(rows) in one-token steps: linear between the measured widths, extended past the last."""
    widths = sorted(curve)
    if rows in curve:
        return curve[rows]
    i = bisect.bisect_left(widths, rows)
    a, b = (widths[i - 1], widths[i]) if i < len(widths) else (widths[-2], widths[-1])
    return curve[a] + (curve[b] - curve[a]) * (rows - a) / (b - a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--dataset", action="append", required=True, help="mt_bench, humaneval, gsm8k or a .jsonl path")
    parser.add_argument("--first", action="append", type=int, default=None, help="skip this many records (per --dataset)")
    parser.add_argument("--limit", action="append", type=int, default=None, help="prompts (per --dataset)")
    parser.add_argument("--profile", action="append", required=True, help="W,N,G,K,M[,B] or a profile name/path")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--past", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--burst", type=int, default=1, help="passes of one width back to back per measurement, timed "
                        "by the median of the second half (the steady state of decoding; default 1: one pass after a "
                        "pause)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.burst < 1:
        parser.error("--burst must be at least 1")

    import lade_export
    from lade_export.artifact import write_text_atomic
    from lade_export.evaluation.compare import fit_prompts
    from lade_export.evaluation.datasets import load_prompts
    from lade_export.profile import GREEDY

    profiles = [candidate(p) for p in args.profile]
    firsts = args.first or [0] * len(args.dataset)
    limits = args.limit or [8] * len(args.dataset)
    model = lade_export.load(args.artifact, threads=args.threads)
    decoder, engine = model.decoder, model.decoder.engine
    curve = step_curve(engine, args.past, args.repeats, args.burst)
    widths = []
    run = engine.run

    def recording(feeds, *a, **kw):
        widths.append(int(feeds["input_ids"].shape[1]))
        return run(feeds, *a, **kw)

    engine.run = recording
    lines = [f"Profiles priced on {args.artifact.name}'s step-cost curve ({args.threads} threads, {args.past} cached "
             f"tokens, wall clock, median of {args.repeats}"
             f"{f', each the median of the last {args.burst - args.burst // 2} of {args.burst} back to back' if args.burst > 1 else ''}): "
             + ", ".join(f"{s}: {c:.2f}" for s, c in sorted(curve.items())), ""]
    for dataset, first, limit in zip(args.dataset, firsts, limits):
        kept, _ = fit_prompts(decoder, model.tokenizer, load_prompts(dataset, limit=limit, skip=first), True)
        totals = {p.name: [0, 0, 0, 0.0, 0] for p in profiles}  # decode tokens, steps, rows, cost, exact
        for _, ids in kept:
            budget = min(args.max_new_tokens, decoder.max_context - len(ids))
            widths.clear()
            base = decoder.generate(ids, budget, GREEDY)
            for p in profiles:
                widths.clear()
                res = decoder.generate(ids, budget, p)
                decode = widths[1:]  # the first pass is the prompt's
                t = totals[p.name]
                t[0] += res.stats.new_tokens - 1  # after the prefill's token
                t[1] += len(decode)
                t[2] += sum(decode)
                t[3] += 1.0 + sum(price(curve, w) for w in decode)  # the prefill's first token: one step
                t[4] += int(res.token_ids == base.token_ids)
        name = Path(dataset).stem if dataset.endswith(".jsonl") else dataset
        lines += [f"{name} records {first}–{first + len(kept) - 1}, up to {args.max_new_tokens} new tokens:", "",
                  "| profile (W,N,G,K,M,B) | max step | tokens/step | rows/step | est. speedup | = greedy |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for p in profiles:
            tokens, steps, rows, cost, exact = totals[p.name]
            shape = f"{p.window},{p.ngram},{p.guesses},{p.lookup},{p.lookup_min_match},{p.lookup_branches}"
            lines.append(f"| {p.name} ({shape}) | {p.max_step} | {tokens / max(steps, 1):.3f} | "
                         f"{rows / max(steps, 1):.2f} | {(tokens + len(kept)) / cost:.3f}× | {exact}/{len(kept)} |")
        lines.append("")
    model.close()
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_text_atomic(args.out, text + "\n")


if __name__ == "__main__":
    main()
