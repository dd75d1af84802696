"""Engine backends. Each module imports its framework lazily, so a missing optional
backend (TensorRT) costs nothing until it is asked for.

Every engine has the same interface, :class:`lade_export.runtime.Engine`: ``name``,
``dims`` (model shape facts), ``kv_layout``, ``step_room``, ``attention_skips``,
``check_profile(profile) -> plan``, ``check_batching(...)``, ``run(feeds,
with_logits=False, plan=None) -> outputs`` on numpy arrays named as in
:mod:`lade_export.specs`, and ``close()``.
"""

from ..errors import BackendUnavailableError, GenerationError

BACKENDS = ("ort", "torch", "tensorrt")
#: Compute dtypes of the torch backend (ONNX Runtime and TensorRT compute in the artifact's precision).
DTYPES = ("float32", "float16", "bfloat16")


def open_engine(artifact, backend: str, threads=None, device="cpu", dtype="float32"):
    """Engine for an opened :class:`lade_export.artifact.Artifact` by backend name.

    ``ort`` runs the artifact's ONNX graph (CPU, or the CUDA execution provider with
    ``device="cuda"``); ``torch`` loads the checkpoint named in the manifest and runs the
    step module (``dtype`` float32/float16/bfloat16); ``tensorrt`` runs the artifact's
    TensorRT engines on GPU 0 (or ``cuda:N``), each step on the engine whose
    optimization profile covers it, with the full TensorRT or the lean runtime.

    Raises:
        BackendUnavailableError: the backend or device is missing, or an unknown backend name.
        ModelSourceError: the torch backend cannot load the recorded checkpoint.
        GenerationError: an unknown ``dtype``, or one other than float32 for a backend that
            computes in the artifact's own precision (ONNX Runtime, TensorRT); the torch
            backend on an int4/int8 artifact (it would run the float32 checkpoint instead).
    """
    if backend not in BACKENDS:
        raise BackendUnavailableError(f"unknown backend {backend!r}: {', '.join(BACKENDS)}")
    if dtype not in DTYPES:
        raise GenerationError(f"dtype must be {', '.join(DTYPES[:-1])} or {DTYPES[-1]}, got {dtype!r}")
    if backend != "torch" and dtype != "float32":
        if backend == "tensorrt":  # graph.precision is model.onnx's; the engines carry their own
            precision = ", ".join(sorted({str(e.precision) for e in artifact.spec.engines})) or "fp32"
        else:
            precision = artifact.spec.graph.precision
        raise GenerationError(f"--dtype {dtype} applies to the torch backend; the {backend} backend computes in the "
                              f"artifact's precision ({precision}, chosen at build time with --precision)")
    if backend == "ort":
        from .onnxruntime import OrtEngine

        return OrtEngine(artifact.onnx_path, artifact.dims, threads=threads, provider="cuda" if device == "cuda" else "cpu",
                         custom_ops=artifact.custom_ops_path)
    if backend == "torch":
        precision = artifact.spec.graph.precision
        if precision in ("int4", "int8"):
            raise GenerationError(f"--backend torch runs the float32 checkpoint ({artifact.spec.source.model}), "
                                  f"not this artifact's {precision} weights; use --backend ort")
        import torch

        from .torch import TorchEngine
        from ..model_source import load_model

        loaded = load_model(artifact.spec.source.model)
        return TorchEngine(loaded.model, device=device, dtype=getattr(torch, dtype), threads=threads)
    from .tensorrt import TensorRTEngine

    return TensorRTEngine(artifact, device=device if device.startswith("cuda") else "cuda")
