"""How much of a one-token step is the weights' own kernels: the floor under greedy decoding.

For each artifact, times (ONNX Runtime, CPU, median of ``--repeats`` after warm-up):

* the whole step graph for one token at ``--past`` cached tokens (what a greedy step runs);
* a graph holding only the step's weight kernels — every ``MatMul`` / ``MatMulNBits``
  whose weight is an initializer (projections, zero-point residual terms, LM head), with
  the artifact's real weights, each fed a random activation of its width, nothing else.

The second figure bounds greedy decoding from above: even if attention, norms, RoPE and
the host were free, a step could not be faster than its weight kernels. Tokens/s figures
are 1000 / ms. A benchmark, not a test: run it on a quiet machine.

``--rows 1,16`` instead times the weight kernels alone fed R rows at once (a step of R
tokens), every artifact and row count alternating pass by pass (interleaved medians), and
reports each against its own one-row time: what an extra row costs the weight kernels.

Usage:
    python bench/kernel_floor.py artifacts/smollm2 artifacts/smollm2-int4 [--past 256] [--repeats 41] \
        [--threads 2] [--rows 1,16] [--out bench/results/kernel-floor.md]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np


def weight_kernels_model(model, rows: int = 1):
    """A model of only ``model``'s weight kernels: one input ``x_K`` float [1, rows, K] per
    input width K, every kernel reading it, every kernel's output a graph output."""
    import onnx
    from onnx import TensorProto, helper

    inits = {i.name: i for i in model.graph.initializer}
    nodes, widths = [], set()
    for node in model.graph.node:
        if node.op_type == "MatMul" and node.input[1] in inits:
            k = inits[node.input[1]].dims[0]
        elif node.op_type == "MatMulNBits":
            k = next(a.i for a in node.attribute if a.name == "K")
        elif node.op_type == "MatMulBlockQ":  # the lade kernels: K = blocks × 32
            k = inits[node.input[1]].dims[1] * 32
        else:
            continue
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.input[0] = f"x_{k}"
        if node.op_type == "MatMulBlockQ":  # the product alone: no row prologue, no residual input
            del copy.input[4:]
            kept = [a for a in copy.attribute if a.name not in ("prologue", "epsilon")]
            del copy.attribute[:]
            copy.attribute.extend(kept)
        nodes.append(copy)
        widths.add(k)
    used = {i for n in nodes for i in n.input}
    graph = helper.make_graph(
        nodes, "weight_kernels",
        [helper.make_tensor_value_info(f"x_{k}", TensorProto.FLOAT, [1, rows, k]) for k in sorted(widths)],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for n in nodes for o in n.output],
        [i for i in model.graph.initializer if i.name in used])
    return helper.make_model(graph, opset_imports=list(model.opset_import)), len(nodes)


