"""Per-operator cost of a step graph: where a step's time goes, by operator type.

Runs each artifact's step graph in an ONNX Runtime CPU session with ``enable_profiling``
(ONNX Runtime docs, "Profiling tools": one JSON event per node run, ``dur`` in µs) at every
``--sizes`` step size and ``--past`` cached tokens, logits read at every row, passes of all
artifacts, sizes and contexts alternating (interleaved), and sums each pass's node times
per operator type; the table gives the median over ``--repeats`` passes in ms at the first size and
the cost per extra row ((ms at the largest size − ms at the first) / (size difference)). The
times are the profiler's wall-clock node times (one thread by default: ``--threads 1``), which
include a few µs of the profiler's own per node: the fixed cost of small nodes reads high, the
per-row costs are what to compare. Run it where the cores are not oversubscribed, and read
ratios from one run. A benchmark, not a test.

Usage:
    python bench/op_profile.py /work/artifacts/smollm2-lade-int8-skip [more artifacts] \
        [--past 256,1024] [--sizes 1,16] [--repeats 7] [--threads 1] [--out table.md]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def per_run(path: str) -> list[dict]:
    """``[{op type: ms}]``, one per ``model_run`` of the session's profile file ``path`` (then
    deleted), node events assigned to the run whose time span holds them; each dict's
    ``"#op type"`` keys count that run's nodes of the type."""
    with open(path) as f:
        events = json.load(f)
    os.unlink(path)
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
    out = [collections.Counter() for _ in spans]
    for event in events:
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            at = next((i for i, (a, b) in enumerate(spans) if a <= event["ts"] <= b), None)
            if at is not None:
                out[at][event["args"]["op_name"]] += event["dur"] / 1e3
                out[at]["#" + event["args"]["op_name"]] += 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--past", default="256,1024", help="cached tokens, comma-separated")
    parser.add_argument("--sizes", default="1,16", help="step sizes, comma-separated (the first is the base)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    args = parser.parse_args()
    pasts = [int(v) for v in args.past.split(",")]
    sizes = [int(v) for v in args.sizes.split(",")]

    import onnxruntime as ort

    from lade_export.artifact import Artifact, write_text_atomic
    from lade_export.feeds import example_feeds

    work = tempfile.mkdtemp(prefix="op-profile-")
    runs = []  # (artifact name, past, size, session, feeds)
    for path in args.artifacts:
        artifact = Artifact(path)
        for past in pasts:
            for size in sizes:
                options = ort.SessionOptions()
                options.log_severity_level = 3
                options.intra_op_num_threads = args.threads
                options.enable_profiling = True
                options.profile_file_prefix = os.path.join(work, f"{path.name}-{past}-{size}")
                if artifact.custom_ops_path is not None:
                    options.register_custom_ops_library(str(artifact.custom_ops_path))
                session = ort.InferenceSession(str(artifact.onnx_path), options, providers=["CPUExecutionProvider"])
                feeds = example_feeds(artifact.dims, step=size, past=past,
                                      kv_layout=artifact.manifest["graph"].get("kv_cache", "sequence-major"))
                # a float16 cache input (the integer path's) gets float16 feeds
                feeds = {i.name: feeds[i.name].astype(np.float16) if i.type == "tensor(float16)" else feeds[i.name]
                         for i in session.get_inputs()}
                runs.append((path.name, past, size, session, feeds))
    for r in range(args.repeats + 1):  # the first round warms up
        for name, past, size, session, feeds in runs[r % len(runs):] + runs[:r % len(runs)]:
            time.sleep(0.02)  # the other sessions' idle pool threads stop spinning first
            session.run(None, feeds)
    totals = {(name, past, size): per_run(session.end_profiling())[1:] for name, past, size, session, _ in runs}
    lines = []
    base, top = sizes[0], sizes[-1]
    for name in dict.fromkeys(n for n, _, _, _, _ in runs):
        ops = sorted({op for (n, _, _), passes in totals.items() if n == name for p in passes for op in p
                      if not op.startswith("#")})
        counts = totals[(name, pasts[0], base)][0]
        header = "| operator (count) | " + " | ".join(f"{past} cached: {base} row ms | per extra row" for past in pasts) + " |"
        lines += [f"{name}: ms per pass by operator type (median of {args.repeats}, {args.threads} thread(s)), "
                  f"{base} row and the cost per extra row up to {top} rows", "", header,
                  "| --- |" + " ---: | ---: |" * len(pasts)]
        rows = []
        for op in ops + ["(all nodes)"]:
            cells, weight = [], 0.0
            for past in pasts:
                def med(size):
                    passes = totals[(name, past, size)]
                    return statistics.median(sum(v for o, v in p.items() if not o.startswith("#"))
                                             if op == "(all nodes)" else p.get(op, 0.0) for p in passes)
                one, many = med(base), med(top)
                extra = (many - one) / (top - base) if top > base else 0.0
                weight = max(weight, one + extra * (top - base))
                cells.append(f"{one:.2f} | {extra:.3f}")
            count = sum(v for o, v in counts.items() if o.startswith("#")) if op == "(all nodes)" else counts["#" + op]
            rows.append((op == "(all nodes)", weight, f"| {op} ({count}) | " + " | ".join(cells) + " |"))
        lines += [row for _, _, row in sorted(rows, key=lambda t: (t[0], -t[1]))] + [""]
    shutil.rmtree(work, ignore_errors=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_text_atomic(args.out, text)


if __name__ == "__main__":
    main()
