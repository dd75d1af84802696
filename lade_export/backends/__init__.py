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
    if backend == "tensorrt":
        from .tensorrt import TensorRTEngine

        return TensorRTEngine(artifact, device=device if device.startswith("cuda") else "cuda")
    opener = _EXPORT_SIDE.get(backend)
    if opener is None:
        raise BackendUnavailableError(f"the {backend} backend is the export side's; import lade_export.export "
                                      "(installed with the export extra) before opening it")
    return opener(artifact, device=device, dtype=dtype, threads=threads)


#: Engines the export side registers (:func:`register_backend`): name → opener.
_EXPORT_SIDE: dict = {}


def register_backend(name: str, opener) -> None:
    """Make ``open_engine(artifact, name, …)`` call ``opener(artifact, device=, dtype=, threads=)``.

    The run-time engines (ONNX Runtime, TensorRT) are this package's own; the PyTorch
    reference engine lives on the export side (:mod:`lade_export.export.torch_engine`, it
    runs :class:`lade_export.graph.DecoderStep`) and registers itself here when
    :mod:`lade_export.export` is imported, so nothing in this package imports export code.

    Raises:
        BackendUnavailableError: ``name`` is not one of :data:`BACKENDS` or is a run-time engine.
    """
    if name not in BACKENDS or name in ("ort", "tensorrt"):
        raise BackendUnavailableError(f"cannot register backend {name!r}: the export side provides only 'torch'")
    _EXPORT_SIDE[name] = opener
