"""TensorRT engines for the step graph: builder (one engine per lookahead profile, two
optimization profiles each) and a runtime engine for the decoding loop.

Written against the TensorRT 10 Python API (named I/O tensors, ``set_input_shape``,
``set_tensor_address``, ``execute_async_v3``, optimization profiles, timing cache,
``IProgressMonitor``). TensorRT is an optional extra: this module imports it only inside
functions, and :func:`tensorrt_unavailable_reason` explains what is missing.

Note: this workplace has no TensorRT (PyPI's ``tensorrt`` is a stub that downloads from
NVIDIA's index), so the code paths that call TensorRT have not run here; everything
around them (shapes, manifest entries, CLI flow) is unit-tested.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import numpy as np

from ..errors import ArtifactError, BackendUnavailableError

INSTALL_HINT = "pip install 'lade-export[tensorrt]' (NVIDIA's tensorrt ≥ 10 wheels, from pypi.nvidia.com) on a machine with an NVIDIA GPU"
PRECISIONS = ("fp32", "fp16", "bf16")


def tensorrt_unavailable_reason() -> str | None:
    """None when TensorRT and a CUDA GPU are usable here, else a one-line reason with the fix."""
    if importlib.util.find_spec("tensorrt") is None:
        return f"TensorRT is not installed; {INSTALL_HINT}"
    try:
        import tensorrt  # noqa: F401
    except Exception as err:  # the PyPI stub raises on import when its download failed
        return f"TensorRT cannot be imported ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); {INSTALL_HINT}"
    try:
        import torch

        if not torch.cuda.is_available():
            return "TensorRT is installed but no CUDA GPU is visible (torch.cuda.is_available() is False)"
    except ImportError:
        return "TensorRT engines need PyTorch with CUDA for device buffers"
    return None


def require_tensorrt() -> None:
    """Raise :class:`BackendUnavailableError` with the reason when TensorRT cannot run here."""
    reason = tensorrt_unavailable_reason()
    if reason:
        raise BackendUnavailableError(reason)


def build_engine(onnx_path: str | Path, opt_profiles: dict, precision: str = "fp16",
                 timing_cache: str | Path | None = None, version_compatible: bool = False,
                 hardware_compatible: bool = False, workspace_bytes: int = 4 << 30, on_progress=None) -> tuple:
    """Build a serialized TensorRT engine from the step graph.

    Args:
        onnx_path: the (sanitized) ONNX step graph.
        opt_profiles: ``{"prefill": {input: {"min","opt","max"}}, "decode": {...}}`` from
            :func:`lade_export.optimization_profiles.optimization_profiles`; added in that
            order, so profile index 0 is prefill and 1 is decode.
        precision: ``fp32``, ``fp16`` or ``bf16`` (builder flags; I/O stays as declared).
        timing_cache: path read before and written after the build (shared across builds).
        version_compatible: set ``BuilderFlag.VERSION_COMPATIBLE`` (engine runs on later TensorRT).
        hardware_compatible: ``HardwareCompatibilityLevel.AMPERE_PLUS`` (any Ampere+ GPU).
        workspace_bytes: builder workspace limit.
        on_progress: ``callable(phase_name, step, steps)`` while the builder runs.

    Returns:
        ``(plan_bytes, info)`` with info = {tensorrt_version, compute_capability, build_s}.

    Raises:
        BackendUnavailableError: TensorRT or a GPU is missing.
        ArtifactError: the ONNX parser rejects the graph (first parser error quoted), or
            the build fails.
    """
    require_tensorrt()
    import tensorrt as trt
    import torch

    if precision not in PRECISIONS:
        raise ArtifactError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        first = parser.get_error(0) if parser.num_errors else "unknown error"
        raise ArtifactError(f"TensorRT's ONNX parser rejected {onnx_path}: {first}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    elif precision == "bf16":
        config.set_flag(trt.BuilderFlag.BF16)
    if version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    if hardware_compatible:
        config.hardware_compatibility_level = trt.HardwareCompatibilityLevel.AMPERE_PLUS
    for phase in ("prefill", "decode"):
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
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise ArtifactError(f"TensorRT failed to build an engine from {onnx_path} (see the TensorRT log above)")
    if cache_path:
        tmp = cache_path.with_name(cache_path.name + ".tmp")
        tmp.write_bytes(memoryview(config.get_timing_cache().serialize()))
        tmp.replace(cache_path)
    major, minor = torch.cuda.get_device_capability()
    info = {"tensorrt_version": trt.__version__, "compute_capability": f"{major}.{minor}",
            "build_s": round(time.perf_counter() - t0, 1)}
    return bytes(memoryview(plan)), info


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


class TensorRTEngine:
    """Runs a TensorRT plan built by ``lade-export build --engine tensorrt``.

    Picks the optimization profile by step kind: an empty cache with a step longer than
    one token is a prefill (profile 0), everything else a decode step (profile 1); one
    execution context per profile. Device buffers are torch CUDA tensors.

    Args:
        artifact: an opened :class:`lade_export.artifact.Artifact` with an ``engines`` entry.
        profile_name: which engine (default: the first).
        device: ``cuda`` (the only choice).

    Raises:
        BackendUnavailableError: TensorRT or a GPU is missing.
        ArtifactError: no engine in the manifest, or its file/compute capability does not match.
    """

    name = "tensorrt"

    def __init__(self, artifact, profile_name: str | None = None, device: str = "cuda"):
        require_tensorrt()
        import tensorrt as trt
        import torch

        from ..graph import ModelDims

        engines = artifact.manifest.get("engines", [])
        if not engines:
            raise ArtifactError(f"{artifact.root} has no TensorRT engines; build with --engine tensorrt")
        entry = next((e for e in engines if profile_name in (None, e["profile"]["name"])), None)
        if entry is None:
            raise ArtifactError(f"no engine for profile {profile_name!r} in {artifact.root}")
        major, minor = torch.cuda.get_device_capability()
        if entry["compute_capability"] != f"{major}.{minor}" and not entry.get("hardware_compatible"):
            raise ArtifactError(
                f"engine {entry['file']} was built for compute capability {entry['compute_capability']}, "
                f"this GPU is {major}.{minor}; rebuild it here or with --hardware-compatible"
            )
        self.torch = torch
        self.dims = ModelDims(**artifact.manifest["model"]["dims"])
        self.entry = entry
        logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(logger)
        if entry.get("version_compatible"):
            self.runtime.engine_host_code_allowed = True
        self.engine = self.runtime.deserialize_cuda_engine((artifact.root / entry["file"]).read_bytes())
        self.stream = torch.cuda.Stream()
        self.contexts = []
        for index in range(self.engine.num_optimization_profiles):
            ctx = self.engine.create_execution_context()
            ctx.set_optimization_profile_async(index, self.stream.cuda_stream)
            self.contexts.append(ctx)
        self.names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.outputs = [n for n in self.names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self._dtypes = {n: self._torch_dtype(trt, self.engine.get_tensor_dtype(n)) for n in self.names}

    @staticmethod
    def _torch_dtype(trt, dtype):
        import torch

        return {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
                trt.int64: torch.int64, trt.int32: torch.int32, trt.bool: torch.bool}[dtype]

    def run(self, feeds: dict, with_logits: bool = False) -> dict:
        """Same contract as the ONNX Runtime engine (numpy in, numpy out)."""
        torch = self.torch
        step = feeds["input_ids"].shape[1]
        past = feeds["past_key_values.0.key"].shape[2]
        ctx = self.contexts[0 if past == 0 and step > 1 else 1]
        keep = []
        for name, value in feeds.items():
            t = torch.from_numpy(np.ascontiguousarray(value)).to("cuda", self._dtypes[name])
            keep.append(t)
            ctx.set_input_shape(name, tuple(t.shape))
            ctx.set_tensor_address(name, t.data_ptr())
        outs = {}
        for name in self.outputs:
            shape = tuple(ctx.get_tensor_shape(name))
            outs[name] = torch.empty(shape, dtype=self._dtypes[name], device="cuda")
            ctx.set_tensor_address(name, outs[name].data_ptr())
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise ArtifactError("TensorRT execute_async_v3 failed")
        self.stream.synchronize()
        return {n: (o.float() if o.is_floating_point() else o).cpu().numpy() for n, o in outs.items()
                if with_logits or n != "logits"}

    def close(self) -> None:
        self.contexts = []
        self.engine = None
