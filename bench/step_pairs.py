"""Whole decoding steps of two (or more) artifacts side by side in one process, steps back to back.

Loads every artifact, runs two untimed warm-up rounds, then for ``--rounds`` rounds runs,
artifact after artifact (their order reversed every other round) and size after size (the sizes'
order rotated every round), three passes of one step size back to back over ``--past`` cached
tokens and times the third: a step as a decoding loop runs it, its weights where the previous
step left them. Prints each artifact's median ms per size (× its one-token step when size 1 is
among the sizes), and for the second and later artifacts the median over rounds of their ratio
to the first artifact's pass of the same round and size. The artifacts must share the model
and the cache's type and layout (every artifact is fed the same inputs).

Built for comparing kernel libraries: copy an artifact, put the other library in its
``kernels/`` folder and its size and sha256 in the copy's manifest. Two artifacts of SmolLM2-135M
int4 (98 MB each) fit this machine's last-level cache together; more push each other out of it
and then time memory instead of the kernels. Runs on a shared machine vary by a few percent: the
same artifact against itself read 0.95-1.03 per size over seven sizes and 21 rounds, which is
the resolution of one run; run the pair in both orders to see an order bias. Give several sizes:
with two, one-token steps read up to 1.16 against themselves.

Usage:
    python bench/step_pairs.py ARTIFACT_A ARTIFACT_B [--sizes 1,2,4,5,6,8,12,16] [--past 256] [--rounds 31]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--sizes", default="1,2,4,5,6,8,12,16", help="step sizes, comma-separated")
    parser.add_argument("--past", type=int, default=256, help="cached tokens before the step")
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--threads", type=int, default=None, help="engine threads (default: one per core)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    import lade_export
    from lade_export.feeds import example_feeds

    models = [lade_export.load(a, threads=args.threads) for a in args.artifacts]
    try:
        engine = models[0].decoder.engine
        for path, model in zip(args.artifacts[1:], models[1:]):
            other = model.decoder.engine
            if (other.dims, other.kv_layout, other.kv_dtype) != (engine.dims, engine.kv_layout, engine.kv_dtype):
                sys.exit(f"{path} has another model or cache ({other.kv_layout}, {other.kv_dtype}) than "
                         f"{args.artifacts[0]}: the pair must take the same inputs")
        feeds = {s: example_feeds(engine.dims, step=s, past=args.past, kv_layout=engine.kv_layout,
                                  dtype=engine.kv_dtype) for s in sizes}
        times = {(a, s): [] for a in range(len(models)) for s in sizes}
        for r in range(-2, args.rounds):  # rounds −2 and −1 warm up, untimed
            order = list(range(len(models)))
            if r % 2:
                order.reverse()
            for a in order:
                run = models[a].decoder.engine.run
                turn = (r // 2) % len(sizes)  # each rotation of the sizes in both artifact orders
                for s in sizes[turn:] + sizes[:turn]:
                    for _ in range(3):
                        t0 = time.perf_counter()
                        run(feeds[s])
                        elapsed = time.perf_counter() - t0
                    if r >= 0:
                        times[a, s].append(elapsed)
    finally:
        for model in models:
            model.close()
    scale = "ms, × the artifact's one-token step" if 1 in sizes else "ms"
    print(f"whole steps at {args.past} cached tokens, the third of three back to back, median of {args.rounds} rounds "
          f"({scale})")
    for a, path in enumerate(args.artifacts):
        one = statistics.median(times[a, 1]) if 1 in sizes else None
        cells = " | ".join(f"{s}: {statistics.median(times[a, s]) * 1e3:.2f}"
                           + (f" ({statistics.median(times[a, s]) / one:.2f}×)" if one else "") for s in sizes)
        print(f"[{a}] {path}: {cells}")
    for a in range(1, len(models)):
        ratios = " ".join(f"{s}: {statistics.median([y / x for x, y in zip(times[0, s], times[a, s])]):.3f}"
                          for s in sizes)
        print(f"[{a}] / [0], per size: {ratios}")


if __name__ == "__main__":
    main()
