"""AttentionRowsHalfCache alone, kernel libraries side by side in one process, call by call.

A pass is 30 attention nodes (SmolLM2's layer count; GQA 9 query heads on 3 KV heads, head
width 64 by default) over one float16 cache of ``--past`` tokens and a step of ``--step``
rows, each row seeing the whole cache and the step's rows up to itself (a lookahead chain),
or with ``--packed`` each row seeing its own ``past/step`` slice of the cache and itself (a
packed pass of ``step`` one-token requests). Every library gets its own one-thread ONNX
Runtime session in this process (sessions register their custom-op library separately), and
the sessions run one pass each in turn, so a slow minute of a shared machine slows every
library alike; times are the calling thread's CPU time per attention node (µs), median over
``--rounds``, and each library against the first as the median of the per-round ratios.
The first pass of each library is compared bit for bit with the first library's: a change
meant to move data only must print ``same bits: yes``.

The inputs stay in the caches between passes (~0.2 MB of keys and values at 256 cached
tokens): this times the kernel's arithmetic, not the memory that a decoding step also waits on.

Usage:
    python bench/attention_rows.py --library new.so --library old.so [--past 256] [--step 8] \
        [--packed] [--rounds 60]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

LAYERS = 30


def attention_model(batch: int, kv_heads: int, groups: int, step: int, past: int, head_dim: int) -> bytes:
    """A model of ``LAYERS`` AttentionRowsHalfCache nodes on the same inputs, summed into one output."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("AttentionRowsHalfCache", ["q", "pk", "k", "pv", "v", "mask"], [f"o{i}"],
                              domain="lade_export", scale=head_dim ** -0.5, past_layout=1) for i in range(LAYERS)]
    nodes.append(helper.make_node("Sum", [f"o{i}" for i in range(LAYERS)], ["out"]))
    inputs = [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, [batch, kv_heads, groups * step, head_dim]),
        helper.make_tensor_value_info("pk", TensorProto.FLOAT16, [batch, past, kv_heads, head_dim]),
        helper.make_tensor_value_info("k", TensorProto.FLOAT, [batch, kv_heads, head_dim, step]),
        helper.make_tensor_value_info("pv", TensorProto.FLOAT16, [batch, past, kv_heads, head_dim]),
        helper.make_tensor_value_info("v", TensorProto.FLOAT, [batch, kv_heads, step, head_dim]),
        helper.make_tensor_value_info("mask", TensorProto.BOOL, [batch, 1, 1, step, past + step]),
    ]
    graph = helper.make_graph(nodes, "attention_rows", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("lade_export", 1)])
    return model.SerializeToString()


def feeds_for(rng, kv_heads: int, groups: int, step: int, past: int, head_dim: int, packed: bool) -> dict:
    """Random inputs; the mask as described in the module docstring: ``bench/packed_attention.py``'s
    "all" (a chain over the whole cache) or "own" (packed) variant, negated (True = masked)."""
    from packed_attention import masks

    seen = masks(step, past)["own" if packed else "all"]  # bool [1, 1, step, past + step], True = may attend
    return {"q": rng.standard_normal((1, kv_heads, groups * step, head_dim)).astype(np.float32),
            "pk": rng.standard_normal((1, past, kv_heads, head_dim)).astype(np.float16),
            "k": rng.standard_normal((1, kv_heads, head_dim, step)).astype(np.float32),
            "pv": rng.standard_normal((1, past, kv_heads, head_dim)).astype(np.float16),
            "v": rng.standard_normal((1, kv_heads, step, head_dim)).astype(np.float32),
            "mask": ~seen[:, :, None]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", action="append", type=Path, required=True, help="a kernel library (repeatable)")
    parser.add_argument("--past", type=int, default=256, help="cached tokens")
    parser.add_argument("--step", type=int, default=1, help="rows of the step (requests, with --packed)")
    parser.add_argument("--packed", action="store_true", help="each row sees its own past/step slice of the cache")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--groups", type=int, default=3, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()

    import onnxruntime as ort

    model = attention_model(1, args.kv_heads, args.groups, args.step, args.past, args.head_dim)
    feeds = feeds_for(np.random.default_rng(0), args.kv_heads, args.groups, args.step, args.past, args.head_dim,
                      args.packed)
    sessions = []
    for library in args.library:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.intra_op_num_threads = 1
        options.register_custom_ops_library(str(library.resolve()))
        sessions.append(ort.InferenceSession(model, options, providers=["CPUExecutionProvider"]))
    first = [s.run(None, feeds)[0] for s in sessions]
    times = [[] for _ in sessions]
    for _ in range(args.rounds):
        for i, s in enumerate(sessions):
            start = time.thread_time()
            s.run(None, feeds)
            times[i].append((time.thread_time() - start) / LAYERS)
    print(f"AttentionRowsHalfCache, {args.past} cached tokens, {args.step} rows"
          f"{' (packed: each its own slice)' if args.packed else ''}, {args.kv_heads} KV heads × {args.groups}, "
          f"head width {args.head_dim}; one thread, CPU time per node, median of {args.rounds} rounds\n")
    print("| library | µs per node | vs the first (median of ratios) | same bits as the first |")
    print("| --- | ---: | ---: | --- |")
    for library, spent, out in zip(args.library, times, first):
        ratio = statistics.median(b / a for a, b in zip(times[0], spent))
        same = "yes" if np.array_equal(out, first[0], equal_nan=True) else "no"
        print(f"| {library.name} | {statistics.median(spent) * 1e6:.1f} | {ratio:.3f} | {same} |")


if __name__ == "__main__":
    main()
