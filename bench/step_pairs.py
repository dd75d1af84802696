"""Whole decoding steps of two (or more) artifacts side by side in one process, steps back to back.

Loads every artifact, then for ``--rounds`` rounds runs, artifact after artifact (their order
reversed every other round) and size after size (the sizes' order rotated every round), three
passes of one step size back to back over ``--past`` cached tokens and times the third: a step
as a decoding loop runs it, its weights where the previous step left them. Prints each
artifact's median ms per size (× its one-token step), and for the second and later artifacts the
median over rounds of their ratio to the first artifact's pass of the same round and size.

Built for comparing kernel libraries: copy an artifact, put the other library in its
``kernels/`` folder and its size and sha256 in the copy's manifest. Two artifacts of SmolLM2-135M
int4 (98 MB each) fit this machine's last-level cache together; more push each other out of it
and then time memory instead of the kernels. Runs on a shared machine vary by a few percent: a
change that leaves a size's code alone should read 0.97-1.03 there, which is the resolution of
one run; run the pair in both orders to see an order bias.

Usage:
    python bench/step_pairs.py ARTIFACT_A ARTIFACT_B [--sizes 1,4,5,8,16] [--past 256] [--rounds 31]
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
    engine = models[0].decoder.engine
    feeds = {s: example_feeds(engine.dims, step=s, past=args.past, kv_layout=engine.kv_layout, dtype=engine.kv_dtype)
             for s in sizes}
    times = {(a, s): [] for a in range(len(models)) for s in sizes}
    for r in range(args.rounds):
        order = list(range(len(models)))
        if r % 2:
            order.reverse()
        for a in order:
            run = models[a].decoder.engine.run
            for s in sizes[r % len(sizes):] + sizes[:r % len(sizes)]:
                for _ in range(3):
                    t0 = time.perf_counter()
                    run(feeds[s])
                    elapsed = time.perf_counter() - t0
                times[a, s].append(elapsed)
    print(f"whole steps at {args.past} cached tokens, the third of three back to back, median of {args.rounds} rounds "
          f"(ms, × the artifact's one-token step)")
    for a, path in enumerate(args.artifacts):
        one = statistics.median(times[a, sizes[0]])
        cells = " | ".join(f"{s}: {statistics.median(times[a, s]) * 1e3:.2f} ({statistics.median(times[a, s]) / one:.2f}×)"
                           for s in sizes)
        print(f"{path.name}: {cells}")
    for a in range(1, len(models)):
        ratios = " ".join(f"{s}: {statistics.median([y / x for x, y in zip(times[0, s], times[a, s])]):.3f}"
                          for s in sizes)
        print(f"{args.artifacts[a].name} / {args.artifacts[0].name}, per size: {ratios}")
    for model in models:
        model.close()


if __name__ == "__main__":
    main()
