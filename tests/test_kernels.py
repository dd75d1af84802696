"""This project's block-quantized kernels (``build --kernels lade``): the packed layout holds
GGML's Q4_1/Q8_0 grids exactly, ``MatMulBlockQ`` matches a float64 product and computes every
row the same whatever else is in the batch (float32 compute: the AVX-512 path and the portable
one; int8 compute: every integer path, forced one by one, bit-identical to the others), the
built artifacts ship the library and keep lookahead exact on every path, the headers come from
the registry with a pinned checksum, and bad input gets one line."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings

import lade_export
from lade_export.cli import main
from lade_export.errors import ArtifactError, ProfileError
from lade_export.kernels import LIBRARY, PATHS, PREFERENCE, compile_library, library_paths, running_path
from lade_export.profile import LookaheadProfile, resolve_profile
from lade_export.export.quantize import QuantSpec
from lade_export.export.weight_blocks import dequantize_block_lanes, pack_block_lanes

try:
    from .test_property import PROMPTS_AND_PROFILES
    from .threads import run_in_threads
except ImportError:  # imported as a top-level module by this file's subprocess checks (tests/ on sys.path)
    from test_property import PROMPTS_AND_PROFILES
    from threads import run_in_threads


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    return compile_library(tmp_path_factory.mktemp("kernels") / "liblade_kernels.so")


def _q4_1_grid(rng, k, n):
    """A [K, N] weight that is exactly a Q4_1 tensor: float16 d and m per block of 32."""
    d = rng.uniform(0.001, 0.05, size=(n, k // 32, 1)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.5, 0.1, size=(n, k // 32, 1)).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, size=(n, k // 32, 32))
    q[..., 0], q[..., 1] = 0, 15  # a Q4_1 block spans its range: min = m, max = m + 15·d
    return (q * d + m).reshape(n, k).T.astype(np.float32)


def _q8_0_grid(rng, k, n):
    d = rng.uniform(0.001, 0.02, size=(n, k // 32, 1)).astype(np.float16).astype(np.float32)
    q = rng.integers(-127, 128, size=(n, k // 32, 32))
    q[..., 0] = -127  # the block's absmax is 127·d, as Q8_0 makes it
    return (q * d).reshape(n, k).T.astype(np.float32)


def test_packed_lanes_hold_q4_1_and_q8_0_grids_exactly():
    rng = np.random.default_rng(0)
    for make, bits, scheme in ((_q4_1_grid, 4, "minmax"), (_q8_0_grid, 8, "absmax")):
        w = make(rng, 96, 40)  # 40 columns: 3 tiles of 16, the last one padded
        packed = pack_block_lanes(w, bits, scheme)
        assert packed["q"].shape == (3, 3, 64 * bits) and packed["d"].shape == (3, 3, 16) and packed["n"] == 40
        assert np.array_equal(dequantize_block_lanes(packed), w), scheme


def _session(library, nodes, inits, inputs, threads=2):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                              [helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, None) for n in nodes],
                              [numpy_helper.from_array(a, n) for n, a in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("lade_export", 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


# Run in a subprocess so that LADE_KERNELS_PORTABLE (read once per process) can pick the path.
_ROW_CHECK = r"""
import hashlib, json, sys
import numpy as np
from onnx import TensorProto, helper
sys.path.insert(0, sys.argv[2])
from test_kernels import _session, _q4_1_grid, _q8_0_grid
from lade_export.export.weight_blocks import pack_block_lanes, dequantize_block_lanes
rng = np.random.default_rng(3)
worst, independent, digest = 0.0, True, hashlib.sha256()
for bits, k, n in ((4, 64, 344), (4, 576, 200), (8, 128, 96), (8, 64, 50)):
    w = (_q4_1_grid if bits == 4 else _q8_0_grid)(rng, k, n)
    p = pack_block_lanes(w, bits, "minmax" if bits == 4 else "absmax")
    node = helper.make_node("MatMulBlockQ", ["x", "q", "d", "m"], ["y"], domain="lade_export", N=n)
    s = _session(sys.argv[1], [node], {"q": p["q"], "d": p["d"], "m": p["m"]}, [("x", TensorProto.FLOAT, ["s", k])])
    x = rng.standard_normal((11, k)).astype(np.float32)
    y = s.run(None, {"x": x})[0]
    digest.update(y.tobytes())
    ref = x.astype(np.float64) @ dequantize_block_lanes(p).astype(np.float64)
    worst = max(worst, float(np.max(np.abs(y - ref)) / np.max(np.abs(ref))))
    for width in (1, 2, 3, 4, 5, 8):
        for start in range(0, 11 - width + 1, 2):
            part = s.run(None, {"x": x[start:start + width]})[0]
            independent &= bool(np.array_equal(part, y[start:start + width]))
print(json.dumps({"worst_rel": worst, "independent": independent, "digest": digest.hexdigest()}))
"""


def _row_check(library, portable: str | None) -> dict:
    env = dict(os.environ)
    env.pop("LADE_KERNELS_PORTABLE", None)
    if portable is not None:
        env["LADE_KERNELS_PORTABLE"] = portable
    done = subprocess.run([sys.executable, "-c", _ROW_CHECK, str(library), os.path.dirname(__file__)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_matmul_block_q_matches_float64_and_each_row_is_computed_alone(library):
    from lade_export.kernels import cpu_has_avx512

    native, portable, zero = _row_check(library, None), _row_check(library, "1"), _row_check(library, "0")
    for result in (native, portable):
        assert result["worst_rel"] < 2e-6  # float32 arithmetic against a float64 product
        assert result["independent"] is True  # a row's output is bit for bit the same in any batch
    assert zero["digest"] == native["digest"]  # only LADE_KERNELS_PORTABLE=1 forces the portable path
    if cpu_has_avx512():  # the two paths sum in different orders: the switch really switches
        assert portable["digest"] != native["digest"]


# The integer path (compute=1), in a subprocess per forced path: outputs, whether every row is the
# same bits alone and inside steps of 2…32 rows (under 1 and 2 threads), and the path that ran.
_INT_CHECK = r"""
import hashlib, json, sys
import numpy as np
from onnx import TensorProto, helper
sys.path.insert(0, sys.argv[2])
from test_kernels import _session, _q4_1_grid, _q8_0_grid
from lade_export.kernels import running_path
from lade_export.export.weight_blocks import pack_block_lanes, dequantize_block_lanes
rng = np.random.default_rng(5)
worst, independent, digests = 0.0, True, {}
for threads in (1, 2):
    digest = hashlib.sha256()
    for bits, k, n in ((4, 64, 344), (4, 576, 200), (4, 1536, 48), (8, 128, 96), (8, 64, 520)):
        w = (_q4_1_grid if bits == 4 else _q8_0_grid)(np.random.default_rng(k + n), k, n)
        p = pack_block_lanes(w, bits, "minmax" if bits == 4 else "absmax")
        node = helper.make_node("MatMulBlockQ", ["x", "q", "d", "m"], ["y"], domain="lade_export", N=n, compute=1)
        s = _session(sys.argv[1], [node], {"q": p["q"], "d": p["d"], "m": p["m"]}, [("x", TensorProto.FLOAT, ["s", k])],
                     threads=threads)
        x = np.random.default_rng(k * n).standard_normal((40, k)).astype(np.float32) * 3
        y = s.run(None, {"x": x})[0]
        digest.update(y.tobytes())
        ref = x.astype(np.float64) @ dequantize_block_lanes(p).astype(np.float64)
        worst = max(worst, float(np.max(np.abs(y - ref)) / np.max(np.abs(ref))))
        for width in (1, 2, 3, 4, 5, 6, 7, 8, 9, 14, 15, 16, 17, 31, 32):
            for start in sorted({0, 3, 40 - width}):
                part = s.run(None, {"x": x[start:start + width]})[0]
                independent &= bool(np.array_equal(part, y[start:start + width]))
    # the row prologues (1: RMS norm, 2: SwiGLU) and the residual input: the same for every row count and path
    for kind, k, n in ((1, 576, 200), (2, 1536, 48), (1, 64, 344), (2, 64, 40)):
        w = _q4_1_grid(np.random.default_rng(k + n + kind), k, n)
        p = pack_block_lanes(w, 4, "minmax")
        wide = 2 * k if kind == 2 else k
        gamma = np.random.default_rng(kind + k).uniform(0.5, 1.5, k).astype(np.float32)
        node = helper.make_node("MatMulBlockQ", ["x", "q", "d", "m", "r"] + (["g"] if kind == 1 else []), ["y"],
                                domain="lade_export", N=n, compute=1, prologue=kind, epsilon=1e-5)
        inits = {"q": p["q"], "d": p["d"], "m": p["m"], **({"g": gamma} if kind == 1 else {})}
        s = _session(sys.argv[1], [node], inits, [("x", TensorProto.FLOAT, ["s", wide]), ("r", TensorProto.FLOAT, ["s", n])],
                     threads=threads)
        x = np.random.default_rng(k * n + kind).standard_normal((40, wide)).astype(np.float32) * 3
        r = np.random.default_rng(n).standard_normal((40, n)).astype(np.float32)
        y = s.run(None, {"x": x, "r": r})[0]
        digest.update(y.tobytes())
        x64 = x.astype(np.float64)
        if kind == 1:
            a = gamma * x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-5)
        else:
            g, u = x64[:, :k], x64[:, k:]
            a = g / (1 + np.exp(-g)) * u
        prod = a @ dequantize_block_lanes(p).astype(np.float64)
        worst = max(worst, float(np.max(np.abs(y - r - prod)) / np.max(np.abs(prod))))
        for width in (1, 2, 5, 8, 9, 16, 17, 32):
            for start in sorted({0, 3, 40 - width}):
                part = s.run(None, {"x": x[start:start + width], "r": r[start:start + width]})[0]
                independent &= bool(np.array_equal(part, y[start:start + width]))
    digests[threads] = digest.hexdigest()
