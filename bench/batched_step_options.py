"""Timing of the batched-step formulations on a built artifact (the measurement behind
lade_export.scheduler's and lade_export.packed's choices).

For B requests, each with C cached tokens and a step of w tokens, it times (interleaved,
median of --reps rounds, ONNX Runtime on this machine's cores):

* ``serial``   — B separate steps of w rows, each on its own cache (today's threads-on-
  one-engine path, one request after another: what B concurrent requests cost now);
* ``pool``     — one step of B·w packed rows over one shared token pool holding all B
  caches (B·C columns) the way the compact pool holds them after greedy decoding: the
  requests' columns interleaved one by one (``TokenPool(regions=False)``), each request's
  rows masked to its own columns and rows: the unchanged step graph, any attention;
* ``regions``  — the same pass over a pool where each request owns one contiguous region
  of C + --room columns (``TokenPool(regions=True)``: its C tokens, then room it has not
  filled yet), so B·(C + room) columns of which B·C are live;
* ``bound``    — one step of B·w rows over a single C-token cache: the weight MatMuls of
  the packed pass with the attention of one request only, i.e. what a formulation with
  attention per request could cost at best. Not a decoding step (the mask is causal), a
  cost bound.

Usage:
    python bench/batched_step_options.py /work/artifacts/smollm2 --batch 1 2 4 --context 256 --width 1 11

Prints one markdown table: milliseconds per option and the ratios serial/pool,
serial/regions, pool/bound and regions/bound. Give two artifacts (e.g. one built before
AttentionRows skipped masked blocks, one after) to alternate them within every round.

Since 2026-12-06 the caches' feeds here are their own views, so on integer-path builds every
option's steps run on ONNX Runtime bindings of the cache buffers kept from step to step, as
the runtime's do (``OrtEngine.run``, ``bench/bound_cache.py``); figures from before that date
include feeding new views at every step.
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


def _feeds(cache, past: int, rows: int, blocks: list[tuple[np.ndarray, int]], vocab: int) -> dict:
    """Feeds of one step: ``blocks`` = (cached columns, rows) per request."""
    rng = np.random.default_rng(rows)
    ids = rng.integers(0, vocab, size=rows).astype(np.int64)
    mask = np.zeros((rows, past + rows), dtype=bool)
    pos = np.zeros(rows, np.int64)
    r = 0
    for columns, w in blocks:
        mask[r:r + w, columns] = True
        mask[r:r + w, past + r:past + r + w] = np.tril(np.ones((w, w), dtype=bool))
        pos[r:r + w] = len(columns) + np.arange(w)
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


def _cases(engine, b: int, c: int, w: int, room: int) -> dict:
    vocab = engine.dims.vocab
    solo = [_buffers(engine, c + w + 1) for _ in range(b)]
    pool = _buffers(engine, b * c + b * w + 1)
    spaced = _buffers(engine, b * (c + room) + b * w + 1)
    one = _buffers(engine, c + b * w + 1)
    mine = np.arange(c)
    interleaved = [(i + b * mine, w) for i in range(b)]  # column j·B + i: request i's j-th token
    regions = [(i * (c + room) + mine, w) for i in range(b)]
    f_solo = [_feeds(s, c, w, [(mine, w)], vocab) for s in solo]
    f_pool = _feeds(pool, b * c, b * w, interleaved, vocab)
    f_regions = _feeds(spaced, b * (c + room) - room, b * w, [(cols, w) for cols, w in regions], vocab)
    f_bound = _feeds(one, c, b * w, [(mine, b * w)], vocab)
    return {
        "serial": lambda: [engine.run(f) for f in f_solo],
        "pool": lambda: engine.run(f_pool),
        "regions": lambda: engine.run(f_regions),
        "bound": lambda: engine.run(f_bound),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", nargs="+")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--context", type=int, nargs="+", default=[256])
    ap.add_argument("--width", type=int, nargs="+", default=[1, 11])
    ap.add_argument("--room", type=int, default=128, help="unfilled columns after each request's region")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)

    from lade_export.artifact import Artifact
    from lade_export.backends import open_engine

    engines = []
    for path in args.artifact:
        art = Artifact(path)
        engines.append(open_engine(art, "ort", threads=args.threads or None))
        print(f"{path}: {engines[-1].kv_layout}, {art.manifest['graph'].get('precision', 'fp32')}")
    names = ("serial", "pool", "regions", "bound")
    print("| artifact | B | context | width | " + " | ".join(f"{n} (ms)" for n in names) +
          " | serial / pool | serial / regions | pool / bound | regions / bound |")
    print("| --- | ---: | ---: | ---: | " + "---: | " * len(names) + "---: | ---: | ---: | ---: |")
    for c in args.context:
        for w in args.width:
            for b in args.batch:
                cases = {(a, k): f for a, e in enumerate(engines) for k, f in _cases(e, b, c, w, args.room).items()}
                times = {k: [] for k in cases}
                for f in cases.values():
                    f()  # warm-up
                for _ in range(args.reps):
                    for k, f in cases.items():
                        t0 = time.perf_counter()
                        f()
                        times[k].append(time.perf_counter() - t0)
                for a, path in enumerate(args.artifact):
                    med = {k: 1e3 * statistics.median(times[a, k]) for k in names}
                    print(f"| {Path(path).name} | {b} | {c} | {w} | " + " | ".join(f"{med[k]:.1f}" for k in names) +
                          f" | {med['serial'] / med['pool']:.2f} | {med['serial'] / med['regions']:.2f} | "
                          f"{med['pool'] / med['bound']:.2f} | {med['regions'] / med['bound']:.2f} |", flush=True)
    for e in engines:
        e.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
