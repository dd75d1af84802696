"""Building TensorRT engines from the step graph: one serialized engine per lookahead
profile, with the prefill, decode and packed optimization profiles of
:mod:`lade_export.export.optimization_profiles`.

This is the export side of the TensorRT path (Polygraphy's loader/runner habit: the
export side builds, :mod:`lade_export.backends.tensorrt` deserializes and runs); which
TensorRT is installed is :mod:`lade_export.backends.tensorrt_install`'s answer, shared by
both.

Versions. Written against the TensorRT 10 and 11 Python APIs (``Builder``,
``OnnxParser``, ``IBuilderConfig``, optimization profiles, timing cache,
``IProgressMonitor``, ``build_serialized_network``). They differ in how precision is
chosen (:func:`precision_plan`): TensorRT 10 builds a weakly typed network from the
float32 graph and lets the builder pick fp16/bf16 kernels (``BuilderFlag.FP16``/``BF16``);
TensorRT 11 removed those flags and every network is strongly typed, so the builder gets
a graph *exported* in the target precision (:mod:`lade_export.export.precision`) and
runs it as typed. Both keep the float32 I/O contract of :mod:`lade_export.specs`. Other
majors are refused with one line. Only the full ``tensorrt`` module builds; the lean and
dispatch runtimes cannot.

Why a hand-written builder rather than Polygraphy's loaders: ``NetworkFromOnnxPath``,
``CreateConfig`` and ``EngineBytesFromNetwork`` reach far more of TensorRT than the
fifteen calls this builder makes (plugin-library setup, quantization flags, tactic
sources, profiling verbosity, their own logger subclass), so a test double would have to
imitate API the project never calls, and their failures come back as Polygraphy
exceptions after a multi-line log instead of one line naming the cause.

Note: no TensorRT and no GPU exist where this was written; every line here runs in CI
against a test double of the TensorRT API (``tests/trt_double.py``) that enforces the
API's rules — it complements, never replaces, a real build.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..backends.tensorrt_install import (FULL_HINT, LEAN_HINT, SUPPORTED_MAJORS, check_version, import_module,
                                         installed_runtimes, tensorrt_unavailable_reason)
from ..errors import ArtifactError, BackendUnavailableError

PRECISIONS = ("fp32", "fp16", "bf16")
#: numpy/ONNX dtype name of each precision.
PRECISION_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
#: (max |Δ|, max |Δ| / max |reference|) per output against the float32 PyTorch step, by
#: engine precision; argmax must agree too. Reduced precision is bounded relatively: fp16
#: keeps ~3 decimal digits (unit roundoff 4.9e-4), bf16 ~2 (3.9e-3), and errors grow
#: through the layers (what the reduced-precision graphs reach: bench/results/tensorrt-precision.md).
PRECISION_BOUNDS = {"fp32": (1e-3, 1e-4), "fp16": (float("inf"), 2e-2), "bf16": (float("inf"), 1e-1)}


def import_builder():
    """The full ``tensorrt`` module (builder and ONNX parser), of a supported version.

    Raises:
        BackendUnavailableError: not installed (naming the full and the lean packages),
            not importable, or an unsupported version.
    """
    trt = import_module("tensorrt")
    if trt is None:
        lean = installed_runtimes(("lean", "dispatch"))
        has = f"only the {lean[0]} runtime is installed, which cannot build engines; " if lean else ""
        raise BackendUnavailableError(f"TensorRT is not installed; {has}{FULL_HINT}; {LEAN_HINT}")
    check_version(trt)
    return trt


def builder_unavailable_reason() -> str | None:
    """None when the full TensorRT and a CUDA GPU are here to build engines, else a
    one-line reason with the fix."""
    return tensorrt_unavailable_reason(import_builder)


def require_builder() -> None:
    """Raise :class:`BackendUnavailableError` with the reason when TensorRT cannot build
    engines here (see :func:`builder_unavailable_reason`)."""
    reason = builder_unavailable_reason()
    if reason:
        raise BackendUnavailableError(reason)


# -- precision ----------------------------------------------------------------------------

def precision_plan(precision: str, major: int) -> dict:
    """How an engine of ``precision`` is built with TensorRT ``major``.

    Returns:
        ``{"tensorrt_major", "network": "weakly typed" | "strongly typed", "graph_dtype":
        dtype of the ONNX graph handed to the parser, "builder_flags": flags set,
        "cleared_flags": flags cleared, "io_dtype": "float32"}``. TensorRT 10: the float32
        graph with ``FP16``/``BF16`` set; TensorRT 11 (no such flags): a strongly typed
        network from the step exported in float16/bfloat16. ``TF32`` is cleared for fp32
        so the engine stays within the float32 parity bound.

    Raises:
        ArtifactError: unknown precision.
        BackendUnavailableError: a major other than 10 or 11.
    """
    if precision not in PRECISIONS:
        raise ArtifactError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if major not in SUPPORTED_MAJORS:
        raise BackendUnavailableError(f"TensorRT {major} is not supported: lade-export builds engines with TensorRT 10 "
                                      "or 11")
    cleared = ["TF32"] if precision == "fp32" else []
    if major == 10:
        flags = [] if precision == "fp32" else [precision.upper()]
        return {"tensorrt_major": 10, "network": "weakly typed", "graph_dtype": "float32", "builder_flags": flags,
                "cleared_flags": cleared, "io_dtype": "float32"}
    return {"tensorrt_major": 11, "network": "strongly typed", "graph_dtype": PRECISION_DTYPES[precision],
            "builder_flags": [], "cleared_flags": cleared, "io_dtype": "float32"}


def describe_precision_plan(plan: dict) -> str:
    """One line for ``build --dry-run``, e.g. ``TensorRT 10: weakly typed network from the
    float32 graph, builder flag FP16; I/O float32``."""
    graph = "the float32 graph" if plan["graph_dtype"] == "float32" else \
        f"the step exported in {plan['graph_dtype']} (RMSNorm and softmax in float32)"
    flags = [f"builder flag {f}" for f in plan["builder_flags"]] + [f"{f} off" for f in plan["cleared_flags"]]
    return (f"TensorRT {plan['tensorrt_major']}: {plan['network']} network from {graph}"
            f"{', ' + ', '.join(flags) if flags else ', no precision flags'}; I/O {plan['io_dtype']} "
            "(KV cache and logits as in the graph contract)")


# -- builder ------------------------------------------------------------------------------

def build_engine(onnx_path: str | Path, opt_profiles: dict, precision: str = "fp16",
                 timing_cache: str | Path | None = None, version_compatible: bool = False,
                 hardware_compatible: bool = False, workspace_bytes: int = 4 << 30, on_progress=None) -> tuple:
    """Build a serialized TensorRT engine from the step graph.

    Args:
        onnx_path: the (sanitized) ONNX step graph, in the dtype of the precision plan
            (:func:`precision_plan`'s ``graph_dtype`` for the installed TensorRT).
        opt_profiles: the optimization profiles' shapes by phase, ``{"prefill": {input:
            {"min","opt","max"}}, "decode": {...}, "packed": {...}}`` from
            :func:`lade_export.export.optimization_profiles.optimization_profiles`; added in
            that order, so optimization profile 0 is prefill, 1 decode and 2 packed (when given).
        precision: ``fp32``, ``fp16`` or ``bf16``.
        timing_cache: path read before and written after the build (shared across builds).
        version_compatible: ``BuilderFlag.VERSION_COMPATIBLE`` (later TensorRT and the lean
            runtime can run the engine).
        hardware_compatible: ``HardwareCompatibilityLevel.AMPERE_PLUS`` (any Ampere+ GPU).
        workspace_bytes: builder workspace limit, bytes.
        on_progress: ``callable(builder_phase_name, step, steps)`` while the builder runs
            (the builder's own phases, from ``IProgressMonitor``).

    Returns:
        ``(plan_bytes, info)``, info = {tensorrt_version, compute_capability, build_s,
        precision_plan}.

    Raises:
        BackendUnavailableError: the full TensorRT or a GPU is missing, or an unsupported
            version.
        ArtifactError: the ONNX parser rejects the graph (first parser error quoted), or
            the build fails.
    """
    from ..backends.cuda import CudaDevice

    require_builder()
    trt = import_builder()
    plan = precision_plan(precision, check_version(trt))
    device = CudaDevice(0)
    try:
        capability = device.compute_capability
    finally:
        device.close()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    if plan["network"] == "strongly typed":
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        first = str(parser.get_error(0)).splitlines()[0] if parser.num_errors else "unknown error"
        raise ArtifactError(f"TensorRT's ONNX parser rejected {onnx_path}: {first}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    for flag in plan["builder_flags"]:
        config.set_flag(getattr(trt.BuilderFlag, flag))
    for flag in plan["cleared_flags"]:
        config.clear_flag(getattr(trt.BuilderFlag, flag))
    if version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    if hardware_compatible:
        config.hardware_compatibility_level = trt.HardwareCompatibilityLevel.AMPERE_PLUS
    for shapes in opt_profiles.values():
        opt_profile = builder.create_optimization_profile()
        for name, shape in shapes.items():
            opt_profile.set_shape(name, shape["min"], shape["opt"], shape["max"])
        config.add_optimization_profile(opt_profile)
    cache_path = Path(timing_cache) if timing_cache else None
    cache = config.create_timing_cache(cache_path.read_bytes() if cache_path and cache_path.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    if on_progress is not None:
        config.progress_monitor = _progress_monitor(trt, on_progress)
    t0 = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ArtifactError(f"TensorRT failed to build an engine from {onnx_path} (see the TensorRT log above)")
    if cache_path:
        tmp = cache_path.with_name(cache_path.name + ".tmp")
        tmp.write_bytes(memoryview(config.get_timing_cache().serialize()))
        tmp.replace(cache_path)
    info = {"tensorrt_version": str(trt.__version__), "compute_capability": capability,
            "build_s": round(time.perf_counter() - t0, 1), "precision_plan": plan}
    return bytes(memoryview(serialized)), info


def _progress_monitor(trt, callback):
    """An ``IProgressMonitor`` passing the builder's phases to ``callback(name, step, steps)``."""
    class Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)

        def phase_start(self, phase_name, parent_phase, num_steps):
            callback(phase_name, 0, num_steps)

        def step_complete(self, phase_name, step):
            callback(phase_name, step, None)
            return True

        def phase_finish(self, phase_name):
            pass

    return Monitor()
