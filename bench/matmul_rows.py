"""MatMulBlockQ alone at several row counts, integer paths and kernel libraries side by side.

The kernel path is chosen once per process (``$LADE_KERNELS_PATH``), so each (library, path)
pair runs in a worker process of its own; the parent sends one pass at a time to each
worker in turn, rotating the order every repeat (interleaved), and reports the median of
the worker's calling-thread CPU time per pass (one ONNX Runtime thread: the pass runs on the
calling thread, and other processes on a shared machine do not inflate that clock). With
``--threads N`` (N > 1) each worker's session has N intra-op threads and a pass is timed by
the wall clock, after a 20 ms pause in which the other workers' idle pool threads stop spinning.
A pass follows another worker's, whose weights have pushed this one's out of the caches; with
``--burst B`` a worker runs B passes back to back and reports the median of the second half,
which find the weights where consecutive decoding steps find them (warm).

A pass is either one synthetic 4-bit layer (``--shape K×N``, random codes and float16 scales),
or, with ``--artifact``, every weight kernel of that artifact's step graph (real weights, as
``bench/kernel_floor.py --rows``). Times are ms per pass; each row count is also shown
against the first row count of the same worker (``×``), and against the first worker's
time at the same row count (``vs first``).

Usage:
    python bench/matmul_rows.py --library new.so --library old.so --paths amx,avx512vnni \
        [--shape 576x1536] [--artifact DIR] [--rows 1,4,8,16] [--repeats 15] [--threads 2] [--burst 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

_WORKER = r"""
import json, os, sys, time
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
library, source, rows = sys.argv[1], sys.argv[2], [int(v) for v in sys.argv[3].split(",")]
sys.path.insert(0, sys.argv[4])
threads, burst = int(sys.argv[5]), int(sys.argv[6])
clock = time.thread_time if threads == 1 else time.perf_counter
rng = np.random.default_rng(0)
def session(model):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.register_custom_ops_library(library)
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
sessions = {}
for r in rows:
    if source.startswith("shape:"):
        k, n = (int(v) for v in source[6:].split("x"))
        inits = [numpy_helper.from_array(rng.integers(0, 256, (n // 16, k // 32, 256), dtype=np.uint8), "q"),
                 numpy_helper.from_array((rng.random((n // 16, k // 32, 16)) * 0.01).astype(np.float16), "d"),
                 numpy_helper.from_array((rng.random((n // 16, k // 32, 16)) * -0.05).astype(np.float16), "m")]
        node = helper.make_node("MatMulBlockQ", ["x", "q", "d", "m"], ["y"], domain="lade_export", N=n, compute=1)
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [r, k])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("lade_export", 1)])
    else:
        import onnx
        from kernel_floor import weight_kernels_model
        from lade_export.artifact import Artifact
        model, _ = weight_kernels_model(onnx.load(str(Artifact(source).onnx_path)), r)
    s = session(model)
    feeds = {i.name: rng.standard_normal([d if isinstance(d, int) else 1 for d in i.shape]).astype(np.float32)
             for i in s.get_inputs()}
    for _ in range(3):
        s.run(None, feeds)
    sessions[r] = (s, feeds)
print("ready", flush=True)
for line in sys.stdin:
    r = int(line)
    s, feeds = sessions[r]
    spent = []
    for _ in range(burst):  # back to back: after the first, the weights are where a decode loop finds them
        start = clock()
        s.run(None, feeds)
        spent.append(clock() - start)
    late = sorted(spent[burst // 2:])  # the second half of the burst
    print(late[len(late) // 2], flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", action="append", type=Path, required=True, help="a kernel library (repeatable)")
    parser.add_argument("--paths", default="amx,avx512vnni", help="integer paths to force, comma-separated")
    parser.add_argument("--shape", default="576x1536", help="K×N of one synthetic 4-bit layer")
    parser.add_argument("--artifact", type=Path, default=None, help="instead: every weight kernel of this artifact")
    parser.add_argument("--rows", default="1,4,8,16")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads per worker (above 1: wall clock instead of CPU time)")
    parser.add_argument("--burst", type=int, default=1,
                        help="passes back to back per turn; the median of the second half is reported")
    args = parser.parse_args()
    rows = [int(v) for v in args.rows.split(",")]
    source = str(args.artifact) if args.artifact else f"shape:{args.shape}"
    workers = []
    for library in args.library:
        for path in args.paths.split(","):
            env = {**os.environ, "LADE_KERNELS_PATH": path}
            env.pop("LADE_KERNELS_PORTABLE", None)
            proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(library.resolve()), source, args.rows,
                                     str(Path(__file__).resolve().parent), str(args.threads),
                                     str(args.burst)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            if proc.stdout.readline().strip() != "ready":
                raise SystemExit(f"worker for {library} {path} failed")
            workers.append((f"{library.name} {path}", proc))
    jobs = [(w, r) for w in range(len(workers)) for r in rows]
    times = {job: [] for job in jobs}
    for rep in range(args.repeats):
        for w, r in jobs[rep % len(jobs):] + jobs[:rep % len(jobs)]:
            proc = workers[w][1]
            time.sleep(0.005 if args.threads == 1 else 0.02)
            proc.stdin.write(f"{r}\n")
            proc.stdin.flush()
            times[(w, r)].append(float(proc.stdout.readline()))
    for _, proc in workers:
        proc.stdin.close()
        proc.wait()
    med = {job: statistics.median(v) * 1e3 for job, v in times.items()}
    clock = "one thread, CPU time" if args.threads == 1 else f"{args.threads} threads, wall clock"
    if args.burst > 1:
        clock += f", warm (median of the second half of {args.burst} passes back to back)"
    print(f"MatMulBlockQ {source}, {clock}, interleaved median of {args.repeats}: ms (× {rows[0]} "
          f"row{'s' if rows[0] > 1 else ''}; vs the first line)\n")
    print("| library, path | " + " | ".join(f"{r} rows" for r in rows) + " |")
    print("| --- |" + " ---: |" * len(rows))
    for w, (name, _) in enumerate(workers):
        cells = [f"{med[(w, r)]:.3f} ({med[(w, r)] / med[(w, rows[0])]:.2f}×; {med[(w, r)] / med[(0, r)]:.2f})"
                 for r in rows]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(json.dumps({f"{workers[w][0]} {r}": med[(w, r)] for w, r in jobs}), file=sys.stderr)


if __name__ == "__main__":
    main()