print(json.dumps({"path": running_path(sys.argv[1], "int8"), "worst_rel": worst, "independent": independent,
                  "digests": digests}))
"""


def _forced(path: str | None, script: str, *args, emulate: list | None = None) -> dict:
    """``script``'s last printed line (JSON) from a subprocess on kernel path ``path`` (None: the
    one the CPU takes), run under ``emulate`` (a command prefix, e.g. a CPU emulator) if given."""
    env = dict(os.environ)
    env.pop("LADE_KERNELS_PORTABLE", None)
    env.pop("LADE_KERNELS_PATH", None)
    if path is not None:
        env["LADE_KERNELS_PATH"] = path
    done = subprocess.run([*(emulate or []), sys.executable, "-c", script, *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def portable_integer(library):
    return _forced("portable", _INT_CHECK, library, os.path.dirname(__file__))


def _skip_unless_runs(library, path):
    if not library_paths(library)["int8"][path]:
        pytest.skip(f"this CPU (or its OS) lacks the {path} path")


@pytest.mark.parametrize("path", PATHS["int8"])
def test_every_integer_path_gives_the_portable_paths_bits_and_computes_each_row_alone(library, portable_integer,
                                                                                      path):
    _skip_unless_runs(library, path)
    got = _forced(path, _INT_CHECK, library, os.path.dirname(__file__))
    assert got["path"] == path
    assert got["independent"] is True  # alone, and inside steps of 2…32 rows: the same bits
    assert got["digests"]["1"] == got["digests"]["2"]  # one thread or two: the same bits
    assert got["digests"] == portable_integer["digests"]  # every integer path: the same bits
    assert 1e-3 < got["worst_rel"] < 0.02  # int8 activations: ~0.6% of the largest output off a float64 product


def test_the_integer_path_differs_from_float32_compute_and_a_bad_forced_path_is_named(library, portable_integer):
    floats = _row_check(library, "1")
    assert floats["worst_rel"] < 2e-6 < portable_integer["worst_rel"]  # really another arithmetic
    script = ("import sys; from lade_export.kernels import running_path; "
              "print('{\"path\": \"%s\"}' % running_path(sys.argv[1], 'int8'))")
    assert _forced("sse9", script, library)["path"] == (
        "error: LADE_KERNELS_PATH=sse9 is none of amx, avx512vnni, avxvnni, avx2, avx512 (float32 compute), portable")
    assert _forced(None, script, library)["path"] == next(p for p in PREFERENCE["int8"]
                                                          if library_paths(library)["int8"][p])
    assert _forced("", script, library)["path"] == _forced(None, script, library)["path"]  # empty: not forced



def test_row_prologues_and_the_residual_compute_their_formulas(library):
    """MatMulBlockQ's row prologues on the float32-compute path against float64: RMS norm
    (γ·x/sqrt(mean(x²)+ε), LLaMA's) and SwiGLU ((g·σ(g))·u over X = [gate | up]), each then
    multiplied by the weight, plus the residual input; a missing norm weight or a residual of
    another shape is one line."""
    from onnx import TensorProto, helper
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

    rng = np.random.default_rng(8)
    for kind, k, n in ((1, 128, 40), (2, 96, 33)):
        w = _q4_1_grid(rng, k, n)
        p = pack_block_lanes(w, 4, "minmax")
        wide = 2 * k if kind == 2 else k
        gamma = rng.uniform(0.5, 1.5, k).astype(np.float32)
        node = helper.make_node("MatMulBlockQ", ["x", "q", "d", "m", "r"] + (["g"] if kind == 1 else []), ["y"],
                                domain="lade_export", N=n, prologue=kind, epsilon=1e-6)
        inits = {"q": p["q"], "d": p["d"], "m": p["m"], **({"g": gamma} if kind == 1 else {})}
        s = _session(library, [node], inits, [("x", TensorProto.FLOAT, ["s", wide]), ("r", TensorProto.FLOAT, ["s", "c"])])
        x = (rng.standard_normal((5, wide)) * 4).astype(np.float32)
        r = rng.standard_normal((5, n)).astype(np.float32)
        x64 = x.astype(np.float64)
        if kind == 1:
            a = gamma * x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-6)
        else:
            a = x64[:, :k] / (1 + np.exp(-x64[:, :k])) * x64[:, k:]
        want = r + a @ dequantize_block_lanes(p).astype(np.float64)
        got = s.run(None, {"x": x, "r": r})[0]
        assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-5, kind
        with pytest.raises(InvalidArgument, match=r"MatMulBlockQ: the residual R \[5, 3\] is not Y's shape \[5, "):
            s.run(None, {"x": x, "r": r[:, :3]})
    bare = helper.make_node("MatMulBlockQ", ["x", "q", "d", "m"], ["y"], domain="lade_export", N=33, prologue=1)
    s = _session(library, [bare], {"q": p["q"], "d": p["d"], "m": p["m"]}, [("x", TensorProto.FLOAT, ["s", 96])])
    with pytest.raises(InvalidArgument, match=r"MatMulBlockQ: the RMS norm prologue needs its weight γ \[96\] as input 5"):
        s.run(None, {"x": np.ones((1, 96), np.float32)})
    with pytest.raises(InvalidArgument, match=r"MatMulBlockQ: X \[1, 96\] does not end in 2·K = 192"):
        _session(library, [helper.make_node("MatMulBlockQ", ["x", "q", "d", "m"], ["y"], domain="lade_export", N=33,
                                            prologue=2)], {"q": p["q"], "d": p["d"], "m": p["m"]},
                 [("x", TensorProto.FLOAT, ["s", 96])]).run(None, {"x": np.ones((1, 96), np.float32)})

def test_gather_block_q_returns_table_rows_and_names_bad_input(library):
    from onnx import TensorProto, helper
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

    rng = np.random.default_rng(4)
    w = _q8_0_grid(rng, 64, 100)  # [hidden, vocab]: the head's weight; column v is token v's embedding
    p = pack_block_lanes(w, 8, "absmax")
    node = helper.make_node("GatherBlockQ", ["q", "d", "m", "ids"], ["e"], domain="lade_export", N=100)
    s = _session(library, [node], {"q": p["q"], "d": p["d"], "m": p["m"]}, [("ids", TensorProto.INT64, ["b", "s"])])
    ids = np.array([[0, 99, 17], [5, 5, 64]], np.int64)
    assert np.array_equal(s.run(None, {"ids": ids})[0], w.T[ids])
    with pytest.raises(InvalidArgument, match="GatherBlockQ: token id 100 is outside the table's 100 rows"):
        s.run(None, {"ids": np.array([[100]], np.int64)})
    bad = helper.make_node("MatMulBlockQ", ["x", "q", "d", "m"], ["y"], domain="lade_export", N=100)
    s = _session(library, [bad], {"q": p["q"], "d": p["d"][:, :1], "m": p["m"]}, [("x", TensorProto.FLOAT, [1, 64])])
    with pytest.raises(InvalidArgument, match=r"MatMulBlockQ: scales \[7, 1, 16\] and offsets \[7, 2, 16\] are not "
                                              r"\[7, 2, 16\]"):
        s.run(None, {"x": np.zeros((1, 64), np.float32)})


# ArgMaxRows in a subprocess per forced path: its indices against numpy.argmax (ties, NaN, ±inf, ±0, the largest
# value in the tail past the last full vector), a digest of them, and an empty row's error.
_ARGMAX_CHECK = r"""
import hashlib, json, sys
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper
node = helper.make_node("ArgMaxRows", ["x"], ["y"], domain="lade_export")
graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                          [helper.make_tensor_value_info("y", TensorProto.INT64, None)])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("lade_export", 1)])
options = ort.SessionOptions()
options.register_custom_ops_library(sys.argv[1])
options.intra_op_num_threads = 2
s = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
rng = np.random.default_rng(7)
digest, cases, wrong = hashlib.sha256(), 0, []
for shape in ((1, 1, 49152), (1, 16, 49157), (2, 3, 37), (5, 1), (7,), (1, 33, 100), (3, 16), (4, 9)):
    x = np.round(rng.standard_normal(shape) * 2).astype(np.float32) / 2  # many equal maxima
    for change in range(6):
        y = x.copy()
        if change == 1:
            y[..., -1] = np.nan  # the first NaN wins
        elif change == 2:
            y[...] = -np.inf
        elif change == 3 and shape[-1] > 3:
            y[..., 1], y[..., 2] = np.inf, np.nan
        elif change == 4:
            y[...] = 0.0
            y[..., ::3] = -0.0  # -0 == +0: the first of them
        elif change == 5:
            y[..., -1] = 99.0  # the largest value last (in the tail when the width is no multiple of 16)
        got = s.run(None, {"x": y})[0]
        digest.update(got.tobytes())
        cases += 1
        if got.dtype != np.int64 or not np.array_equal(got, np.argmax(y, axis=-1)):
            wrong.append([list(shape), change])
try:
    s.run(None, {"x": np.zeros((2, 0), np.float32)})
    error = None
except Exception as e:
    error = str(e).splitlines()[0]
