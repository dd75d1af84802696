"""TensorRT engines for the step graph: the builder (one engine per lookahead profile, two
optimization profiles each) and the runtime backend of the decoding loop.

Versions. Written against the TensorRT 10 and 11 Python APIs (named I/O tensors,
``set_input_shape``, ``set_tensor_address``, ``execute_async_v3``, optimization profiles,
timing cache, ``IProgressMonitor``). They differ in how precision is chosen
(:func:`precision_plan`): TensorRT 10 builds a weakly typed network from the float32
graph and lets the builder pick fp16/bf16 kernels (``BuilderFlag.FP16``/``BF16``);
TensorRT 11 removed those flags and every network is strongly typed, so the builder gets
a graph *exported* in the target precision (:mod:`lade_export.export.precision`) and runs it as
typed. Both keep the float32 I/O contract of :mod:`lade_export.specs`. Other majors are
refused with one line.

Runtimes. :class:`TensorRTEngine` runs with whichever TensorRT runtime is installed: the
full ``tensorrt`` module, or the lean runtime (``tensorrt_lean``, from PyPI's
``tensorrt-lean``/``tensorrt-lean-cu12`` wheels; also ``tensorrt_dispatch``), which
deserializes only engines built with ``--version-compatible`` and has no builder. Device
buffers go through :mod:`lade_export.backends.cuda` (``cuda-bindings``), so a service runs
engines with the lean runtime, numpy and nothing else — no PyTorch.

Why a hand-written builder rather than Polygraphy's loaders: ``NetworkFromOnnxPath``,
``CreateConfig`` and ``EngineBytesFromNetwork`` reach far more of TensorRT than the
fifteen calls this builder makes (plugin-library setup, quantization flags, tactic
sources, profiling verbosity, their own logger subclass), so a test double would have to
imitate API the project never calls, and their failures come back as Polygraphy
exceptions after a multi-line log instead of one line naming the cause. Likewise
``lade-export check`` wraps :class:`TensorRTEngine` as a Polygraphy runner rather than
using ``TrtRunner``, which keeps one optimization profile per activation and needs
``libcudart`` on the loader path: the wrapper runs each feed in the optimization
profile that covers it, through the same code that serves requests.

TensorRT is optional: this module imports it only inside functions. Note: no TensorRT
and no GPU exist where this was written; every line here runs in CI against a test
double of the TensorRT API (``tests/trt_double.py``) that enforces the API's rules and
computes real outputs with ONNX Runtime — it complements, never replaces, a real run.
"""

from __future__ import annotations

import importlib
import threading
import time
from pathlib import Path

import numpy as np

from ..errors import ArtifactError, BackendUnavailableError, EngineError, GenerationError, ProfileError
from .cuda import grow_buffer

SUPPORTED_MAJORS = (10, 11)
PRECISIONS = ("fp32", "fp16", "bf16")
#: numpy/ONNX dtype name of each precision.
PRECISION_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
#: (max |Δ|, max |Δ| / max |reference|) per output against the float32 PyTorch step, by
#: engine precision; argmax must agree too. Reduced precision is bounded relatively: fp16
#: keeps ~3 decimal digits (unit roundoff 4.9e-4), bf16 ~2 (3.9e-3), and errors grow
#: through the layers — measured 5.7e-3 (stories260K, fp16 graph, 51-token prefill) and
#: 1.2e-3 (SmolLM2-135M) under ONNX Runtime.
PRECISION_BOUNDS = {"fp32": (1e-3, 1e-4), "fp16": (float("inf"), 2e-2), "bf16": (float("inf"), 1e-1)}
#: Importable module names of a TensorRT runtime, in order of preference, and their kind.
RUNTIME_MODULES = (("tensorrt", "full"), ("tensorrt_lean", "lean"), ("tensorrt_lean_bindings", "lean"),
                   ("tensorrt_dispatch", "dispatch"), ("tensorrt_dispatch_bindings", "dispatch"))
