"""Step-cost curves of built artifacts: the latency of one forward pass per step size.

A lookahead step of S tokens pays off when it accepts more tokens than its cost relative
to a one-token (greedy) step; this curve is what decides the default profile per engine
precision (bench/results/README.md). Each step runs at ``--past`` cached tokens, with
logits read at every row (the most a lookahead step reads), median of ``--repeats`` runs
after one warm-up. A benchmark, not a test: run it on a quiet machine.

Usage:
    python bench/step_costs.py build/smollm2 build/smollm2-int4 build/smollm2-int8 \
        [--past 256] [--repeats 9] [--out bench/results/step-costs.md]
"""

from __future__ import annotations

import argparse
from pathlib import Path

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 19, 24, 32, 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--past", type=int, default=256, help="cached tokens before the step")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    args = parser.parse_args()

    import lade_export
    from lade_export.artifact import write_text_atomic
    from lade_export.compare import environment
    from lade_export.tune import measure_step_costs

    curves = {}
    for path in args.artifacts:
        with lade_export.load(path) as model:
            precision = model.artifact.manifest["graph"].get("precision", "fp32")
            curves[f"{path.name} ({precision})"] = measure_step_costs(model.decoder.engine, SIZES, args.past,
                                                                      args.repeats)
    machine = environment()
    lines = [f"Step-cost curves at {args.past} cached tokens, median of {args.repeats} passes "
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


if __name__ == "__main__":
    main()
