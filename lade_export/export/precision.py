"""The decoder step in float16 or bfloat16, for TensorRT 11's strongly typed networks.

TensorRT 11 removed the builder flags that let TensorRT 10 pick reduced-precision kernels
for a float32 graph; a network's precision is now the types in the graph itself
(TensorRT 10→11 migration guide, "Strongly Typed Networks Are Now Required"). Rather
than rewriting a float32 ONNX graph op by op, the step module is exported in the target
precision: the checkpoint's own code then decides what runs in float32 — transformers'
LlamaRMSNorm normalizes in float32, :class:`lade_export.graph.DecoderStep` computes RoPE
angles and the attention softmax in float32 — which is also what the PyTorch backend runs
with ``--dtype float16``.

The I/O contract (:mod:`lade_export.specs`) stays as it is: KV cache inputs and every
float output are float32 at the graph's edges, cast to and from the compute dtype inside
the graph, so the runtime, the manifest and other engines see no difference.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class ReducedPrecisionStep(nn.Module):
    """A copy of a :class:`lade_export.graph.DecoderStep` computing in ``dtype`` behind the
    float32 I/O contract.

    Args:
        step: the float32 step module (left unchanged).
        dtype: ``"float16"`` or ``"bfloat16"``.

    ``forward`` takes and returns what ``DecoderStep.forward`` does: the
    ``past_key_values`` float32 [batch, past, kv_heads, head_dim] are cast to ``dtype``;
    ``logits`` float32 [batch, n_logits, vocab], ``next_token_ids`` int64 and the
    ``present`` float32 [batch, step, kv_heads, head_dim] come back.
    """

    def __init__(self, step, dtype: str):
        super().__init__()
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.dtype = DTYPES[dtype]
        self.inner = copy.deepcopy(step).to(self.dtype).eval()
        self.inner.inv_freq = step.inv_freq.detach().clone().float()  # RoPE angles stay float32
        self.dims = step.dims

    def forward(self, input_ids, position_ids, attention_mask, logits_positions, *past):
        out = self.inner(input_ids, position_ids, attention_mask, logits_positions, *(p.to(self.dtype) for p in past))
        return (out[0].float(), out[1], *(o.float() for o in out[2:]))


def export_reduced_precision(step, dtype: str, path: str | Path) -> Path:
    """Export ``step`` computing in ``dtype`` (float16/bfloat16) to ONNX at ``path``, with
    the float32 I/O contract (see :class:`ReducedPrecisionStep`).

    Returns:
        the ONNX model path.

    Raises:
        ValueError: another dtype.
        onnx.checker.ValidationError: the exported graph is invalid.
    """
    from ..graph import export_onnx

    return export_onnx(ReducedPrecisionStep(step, dtype).eval(), path)
