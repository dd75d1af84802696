"""Timing of the batched-step formulations on a built artifact (the measurement behind
lade_export.scheduler's choice).

For B requests, each with C cached tokens and a step of w tokens, it times (interleaved,
median of --reps rounds, ONNX Runtime on this machine's cores):

* ``serial``   — B separate steps of w rows, each on its own cache (today's threads-on-
  one-engine path, one request after another: what B concurrent requests cost now);
* ``pool``     — one step of B·w packed rows over one shared token pool holding all B
  caches (B·C columns), each request's rows masked to its own columns and rows: the
  unchanged step graph, any attention formulation;
* ``bound``    — one step of B·w rows over a single C-token cache: the weight MatMuls of
  the packed pass with the attention of one request only, i.e. what a formulation with
  attention per request (one attention node per slot, a ragged-attention kernel) could
  cost at best. Not a decoding step (the mask is causal), a cost bound.

Usage:
    python bench/batched_step_options.py /work/artifacts/smollm2 --batch 1 2 4 --context 256 --width 1 11

Prints one markdown table: milliseconds per option and the ratios serial/pool, pool/bound.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _buffers(engine, tokens: int):
    d = engine.dims
    from lade_export.kv_cache import KVCache

    cache = KVCache(d, capacity=tokens, layout=getattr(engine, "kv_layout", "sequence-major"), step_room=0)
    rng = np.random.default_rng(0)
    for buf in (*cache.keys, *cache.values):
        buf[...] = rng.standard_normal(buf.shape, dtype=np.float32) * 0.5
    return cache


def _feeds(cache, past: int, rows: int, blocks: list[tuple[int, int, int]], vocab: int) -> dict:
    """Feeds of one step: ``blocks`` = (first cached column, cached columns, rows) per request."""
    rng = np.random.default_rng(rows)
    ids = rng.integers(0, vocab, size=rows).astype(np.int64)
    mask = np.zeros((rows, past + rows), dtype=bool)
    pos = np.zeros(rows, np.int64)
    r = 0
    for first, n, w in blocks:
        mask[r:r + w, first:first + n] = True
        mask[r:r + w, past + r:past + r + w] = np.tril(np.ones((w, w), dtype=bool))
        pos[r:r + w] = n + np.arange(w)
        r += w
    cache.length = past
    feeds = {"input_ids": ids[None], "position_ids": pos[None], "attention_mask": mask[None, None],
             "logits_positions": np.arange(rows, dtype=np.int64)[None]}
    feeds.update(_cache_feeds(cache, past))
    return feeds


def _cache_feeds(cache, past):
    if cache.layout == "head-major-shared":
        return cache.feeds()
    cache.length = past
    return {k: v for k, v in cache.feeds().items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--context", type=int, nargs="+", default=[256])
    ap.add_argument("--width", type=int, nargs="+", default=[1, 11])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)

    from lade_export.artifact import Artifact
    from lade_export.backends import open_engine

    art = Artifact(args.artifact)
    engine = open_engine(art, "ort", threads=args.threads or None)
    d = engine.dims
    print(f"{args.artifact}: {engine.kv_layout}, {art.manifest['graph'].get('precision', 'fp32')}")
    print("| B | context | width | serial (ms) | pool (ms) | bound (ms) | serial / pool | pool / bound |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for c in args.context:
        for w in args.width:
            for b in args.batch:
                solo = [_buffers(engine, c + w + 1) for _ in range(b)]
                pool = _buffers(engine, b * c + b * w + 1)
                one = _buffers(engine, c + b * w + 1)
                cases = {
                    "serial": lambda: [engine.run(_feeds(s, c, w, [(0, c, w)], d.vocab)) for s in solo],
                    "pool": lambda: engine.run(_feeds(pool, b * c, b * w, [(i * c, c, w) for i in range(b)], d.vocab)),
                    "bound": lambda: engine.run(_feeds(one, c, b * w, [(0, c, b * w)], d.vocab)),
                }
                times = {k: [] for k in cases}
                for f in cases.values():
                    f()  # warm-up
                for _ in range(args.reps):
                    for k, f in cases.items():
                        t0 = time.perf_counter()
                        f()
                        times[k].append(time.perf_counter() - t0)
                med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
                print(f"| {b} | {c} | {w} | {med['serial']:.1f} | {med['pool']:.1f} | {med['bound']:.1f} | "
                      f"{med['serial'] / med['pool']:.2f} | {med['pool'] / med['bound']:.2f} |", flush=True)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