FULL_HINT = ("the full TensorRT builds and runs engines: pip install 'lade-export[tensorrt]' "
             "(tensorrt from NVIDIA's index pypi.nvidia.com, on a machine with an NVIDIA GPU)")
LEAN_HINT = ("the lean runtime only runs engines built with --version-compatible: "
             "pip install 'lade-export[tensorrt-lean]' (tensorrt-lean and cuda-bindings, from PyPI)")


# -- which TensorRT is here ---------------------------------------------------------------

def _import(name: str):
    """The module, None when it is not installed; raises BackendUnavailableError when it
    is installed but cannot be imported (a placeholder wheel, a missing libnvinfer)."""
    hint = FULL_HINT if name == "tensorrt" else LEAN_HINT
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name and name.startswith(err.name.split(".")[0]):
            return None
        raise BackendUnavailableError(f"{name} cannot be imported (missing {err.name}); {hint}") from None
    except Exception as err:  # noqa: BLE001 - placeholder wheels raise anything on import
        first = str(err).splitlines()[0] if str(err) else ""
        raise BackendUnavailableError(f"{name} cannot be imported ({type(err).__name__}: {first}); {hint}") from None


def version_of(module) -> tuple[int, int]:
    """(major, minor) of a TensorRT module's ``__version__``."""
    parts = str(module.__version__).split(".")
    return int(parts[0]), int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def check_version(module) -> int:
    """The module's major version, when lade-export supports it.

    Raises:
        BackendUnavailableError: a TensorRT other than 10.x or 11.x.
    """
    major = version_of(module)[0]
    if major not in SUPPORTED_MAJORS:
        raise BackendUnavailableError(
            f"TensorRT {module.__version__} is not supported: lade-export builds and runs engines with TensorRT 10 or 11 "
            "(pip install 'tensorrt>=10,<12')")
    return major


def import_builder():
    """The full ``tensorrt`` module (builder and ONNX parser), of a supported version.

    Raises:
        BackendUnavailableError: not installed (naming the full and the lean packages),
            not importable, or an unsupported version.
    """
    trt = _import("tensorrt")
    if trt is None:
        lean = _installed_runtimes(("lean", "dispatch"))
        has = f"only the {lean[0]} runtime is installed, which cannot build engines; " if lean else ""
        raise BackendUnavailableError(f"TensorRT is not installed; {has}{FULL_HINT}; {LEAN_HINT}")
    check_version(trt)
    return trt


def import_runtime(kind: str | None = None):
    """``(module, kind)`` of the first installed TensorRT runtime (full, lean, dispatch),
    or of the given ``kind``.

    Raises:
        BackendUnavailableError: none installed (naming the full and lean packages), or
            an unsupported version.
    """
    for name, k in RUNTIME_MODULES:
        if kind not in (None, k):
            continue
        module = _import(name)
        if module is not None:
            check_version(module)
            return module, k
    wanted = f"the TensorRT {kind} runtime is" if kind else "TensorRT is"
    raise BackendUnavailableError(f"{wanted} not installed; {LEAN_HINT}; {FULL_HINT}")


def _installed_runtimes(kinds=("full", "lean", "dispatch")) -> list:
    """Names of the importable TensorRT modules of ``kinds`` (broken installs left out)."""
    found = []
    for name, kind in RUNTIME_MODULES:
        try:
            if kind in kinds and _import(name) is not None:
                found.append(name)
        except BackendUnavailableError:
            pass
    return found


def installed_tensorrt_major() -> int | None:
    """Major version of the installed TensorRT (the full module, else a runtime), None if none."""
    names = _installed_runtimes()
    return version_of(importlib.import_module(names[0]))[0] if names else None


