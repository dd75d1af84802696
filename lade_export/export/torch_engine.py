"""PyTorch engine: runs :class:`lade_export.graph.DecoderStep` directly.

It is the reference for parity checks and the backend for a GPU machine without
TensorRT (``device="cuda"``, ``dtype=torch.float16``).
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import BackendUnavailableError, GenerationError
from ..graph import DecoderStep
from ..specs import past_key_name, past_value_name, present_key_name, present_value_name


class TorchEngine:
    """Runs the step module with PyTorch.

    Args:
        hf_model: a transformers LLaMA causal LM.
        device: ``"cpu"`` or ``"cuda"``.
        dtype: compute dtype (``torch.float32`` or ``torch.float16``/``bfloat16`` on a GPU).
        threads: ``torch.set_num_threads`` value (None leaves it).

    Attributes:
        kv_layout: ``"sequence-major"`` (the step module takes the cache as its inputs).
        step_room: None (the standard-operator attention has no rotary-table limit).
        attention_skips: 0 (attention spans every column).

    Raises:
        BackendUnavailableError: ``device="cuda"`` without a CUDA device.
    """

    name = "torch"
    kv_layout = "sequence-major"
    kv_dtype = np.dtype(np.float32)  # host caches in float32 (runtime.Engine)
    step_room = None
    attention_skips = 0

    def __init__(self, hf_model, device: str = "cpu", dtype=torch.float32, threads: int | None = None):
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise BackendUnavailableError("--device cuda asked for, but PyTorch sees no CUDA device")
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(device)
        self.dtype = dtype
        self.step_module = DecoderStep(hf_model).to(self.device, dtype).eval()
        self.dims = self.step_module.dims
        self._names = ["logits", "next_token_ids"]
        for i in range(self.dims.num_layers):
            self._names += [present_key_name(i), present_value_name(i)]

    def check_profile(self, profile) -> None:
        """Accept any lookahead profile (:meth:`lade_export.runtime.Engine.check_profile`):
        the module takes steps of any width. Returns None (no plan to choose)."""
        return None

    def check_batching(self, token_budget: int, prefill_chunk: int, kv_tokens: int) -> None:
        """Accept any scheduler options (shapes are dynamic)."""

    def run(self, feeds: dict, with_logits: bool = False, plan: str | None = None) -> dict:
        """Same contract as :meth:`lade_export.backends.onnxruntime.OrtEngine.run` (``plan`` ignored)."""
        dev = self.device
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
        past = []
        for i in range(self.dims.num_layers):
            past += [t(feeds[past_key_name(i)]).to(self.dtype), t(feeds[past_value_name(i)]).to(self.dtype)]
        with torch.inference_mode():
            outs = self.step_module(t(feeds["input_ids"]), t(feeds["position_ids"]), t(feeds["attention_mask"]),
                                    t(feeds["logits_positions"]), *past)
        result = {}
        for name, out in zip(self._names, outs):
            if name == "logits" and not with_logits:
                continue
            result[name] = out.float().cpu().numpy() if out.is_floating_point() else out.cpu().numpy()
        return result

    def close(self) -> None:
        self.step_module = None


def open_torch_engine(artifact, device: str = "cpu", dtype: str = "float32", threads: int | None = None) -> TorchEngine:
    """The ``torch`` backend of :func:`lade_export.backends.open_engine`: loads the checkpoint
    the artifact's manifest names (``source.model``) and runs its step module.

    Args:
        artifact: an opened :class:`lade_export.artifact.Artifact`.
        device: ``"cpu"`` or ``"cuda"``/``"cuda:N"``.
        dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``.
        threads: ``torch.set_num_threads`` value (None leaves it).

    Raises:
        GenerationError: an int4/int8 artifact (this engine would run the float32 checkpoint).
        ModelSourceError: the recorded checkpoint cannot be loaded.
        BackendUnavailableError: ``device="cuda"`` without a CUDA device.
    """
    precision = artifact.spec.graph.precision
    if precision in ("int4", "int8"):
        raise GenerationError(f"--backend torch runs the float32 checkpoint ({artifact.spec.source.model}), "
                              f"not this artifact's {precision} weights; use --backend ort")
    from .model_source import load_model

    loaded = load_model(artifact.spec.source.model)
    return TorchEngine(loaded.model, device=device, dtype=getattr(torch, dtype), threads=threads)
