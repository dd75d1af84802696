"""What a packed pass's rows cost when each request's rows see their own keys, against
the same rows seeing shared keys (issue 21: why batched decoding scales less than one
request's step-cost curve suggests).

One step of --step rows over --past cached tokens through the artifact's engine, the
attention mask varied and nothing else (same ids, same cache, same shapes):

* ``all``   — every row sees the whole cache (one request's lookahead step);
* ``first`` — every row sees the first past/step cached tokens (one request's step over a
  short history, the rest of the cache masked);
* ``own``   — row i sees its own past/step cached tokens (a packed pass of ``step``
  requests, each with its own history of that length, as :mod:`lade_export.packed`
  lays them out with one region per request);
* ``own, packed positions`` — ``own`` with each row at its own position, as a packed pass has;
* ``1-token`` — a one-token step over the whole cache (the unit).

Each row sees itself among the step's columns. The passes alternate, --repeats times after
a warm-up (10 ms of sleep before each: an idle pool thread of ONNX Runtime spins for a
while after a run); the median of each is printed in ms and in one-token steps.

Usage:
    python bench/packed_attention.py /work/artifacts/smollm2-lade-int8-k4 --past 256 1024 --step 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def masks(step: int, past: int) -> dict:
    """``{name: bool [1, 1, step, past + step]}`` for the variants of the module docstring."""
    per = past // step
    out = {}
    for kind in ("all", "first", "own"):
        mask = np.zeros((1, 1, step, past + step), dtype=bool)
        for i in range(step):
            if kind == "all":
                mask[0, 0, i, :past] = True
            elif kind == "first":
                mask[0, 0, i, :per] = True
            else:
                mask[0, 0, i, per * i:per * (i + 1)] = True
            if kind == "own":
                mask[0, 0, i, past + i] = True
            else:
                mask[0, 0, i, past:past + i + 1] = True
        out[kind] = mask
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--past", type=int, nargs="+", default=[256, 1024], help="cached tokens")
    ap.add_argument("--step", type=int, default=8, help="rows of the step (requests of the packed pass)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None, help="engine threads (default: one per core)")
    args = ap.parse_args(argv)

    import lade_export
    from lade_export.feeds import example_feeds

    with lade_export.load(args.artifact, threads=args.threads) as model:
        engine = model.decoder.engine
        print(f"{args.artifact}: {args.step}-row steps, median of {args.repeats} interleaved passes, ms (× a one-token step)")
        print("| cached tokens | " + " | ".join(["all", "first", "own", "own, packed positions", "1-token"]) + " |")
        print("| ---: |" + " ---: |" * 5)
        for past in args.past:
            base = example_feeds(engine.dims, step=args.step, past=past, kv_layout=engine.kv_layout,
                                 dtype=engine.kv_dtype)
            runs = {kind: {**base, "attention_mask": mask} for kind, mask in masks(args.step, past).items()}
            per = past // args.step
            runs["own, packed positions"] = {**runs["own"], "position_ids":
                                             (per + 7 * np.arange(args.step, dtype=np.int64))[None]}
            runs["1-token"] = example_feeds(engine.dims, step=1, past=past, kv_layout=engine.kv_layout,
                                            dtype=engine.kv_dtype)
            for feeds in runs.values():
                engine.run(feeds)
            times = {k: [] for k in runs}
            for _ in range(args.repeats):
                for kind, feeds in runs.items():
                    time.sleep(0.01)
                    start = time.perf_counter()
                    engine.run(feeds)
                    times[kind].append(time.perf_counter() - start)
            unit = statistics.median(times["1-token"])
            cells = [f"{1e3 * statistics.median(t):.2f} ({statistics.median(t) / unit:.2f}×)" for t in times.values()]
            print(f"| {past} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
