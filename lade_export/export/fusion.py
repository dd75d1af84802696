"""Sibling-MatMul fusion of the exported step graph: one MatMul where several read the same input.

A LLaMA layer multiplies the same normalized hidden state by three projection weights
(query, key, value) and, after the attention, by two more (gate, up). Each is its own
MatMul in the exported graph; :func:`fuse_sibling_matmuls` concatenates the weights of
MatMuls that share their input along the output dimension, runs one MatMul and splits
its result back into the original outputs (the fused-QKV layout of the field's inference
engines). Every output column is the same dot product as before, so the step's I/O
contract (:mod:`lade_export.specs`) and its numbers are unchanged up to float32 rounding
of the larger kernel; the graph has fewer, larger kernels.

With ONNX Runtime on CPU the fused graph runs a lookahead-sized step faster (the
measurement: ``bench/results/design-figures.md``, *Sibling-MatMul fusion*); the quantized
graphs (:mod:`lade_export.export.quantize`) then also have one ``MatMulNBits`` and one
zero-point residual term per fused projection instead of one per weight.
"""

from __future__ import annotations

import numpy as np

from .sanitize import drop_unused_initializers


def fuse_sibling_matmuls(model) -> int:
    """Fuse, in place, every group of ≥ 2 MatMuls that read the same input tensor and
    multiply it by 2-D initializers with the same number of rows.

    Args:
        model: an in-memory ``onnx.ModelProto`` with its weights loaded (not external).

    Each group of MatMuls ``y_i = x @ W_i`` (``W_i`` float [K, N_i]) becomes
    ``Split(x @ concat(W_1..W_n, axis=1), [N_1..N_n], axis=-1) -> y_1..y_n``, placed where
    the first MatMul of the group was; the unused ``W_i`` are removed.

    Returns:
        the number of groups fused.
    """
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    groups: dict[str, list] = {}
    for node in graph.node:
        if (node.op_type == "MatMul" and len(node.input) == 2 and node.input[1] in inits
                and len(inits[node.input[1]].dims) == 2):
            groups.setdefault(node.input[0], []).append(node)
    fused = 0
    for x, nodes in groups.items():
        if len(nodes) < 2 or len({inits[n.input[1]].dims[0] for n in nodes}) != 1:
            continue
        weights = [numpy_helper.to_array(inits[n.input[1]]) for n in nodes]
        if len({w.dtype for w in weights}) != 1:
            continue
        name = nodes[0].input[1] + "_fused"
        sizes = np.array([w.shape[1] for w in weights], np.int64)
        graph.initializer.extend([numpy_helper.from_array(np.concatenate(weights, axis=1), name),
                                  numpy_helper.from_array(sizes, name + "_split_sizes")])
        position = list(graph.node).index(nodes[0])
        for node in nodes:
            graph.node.remove(node)
        graph.node.insert(position, helper.make_node("MatMul", [x, name], [name + "_out"],
                                                     name=nodes[0].name + "_fused"))
        graph.node.insert(position + 1, helper.make_node("Split", [name + "_out", name + "_split_sizes"],
                                                         [n.output[0] for n in nodes],
                                                         name=nodes[0].name + "_fused_split", axis=-1))
        fused += 1
    drop_unused_initializers(graph)
    return fused


def pack_qkv_into_attention(model) -> int:
    """Feed each fused query/key/value projection to ``GroupQueryAttention`` packed, in place.

    Where a ``com.microsoft.GroupQueryAttention`` node reads its query, key and value as
    the three outputs, in order, of one ``Split`` (the fused projection of
    :func:`fuse_sibling_matmuls`, weights concatenated as [W_q | W_k | W_v]) and nothing
    else reads them, the node takes the unsplit tensor [b, step, (heads + 2·kv_heads)·hd]
    as its packed query (ONNX Runtime ContribOperators.md: key and value then omitted) and
    the ``Split`` is removed. Same numbers, one copy and one node fewer per layer.

    Returns:
        the number of attention nodes rewritten.
    """
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    packed = 0
    for node in list(graph.node):
        if node.op_type != "GroupQueryAttention" or len(node.input) < 3:
            continue
        split = producer.get(node.input[0])
        if (split is None or split.op_type != "Split" or list(split.output) != list(node.input[:3])
                or any(readers.get(o, 0) != 1 for o in split.output)):
            continue
        node.input[0] = split.input[0]
        node.input[1] = ""
        node.input[2] = ""
        graph.node.remove(split)
        packed += 1
    drop_unused_initializers(graph)
    return packed
