"""Decoding with the KV cache bound to ONNX Runtime once against fed as new views every step.

On an integer-path (``--kernels lade``) artifact, :meth:`lade_export.backends.onnxruntime.OrtEngine.run`
runs a step whose cache feeds are a :class:`~lade_export.kv_cache.KVCache`'s own views on I/O
bindings of the cache's buffers kept from step to step (the bound path); before, every step
handed ONNX Runtime 60 new views and took 60 new output arrays (the views path, still what
feeds of the caller's own arrays take). This runs the same requests both ways in one process,
one model: the views path by making ``cache_of_feeds`` find no cache (the engine then takes
the views path, as before the bound path existed). Per round, prompt after prompt, both paths
run the prompt back to back, their order alternating by round; it prints each path's mean
decode tokens/s, the median over (prompt, round) pairs of bound / views, and whether every
output of both paths is the same token for token.

With ``--concurrency N`` > 1 the model is loaded with ``batching=True`` and N client threads
keep N requests in flight (``serve_load.closed_loop`` over the prompts, ``--requests`` per run): the
scheduler's packed passes over its pool, bound or not; the ratio is then of aggregate tokens/s
per run, one run of each path per round.

A benchmark, not a test: run it on a quiet machine, and read ratios, not absolute figures.

Usage:
    python bench/bound_cache.py /work/artifacts/lade [--profile greedy default-int4] \\
        [--prompts 6] [--first-prompt 8] [--max-new-tokens 256] [--rounds 3] [--threads 2] \\
        [--concurrency 1] [--requests 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lade_export  # noqa: E402
from lade_export.backends import onnxruntime as ort_backend  # noqa: E402
from lade_export.kv_cache import cache_of_feeds  # noqa: E402
from serve_load import closed_loop  # noqa: E402

PATHS = {"bound": cache_of_feeds, "views": lambda feeds: None}


def one_by_one(model, prompts, profile, max_new_tokens, rounds):
    """``{path: [tokens/s per (round, prompt)]}`` and whether every output matched."""
    rates = {path: [] for path in PATHS}
    outputs, same = {}, True
    for r in range(rounds):
        for p in prompts:
            for path in (("views", "bound") if r % 2 == 0 else ("bound", "views")):
                ort_backend.cache_of_feeds = PATHS[path]
                result = model.generate(p, max_new_tokens=max_new_tokens, profile=profile)
                rates[path].append(result.stats.new_tokens / result.stats.decode_s)
                same &= outputs.setdefault(p, result.token_ids) == result.token_ids
    return rates, same


def batched(model, prompts, profile, max_new_tokens, rounds, concurrency, requests):
    """``{path: [aggregate tokens/s per round]}`` (one :func:`serve_load.closed_loop` of
    ``requests`` requests per path and round) and whether every output matched."""
    rates = {path: [] for path in PATHS}
    outputs, same = {}, True

    def send(prompt, state):
        return {"text": prompt, "ids": model.generate(prompt, max_new_tokens=max_new_tokens, profile=profile).token_ids}

    for r in range(rounds):
        for path in (("views", "bound") if r % 2 == 0 else ("bound", "views")):
            ort_backend.cache_of_feeds = PATHS[path]
            records, wall = closed_loop(send, prompts, concurrency, requests)
            rates[path].append(sum(len(rec["ids"]) for rec in records) / wall)
            for rec in records:
                same &= outputs.setdefault(rec["text"], rec["ids"]) == rec["ids"]
    return rates, same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--profile", nargs="+", default=["greedy", "default-int4"])
    ap.add_argument("--prompts", type=int, default=6, help="bench/prompts/chat.jsonl records, from --first-prompt")
    ap.add_argument("--first-prompt", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--requests", type=int, default=16, help="requests per run with --concurrency > 1")
    args = ap.parse_args()
    path = Path(__file__).resolve().parent / "prompts" / "chat.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prompts = [r["prompt"] for r in records[args.first_prompt:args.first_prompt + args.prompts]]
    model = lade_export.load(args.artifact, threads=args.threads, batching=args.concurrency > 1)
    if not model.decoder.engine.attention_skips:
        sys.exit(f"error: {args.artifact} is not an integer-path build (its attention spans every column): "
                 "it has no bound path")
    model.generate(prompts[0], max_new_tokens=16)  # warm-up
    for profile in args.profile:
        if args.concurrency > 1:
            rates, same = batched(model, prompts, profile, args.max_new_tokens, args.rounds, args.concurrency,
                                  args.requests)
        else:
            rates, same = one_by_one(model, prompts, profile, args.max_new_tokens, args.rounds)
        ratios = [b / v for b, v in zip(rates["bound"], rates["views"])]
        print(f"{profile}, concurrency {args.concurrency}: bound {statistics.mean(rates['bound']):.1f} tok/s, "
              f"views {statistics.mean(rates['views']):.1f} tok/s; bound / views median {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} pairs); outputs equal: {same}")
    ort_backend.cache_of_feeds = cache_of_feeds
    model.close()


if __name__ == "__main__":
    main()
