"""ONNX Runtime engine for the exported decoder step."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import ArtifactError, BackendUnavailableError
from ..graph import ModelDims


def _dims_from_session(session) -> ModelDims:
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = {o.name: o for o in session.get_outputs()}
    layers = sum(1 for n in inputs if n.startswith("past_key_values.") and n.endswith(".key"))
    kv_heads, head_dim = inputs["past_key_values.0.key"].shape[1], inputs["past_key_values.0.key"].shape[3]
    vocab = outputs["logits"].shape[2]
    meta = session.get_modelmeta().custom_metadata_map
    return ModelDims(
        num_layers=layers,
        heads=int(meta.get("heads", kv_heads)),
        kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        hidden=int(meta.get("hidden", 0)),
        vocab=int(vocab),
        max_context=int(meta.get("max_context", 0)),
        tied_embeddings=meta.get("tied_embeddings", "False") == "True",
    )


class OrtEngine:
    """Runs the step graph with ONNX Runtime.

    Args:
        onnx_path: the exported ``model.onnx`` (external data beside it is found by ORT).
        threads: intra-op threads (None: ORT's default, one per core).
        provider: ``"cpu"`` or ``"cuda"`` (CUDAExecutionProvider, when onnxruntime-gpu is installed).

    Raises:
        ArtifactError: the model file is missing or ORT cannot load it.
        BackendUnavailableError: ``provider="cuda"`` without the CUDA execution provider.
    """

    name = "ort"

    def __init__(self, onnx_path: str | Path, threads: int | None = None, provider: str = "cpu"):
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
        self.dims = _dims_from_session(self.session)
        self._all_outputs = [o.name for o in self.session.get_outputs()]
        self._fast_outputs = [n for n in self._all_outputs if n != "logits"]

    def run(self, feeds: dict, with_logits: bool = False) -> dict:
        """One forward pass. ``feeds``: numpy arrays by input name. Returns numpy arrays by
        output name; ``logits`` only when ``with_logits`` (the decoder reads ``next_token_ids``)."""
        names = self._all_outputs if with_logits else self._fast_outputs
        feeds = {k: np.ascontiguousarray(v) for k, v in feeds.items()}
        return dict(zip(names, self.session.run(names, feeds)))

    def close(self) -> None:
        self.session = None
