"""ONNX Runtime engine for the exported decoder step (CPU, or the CUDA execution provider)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import ArtifactError, BackendUnavailableError, EngineError
from ..specs import ModelDims


class OrtEngine:
    """Runs the step graph with ONNX Runtime.

    Args:
        onnx_path: the exported ``model.onnx`` (external data beside it is found by ORT).
        dims: the model's shape facts (from the manifest, or the step module at export).
        threads: intra-op threads (None: ORT's default, one per core).
        provider: ``"cpu"`` or ``"cuda"`` (CUDAExecutionProvider, when onnxruntime-gpu is installed).

    ``run`` may be called from several threads at once (ONNX Runtime sessions allow
    concurrent ``Run`` calls and release the GIL while running).

    Raises:
        ArtifactError: the model file is missing or ORT cannot load it.
        BackendUnavailableError: ``provider="cuda"`` without the CUDA execution provider.
    """

    name = "ort"

    def __init__(self, onnx_path: str | Path, dims: ModelDims, threads: int | None = None, provider: str = "cpu"):
        import onnxruntime as ort

        path = Path(onnx_path)
        if not path.is_file():
            raise ArtifactError(f"ONNX model not found: {path}")
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        available = ort.get_available_providers()
        if provider == "cuda":
            if "CUDAExecutionProvider" not in available:
                raise BackendUnavailableError(
                    "ONNX Runtime has no CUDAExecutionProvider here; pip install onnxruntime-gpu (needs an NVIDIA GPU)"
                )
            providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
        else:
            providers = ["CPUExecutionProvider"]
        try:
            self.session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as err:  # ORT raises its own Fail/InvalidGraph types
            raise ArtifactError(f"ONNX Runtime cannot load {path}: {str(err).splitlines()[0]}") from None
        self.dims = dims
        self._all_outputs = [o.name for o in self.session.get_outputs()]
        self._fast_outputs = [n for n in self._all_outputs if n != "logits"]

    def run(self, feeds: dict, with_logits: bool = False) -> dict:
        """One forward pass. ``feeds``: numpy arrays by input name. Returns numpy arrays by
        output name; ``logits`` only when ``with_logits`` (the decoder reads ``next_token_ids``).

        Raises:
            EngineError: ONNX Runtime failed to run the feeds (first line of its message).
        """
        names = self._all_outputs if with_logits else self._fast_outputs
        feeds = {k: np.ascontiguousarray(v) for k, v in feeds.items()}
        try:
            return dict(zip(names, self.session.run(names, feeds)))
        except Exception as err:  # onnxruntime's Fail / InvalidArgument
            raise EngineError(f"ONNX Runtime step failed: {str(err).splitlines()[0]}") from None

    def close(self) -> None:
        self.session = None