print(json.dumps({"cases": cases, "wrong": wrong, "digest": digest.hexdigest(), "error": error}))
"""


@pytest.mark.parametrize("path", ["portable", "avx2", "avx512vnni"])
def test_argmax_rows_gives_numpy_argmax_on_every_path(library, path):
    _skip_unless_runs(library, path)  # avx2 takes the 8-lane code, avx512vnni the 16-lane one
    got = _forced(path, _ARGMAX_CHECK, library)
    assert got["cases"] == 48 and got["wrong"] == []
    assert got["digest"] == _forced("portable", _ARGMAX_CHECK, library)["digest"]
    assert got["error"].endswith("ArgMaxRows: input [2, 0] has no values to choose from")


def test_lade_argmax_swaps_only_an_argmax_over_the_last_axis():
    from onnx import TensorProto, helper

    from lade_export.export.quantized_ops import lade_argmax

    nodes = [helper.make_node("ArgMax", ["x"], ["a"], axis=-1, keepdims=0),
             helper.make_node("ArgMax", ["x"], ["b"], axis=2, keepdims=0),  # the last of rank 3: swapped
             helper.make_node("ArgMax", ["x"], ["c"], axis=1, keepdims=0),
             helper.make_node("ArgMax", ["x"], ["d"], axis=-1, keepdims=1),
             helper.make_node("ArgMax", ["x"], ["e"], axis=-1, keepdims=0, select_last_index=1)]
    outputs = [helper.make_tensor_value_info(n, TensorProto.INT64, None) for n in "abcde"]
    unknown = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)], outputs)
    assert lade_argmax(unknown) == 1  # axis 2 is the last one only where the rank is declared
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 8])], outputs)
    assert lade_argmax(graph) == 2
    assert [(n.op_type, n.domain, list(n.output)) for n in graph.node] == [
        ("ArgMaxRows", "lade_export", ["a"]), ("ArgMaxRows", "lade_export", ["b"]), ("ArgMax", "", ["c"]),
        ("ArgMax", "", ["d"]), ("ArgMax", "", ["e"])]
    assert [n.name for n in graph.node[:2]] == ["argmax_rows_0", "argmax_rows_1"]  # unnamed: a name each
    half = helper.make_graph([helper.make_node("ArgMax", ["h"], ["a"], axis=-1, keepdims=0)], "g",
                             [helper.make_tensor_value_info("h", TensorProto.FLOAT16, [1, 8])], outputs[:1])
    assert lade_argmax(half) == 0 and half.node[0].op_type == "ArgMax"  # ArgMaxRows takes float32 only


@pytest.fixture(scope="module")
def stories_lade(tmp_path_factory, stories_dir, stories_loaded):
    from lade_export.export.build import build_artifact

    out = tmp_path_factory.mktemp("lade") / "art"
    build_artifact(str(stories_dir), [resolve_profile("default-int4"), resolve_profile("default")], out,
                   loaded=stories_loaded, quantization=QuantSpec.for_precision("int4", kernels="lade"))
    return out


def test_lade_build_ships_its_kernels_and_records_them(stories_lade):
    import onnx

    m = json.loads((stories_lade / "manifest.json").read_text())
    assert m["graph"]["custom_ops"] == LIBRARY == "kernels/liblade_kernels.so"
    assert m["graph"]["precision"] == "int4" and m["graph"]["lookahead_exact"] is True
    assert LIBRARY in m["files"] and m["files"][LIBRARY]["bytes"] == (stories_lade / LIBRARY).stat().st_size
    spec = m["quantization"]["spec"]
    assert (spec["kernels"], spec["bits"], spec["head_bits"], spec["compute"]) == ("lade", 4, 8, "int8")
    assert m["default_profile"] == "default-int4" and m["graph"]["attention"] == "onnx-ops"
    assert m["quantization"]["quality"]["top1_agreement"] > 0.85  # 4-bit stories260K, int8 activations: 90.2%
    assert m["quantization"]["graph"]["attention_rows"] == 5
    kernels = m["quantization"]["kernels"]
    assert kernels["paths"] == {"int8": ["amx", "avx512vnni", "avxvnni", "avx2", "portable"],
                                "float32": ["avx512", "portable"]}
    assert kernels["compute"] == "int8" and kernels["path_at_build"] in PATHS["int8"]
    graph = onnx.load(str(stories_lade / "model.onnx"), load_external_data=False)
    ops = [n.op_type for n in graph.graph.node]
    # 5 layers × (q/k/v, o, gate/up) + the head; the 172-wide down projection is no multiple of 32 and stays float32
    assert ops.count("MatMulBlockQ") == 16 and ops.count("GatherBlockQ") == 1
    computes = [a.i for n in graph.graph.node if n.op_type == "MatMulBlockQ" for a in n.attribute if a.name == "compute"]
    assert computes == [1] * 16
    # each layer's attention is one RotaryAttentionRows over a float16 cache (the rotary embedding and the head
    # layout inside it): no Softmax, no Slice, Transpose or Cast left, and the only float MatMuls are the down
    # projections
    assert ops.count("RotaryAttentionRows") == 5 and "AttentionRowsHalfCache" not in ops and "Softmax" not in ops
    assert not {"Slice", "Transpose", "Neg", "Reshape"} & set(ops) and ops.count("Cast") <= 1  # positions to float
    assert m["quantization"]["graph"]["kv_cache_dtype"] == "float16"
    assert m["quantization"]["graph"]["rotary_attention_rows"] == 5
    # the norms before q/k/v, gate/up and the head, and the residual after o_proj, inside MatMulBlockQ (the
    # float32 down projection keeps its SwiGLU and its residual Add)
    assert m["quantization"]["graph"]["matmul_row_work"] == {"rms_norm": 11, "swiglu": 0, "residual": 5}
    # the tokens from the kernels' ArgMaxRows, not ONNX Runtime's ArgMax
    assert m["quantization"]["graph"]["argmax_rows"] == 1
    assert ops.count("ArgMaxRows") == 1 and "ArgMax" not in ops
    assert "ReduceMean" not in ops and ops.count("Add") == 5 and ops.count("Sigmoid") == 5
    assert "(sequence-major), float16, RoPE applied to keys" in m["graph"]["kv_layout"]
    cache_specs = [t for t in m["graph"]["inputs"] + m["graph"]["outputs"]
                   if t["name"].startswith(("past_key_values.", "present."))]
    assert len(cache_specs) == 20 and {t["dtype"] for t in cache_specs} == {"float16"}
    with lade_export.load(stories_lade) as model:  # the runtime keeps the cache in the graph's dtype
        assert model.decoder.engine.kv_dtype == np.float16
        from lade_export.kv_cache import KVCache

        dims = model.decoder.dims
        cache = KVCache(dims, 10, dtype=model.decoder.engine.kv_dtype)
        assert cache.nbytes == 10 * dims.kv_bytes_per_token // 2
    weights = {i.name for i in graph.graph.initializer}
    assert "MatMulNBits" not in ops
    assert sum(n.op_type == "MatMul" for n in graph.graph.node) == 5
    assert sum(n.op_type == "MatMul" and n.input[1] in weights for n in graph.graph.node) == 5
    shown = " ".join(CliRunner().invoke(main, ["inspect", str(stories_lade)]).output.split())
    agreement = m["quantization"]["quality"]["top1_agreement"]
    here = running_path(stories_lade / LIBRARY, "int8")  # the path this process takes
    assert ("weights: int4 layers, 8-bit head and embedding, lade kernels (kernels/liblade_kernels.so; int8 compute, "
            f"paths amx, avx512vnni, avxvnni, avx2, portable; this CPU takes {here}, the build measured on "
            f"{kernels['path_at_build']}); lookahead exact: True; top-1 agreement with float32 "
            f"{100 * agreement:.1f}%") in shown
    assert (f"attention: onnx-ops, each as the lade kernels' AttentionRows ({dims.num_layers}), {dims.num_layers} of "
            "them with their rotary embedding and head layout fused (RotaryAttentionRows);") in shown
    result = CliRunner().invoke(main, ["generate", str(stories_lade), "--prompt", "Once", "--max-new-tokens", "4"])
    assert result.exit_code == 0
    assert f"[kernels] lade, int8 compute, path: {kernels['path_at_build']}\n" in result.stderr



@pytest.fixture(scope="module")
def stories_lade_unfused(tmp_path_factory, stories_dir, stories_loaded):
    """stories260K's int8 build without RotaryAttentionRows (its norms, SwiGLU and residual adds
    folded into MatMulBlockQ as in every int8 build): each layer's attention as the graph's own
    nodes around AttentionRowsHalfCache, as builds made before the fused operator hold it."""
    from unittest import mock

    from lade_export.export.build import build_artifact

    out = tmp_path_factory.mktemp("lade-unfused") / "art"
    with mock.patch("lade_export.export.quantize.fuse_rotary_attention", return_value=0):
        build_artifact(str(stories_dir), [resolve_profile("default-int4")], out, loaded=stories_loaded,
                       quantization=QuantSpec.for_precision("int4", kernels="lade"))
    return out


def _all_outputs(artifact, feeds_list):
    """Every output of the artifact's graph (logits, ids, present keys/values) for each feeds, raw bytes."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.register_custom_ops_library(str(artifact / LIBRARY))
    session = ort.InferenceSession(str(artifact / "model.onnx"), options, providers=["CPUExecutionProvider"])
    names = sorted(o.name for o in session.get_outputs())
    return [{n: (v.shape, v.dtype, v.tobytes()) for n, v in zip(names, session.run(names, feeds))} for feeds in feeds_list]