def median_ms(session, feeds, repeats: int) -> float:
    """Median ms of ``session.run`` (an ``OrtEngine``, or an ``InferenceSession`` reading every output)."""
    run = (lambda: session.run(feeds)) if hasattr(session, "kv_layout") else (lambda: session.run(None, feeds))
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--past", type=int, default=256, help="cached tokens before the step")
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: ORT's)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    parser.add_argument("--rows", default=None, help="weight kernels alone at these row counts, e.g. 1,16 (interleaved)")
    args = parser.parse_args()

    import onnx
    import onnxruntime as ort

    from lade_export.artifact import Artifact, write_text_atomic
    from lade_export.evaluation.report import environment
    from lade_export.backends.onnxruntime import OrtEngine
    from lade_export.feeds import example_feeds

    def session(source, custom_ops=None):
        options = ort.SessionOptions()
        options.log_severity_level = 3
        if custom_ops is not None:
            options.register_custom_ops_library(str(custom_ops))
        if args.threads:
            options.intra_op_num_threads = args.threads
        return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])

    rng = np.random.default_rng(0)
    if args.rows:
        return rows_table(args, session, rng)
    rows = []
    for path in args.artifacts:
        artifact = Artifact(path)
        graph_path = artifact.onnx_path
        precision = artifact.manifest["graph"].get("precision", "fp32")
        # The step through the runtime's engine: a head-major-shared cache is bound in place, as when decoding.
        step = OrtEngine(graph_path, artifact.dims, threads=args.threads, custom_ops=artifact.custom_ops_path)
        feeds = example_feeds(artifact.dims, step=1, past=args.past, kv_layout=step.kv_layout, dtype=step.kv_dtype)
        step_ms = median_ms(step, feeds, args.repeats)
        step.close()
        kernels, count = weight_kernels_model(onnx.load(str(graph_path)))
        kernel_session = session(kernels.SerializeToString(), artifact.custom_ops_path)
        kernel_feeds = {i.name: rng.standard_normal(i.shape).astype(np.float32) for i in kernel_session.get_inputs()}
        kernel_ms = median_ms(kernel_session, kernel_feeds, args.repeats)
        rows.append((f"{path.name} ({precision})", step_ms, count, kernel_ms))

    machine = environment()
    lines = [f"One-token step vs its weight kernels alone, ONNX Runtime CPU, {args.past} cached tokens, median of "
             f"{args.repeats} ({machine['cpu']}, {machine['cores']} cores, threads {args.threads or 'default'}).", "",
             "| artifact | step ms (tok/s) | weight kernels | kernels alone ms (tok/s ceiling) | kernels' share |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, step_ms, count, kernel_ms in rows:
        lines.append(f"| {name} | {step_ms:.1f} ({1e3 / step_ms:.0f}) | {count} | {kernel_ms:.1f} "
                     f"({1e3 / kernel_ms:.0f}) | {kernel_ms / step_ms:.0%} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_text_atomic(args.out, text)


def rows_table(args, session, rng) -> None:
    """``--rows``: the weight kernels alone at each row count, interleaved; prints (and writes) a table."""
    import onnx

    from lade_export.artifact import Artifact, write_text_atomic
    from lade_export.evaluation.report import environment

    counts = [int(v) for v in args.rows.split(",")]
    runs = []
    for path in args.artifacts:
        artifact = Artifact(path)
        graph = onnx.load(str(artifact.onnx_path))
        compute = (artifact.manifest.get("quantization") or {}).get("spec", {}).get("compute", "float32")
        for count in counts:
            model, _ = weight_kernels_model(graph, count)
            s = session(model.SerializeToString(), artifact.custom_ops_path)
            feeds = {i.name: rng.standard_normal(i.shape).astype(np.float32) for i in s.get_inputs()}
            for _ in range(3):
                s.run(None, feeds)
            runs.append((f"{path.name} ({compute} compute)", count, s, feeds))
    times = {(name, count): [] for name, count, _, _ in runs}
    # one thread: the calling thread's CPU time (ONNX Runtime runs a one-thread session on it), which other
    # processes on a shared machine do not inflate; else wall time
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    for r in range(args.repeats):
        for name, count, s, feeds in runs[r % len(runs):] + runs[:r % len(runs)]:
            time.sleep(0.02)  # the other sessions' idle pool threads stop spinning first
            start = clock()
            s.run(None, feeds)
            times[(name, count)].append(clock() - start)
    machine = environment()
    lines = [f"Weight kernels alone (every MatMulBlockQ of the step, head included, real weights), fed R rows, "
             f"interleaved median of {args.repeats} ({machine['cpu']}, {machine['cores']} cores, threads "
             f"{args.threads or 'default'}{'; CPU time of the calling thread' if args.threads == 1 else ''}): "
             f"ms (× one row).", "",
             "| artifact | " + " | ".join(f"{c} rows" for c in counts) + " |", "| --- |" + " ---: |" * len(counts)]
    for name in dict.fromkeys(name for name, _, _, _ in runs):
        ms = [statistics.median(times[(name, c)]) * 1e3 for c in counts]
        lines.append(f"| {name} | " + " | ".join(f"{m:.2f} ({m / ms[0]:.2f}×)" for m in ms) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_text_atomic(args.out, text)


if __name__ == "__main__":
    main()
