"""Step-cost curves of built artifacts: the latency of one forward pass per step size.

A lookahead step of S tokens pays off when it accepts more tokens than its cost relative
to a one-token (greedy) step; this curve is what decides the default profile per engine
precision (bench/results/README.md). Each step runs at ``--past`` cached tokens, with
logits read at every row (the most a lookahead step reads), median of ``--repeats`` runs
after one warm-up. A benchmark, not a test: run it on a quiet machine.

With ``--interleave`` every pass of every artifact and step size alternates with the others
(repeat after repeat, sizes in a rotating order), so a shared machine's noise falls on all
curves alike; ``--sizes`` picks the step sizes.

An interleaved pass follows a 20 ms pause and another artifact's or size's pass: it starts
cold (a core that idled, weights another pass pushed out of the caches), which adds about the
same milliseconds to every size and so flattens the curve in one-token steps. Decoding runs
its steps back to back. With ``--burst B`` each interleaved measurement is B passes of the
same size back to back, timed by the median of the second half: the steady state a decoding
loop sees (on a CPU whose last-level cache holds the weights, a much cheaper one-token step).

Usage:
    python bench/step_costs.py artifacts/smollm2 artifacts/smollm2-int4 artifacts/smollm2-int8 \
        [--past 256] [--repeats 9] [--sizes 1,2,4,8,16] [--interleave] [--out bench/results/step-costs.md]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 19, 24, 32, 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--past", type=int, default=256, help="cached tokens before the step")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    parser.add_argument("--sizes", default=None, help="step sizes, comma-separated (default: %s)" % ",".join(map(str, SIZES)))
    parser.add_argument("--interleave", action="store_true", help="alternate artifacts and sizes pass by pass")
    parser.add_argument("--threads", type=int, default=None, help="engine threads (default: one per core)")
    parser.add_argument("--burst", type=int, default=1,
                        help="with --interleave: passes of the same size back to back per measurement, timed by "
                             "the median of the second half (the steady state of a decoding loop; default 1)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="with --interleave --threads 1: time each pass by the calling thread's CPU time (ONNX "
                             "Runtime runs a one-thread session on it), which other processes on a shared machine "
                             "do not inflate")
    args = parser.parse_args()
    sizes = tuple(int(v) for v in args.sizes.split(",")) if args.sizes else SIZES

    import lade_export
    from lade_export.artifact import write_text_atomic
    from lade_export.evaluation.report import environment
    from lade_export.evaluation.tune import measure_step_costs

    curves = {}
    if args.burst != 1 and not args.interleave:
        parser.error("--burst times interleaved measurements: add --interleave")
    if args.interleave:
        if args.cpu_time and args.threads != 1:
            parser.error("--cpu-time measures one-thread sessions: add --threads 1")
        if args.burst < 1:
            parser.error("--burst must be at least 1")
        curves = interleaved_curves(args.artifacts, sizes, args.past, args.repeats, args.threads, args.cpu_time,
                                    args.burst)
    for path in [] if args.interleave else args.artifacts:
        with lade_export.load(path, threads=args.threads) as model:
            precision = model.artifact.manifest["graph"].get("precision", "fp32")
            curves[f"{path.name} ({precision})"] = measure_step_costs(model.decoder.engine, sizes, args.past,
                                                                      args.repeats)
    machine = environment()
    lines = [f"Step-cost curves at {args.past} cached tokens, median of {args.repeats} passes"
             f"{' (interleaved)' if args.interleave else ''}"
             f"{f', each the median of the last {args.burst - args.burst // 2} of {args.burst} back to back' if args.interleave and args.burst > 1 else ''}"
             f"{f', {args.threads} thread(s)' if args.threads else ''}"
             f"{', CPU time of the calling thread' if args.cpu_time else ''} "
             f"({machine['cpu']}, {machine['cores']} cores): ms per forward pass (× a one-token step of the same engine).", "",
             "| step tokens | " + " | ".join(curves) + " |", "| ---: |" + " ---: |" * len(curves)]
    steps = sorted({row["step"] for rows in curves.values() for row in rows})
    for step in steps:
        cells = []
        for rows in curves.values():
            row = next((r for r in rows if r["step"] == step), None)
            cells.append("–" if row is None else f"{row['seconds'] * 1e3:.1f} ({row['relative']:.2f}×)")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_text_atomic(args.out, text)


def interleaved_curves(paths, sizes, past: int, repeats: int, threads: int | None = None,
                       cpu_time: bool = False, burst: int = 1) -> dict:
    """``{name: [{"step", "seconds", "relative"}]}`` as :func:`lade_export.evaluation.tune.measure_step_costs`
    gives, with the passes of all artifacts and sizes alternating (one warm-up pass each, 20 ms
    of sleep before each pass: an ONNX Runtime session's pool threads spin for a while after a
    run and would slow the next session's pass). ``cpu_time``: seconds of the calling thread's
    CPU time instead of wall time (for one-thread sessions). ``burst``: passes of one size back to
    back per measurement, which is the median of the last ``burst − burst // 2`` of them."""
    import lade_export
    from lade_export.feeds import example_feeds

    models = [lade_export.load(p, threads=threads) for p in paths]
    runs = []  # (name, size, engine, feeds)
    for path, model in zip(paths, models):
        engine = model.decoder.engine
        name = f"{path.name} ({model.artifact.manifest['graph'].get('precision', 'fp32')})"
        for size in sizes:
            if past + size <= engine.dims.max_context:
                runs.append((name, size, engine, example_feeds(engine.dims, step=size, past=past,
                                                               kv_layout=engine.kv_layout, dtype=engine.kv_dtype)))
    for _, _, engine, feeds in runs:
        engine.run(feeds)
    times = {(name, size): [] for name, size, _, _ in runs}
    clock = time.thread_time if cpu_time else time.perf_counter
    for r in range(repeats):
        order = runs[r % len(runs):] + runs[:r % len(runs)]
        for name, size, engine, feeds in order:
            time.sleep(0.02)  # let the other sessions' idle pool threads stop spinning before this pass
            passes = []
            for _ in range(burst):
                start = clock()
                engine.run(feeds)
                passes.append(clock() - start)
            times[(name, size)].append(statistics.median(passes[burst // 2:]))
    curves = {}
    for name, size, _, _ in runs:
        seconds = statistics.median(times[(name, size)])
        base = curves.setdefault(name, [])
        base.append({"step": size, "seconds": seconds, "relative": seconds / (base[0]["seconds"] if base else seconds)})
    for model in models:
        model.close()
    return curves


if __name__ == "__main__":
    main()