@pytest.mark.parametrize("which", ["stories", "tiny"])
def test_rotary_attention_rows_computes_the_bits_of_the_nodes_it_replaces(request, which):
    """The fused graph (one RotaryAttentionRows per layer) against the same build without the fusion
    (the rotary embedding, the float16 rounding of this step's keys and values, the head reshapes
    and transposes as nodes around AttentionRowsHalfCache): logits, next ids and every present key
    and value the same bits, for one-token and many-token steps over empty, short and block-crossing
    caches, with causal masks and with rows that see scattered cache columns (a packed pass) — on
    stories260K (head width 8: the scalar code) and a tiny model of head width 64 (16 lanes at a
    time on AVX-512 CPUs; the forced-path tests compare that with the scalar code)."""
    from lade_export.feeds import example_feeds

    fused_art = request.getfixturevalue(f"{which}_lade")
    unfused_art = request.getfixturevalue(f"{which}_lade_unfused")
    layers = lade_export.load(fused_art).artifact.dims.num_layers
    unfused = onnx_ops(unfused_art)
    assert unfused.count("AttentionRowsHalfCache") == layers and "RotaryAttentionRows" not in unfused
    assert unfused.count("Transpose") >= 3 * layers and unfused.count("Cast") >= 4 * layers  # what the fusion removes
    fused = onnx_ops(fused_art)
    assert fused.count("RotaryAttentionRows") == layers and len(fused) < len(unfused) - layers * 25
    dims = lade_export.load(fused_art).artifact.dims
    rng = np.random.default_rng(3)
    cases = []
    for step, past in ((1, 0), (1, 37), (4, 0), (7, 16), (16, 33), (2, 100)):
        feeds = example_feeds(dims, step=step, past=past, seed=step + past, dtype=np.float16)
        cases.append(feeds)
        if past and step > 1:  # each row sees a scattered subset of the cache and itself
            mask = np.zeros_like(feeds["attention_mask"])
            mask[..., :past] = rng.random((step, past)) < 0.6
            mask[0, 0, np.arange(step), past + np.arange(step)] = True
            cases.append({**feeds, "attention_mask": mask})
    got, want = _all_outputs(fused_art, cases), _all_outputs(unfused_art, cases)
    assert len(got) == len(cases) == 9
    for case, a, b in zip(cases, got, want):
        assert a.keys() == b.keys() and any(n.startswith("present.") for n in a)
        for name in a:
            assert a[name] == b[name], (name, case["input_ids"].shape)


def onnx_ops(artifact) -> list[str]:
    import onnx

    return [n.op_type for n in onnx.load(str(artifact / "model.onnx"), load_external_data=False).graph.node]

@pytest.fixture(scope="module")
def stories_lade_decoder(stories_lade):
    with lade_export.load(stories_lade) as model:
        yield model.decoder


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**PROMPTS_AND_PROFILES)
def test_integer_path_lookahead_equals_greedy_bit_for_bit_for_random_prompts_and_profiles(
        stories_lade_decoder, body, w, n, g, k, max_new):
    """The integer path's rows are the same bits in any step on every CPU, so here lookahead
    equals greedy without the float32 engine's tie clause (tests/test_property.py)."""
    prompt = [1] + body
    profile = LookaheadProfile(w, n, g, lookup=k)
    greedy = stories_lade_decoder.generate(prompt, max_new, None)
    look = stories_lade_decoder.generate(prompt, max_new, profile)
    assert look.token_ids == greedy.token_ids
    assert look.stop_reason == greedy.stop_reason


def test_every_row_of_a_step_is_the_bits_it_has_alone(stories_lade):
    """The whole int8 step graph, not only its weight kernels: a token's logits and keys/values are
    the same bits in a one-token step and as row 0 of steps of 2…16 tokens over the same cache."""
    from lade_export.feeds import causal_feeds, empty_past_feeds, run_sequence_major
    from lade_export.specs import past_key_name, past_value_name, present_key_name, present_value_name

    model = lade_export.load(stories_lade)
    engine, dims = model.decoder.engine, model.artifact.dims
    rng = np.random.default_rng(0)
    out = run_sequence_major(engine, {**causal_feeds(list(rng.integers(3, dims.vocab, 20)), 0), **empty_past_feeds(dims)})
    cache = {}
    for i in range(dims.num_layers):
        cache[past_key_name(i)], cache[past_value_name(i)] = out[present_key_name(i)], out[present_value_name(i)]
    names = ["logits"] + [present_key_name(i) for i in range(dims.num_layers)] + \
        [present_value_name(i) for i in range(dims.num_layers)]
    alone = None
    for width in (1, 2, 3, 5, 8, 16):
        ids = [7] + list(rng.integers(3, dims.vocab, width - 1))
        got = run_sequence_major(engine, {**causal_feeds(ids, 20, logit_rows=np.arange(width)), **cache},
                                 with_logits=True)
        rows = {n: got[n][:, :1] for n in names}
        alone = alone or rows
        assert all(np.array_equal(rows[n], alone[n]) for n in names), width


@pytest.mark.parametrize("past", [37, 1300])  # 1300: rows over ~900 visible keys of ~80 blocks
def test_attention_rows_matches_float64_and_names_bad_shapes(library, past):
    from onnx import TensorProto, helper
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

    rng = np.random.default_rng(6)
    b, kv, group, s, p, d = 1, 2, 3, 4, past, 16
    q = rng.standard_normal((b, kv, group * s, d)).astype(np.float32)
    pk, k = rng.standard_normal((b, kv, d, p)).astype(np.float32), rng.standard_normal((b, kv, d, s)).astype(np.float32)
    pv, v = rng.standard_normal((b, kv, p, d)).astype(np.float32), rng.standard_normal((b, kv, s, d)).astype(np.float32)
    masked = rng.random((b, 1, 1, s, p + s)) < 0.3
    masked[..., 0] = False  # every row sees a key
    node = helper.make_node("AttentionRows", ["q", "pk", "k", "pv", "v", "m"], ["o"], domain="lade_export", scale=0.25)
    names = [("q", TensorProto.FLOAT), ("pk", TensorProto.FLOAT), ("k", TensorProto.FLOAT), ("pv", TensorProto.FLOAT),
             ("v", TensorProto.FLOAT), ("m", TensorProto.BOOL)]
    sess = _session(library, [node], {}, [(n, t, None) for n, t in names])
    got = sess.run(None, {"q": q, "pk": pk, "k": k, "pv": pv, "v": v, "m": masked})[0]
    keys = np.concatenate([pk, k], -1).astype(np.float64)  # [b, kv, d, total]
    values = np.concatenate([pv, v], 2).astype(np.float64)
    scores = np.einsum("bhrd,bhdj->bhrj", q.astype(np.float64), keys) * 0.25
    rows_masked = masked[:, 0, 0][:, None, np.arange(group * s) % s]  # row r is step row r mod S
    scores = np.where(rows_masked, -np.inf, scores)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    ref = np.einsum("bhrj,bhjd->bhrd", weights / weights.sum(-1, keepdims=True), values)
    assert 0 < np.max(np.abs(got - ref)) < 1e-5
    if past != 37:
        return
    with pytest.raises(InvalidArgument, match=r"AttentionRows: Q \[1, 2, 12, 16\], PK \[1, 2, 16, 37\], K "
                                              r"\[1, 2, 16, 4\], PV \[1, 2, 36, 16\], V .* do not fit together"):
        sess.run(None, {"q": q, "pk": pk, "k": k, "pv": pv[:, :, 1:], "v": v, "m": masked})


def _attention_rows(library, past_layout=None, threads=2, half_cache=False):
    """A session of one ``AttentionRows`` (``AttentionRowsHalfCache`` with ``half_cache``:
    float16 pk and pv, read in place)."""
    from onnx import TensorProto, helper

    extra = {} if past_layout is None else {"past_layout": past_layout}
    op = "AttentionRowsHalfCache" if half_cache else "AttentionRows"
    node = helper.make_node(op, ["q", "pk", "k", "pv", "v", "m"], ["o"], domain="lade_export", scale=0.125, **extra)
    cache = TensorProto.FLOAT16 if half_cache else TensorProto.FLOAT
    names = [("q", TensorProto.FLOAT), ("pk", cache), ("k", TensorProto.FLOAT), ("pv", cache),
             ("v", TensorProto.FLOAT), ("m", TensorProto.BOOL)]
    return _session(library, [node], {}, [(n, t, None) for n, t in names], threads=threads)


def test_half_cache_attention_of_a_batch_entry_is_its_bits_alone(library):
    """AttentionRowsHalfCache over a batch of 2 (each entry its own cache of 37 tokens: a
    partial last block) and a step of 16 rows, 3 query heads per KV head — enough groups per
    head that the keys are tiled and the values widened once into tiles (AVX-512) — gives each
    batch entry the bits it gets alone, with lookahead-style masks and NaN in columns no row sees."""
    rng = np.random.default_rng(5)
    kv, group, d, past, width = 2, 3, 64, 37, 16
    session = _attention_rows(library, past_layout=1, threads=2, half_cache=True)
    n = past + width
    keys = rng.standard_normal((2, n, kv, d)).astype(np.float16)
    values = rng.standard_normal((2, n, kv, d)).astype(np.float16)
    keys[:, 20:23] = values[:, 20:23] = np.nan  # no row sees these columns
    q = rng.standard_normal((2, kv, group * width, d)).astype(np.float32)
    sees = np.tril(np.ones((width, n), bool), k=past) & (rng.random((2, width, n)) < 0.8)
    sees[:, np.arange(width), past + np.arange(width)] = True
    sees[:, :, 20:23] = False

    def run(at):  # batch entries ``at`` (a slice)
        return session.run(None, {
            "q": np.ascontiguousarray(q[at]), "pk": np.ascontiguousarray(keys[at, :past]),
            "pv": np.ascontiguousarray(values[at, :past]),
            "k": np.ascontiguousarray(keys[at, past:].astype(np.float32).transpose(0, 2, 3, 1)),
            "v": np.ascontiguousarray(values[at, past:].astype(np.float32).transpose(0, 2, 1, 3)),
            "m": np.ascontiguousarray(~sees[at][:, None, None])})[0]

    both = run(slice(0, 2))
    assert np.isfinite(both).all()
    for b in range(2):
        assert np.array_equal(run(slice(b, b + 1))[0], both[b])


