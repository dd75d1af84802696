"""Graph hygiene before an engine build: constant folding, dead-node removal and shape
inference with onnxslim, then the same ONNX Runtime vs PyTorch parity check as export.

TensorRT's ONNX parser handles fewer patterns than ONNX Runtime; folding the exporter's
shape arithmetic (Shape/Gather/Concat/Unsqueeze chains) into constants leaves it a
smaller, static-where-possible graph (TensorRT developer guide, "Constant Folding with
Polygraphy"; onnxslim does the same folding without onnx-graphsurgeon).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import BackendUnavailableError


def drop_unused_initializers(graph) -> int:
    """Remove, in place, the initializers of ``graph`` (an ``onnx.GraphProto``) that no node
    reads, e.g. the weights a rewrite replaced. Returns how many were removed."""
    used = {i for n in graph.node for i in n.input}
    unused = [init for init in graph.initializer if init.name not in used]
    for init in unused:
        graph.initializer.remove(init)
    return len(unused)


def slim_model(model):
    """Constant-fold, drop dead nodes and infer shapes of an in-memory ONNX model (onnxslim).

    Raises:
        BackendUnavailableError: onnxslim is not installed.
    """
    try:
        import onnxslim
    except ImportError:
        raise BackendUnavailableError("graph slimming needs onnxslim: pip install onnxslim") from None
    return onnxslim.slim(model)


def sanitize_onnx(src: str | Path, dst: str | Path, external_data_threshold_bytes: int = 64 << 20) -> dict:
    """Write a folded, shape-inferred copy of the step graph ``src`` to ``dst``.

    Returns:
        ``{"nodes_before": int, "nodes_after": int}``.

    Raises:
        BackendUnavailableError: onnxslim is not installed (``pip install onnxslim``).
        onnx.checker.ValidationError: the result is not a valid model.
    """
    import onnx

    src, dst = Path(src), Path(dst)
    model = onnx.load(str(src))
    before = len(model.graph.node)
    slim = slim_model(model)
    after = len(slim.graph.node)
    size = sum(len(t.raw_data) for t in slim.graph.initializer)
    if size > external_data_threshold_bytes:
        onnx.save_model(slim, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=dst.name + ".data", size_threshold=1024)
    else:
        onnx.save_model(slim, str(dst))
    onnx.checker.check_model(str(dst), full_check=True)
    return {"nodes_before": before, "nodes_after": after}
