"""The ONNX nodes a quantized step graph is rewritten with (:mod:`.quantize` drives the
rewrite): a float32 MatMul becomes ONNX Runtime's ``MatMulNBits`` (com.microsoft; ONNX
Runtime ContribOperators.md), plus the zero-point residual term where a block's zero point
is not an integer (:mod:`.weight_blocks`), or the lade kernels' ``MatMulBlockQ``
(:mod:`lade_export.kernels`); the token embedding's ``Gather`` becomes
``GatherBlockQuantized`` or ``GatherBlockQ``, on the LM head's own packed weight when the
two are tied. Each function adds its initializers to the graph and returns the nodes;
inserting them is the caller's. :func:`lade_argmax` swaps the tokens' ``ArgMax`` in place.
"""

from __future__ import annotations

import numpy as np

from .weight_blocks import block_quant, pack_block_lanes


def _matmul_nbits(graph, node, weight: np.ndarray, bits: int, spec, scheme: str) -> list:
    """Nodes replacing MatMul ``node`` (initializers are added to ``graph``): a
    ``MatMulNBits``, plus the zero-point residual term ``ReduceSum_block(x) @ R`` when the
    blocks' zero points are not integers (see the module docstring)."""
    from onnx import helper, numpy_helper

    q = block_quant(weight, bits, spec.block_size, scheme)
    base = node.input[1]
    k, n = weight.shape
    graph.initializer.extend([numpy_helper.from_array(q["packed"], f"{base}_Q{bits}"),
                              numpy_helper.from_array(q["scales"], f"{base}_scales")])
    inputs = [node.input[0], f"{base}_Q{bits}", f"{base}_scales"]
    if q["zero_points"] is not None:
        graph.initializer.append(numpy_helper.from_array(q["zero_points"], f"{base}_zero_points"))
        inputs.append(f"{base}_zero_points")
    out = node.output[0]
    main = out if q["residual"] is None else f"{base}_nbits_out"
    nodes = [helper.make_node("MatMulNBits", inputs, [main], name=f"{node.name}_Q{bits}", domain="com.microsoft", K=k,
                              N=n, bits=bits, block_size=spec.block_size, accuracy_level=spec.accuracy_level)]
    if q["residual"] is not None:  # x [.., K] -> [.., K/block, block] -> sums [.., K/block] @ R [K/block, N]
        graph.initializer.extend([
            numpy_helper.from_array(np.array([0, 0, k // spec.block_size, spec.block_size], np.int64), f"{base}_blocks"),
            numpy_helper.from_array(np.array([-1], np.int64), f"{base}_last_axis"),
            numpy_helper.from_array(q["residual"], f"{base}_zero_residual")])
        nodes += [helper.make_node("Reshape", [node.input[0], f"{base}_blocks"], [f"{base}_x_blocks"],
                                   name=f"{node.name}_x_blocks"),
                  helper.make_node("ReduceSum", [f"{base}_x_blocks", f"{base}_last_axis"], [f"{base}_x_block_sums"],
                                   name=f"{node.name}_x_block_sums", keepdims=0),
                  helper.make_node("MatMul", [f"{base}_x_block_sums", f"{base}_zero_residual"], [f"{base}_residual_out"],
                                   name=f"{node.name}_zero_residual"),
                  helper.make_node("Add", [main, f"{base}_residual_out"], [out], name=f"{node.name}_plus_residual")]
    return nodes



def _matmul_block_q(graph, node, weight: np.ndarray, bits: int, scheme: str, compute: str = "float32") -> list:
    """``MatMulBlockQ`` replacing MatMul ``node`` (its packed weight added to ``graph``);
    ``compute="int8"`` sets its attribute ``compute=1`` (float32 leaves it out, as graphs
    made before the integer path have it)."""
    from onnx import helper, numpy_helper

    from ..kernels import DOMAIN

    packed = pack_block_lanes(weight, bits, scheme)
    base = node.input[1]
    names = [f"{base}_lanes_q{bits}", f"{base}_lanes_d", f"{base}_lanes_m"]
    graph.initializer.extend(numpy_helper.from_array(packed[key], name) for key, name in zip("qdm", names))
    extra = {"compute": 1} if compute == "int8" else {}
    return [helper.make_node("MatMulBlockQ", [node.input[0], *names], list(node.output), name=f"{node.name}_Q{bits}",
                             domain=DOMAIN, N=packed["n"], **extra)]


def _lade_scheme(bits: int, scheme: str) -> str:
    """The lade kernels' symmetric blocks are 8-bit only (Q8_0); a 4-bit head takes min-max blocks."""
    return scheme if bits == 8 else "minmax"


def quantized_matmul(graph, node, weight: np.ndarray, bits: int, spec, scheme: str) -> list:
    """Nodes replacing MatMul ``node`` with the spec's kernels (``MatMulNBits`` or ``MatMulBlockQ``).

    Args:
        graph: the ONNX ``GraphProto`` (the packed weight's initializers are added to it).
        node: the MatMul ``NodeProto``; its output names are kept.
        weight: float [K, N], the MatMul's B.
        bits: 4 or 8.
        spec: the :class:`~lade_export.export.quantize.QuantSpec` (kernels, block size,
            accuracy level, compute).
        scheme: ``"minmax"`` (the layers) or ``"absmax"`` (the LM head).
    """
    if spec.kernels == "lade":
        return _matmul_block_q(graph, node, weight, bits, _lade_scheme(bits, scheme), spec.compute)
    return _matmul_nbits(graph, node, weight, bits, spec, scheme)


def block_q_embedding(graph, embed: np.ndarray, head, gather, spec) -> tuple[list, str]:
    """Nodes replacing the embedding ``gather`` with the lade kernels: a ``GatherBlockQ`` on
    the head's own packed tensors when ``head`` (its ``MatMulBlockQ``) is tied, else on a
    table of its own (added to ``graph``). Returns ``(nodes, description)``."""
    from onnx import helper, numpy_helper

    from ..kernels import DOMAIN

    if head is not None:
        tables, embedding = list(head.input[1:4]), "shared with the LM head"
    else:
        packed = pack_block_lanes(np.ascontiguousarray(embed.T), spec.head_bits, _lade_scheme(spec.head_bits, "absmax"))
        tables, embedding = ["embedding_lanes_q", "embedding_lanes_d", "embedding_lanes_m"], "own table"
        graph.initializer.extend(numpy_helper.from_array(packed[key], name) for key, name in zip("qdm", tables))
    return [helper.make_node("GatherBlockQ", [*tables, gather.input[1]], list(gather.output),
                             name="embedding_gather_block_q", domain=DOMAIN, N=embed.shape[0])], embedding


def nbits_embedding(graph, embed: np.ndarray, head, gather, spec) -> tuple[list, str]:
    """Nodes replacing the embedding ``gather`` with ONNX Runtime's ``GatherBlockQuantized``:
    on the head's packed weight (through a Reshape) when ``head`` (its ``MatMulNBits``) is
    tied, else on a table of its own (added to ``graph``). Returns ``(nodes, description)``."""
    import onnx
    from onnx import helper, numpy_helper

    vocab, hidden = embed.shape
    kbytes = hidden * spec.head_bits // 8
    nodes = []
    if head is not None:
        shape = helper.make_tensor("embedding_q_shape", onnx.TensorProto.INT64, [2], [vocab, kbytes])
        graph.initializer.append(shape)
        nodes.append(helper.make_node("Reshape", [head.input[1], shape.name], ["embedding_q"],
                                      name="embedding_shares_lm_head"))
        data, scales, embedding = "embedding_q", head.input[2], "shared with the LM head"
    else:
        q = block_quant(np.ascontiguousarray(embed.T), spec.head_bits, spec.block_size, "absmax")
        graph.initializer.extend([numpy_helper.from_array(q["packed"].reshape(vocab, kbytes), "embedding_q"),
                                  numpy_helper.from_array(q["scales"].reshape(vocab, hidden // spec.block_size),
                                                          "embedding_scales")])
        data, scales, embedding = "embedding_q", "embedding_scales", "own table"
    nodes.append(helper.make_node("GatherBlockQuantized", [data, gather.input[1], scales], list(gather.output),
                                  name="embedding_gather_quantized", domain="com.microsoft", gather_axis=0,
                                  quantize_axis=1, block_size=spec.block_size, bits=spec.head_bits))
    return nodes, embedding


def lade_argmax(graph) -> int:
    """Swap every ``ArgMax`` over the last axis of a float32 tensor (``keepdims=0``,
    ``select_last_index=0``: the step graph's ``next_token_ids`` from its logits) for the lade
    kernels' ``ArgMaxRows``, in place.

    The same indices (the first of equal maxima; a NaN counts as the largest, as
    ``numpy.argmax``; comparisons only, so every CPU path agrees), in ~15 µs a row where
    ONNX Runtime's ``ArgMax`` spent 60-80 µs on each 49,152-wide row of SmolLM2's logits: about
    3% of a one-token step and 6-8% of an 8-token one with the int4 lade kernels
    (bench/results/step-costs.md). An ``ArgMax`` on another axis, keeping its axis or taking
    the last of equal maxima, stays.

    Args:
        graph: an ONNX ``GraphProto``. Only an input the graph declares float32 (a graph input
            or output, or its ``value_info``) is swapped; an ``axis`` of −1 is matched, a
            non-negative one where the declared type gives the rank.

    Returns:
        the number of nodes swapped.
    """
    from onnx import TensorProto, helper

    from ..kernels import DOMAIN

    declared = [*graph.input, *graph.output, *graph.value_info]
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in declared if v.type.tensor_type.HasField("shape")}
    floats = {v.name for v in declared if v.type.tensor_type.elem_type == TensorProto.FLOAT}
    names = {n.name for n in graph.node}
    swapped = 0
    for k, node in enumerate(graph.node):
        if node.op_type != "ArgMax" or node.domain not in ("", "ai.onnx"):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        axis, rank = attrs.get("axis", 0), ranks.get(node.input[0])
        last = axis == -1 or (rank is not None and axis == rank - 1)
        if (not last or node.input[0] not in floats or attrs.get("keepdims", 1) != 0
                or attrs.get("select_last_index", 0) != 0):
            continue
        name = node.name
        if not name:  # a name of its own: ONNX Runtime refuses two nodes of one name
            name = next(f"argmax_rows_{i}" for i in range(len(names) + 1) if f"argmax_rows_{i}" not in names)
            names.add(name)
        graph.node[k].CopyFrom(helper.make_node("ArgMaxRows", [node.input[0]], list(node.output), name=name,
                                                domain=DOMAIN))
        swapped += 1
    return swapped