def test_attention_rows_bits_do_not_depend_on_masked_columns_or_the_cache_layout(library):
    """A packed pass's rows: each row's output is the same bits over its own request's
    columns alone as inside a pool with other requests' columns, unused room (NaN here: a
    skipped block is never read, a partly seen one's masked keys add nothing) and other rows
    around it; the in-place sequence-major cache (past_layout=1) gives the transposed
    layout's bits."""
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

    rng = np.random.default_rng(21)
    kv, group, d = 2, 3, 64
    own = [37, 5, 300]  # cached tokens of three requests (not multiples of 16: blocks shared at the edges)
    widths = [2, 1, 3]  # their step rows
    transposed, in_place = _attention_rows(library), _attention_rows(library, past_layout=1)

    def run(sess, q, cache_k, cache_v, k, v, masked, layout):
        if layout == "transposed":
            cache_k, cache_v = cache_k.transpose(0, 2, 3, 1), cache_v.transpose(0, 2, 1, 3)
        feeds = {"q": q, "pk": np.ascontiguousarray(cache_k), "k": k, "pv": np.ascontiguousarray(cache_v), "v": v,
                 "m": masked}
        return sess.run(None, feeds)[0]

    caches = [(rng.standard_normal((1, n, kv, d)).astype(np.float32),
               rng.standard_normal((1, n, kv, d)).astype(np.float32)) for n in own]
    steps = [(rng.standard_normal((1, kv, group * w, d)).astype(np.float32),  # q of the request's rows
              rng.standard_normal((1, kv, d, w)).astype(np.float32), rng.standard_normal((1, kv, w, d)).astype(np.float32))
             for w in widths]
    alone = []
    for (ck, cv), (q, k, v), n, w in zip(caches, steps, own, widths):
        masked = np.ones((1, 1, 1, w, n + w), bool)
        masked[..., :n] = False
        masked[0, 0, 0, :, n:] = ~np.tril(np.ones((w, w), bool))
        outs = [run(s, q, ck, cv, k, v, masked, layout) for s, layout in ((transposed, "transposed"), (in_place, "seq"))]
        assert np.array_equal(outs[0], outs[1]) and np.isfinite(outs[0]).all()
        alone.append(outs[0])
    # the pool: room, request 0, room, request 1, other columns, request 2, room (NaN where no request is)
    starts, total = [3, 61, 90], 400
    pool_k = np.full((1, total, kv, d), np.nan, np.float32)
    pool_v = np.full((1, total, kv, d), np.nan, np.float32)
    for (ck, cv), at, n in zip(caches, starts, own):
        pool_k[:, at:at + n], pool_v[:, at:at + n] = ck, cv
    pool_k[:, 70:85] = rng.standard_normal((1, 15, kv, d))  # a request not in this pass
    s = sum(widths)
    masked = np.ones((1, 1, 1, s, total + s), bool)
    q = np.zeros((1, kv, group * s, d), np.float32)
    k = np.zeros((1, kv, d, s), np.float32)
    v = np.zeros((1, kv, s, d), np.float32)
    o = 0
    for (qi, ki, vi), at, n, w in zip(steps, starts, own, widths):
        masked[0, 0, 0, o:o + w, at:at + n] = False
        masked[0, 0, 0, o:o + w, total + o:total + o + w] = ~np.tril(np.ones((w, w), bool))
        k[..., o:o + w], v[:, :, o:o + w] = ki, vi
        for g in range(group):  # row r of the op is step row r mod S: query group g of step row t is row g·S + t
            q[:, :, g * s + o:g * s + o + w] = qi[:, :, g * w:(g + 1) * w]
        o += w
    packed = run(in_place, q, pool_k, pool_v, k, v, masked, "seq")
    o = 0
    for want, w in zip(alone, widths):
        got = np.concatenate([packed[:, :, g * s + o:g * s + o + w] for g in range(group)], axis=2)
        assert np.array_equal(got, want), w
        o += w
    with pytest.raises(InvalidArgument, match=r"AttentionRows: Q \[1, 2, 18, 64\], PK \[1, 400, 2, 64\], K "
                                              r"\[1, 2, 64, 6\], PV \[1, 399, 2, 64\], V .* do not fit together"):
        run(in_place, q, pool_k, pool_v[:, 1:], k, v, masked, "seq")
    with pytest.raises(Exception, match="attribute past_layout = 2 is not 0"):
        run(_attention_rows(library, past_layout=2), q, pool_k, pool_v, k, v, masked, "seq")


# AttentionRows in a subprocess per forced path (LADE_KERNELS_PATH: avx512vnni and amx take the AVX-512
# attention, which computes rows that see the same key blocks together; the others the scalar one, row by
# row): 32 step tokens over a cache, each run as one step, and as steps of 1…32 rows with the tokens before
# them moved into the cache; every row must be the same bits in each, under 1 and 2 threads, on both cache
# layouts and on a float16 cache (AttentionRowsHalfCache, keys and values rounded to float16 wherever they
# sit, as the graph rounds a step's). Lookahead-like masks (each row sees a random subset of its history) and
# NaN in columns no row sees (a pool's unused room) included. Prints a digest of all outputs per thread count.
_ATTENTION_CHECK = r"""
import hashlib, json, sys
import numpy as np
sys.path.insert(0, sys.argv[2])
from test_kernels import _attention_rows
from lade_export.kernels import running_path
independent, digests, runs = True, {}, 0
for threads in (1, 2):
    digest = hashlib.sha256()
    sessions = {layout: _attention_rows(sys.argv[1], past_layout=layout, threads=threads) for layout in (None, 1)}
    sessions["half"] = _attention_rows(sys.argv[1], past_layout=1, threads=threads, half_cache=True)
    for kv, group, d, past, tree in ((1, 1, 8, 0, False), (2, 3, 8, 21, True), (3, 3, 64, 37, False),
                                     (3, 3, 64, 300, True), (2, 4, 72, 50, True), (1, 2, 128, 19, False),
                                     (3, 3, 64, 740, True)):
        rng = np.random.default_rng(kv * 1000 + d + past)
        n = past + 32  # the history: cache, then 32 step tokens
        keys = rng.standard_normal((1, n, kv, d)).astype(np.float32)
        values = rng.standard_normal((1, n, kv, d)).astype(np.float32)
        q = rng.standard_normal((1, kv, group, 32, d)).astype(np.float32)
        sees = np.tril(np.ones((32, n), bool), k=past)  # token t sees columns < past + t + 1
        if tree:  # a lookahead step: each token sees a random part of its history (itself always)
            sees &= rng.random((32, n)) < 0.7
            sees[np.arange(32), past + np.arange(32)] = True
            sees[:, 5:9] = False  # columns no row sees hold NaN: never read, or masked inside a seen block
            keys[:, 5:9] = values[:, 5:9] = np.nan
        halves = (keys.astype(np.float16), values.astype(np.float16))

        def step(a, width, layout):  # step tokens [a, a + width), the ones before them in the cache
            p = past + a
            hk, hv = halves if layout == "half" else (keys, values)
            ck, cv = hk[:, :p], hv[:, :p]
            if layout is None:
                ck, cv = ck.transpose(0, 2, 3, 1), cv.transpose(0, 2, 1, 3)
            feeds = {"q": np.ascontiguousarray(q[:, :, :, a:a + width].reshape(1, kv, group * width, d)),
                     "pk": np.ascontiguousarray(ck), "pv": np.ascontiguousarray(cv),
                     "k": np.ascontiguousarray(hk[:, p:p + width].astype(np.float32).transpose(0, 2, 3, 1)),
                     "v": np.ascontiguousarray(hv[:, p:p + width].astype(np.float32).transpose(0, 2, 1, 3)),
                     "m": ~sees[a:a + width, :p + width][None, None, None]}
            out = sessions[layout].run(None, feeds)[0]
            return out.reshape(1, kv, group, width, d)

        for layout in (None, 1, "half"):
            whole = step(0, 32, layout)
            digest.update(whole.tobytes())
            for width in (1, 2, 3, 5, 8, 16, 17, 31, 32):
                for a in sorted({0, min(3, 32 - width), 32 - width}):
                    independent &= bool(np.array_equal(step(a, width, layout), whole[:, :, :, a:a + width]))
                    runs += 1
    digests[threads] = digest.hexdigest()
print(json.dumps({"path": running_path(sys.argv[1], "int8"), "independent": independent, "digests": digests,
                  "runs": runs}))
"""


@pytest.fixture(scope="module")
def portable_attention(library):
    return _forced("portable", _ATTENTION_CHECK, library, os.path.dirname(__file__))


@pytest.mark.parametrize("path", PATHS["int8"])
def test_attention_rows_gives_each_row_its_bits_alone_in_any_step_thread_count_and_path(library, portable_attention,
                                                                                        path):
    """A token's attention output is the same bits computed alone over its history (the tokens
    before it in the cache) and inside steps of 2…32 rows, with its query heads and step rows
    computed together (the AVX-512 attention's groups) or one by one (the scalar one), on 1 or
    2 threads, over a float32 cache and over a float16 one: what keeps lookahead exact on
    int8-compute graphs."""
    _skip_unless_runs(library, path)
    got = portable_attention if path == "portable" else _forced(path, _ATTENTION_CHECK, library,
                                                                os.path.dirname(__file__))
    assert got["path"] == path
    assert got["runs"] == 2 * 7 * 3 * 24  # threads × shapes × caches (transposed, in place, float16) × (width, start)
    assert got["independent"] is True
    assert got["digests"]["1"] == got["digests"]["2"]
    assert got["digests"] == portable_attention["digests"]  # AVX-512 groups and scalar rows: the same bits