def tensorrt_unavailable_reason(purpose: str = "build") -> str | None:
    """None when TensorRT can ``build`` (the full module) or ``run`` (any runtime) here with
    a CUDA GPU, else a one-line reason with the fix."""
    from .cuda import cuda_unavailable_reason

    try:
        import_builder() if purpose == "build" else import_runtime()
    except BackendUnavailableError as err:
        return str(err)
    reason = cuda_unavailable_reason()
    return f"TensorRT is installed but {reason}" if reason else None


def require_tensorrt(purpose: str = "build") -> None:
    """Raise :class:`BackendUnavailableError` with the reason when TensorRT cannot
    ``build`` or ``run`` here (see :func:`tensorrt_unavailable_reason`)."""
    reason = tensorrt_unavailable_reason(purpose)
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
        opt_profiles: ``{"prefill": {input: {"min","opt","max"}}, "decode": {...},
            "packed": {...}}`` from
            :func:`lade_export.export.optimization_profiles.optimization_profiles`; added in that
            order, so optimization profile 0 is prefill, 1 decode and 2 packed (when given).
        precision: ``fp32``, ``fp16`` or ``bf16``.
        timing_cache: path read before and written after the build (shared across builds).
        version_compatible: ``BuilderFlag.VERSION_COMPATIBLE`` (later TensorRT and the lean
            runtime can run the engine).
        hardware_compatible: ``HardwareCompatibilityLevel.AMPERE_PLUS`` (any Ampere+ GPU).
        workspace_bytes: builder workspace limit, bytes.
        on_progress: ``callable(phase_name, step, steps)`` while the builder runs.

    Returns:
        ``(plan_bytes, info)``, info = {tensorrt_version, compute_capability, build_s,
        precision_plan}.

    Raises:
        BackendUnavailableError: the full TensorRT or a GPU is missing, or an unsupported
            version.
        ArtifactError: the ONNX parser rejects the graph (first parser error quoted), or
            the build fails.
    """
    from .cuda import CudaDevice

    require_tensorrt("build")
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
    for phase in opt_profiles:
        profile = builder.create_optimization_profile()
        for name, shape in opt_profiles[phase].items():
            profile.set_shape(name, shape["min"], shape["opt"], shape["max"])
        config.add_optimization_profile(profile)
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


# -- runtime ------------------------------------------------------------------------------

class _Plan:
    """One engine of the manifest: its optimization-profile shapes, and once used, the
    deserialized ``ICudaEngine`` and an execution context per optimization profile."""

    def __init__(self, root: Path, entry):
        self.entry = entry  # a lade_export.manifest.EngineEntry
        self.name = entry.profile.name
        self.path = root / entry.file
        self.phases = list(entry.optimization_profiles)  # index = optimization profile index
        self.shapes = entry.optimization_profiles
        decode = self.shapes["decode"]
        self.decode_step = decode["input_ids"]["max"][1]
        self.decode_rows = decode["logits_positions"]["max"][1]
        self.max_past = decode["past_key_values.0.key"]["max"][1]
        self.max_prompt = self.shapes["prefill"]["input_ids"]["max"][1]
        self.engine = None
        self.contexts: dict[int, object] = {}
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.dtypes: dict[str, np.dtype] = {}

    def covers(self, index: int, shapes: dict) -> bool:
        """Whether optimization profile ``index`` admits every input shape in ``shapes``."""
        for name, s in self.shapes[self.phases[index]].items():
            shape = shapes.get(name)
            if shape is None or len(shape) != len(s["min"]):
                return False
            if any(not lo <= d <= hi for d, lo, hi in zip(shape, s["min"], s["max"])):
                return False
        return True

    def limits(self) -> str:
        packed = self.shapes.get("packed")
        rows = f"; packed passes ≤ {packed['input_ids']['max'][1]} rows, pool ≤ " \
               f"{packed['past_key_values.0.key']['max'][1]}" if packed else ""
        return (f"{self.name} (prefill ≤ {self.max_prompt} tokens; decode steps ≤ {self.decode_step} tokens, "
                f"≤ {self.decode_rows} logit rows, cache ≤ {self.max_past}{rows})")


class TensorRTEngine:
    """Runs the TensorRT engines built by ``lade-export build --engine tensorrt``.

    Every step goes to the engine and optimization profile that cover its shapes: an
    empty cache tries the prefill profile (0) first, a step with a cache the decode
    profile (1), then the packed profile (2, the scheduler's passes, in engines built
    with it: :mod:`lade_export.export.optimization_profiles`). Which engine is a request's:
    :meth:`check_profile` returns, for a lookahead profile, the name of the engine whose
    decode profile covers its largest step with the fewest tokens to spare (its plan),
    and the request passes that name with each of its steps (``run(..., plan=name)``):
    that engine is tried first, then the engines already loaded, then the smallest. The
    choice travels with the request, never as state of this object, so concurrent
    requests of different profiles each run on their own engine; a step without a plan
    (greedy decoding, a scheduler's packed pass) goes to a loaded engine that covers it
    if any. A workload of one profile loads one engine. Any covering engine computes the
    same step; the order only saves memory and keeps steps near an engine's tuned
    shapes. Engines are deserialized when first used. One execution context per
    (engine, optimization profile); ``run`` holds a lock, so one object serves several
    threads.

    Args:
        artifact: an opened :class:`lade_export.artifact.Artifact` with ``engines`` entries.
        engine: only this engine (by profile name; ``lade-export check`` checks each);
            None: all of them.
        device: ``cuda`` or ``cuda:N`` (TensorRT runs on a GPU; anything else means cuda:0).
        runtime: ``full``, ``lean`` or ``dispatch``; None: the first installed
            (:data:`RUNTIME_MODULES`). The lean and dispatch runtimes run only engines
            built with ``--version-compatible``.

    Attributes:
        runtime_kind: ``full``, ``lean`` or ``dispatch``; ``runtime_description`` says
            which module and version run the engines.
        kv_layout: ``"sequence-major"`` (TensorRT builds keep the standard attention operators).
        step_room: None (no rotary table past the context).
        attention_skips: 0 (attention spans every column).

    Raises:
        BackendUnavailableError: no TensorRT runtime, no CUDA wrapper or GPU, an
            unsupported version, or a lean runtime with engines that are not
            version-compatible.
        ArtifactError: no engines in the manifest, an unknown ``engine``, or engines built
            for another GPU or TensorRT version.
    """

    name = "tensorrt"
    kv_layout = "sequence-major"
    step_room = None
    attention_skips = 0

    def __init__(self, artifact, engine: str | None = None, device: str = "cuda", runtime: str | None = None):
        from .cuda import CudaDevice, cuda_unavailable_reason

        entries = list(artifact.spec.engines)
        if not entries:
            raise ArtifactError(f"{artifact.root} has no TensorRT engines; build it with --engine tensorrt")
        if engine is not None:
            names = [e.profile.name if e.profile else e.file for e in entries]
            entries = [e for e in entries if e.profile is not None and e.profile.name == engine]
            if not entries:
                raise ArtifactError(f"{artifact.root} has no TensorRT engine {engine!r}; it has {', '.join(names)}")
        self.trt, self.runtime_kind = import_runtime(runtime)
        self.version = str(self.trt.__version__)
        reason = cuda_unavailable_reason()  # before trt.Runtime, which crashes the process without a GPU
        if reason:
            raise BackendUnavailableError(f"TensorRT is installed but {reason}")
        index = int(device.split(":", 1)[1]) if device.startswith("cuda:") else 0
        self.cuda = CudaDevice(index)
        self.dims = artifact.dims
        capability = self.cuda.compute_capability
        for e in entries:
            self._check_entry(e, capability)
        self.plans = [_Plan(artifact.root, e) for e in entries]
        self.max_prompt = max(p.max_prompt for p in self.plans)
        self.max_context = max(p.max_past for p in self.plans) + 1
        self.runtime_description = (f"TensorRT {self.version} {self.runtime_kind} runtime ({self.trt.__name__}) on GPU "
                                    f"{index} (compute capability {capability})")
        self._runtime = None
        self._buffers: dict[str, object] = {}
        self._mirrors: dict[int, object] = {}  # id(KVCache) -> its KVMirror (device copy of the cache)
        self._latest = None  # (present.0.key returned by the latest run, its present device buffers)
        self._lock = threading.Lock()

    def _check_entry(self, entry, capability: str) -> None:
        file = entry.file
        if entry.profile is None or entry.optimization_profiles is None:
            raise ArtifactError(f"engine {file}: its manifest entry lacks its profile or optimization profiles; "
                                "rebuild with lade-export build --engine tensorrt")
        built = entry.tensorrt_version or "?"
        vc = bool(entry.version_compatible)
        if self.runtime_kind != "full" and not vc:
            raise BackendUnavailableError(
                f"{file} was built without --version-compatible, which the {self.runtime_kind} runtime "
                f"({self.trt.__name__}) needs; rebuild with --version-compatible, or install the full TensorRT "
                "(pip install 'lade-export[tensorrt]')")
        if entry.compute_capability != capability and not entry.hardware_compatible:
            raise ArtifactError(
                f"engine {file} was built for compute capability {entry.compute_capability}, this GPU is "
                f"{capability}; rebuild it here or with --hardware-compatible")
        same = built.split(".")[:3] == self.version.split(".")[:3]
        later = version_of(self.trt) >= tuple(int(x) for x in built.split(".")[:2]) if built != "?" else False
        if not (same or (vc and later)):
            need = "this exact version" if not vc else "this version or a later one"
            raise ArtifactError(
                f"engine {file} was built with TensorRT {built} and needs {need}; this runtime is {self.version}: "
                "rebuild it here" + ("" if vc else " (or build with --version-compatible)"))

    # -- engines and contexts ------------------------------------------------------------

    def _trt_runtime(self):
        if self._runtime is None:
            trt = self.trt
            self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
            # Version-compatible plans carry host code (their lean runtime); the manifest
            # lists them with size and sha256, checked when the artifact was opened.
            self._runtime.engine_host_code_allowed = True
        return self._runtime

    def _load(self, plan: _Plan) -> None:
        trt = self.trt
        engine = self._trt_runtime().deserialize_cuda_engine(plan.path.read_bytes())
        if engine is None:
            raise ArtifactError(f"TensorRT {self.version} ({self.runtime_kind} runtime) cannot deserialize "
                                f"{plan.entry.file}; see the TensorRT log above")
        numpy_of = {trt.float32: np.float32, trt.float16: np.float16, trt.int64: np.int64, trt.int32: np.int32,
                    trt.bool: np.bool_}
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        for name in names:
            dtype = engine.get_tensor_dtype(name)
            if dtype not in numpy_of:
                raise ArtifactError(f"{plan.entry.file}: I/O tensor {name} is {dtype}; the runtime exchanges "
                                    "float32, int64 and bool tensors (rebuild the engine)")
            plan.dtypes[name] = np.dtype(numpy_of[dtype])
        plan.inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        plan.outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        if engine.num_optimization_profiles != len(plan.phases):
            raise ArtifactError(f"{plan.entry.file} has {engine.num_optimization_profiles} optimization profiles; "
                                f"the manifest lists {len(plan.phases)} ({', '.join(plan.phases)})")
        plan.engine = engine

    def _context(self, plan: _Plan, index: int):
        if plan.engine is None:
            self._load(plan)
        ctx = plan.contexts.get(index)
        if ctx is None:
            ctx = plan.engine.create_execution_context()
            if ctx is None:
                raise EngineError(f"TensorRT cannot create an execution context for {plan.entry.file} "
                                  "(out of GPU memory?)")
            if not ctx.set_optimization_profile_async(index, self.cuda.stream_handle):
                raise EngineError(f"TensorRT cannot select optimization profile {index} ({plan.phases[index]}) of "
                                  f"{plan.entry.file}")
            self.cuda.synchronize()
            plan.contexts[index] = ctx
        return ctx

    def select(self, feeds: dict, plan: str | None = None):
        """``(plan, optimization profile index)`` whose shapes cover ``feeds``, None if none.

        Args:
            feeds: the step's inputs (only their shapes are read).
            plan: the name of the engine to try first (what :meth:`check_profile` returned
                for the request's profile), or None.

        Order: the engine named ``plan``, then the loaded engines, then the smallest decode
        step; within an engine the prefill profile first for an empty cache, else the
        decode profile, then packed.

        Raises:
            GenerationError: ``plan`` names no engine of this object.
        """
        if plan is not None and all(p.name != plan for p in self.plans):
            raise GenerationError(f"no TensorRT engine {plan!r} here (engines: {', '.join(p.name for p in self.plans)})")
        shapes = {k: tuple(np.shape(v)) for k, v in feeds.items()}
        past = shapes.get("past_key_values.0.key", (0, 0, 0))[1]
        plans = sorted(self.plans, key=lambda p: (p.name != plan, p.engine is None, p.decode_step))
        preference = ("prefill", "decode", "packed") if past == 0 else ("decode", "packed", "prefill")
        for candidate in plans:
            order = sorted(range(len(candidate.phases)), key=lambda i: preference.index(candidate.phases[i])
                           if candidate.phases[i] in preference else 9)
            for index in order:
                if candidate.covers(index, shapes):
                    return candidate, index
        return None

    @property
    def packed_limits(self) -> tuple[int, int] | None:
        """``(rows, pool tokens)`` the engines' packed optimization profiles cover (the
        largest of them), None when no engine has one (built before batching existed)."""
        limits = [(p.shapes["packed"]["input_ids"]["max"][1], p.shapes["packed"]["past_key_values.0.key"]["max"][1] + 1)
                  for p in self.plans if "packed" in p.shapes]
        return max(limits) if limits else None

    def check_batching(self, token_budget: int, prefill_chunk: int, kv_tokens: int) -> None:
        """Refuse continuous batching whose passes no engine's packed profile covers.

        Args:
            token_budget, prefill_chunk, kv_tokens: the scheduler's options
                (:class:`lade_export.scheduler.Scheduler`).

        Raises:
            GenerationError: no engine has a packed profile (rebuild), or the options
                exceed its rows or pool tokens.
        """
        limits = self.packed_limits
        if limits is None:
            raise GenerationError("batching=True needs TensorRT engines with a packed optimization profile; these were "
                                  "built before batching existed: rebuild with --engine tensorrt")
        rows, tokens = limits
        if max(token_budget, prefill_chunk) > rows or kv_tokens > tokens:
            raise GenerationError(f"the scheduler's passes (token budget {token_budget}, prefill chunk "
                                  f"{prefill_chunk}, pool of {kv_tokens} tokens) exceed the TensorRT engines' packed "
                                  f"profile ({rows} rows, {tokens} pool tokens): give the scheduler smaller options "
                                  "(Scheduler(model.decoder, token_budget=…, prefill_chunk=…, kv_tokens=…)) or rebuild "
                                  "the engines with a larger --max-context")

    def optimization_profile_for(self, feeds: dict, plan: str | None = None) -> str | None:
        """``"ENGINE:PHASE"`` that :meth:`run` would use for ``feeds`` with ``plan`` (None: not covered)."""
        chosen = self.select(feeds, plan)
        return f"{chosen[0].name}:{chosen[0].phases[chosen[1]]}" if chosen else None

    def check_profile(self, profile) -> str:
        """Refuse a lookahead profile whose largest step no engine's decode profile covers
        (called by :meth:`lade_export.runtime.Decoder.check_request`), else choose its engine.

        Returns:
            the name of the engine whose decode profile covers the profile's largest step
            and logit rows with the fewest tokens to spare: the request's ``plan`` for
            :meth:`run`. Nothing is kept here.

        Raises:
            ProfileError: naming the profile, its largest step and each engine's limits.
        """
        fits = [p for p in self.plans if p.decode_step >= profile.max_step and p.decode_rows >= profile.max_logit_rows]
        if fits:
            return min(fits, key=lambda p: p.decode_step).name
        have = "; ".join(f"{p.name}: steps ≤ {p.decode_step}, ≤ {p.decode_rows} logit rows" for p in self.plans)
        raise ProfileError(
            f"profile {profile.name!r} needs steps of up to {profile.max_step} tokens ({profile.max_logit_rows} logit "
            f"rows), more than any TensorRT engine here covers ({have}); rebuild with --engine tensorrt --profile "
            f"{profile.name}")

    # -- running -------------------------------------------------------------------------

    def _mirror(self, plan: _Plan, feeds: dict):
        """The device copy of the host cache behind ``feeds`` (created on first use), or
        None when the feeds do not come from a :class:`~lade_export.kv_cache.KVCache` of
        batch 1 the engine can mirror (then the cache is uploaded whole, as any input).
        Copies of caches that no longer exist are freed here."""
        from ..kv_cache import owner_of
        from .cuda import KVMirror

        for key in [k for k, m in self._mirrors.items() if m.cache() is None]:
            self._mirrors.pop(key).close()
        names = [n for n in plan.inputs if n.startswith("past_key_values.")]
        cache = owner_of(feeds.get(names[0])) if names else None
        if cache is None or cache.layout != "sequence-major" or np.shape(feeds[names[0]])[0] != 1:
            return None, None
        layer = {n: cache.keys[i] if n.endswith(".key") else cache.values[i]
                 for n in names for i in [int(n.split(".")[1])]}
        if any(getattr(feeds[n], "base", None) is not layer[n] or plan.dtypes[n] != np.float32 for n in names):
            return None, None
        mirror = self._mirrors.get(id(cache))
        if mirror is None or mirror.cache() is not cache or mirror.names != names:
            if mirror is not None:
                mirror.close()
            mirror = self._mirrors[id(cache)] = KVMirror(self.cuda, cache, names)
        return cache, mirror

    def run(self, feeds: dict, with_logits: bool = False, plan: str | None = None) -> dict:
        """One forward pass; same contract as the ONNX Runtime engine (numpy in, numpy out,
        ``logits`` only when ``with_logits`` — it is then the only output not copied back
        otherwise). ``plan``: the engine to try first (the request's, from
        :meth:`check_profile`; see :meth:`select`), None to choose by the shapes alone.

        The KV cache stays on the GPU: when the ``past_key_values.*`` feeds are a
        :class:`~lade_export.kv_cache.KVCache`'s (batch 1, as the decoding loop and the
        scheduler's pool pass them), the engine binds a device copy of that cache
        (:class:`~lade_export.backends.cuda.KVMirror`), kept in step by copying the rows
        each append kept from this engine's ``present.*`` buffers on the device; a step
        then uploads only ``input_ids``, ``position_ids``, ``attention_mask`` and
        ``logits_positions`` (plus the rows of any write the engine did not produce).
        Other feeds (a batch > 1, arrays of no cache) are uploaded whole. Outputs are
        copied back as before (``present.*`` too: the host cache keeps the accepted rows).

        Raises:
            GenerationError: no engine's optimization profiles cover the step (a prompt
                longer than the engines' ``--max-prompt``, a cache beyond their
                ``--max-context``, a larger batch or step), or ``plan`` names no engine here.
            EngineError: TensorRT rejects an input shape or fails to run the step, or a
                CUDA copy fails.
        """
        with self._lock:
            chosen = self.select(feeds, plan)
            if chosen is None:
                step = np.shape(feeds["input_ids"])
                past = np.shape(feeds["past_key_values.0.key"])[1]
                rows = np.shape(feeds["logits_positions"])[1]
                raise GenerationError(
                    f"no TensorRT engine covers a step of {step[1]} tokens (batch {step[0]}) with {past} cached tokens "
                    f"and {rows} logit rows: {'; '.join(p.limits() for p in self.plans)}; rebuild with larger "
                    "--max-prompt/--max-context/--max-batch")
            plan, index = chosen
            ctx = self._context(plan, index)
            where = f"{plan.entry.file} (optimization profile {index}, {plan.phases[index]})"
            cache, mirror = self._mirror(plan, feeds)
            if mirror is not None:
                mirror.sync(cache, feeds, self._latest)
            hold = []
            for name in plan.inputs:
                on_device = mirror is not None and name in mirror.offsets
                array = feeds[name] if on_device else np.ascontiguousarray(feeds[name], dtype=plan.dtypes[name])
                if not ctx.set_input_shape(name, array.shape):
                    s = plan.shapes[plan.phases[index]][name]
                    raise EngineError(f"TensorRT rejected shape {list(array.shape)} of {name} in {where}; the profile "
                                      f"allows {s['min']} to {s['max']}")
                if on_device:
                    address = mirror.address(name)
                else:
                    buf = grow_buffer(self.cuda, self._buffers, name, array.nbytes)
                    self.cuda.upload(buf, array)
                    hold.append(array)
                    address = buf.ptr
                if not ctx.set_tensor_address(name, address):
                    raise EngineError(f"TensorRT rejected the device address of {name} in {where}")
            outputs = {}
            for name in plan.outputs:
                shape = tuple(ctx.get_tensor_shape(name))
                if any(d < 0 for d in shape):
                    raise EngineError(f"TensorRT could not infer the shape of output {name} in {where}: {list(shape)}")
                host = np.empty(shape, plan.dtypes[name])
                buf = grow_buffer(self.cuda, self._buffers, name, host.nbytes)
                if not ctx.set_tensor_address(name, buf.ptr):
                    raise EngineError(f"TensorRT rejected the device address of {name} in {where}")
                outputs[name] = (host, buf)
            self._latest = None  # the present buffers are about to be overwritten
            if not ctx.execute_async_v3(self.cuda.stream_handle):
                self.cuda.synchronize()
                raise EngineError(f"TensorRT failed to run {where} on a step of {np.shape(feeds['input_ids'])[1]} "
                                  f"tokens with {np.shape(feeds['past_key_values.0.key'])[1]} cached; see the "
                                  "TensorRT log above")
            result = {}
            for name, (host, buf) in outputs.items():
                if with_logits or name != "logits":
                    self.cuda.download(host, buf)
                    result[name] = host
            self.cuda.synchronize()
            del hold
            result = {n: a.astype(np.float32) if a.dtype == np.float16 else a for n, a in result.items()}
            source = result.get("present.0.key")
            if source is not None and all(plan.dtypes.get(n) == np.float32 for n in outputs if n.startswith("present.")):
                # What an append of these outputs copied is still in the present buffers until the next run.
                self._latest = (source, {f"past_key_values.{n[len('present.'):]}": (buf, 0)
                                         for n, (_, buf) in outputs.items() if n.startswith("present.")})
        return result

    @property
    def loaded_engines(self) -> list[str]:
        """Names of the engines deserialized so far."""
        return [p.name for p in self.plans if p.engine is not None]

    def close(self) -> None:
        """Release contexts, engines, device buffers and the stream (idempotent)."""
        with self._lock:
            for plan in self.plans:
                plan.contexts.clear()
                plan.engine = None
            self._runtime = None
            self._buffers.clear()
            self._mirrors.clear()
            self._latest = None
            self.cuda.close()