def test_the_int8_graph_reads_its_cache_in_place_and_batches_in_regions(stories_lade, reference_greedy):
    """The built int8 graph feeds each AttentionRows the sequence-major cache itself (no
    Transpose of a past input: a copy of the whole pool per layer), says so in its metadata,
    and the scheduler on it gives each request a contiguous region of the pool; four
    concurrent requests (three at a time: the fourth is admitted after a leave, into freed
    room) each equal their solo run."""
    import onnx

    from lade_export.scheduler import Scheduler

    graph = onnx.load(str(stories_lade / "model.onnx"), load_external_data=False).graph
    inputs = {i.name for i in graph.input}
    rows = [n for n in graph.node if n.op_type == "RotaryAttentionRows"]  # float16 cache, read in place
    assert not [n for n in graph.node if n.op_type in ("AttentionRows", "AttentionRowsHalfCache")]
    cache_io = [t for t in (*graph.input, *graph.output) if t.name.startswith(("past_key_values.", "present."))]
    assert len(cache_io) == 4 * 5 and {t.type.tensor_type.elem_type for t in cache_io} == {onnx.TensorProto.FLOAT16}
    assert [(n.input[3], n.input[4], n.output[1], n.output[2]) for n in rows] == [
        (f"past_key_values.{i}.key", f"past_key_values.{i}.value", f"present.{i}.key", f"present.{i}.value")
        for i in range(5)]
    assert not [n for n in graph.node if n.op_type == "Transpose" and n.input[0] in inputs]
    model = lade_export.load(stories_lade)
    decoder = model.decoder
    assert decoder.engine.attention_skips == 16  # the graph's metadata attention_skips_masked
    cases = reference_greedy["cases"]
    specs = [(cases[0]["prompt_ids"], 40, resolve_profile("default-int4")), (cases[1]["prompt_ids"], 24, None),
             (cases[2]["prompt_ids"], 32, resolve_profile("default")), (cases[1]["prompt_ids"], 30,
                                                                        resolve_profile("default-int4"))]
    solo = [decoder.generate(ids, n, prof).token_ids for ids, n, prof in specs]
    scheduler = Scheduler(decoder, max_batch=3)
    assert scheduler.pool.regions
    got, seen = [None] * len(specs), []

    def run(i):
        ids, n, prof = specs[i]
        chunks = []
        for chunk in scheduler.stream(ids, n, prof):
            chunks.append(chunk)
            seen.append(len(scheduler.pool._region))
        got[i] = [t for c in chunks for t in c.token_ids]

    run_in_threads(run, len(specs))
    assert got == solo
    assert max(seen) == 3  # three regions at once
    assert scheduler.pool.used == 0 and scheduler.active_requests == 0
    scheduler.close()


def test_steps_bound_to_a_caches_buffers_give_the_bits_of_its_views(stories_lade, reference_greedy, monkeypatch):
    """On an engine whose attention skips masked key blocks, a step whose cache feeds are a
    KVCache's own views runs on a prefix of the cache's buffers bound once (the mask widened
    with False columns up to it): every output, logits and present keys/values, is the
    bits the same feeds give as the caller's own arrays (the views path), for greedy and
    lookahead steps of one request and for the scheduler's packed passes over its pool (whose
    bound presents are views of one block, :class:`~lade_export.kv_cache.StackedPresents`); a
    step whose widened mask would pass KEPT_STEP_BYTES (a long prefill) takes the views path."""
    from lade_export.backends import onnxruntime as ort_backend
    from lade_export.errors import EngineError
    from lade_export.kv_cache import cache_of_feeds
    from lade_export.scheduler import Scheduler

    model = lade_export.load(stories_lade)
    decoder, engine = model.decoder, model.decoder.engine
    plain, bound = engine.run, engine._run_bound
    counts = collections.Counter()

    def counted(*args, **kwargs):
        out = bound(*args, **kwargs)
        counts["bound" if out is not None else "first sight"] += 1
        if out is not None and args[2].stacked:  # a pool's presents: views of one block, stored in one copy
            block = out["present.0.key"].base
            counts["pool"] += 1
            counts["one block"] += all(out[n].base is block for n in out if n.startswith("present."))
        return out

    def both(feeds, with_logits=False, plan=None):
        owned = cache_of_feeds(feeds)
        got = {k: (v.shape, v.dtype, v.tobytes()) for k, v in plain(feeds, with_logits=True).items()}
        if owned is not None:
            copies = {k: np.array(v) for k, v in feeds.items()}  # the caller's own arrays
            assert cache_of_feeds(copies) is None
            want = {k: (v.shape, v.dtype, v.tobytes()) for k, v in plain(copies, with_logits=True).items()}
            assert got == want
            counts["compared"] += 1
        return plain(feeds, with_logits=with_logits)

    monkeypatch.setattr(engine, "_run_bound", counted)
    monkeypatch.setattr(engine, "run", both)
    cases = reference_greedy["cases"]
    # 300 tokens: bound prefixes of 256 columns, then the whole capacity (305)
    specs = [(cases[0]["prompt_ids"], 300, None), (cases[1]["prompt_ids"], 24, resolve_profile("default-int4")),
             (cases[2]["prompt_ids"], 32, resolve_profile("default"))]
    solo = [decoder.generate(ids, n, prof).token_ids for ids, n, prof in specs]
    assert len(solo[0]) == 300
    steps = counts["compared"]
    # every step of every request reached it (twice a step above); a shape's first step ran on views
    assert steps >= 300 + 3 and counts["bound"] + counts["first sight"] == 2 * steps
    assert counts["bound"] > 1.9 * steps
    scheduler = Scheduler(decoder, max_batch=3)
    got = [None] * len(specs)

    def run(i):
        ids, n, prof = specs[i]
        got[i] = [t for c in scheduler.stream(ids, n, prof) for t in c.token_ids]

    run_in_threads(run, len(specs))
    scheduler.close()
    assert got == solo and counts["compared"] > steps + 10
    assert counts["bound"] - 1.9 * steps > counts["compared"] - steps  # most passes of the pool were bound
    assert counts["one block"] == counts["pool"] > 10
    # a step too wide for a kept mask: the views path (no step bound)
    monkeypatch.setattr(ort_backend, "KEPT_STEP_BYTES", 0)
    before = dict(counts)
    assert decoder.generate(*specs[0]).token_ids == solo[0]
    assert counts["bound"] == before["bound"] and counts["compared"] > before["compared"]
    # the cache's own views with a mask of another width
    monkeypatch.setattr(ort_backend, "KEPT_STEP_BYTES", 1 << 20)
    from lade_export.kv_cache import KVCache
    from lade_export.feeds import causal_feeds

    cache = KVCache(engine.dims, 16, layout=engine.kv_layout, dtype=engine.kv_dtype)
    cache.append(plain({**causal_feeds([1, 2, 3], 0), **cache.feeds()}), step=3)
    feeds = {**causal_feeds([4], 3), **cache.feeds()}
    feeds["attention_mask"] = feeds["attention_mask"][..., 1:]
    with pytest.raises(EngineError, match=r"^attention_mask is \[1, 1, 1, 3\], not \[1, 1, 1, 4\] for 3 cached "
                                          r"tokens and a step of 1$"):
        plain(feeds)
    # feeds the bound path does not take: a missing input, another dtype (refused alike every time)
    feeds = {**causal_feeds([4], 3), **cache.feeds()}
    del feeds["logits_positions"]
    for _ in range(2):
        with pytest.raises(EngineError, match=r"^ONNX Runtime step failed: .*logits_positions"):
            plain(feeds)
    feeds = {**causal_feeds([4], 3), **cache.feeds()}
    feeds["position_ids"] = feeds["position_ids"].astype(np.int32)
    for _ in range(2):
        with pytest.raises(EngineError, match=r"^ONNX Runtime step failed: .*Actual: \(tensor\(int32\)\)"):
            plain(feeds)
    # a history that shrinks (set by hand, as a pool's when its last request leaves): the bound mask's
    # columns past the new length are False again (the views' bits, compared by run above)
    for at in range(3, 12):
        cache.append(plain({**causal_feeds([at], at), **cache.feeds()}))
    before = dict(counts)
    for length in (12, 12, 5, 5, 9):
        cache.length = length
        engine.run({**causal_feeds([7], length), **cache.feeds()})
    assert counts["compared"] == before["compared"] + 5 and counts["bound"] >= before["bound"] + 4
    cache.length = 3
    engine._bound.pop(cache)
    # what a cache keeps bound: shapes of 1…4 tokens, each run twice (bound the second time), in a budget
    # of two one-token shapes' bytes: the latest shape alone is left, and the next step of the dropped
    # one-token shape is its first sight again
    one = None
    for width in (1, 1, 2, 2, 3, 3, 4, 4):
        got = plain({**causal_feeds(list(range(5, 5 + width)), 3), **cache.feeds()})
        kept = engine._bound[cache][0]
        one = one or next(iter(kept.values()), None)
        if one is not None:
            monkeypatch.setattr(ort_backend, "KEPT_CACHE_BYTES", 2 * one.nbytes)
    assert [k[1] for k in kept] == [4] and got["present.0.key"].shape == (1, 4, engine.dims.kv_heads, engine.dims.head_dim)
    before = dict(counts)
    plain({**causal_feeds([5], 3), **cache.feeds()})
    assert counts["first sight"] == before["first sight"] + 1


def test_int8_compute_refuses_group_query_attention_and_a_bad_forced_path(stories_lade, stories_dir, tmp_path):
    env = {**os.environ, "LADE_KERNELS_PATH": "sse9"}  # read once per process: a fresh one
    done = subprocess.run([sys.executable, "-m", "lade_export.cli", "generate", str(stories_lade), "--prompt", "Once",
                           "--max-new-tokens", "4"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.strip() == (
        "error: LADE_KERNELS_PATH=sse9 is none of amx, avx512vnni, avxvnni, avx2, avx512 (float32 compute), portable")
    result = CliRunner().invoke(main, ["build", "--model", str(stories_dir), "--precision", "int4", "--kernels", "lade",
                                       "--attention", "group-query-attention", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and result.stderr.strip() == (
        "error: --compute int8 computes attention with the lade kernels (each row over the keys it sees, for exact "
        "lookahead), on the onnx-ops graph: drop --attention group-query-attention")
    assert not (tmp_path / "o").exists()


def test_lookahead_equals_greedy_on_the_lade_engine(stories_lade, reference_greedy):
    from .test_quantize import assert_lookahead_equals_greedy

    assert_lookahead_equals_greedy(stories_lade, reference_greedy)


# Lookahead against greedy on an int8-compute artifact, in a subprocess per forced path: the greedy
# tokens, whether every profile gave them, the steps taken, and a digest of a 32-token step's logits.
_DECODE_CHECK = r"""
import hashlib, json, sys
import numpy as np
import lade_export
from lade_export.feeds import causal_feeds, empty_past_feeds, run_sequence_major
from lade_export.kernels import running_path
model = lade_export.load(sys.argv[1], threads=int(sys.argv[3]))
greedy, same, steps = [], True, []
for ids in json.loads(sys.argv[2]):
    base = model.generate(ids, max_new_tokens=96, lookahead=False, stop_token_ids=())
    greedy.append(base.token_ids)
    for profile in ("default-int4", "default", "paper", "2,3,2,6,2", "0,3,2,6,2"):
        look = model.generate(ids, max_new_tokens=96, profile=profile, stop_token_ids=())
        same &= look.token_ids == base.token_ids
        steps.append((look.stats.steps, base.stats.steps))
engine, dims = model.decoder.engine, model.artifact.dims
logits = run_sequence_major(engine, {**causal_feeds(greedy[0][:32], 0, logit_rows=np.arange(32)),
                                     **empty_past_feeds(dims)}, with_logits=True)["logits"]
print(json.dumps({"path": running_path(model.artifact.custom_ops_path, "int8"), "greedy": greedy, "same": same,
                  "steps": steps, "logits": hashlib.sha256(logits.tobytes()).hexdigest()}))
"""


def _tiny_lade(root, fuse_rotary: bool = True):
    """A tiny random LLaMA with SmolLM2's head width (64: the rotary embedding's 16-lane code), two
    query heads on one KV head and a 128-wide MLP (its down projection on the kernels, with the
    SwiGLU folded in), built with --kernels lade."""
    from unittest import mock

    from lade_export.export.build import build_artifact

    from .conftest import tiny_checkpoint

    ckpt = tiny_checkpoint(root / "ckpt", seed=7, hidden_size=128, intermediate_size=128, num_attention_heads=2,
                           num_key_value_heads=1)
    out = root / "art"
    with contextlib.nullcontext() if fuse_rotary else mock.patch("lade_export.export.quantize.fuse_rotary_attention",
                                                                  return_value=0):
        build_artifact(str(ckpt), [resolve_profile("default-int4")], out,
                       quantization=QuantSpec.for_precision("int4", kernels="lade"))
    return out


@pytest.fixture(scope="module")
def tiny_lade(tmp_path_factory):
    return _tiny_lade(tmp_path_factory.mktemp("tiny-lade"))


@pytest.fixture(scope="module")
def tiny_lade_unfused(tmp_path_factory):
    return _tiny_lade(tmp_path_factory.mktemp("tiny-lade-unfused"), fuse_rotary=False)


@pytest.fixture(scope="module")
def portable_decodes(stories_lade, tiny_lade, reference_greedy):
    prompts = json.dumps([c["prompt_ids"] for c in reference_greedy["cases"]])
    return {name: _forced("portable", _DECODE_CHECK, art, prompts, 2)
            for name, art in (("stories", stories_lade), ("tiny", tiny_lade))}


def test_a_cpu_without_avx512_decodes_on_its_avx2_path(stories_lade, reference_greedy):
    """On a CPU with AVX2, FMA and F16C but no AVX-512 (Haswell, emulated by QEMU's user mode), the
    artifact's library takes its avx2 path unforced and decodes the portable path's tokens and logits,
    lookahead equal to greedy: no AVX-512 instruction runs outside the AVX-512 paths (the scalar
    attention was once compiled with an AVX-512 target and stopped such a CPU at its first step)."""
    qemu = shutil.which("qemu-x86_64")
    if qemu is None or platform.machine() != "x86_64":
        pytest.skip("needs qemu-x86_64 (Debian: qemu-user) on an x86-64 machine")
    prompts = json.dumps([c["prompt_ids"][:24] for c in reference_greedy["cases"][:1]])
    got = _forced(None, _DECODE_CHECK, stories_lade, prompts, 1, emulate=[qemu, "-cpu", "Haswell"])
    want = _forced("portable", _DECODE_CHECK, stories_lade, prompts, 1)
    assert got["path"] == "avx2"
    assert got["same"] is True
    assert got["greedy"] == want["greedy"] and got["logits"] == want["logits"]
    assert len(got["greedy"][0]) == 96


@pytest.mark.parametrize("path", PATHS["int8"])
@pytest.mark.parametrize("which", ["stories", "tiny"])
def test_lookahead_equals_greedy_on_every_forced_integer_path(library, stories_lade, tiny_lade, reference_greedy,
                                                              portable_decodes, which, path):
    _skip_unless_runs(library, path)
    art = stories_lade if which == "stories" else tiny_lade
    prompts = json.dumps([c["prompt_ids"] for c in reference_greedy["cases"]])
    for threads in (1, 2):
        got = portable_decodes[which] if path == "portable" and threads == 2 else \
            _forced(path, _DECODE_CHECK, art, prompts, threads)
        assert got["path"] == path
        assert got["same"] is True  # every profile's output is this path's greedy output
        assert got["greedy"] == portable_decodes[which]["greedy"]  # every path, any thread count: the same tokens
        assert got["logits"] == portable_decodes[which]["logits"]  # and the same logits, bit for bit
        assert [len(g) for g in got["greedy"]] == [96, 96, 96]
    if which == "stories":  # lookahead really looked ahead: fewer steps than tokens on a trained model
        assert sum(look for look, _ in got["steps"]) < sum(base for _, base in got["steps"])
        assert got["greedy"][0][:8] == reference_greedy["cases"][0]["greedy_ids"][:8]


def test_threads_share_a_lade_engine(stories_lade):
    model = lade_export.load(stories_lade)
    prompts = ["Once upon a time", "The little dog", "Lily went to the park", "Tom had a red ball"]
    alone = [model.generate(p, max_new_tokens=48, profile="default").token_ids for p in prompts]
    got = [None] * len(prompts)

    def run(i):
        got[i] = model.generate(prompts[i], max_new_tokens=48, profile="default").token_ids

    run_in_threads(run, len(prompts))
    assert got == alone


def test_int8_with_float32_compute_lade_kernels_is_exact_and_looks_ahead(tmp_path, stories_dir, stories_loaded):
    import onnx

    from lade_export.export.build import build_artifact

    out = tmp_path / "int8"
    m = build_artifact(str(stories_dir), [resolve_profile("default-int4")], out, loaded=stories_loaded,
                       quantization=QuantSpec.for_precision("int8", kernels="lade", compute="float32"))
    assert m["graph"]["lookahead_exact"] is True and m["quantization"]["quality"]["top1_agreement"] > 0.97
    assert m["quantization"]["spec"]["compute"] == m["quantization"]["kernels"]["compute"] == "float32"
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False)  # as graphs made before the integer path
    assert not [a for n in graph.graph.node if n.op_type == "MatMulBlockQ" for a in n.attribute if a.name == "compute"]
    assert "AttentionRows" not in {n.op_type for n in graph.graph.node}
    result = CliRunner().invoke(main, ["generate", str(out), "--prompt", "Once", "--max-new-tokens", "4"])
    assert result.exit_code == 0
    assert f"[kernels] lade, float32 compute, path: {m['quantization']['kernels']['path_at_build']}\n" in result.stderr
    model = lade_export.load(out)
    greedy = model.generate("Once upon a time", max_new_tokens=64, lookahead=False)
    for profile in ("default-int4", "default", "paper"):
        assert model.generate("Once upon a time", max_new_tokens=64, profile=profile).token_ids == greedy.token_ids


def test_a_lade_artifact_without_its_library_is_refused(tmp_path, stories_lade):
    copy = tmp_path / "copy"
    shutil.copytree(stories_lade, copy)
    (copy / LIBRARY).unlink()
    with pytest.raises(ArtifactError, match="kernels/liblade_kernels.so"):
        lade_export.load(copy)
    result = CliRunner().invoke(main, ["generate", str(copy), "--prompt", "Once", "--max-new-tokens", "4"])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1


def test_a_library_that_is_not_loadable_here_is_one_line(tmp_path, stories_lade):
    """A library whose checksums agree with the manifest but that this machine cannot load (not
    an ELF file: another platform's build, a bad copy recorded as built): ONNX Runtime's one-line
    refusal, exit 2, not the dynamic loader's OSError traceback."""
    import hashlib
    import json

    copy = tmp_path / "copy"
    shutil.copytree(stories_lade, copy)
    junk = b"not a shared library\n" * 200
    (copy / LIBRARY).write_bytes(junk)
    m = json.loads((copy / "manifest.json").read_text())
    m["files"][LIBRARY] = {"sha256": hashlib.sha256(junk).hexdigest(), "bytes": len(junk)}
    (copy / "manifest.json").write_text(json.dumps(m))
    result = CliRunner().invoke(main, ["generate", str(copy), "--prompt", "Once", "--max-new-tokens", "4"])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"error: ONNX Runtime cannot load {copy / LIBRARY}: invalid ELF header"]


def test_a_damaged_library_is_refused_even_without_verification(tmp_path, stories_lade):
    """``verify=False`` skips the weights' checks, not the kernel library's: native code that is
    not the build's (here the same size, one byte changed; or truncated) is refused by name before
    ONNX Runtime maps it, where it could crash the process."""
    copy = tmp_path / "copy"
    shutil.copytree(stories_lade, copy)
    data = bytearray((copy / LIBRARY).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / LIBRARY).write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"checksum mismatch for kernels/liblade_kernels\.so"):
        lade_export.load(copy, verify=False)
    (copy / LIBRARY).write_bytes(bytes(data[:4096]))
    with pytest.raises(ArtifactError, match=r"size mismatch for kernels/liblade_kernels\.so: 4,096 bytes"):
        lade_export.load(copy, verify="none")


def test_inspect_does_not_load_a_library_that_is_not_the_one_built(tmp_path, stories_lade):
    """A truncated kernel library can crash the process that maps it (a bus error, not an
    OSError), so inspect loads it only when its size and sha256 are the manifest's: here it reports
    the mismatch in its file check, in a process that lives to exit 2."""
    copy = tmp_path / "copy"
    shutil.copytree(stories_lade, copy)
    whole = (stories_lade / LIBRARY).read_bytes()
    (copy / LIBRARY).write_bytes(whole[:1000])
    done = subprocess.run([sys.executable, "-m", "lade_export.cli", "inspect", str(copy)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-500:]
    assert f"1,000 bytes on disk, the manifest says {len(whole):,}" in " ".join(done.stdout.split())
    assert "this CPU takes" not in done.stdout


def test_a_build_offline_without_the_headers_stops_before_any_work(tmp_path, stories_dir, monkeypatch):
    """The other refused --kernels combinations are rows of docs/errors.md (tests/test_errors.py)."""
    import lade_export.kernels as kernels

    monkeypatch.delenv("LADE_ORT_INCLUDE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no headers in HOME's cache
    missing = (tmp_path / "offline.tgz").as_uri()  # a download that cannot succeed, like one without a network
    monkeypatch.setattr(kernels, "HEADERS_URL", missing)
    result = CliRunner().invoke(main, ["build", "--model", str(stories_dir), "--precision", "int4", "--kernels", "lade",
                                       "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    note, error = result.stderr.strip().splitlines()  # what the build is about to do, then the one error line
    assert note == (f"note: downloading ONNX Runtime's C/C++ headers (com.github.asus4.onnxruntime@0.4.9, ~150 MB, "
                    f"once) into {tmp_path / '.cache' / 'lade-export' / 'ort-include'}")
    assert error == (
        f"error: --kernels lade needs ONNX Runtime's C/C++ headers and could not download them "
        f"(com.github.asus4.onnxruntime@0.4.9 from {missing}: [Errno 2] No such file or directory: "
        f"'{tmp_path / 'offline.tgz'}'); connect, or set $LADE_ORT_INCLUDE to a folder holding onnxruntime_cxx_api.h")
    assert not (tmp_path / "o").exists() and not (tmp_path / ".cache" / "lade-export" / "ort-include").exists()
    with pytest.raises(ProfileError, match="--kernels must be onnxruntime or lade, got 'mlas'"):
        QuantSpec(4, kernels="mlas")
    result = CliRunner().invoke(main, ["build", "--model", str(stories_dir), "--precision", "int4", "--compute", "int8",
                                       "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and result.stderr.strip() == (
        "error: --compute picks the arithmetic of --kernels lade; ONNX Runtime's MatMulNBits takes --accuracy-level "
        "instead: drop --compute int8 or add --kernels lade")


def _headers_tarball(path, headers=("onnxruntime_cxx_api.h", "onnxruntime_c_api.h")):
    """A tarball laid out like the npm package: the headers inside the iOS framework, and other files."""
    import io
    import tarfile

    from lade_export.kernels import HEADERS_IN_PACKAGE

    with tarfile.open(path, "w:gz") as tar:
        for name, text in [(HEADERS_IN_PACKAGE + h, f"// {h}\n") for h in headers] + [("package/package.json", "{}")]:
            info = tarfile.TarInfo(name)
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text.encode()))
    return path


def test_headers_are_fetched_from_the_registry_package_and_checked(tmp_path, monkeypatch):
    import base64
    import hashlib

    import lade_export.kernels as kernels
    from lade_export.errors import BackendUnavailableError

    tarball = _headers_tarball(tmp_path / "pkg.tgz")
    dest = tmp_path / "cache" / "ort-include"
    with pytest.raises(BackendUnavailableError, match=r"the ONNX Runtime headers' tarball from file://.*pkg.tgz has "
                                                      r"sha512 .*, not the pinned BkzxduSZ9I.*; nothing was installed"):
        kernels.fetch_headers(dest, tarball.as_uri())
    assert not dest.exists() and sorted(p.name for p in dest.parent.iterdir()) == []  # nothing half-written
    monkeypatch.setattr(kernels, "HEADERS_SHA512", base64.b64encode(hashlib.sha512(tarball.read_bytes()).digest()).decode())
    assert kernels.fetch_headers(dest, tarball.as_uri()) == dest
    assert sorted(p.name for p in dest.iterdir()) == ["onnxruntime_c_api.h", "onnxruntime_cxx_api.h"]
    assert (dest / "onnxruntime_cxx_api.h").read_text() == "// onnxruntime_cxx_api.h\n"
    tarball.unlink()  # present headers: nothing is fetched
    assert kernels.fetch_headers(dest, tarball.as_uri()) == dest
    empty = _headers_tarball(tmp_path / "empty.tgz", headers=("cpu_provider_factory.h",))
    monkeypatch.setattr(kernels, "HEADERS_SHA512", base64.b64encode(hashlib.sha512(empty.read_bytes()).digest()).decode())
    with pytest.raises(BackendUnavailableError, match=r"holds no package/Plugins/.*/Headers/onnxruntime_cxx_api.h"):
        kernels.fetch_headers(tmp_path / "other", empty.as_uri())
    assert not (tmp_path / "other").exists()


def test_toolchain_problems_are_named(tmp_path, monkeypatch):
    from lade_export.errors import BackendUnavailableError
    from lade_export.kernels import header_dir, require_toolchain

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    with pytest.raises(BackendUnavailableError, match=r"\$CXX is '.*no-such-g\+\+', which is not an executable compiler"):
        require_toolchain()
    monkeypatch.setenv("CXX", "false")  # a compiler that fails without a word
    with pytest.raises(BackendUnavailableError, match=r"compiling the lade kernels failed: .*false exited with status 1, "
                                                      r"printing nothing"):
        compile_library(tmp_path / "lib.so")
    assert not list(tmp_path.iterdir())  # nothing half-written
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("LADE_ORT_INCLUDE", str(tmp_path))  # named, but empty: no fallback to the cache
    with pytest.raises(BackendUnavailableError, match=r"\$LADE_ORT_INCLUDE is .*, which holds no onnxruntime_cxx_api.h"):
        header_dir()


def test_dry_run_checks_the_toolchain_and_names_the_library(tmp_path, stories_dir, monkeypatch):
    args = ["build", "--model", str(stories_dir), "--precision", "int4", "--kernels", "lade", "--dry-run",
            "--out", str(tmp_path / "o")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "kernels/liblade_kernels.so (compiled)" in result.output
    monkeypatch.setenv("LADE_ORT_INCLUDE", str(tmp_path))
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "which holds no onnxruntime_cxx_api.h" in result.stderr
    monkeypatch.delenv("LADE_ORT_INCLUDE")
    monkeypatch.setenv("HOME", str(tmp_path))  # no cached headers: a dry run names the download, fetches nothing
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "kernels/liblade_kernels.so (compiled; ONNX Runtime's headers downloaded first, ~150 MB)" in result.output
    assert not (tmp_path / ".cache").exists()
    result = CliRunner().invoke(main, ["build", "--model", str(stories_dir), "--engine", "tensorrt", "--precision",
                                       "int4", "--kernels", "lade", "--out", str(tmp_path / "o")])
    assert result.stderr.strip().startswith("error: --kernels lade makes ONNX Runtime custom operators")


def test_check_reports_a_quantized_graph_without_holding_it_to_float32_bounds(stories_lade):
    result = CliRunner().invoke(main, ["check", str(stories_lade)])
    assert result.exit_code == 0, result.output
    assert "n/a (quantized)" in result.output and "check passed" in result.output
    assert ("note: int4 graph: its differences from the float32 PyTorch step are its quantization's (build-time "
            "quality against the float32 graph: top-1 agreement") in result.output


def test_torch_backend_and_foreign_libraries_are_refused(tmp_path, stories_lade):
    result = CliRunner().invoke(main, ["generate", str(stories_lade), "--prompt", "Once", "--backend", "torch"])
    assert result.exit_code == 2
    assert result.stderr.strip().startswith("error: --backend torch runs the float32 checkpoint (")
    assert result.stderr.strip().endswith("not this artifact's int4 weights; use --backend ort")
    copy = tmp_path / "copy"
    shutil.copytree(stories_lade, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    for name in ("../elsewhere/liblade_kernels.so", "/tmp/liblade_kernels.so", "kernels/unlisted.so"):
        manifest["graph"]["custom_ops"] = name
        (copy / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ArtifactError, match=f"graph.custom_ops '{name}' is not a file of the artifact listed in "
                                                 f"its files"):
            lade_export.load(copy)
