"""The int8 path's per-row layer work folded into the lade kernels' ``MatMulBlockQ``
(:func:`fuse_row_work`): each RMS norm into the projection it feeds, each SwiGLU into the
down projection, each residual add into the projection whose output it adds.

Why. After :func:`lade_export.export.attention_rows.fuse_rotary_attention` a SmolLM2 layer
still runs, around its four weight kernels, two RMS norms (seven nodes each as exported, one
``SimplifiedLayerNormalization`` after ONNX Runtime's own fusion), two residual ``Add``, the
``Split`` of the gate/up projection, its ``Sigmoid``/``Mul`` (``QuickGelu``) and the ``Mul`` by
the up projection: seven nodes that ONNX Runtime dispatches one by one on one thread while the
other waits (bench/results/step-costs.md: ~1.8 µs a node). Folded, a layer is five nodes.

What changes. The residual add is the same IEEE sum it was (``R + X·W``, element by element),
but the norm and the SwiGLU are the kernels' own arithmetic, not ONNX Runtime's: the same
formula (LLaMA's RMSNorm, Zhang & Sennrich 2019, arXiv 1910.07467: ``γ · (x / sqrt(mean(x²) +
ε))`` computed as ``γ·(x·r)``, ``r = 1/sqrt(Σx²/K + ε)``; SwiGLU, Shazeer 2020, arXiv 2002.05202:
``(g·σ(g))·u``), in one fixed order per row on every CPU path (the kernels' source gives it),
so a row's bits depend on that row alone — lookahead stays exact — and every integer path
stays bit-identical, but the last bits differ from ONNX Runtime's kernels for these ops (whose
own vectorized code may differ between CPUs). Only int8-compute graphs are rewritten.
"""

from __future__ import annotations

#: ``MatMulBlockQ`` attribute ``prologue``: what a row of its input becomes before the product.
PROLOGUE_RMS_NORM, PROLOGUE_SWIGLU = 1, 2


def fuse_row_work(graph) -> dict:
    """Fold RMS norms, SwiGLUs and residual adds into the int8 ``MatMulBlockQ`` nodes they feed
    or follow (module docstring). A pattern that is not exactly the exported form (another
    normalization, an activation that is not SwiGLU, a tensor with other readers) is left as it
    is.

    Args:
        graph: an ONNX ``GraphProto`` whose projections are ``MatMulBlockQ`` with ``compute=1``;
            changed in place.

    Returns:
        ``{"rms_norm": n, "swiglu": n, "residual": n}``: the nodes folded of each kind.
    """
    from onnx import helper, numpy_helper

    producers = {o: n for n in graph.node for o in n.output}
    readers = {}
    for n in graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    inits = {i.name: i for i in graph.initializer}
    outputs = {o.name for o in graph.output}
    position = {id(n): k for k, n in enumerate(graph.node)}

    def const(name):
        if name in inits:
            return numpy_helper.to_array(inits[name])
        node = producers.get(name)
        if node is not None and node.op_type == "Constant":
            return next((numpy_helper.to_array(a.t) for a in node.attribute if a.name == "value"), None)
        return None

    def scalar(name):
        value = const(name)
        return float(value.ravel()[0]) if value is not None and value.size == 1 else None

    def attr(node, name, default=None):
        a = next((a for a in node.attribute if a.name == name), None)
        return default if a is None else helper.get_attribute_value(a)

    def sole(name, op):
        """The producer of ``name``, an ``op``, when ``name`` has one reader and is no graph output."""
        node = producers.get(name)
        if node is None or node.op_type != op or len(readers.get(name, [])) != 1 or name in outputs:
            raise LookupError(name)
        return node

    def other(node, name):
        rest = [i for i in node.input if i != name]
        if len(rest) != 1:
            raise LookupError(node.name)
        return rest[0]

    def rms_norm(name):
        """``γ · (x · (1 / sqrt(mean(x²) + ε)))`` ending in ``name`` → (x, γ, ε, its nodes)."""
        scaled = sole(name, "Mul")
        gamma = next((i for i in scaled.input if i in inits), None)
        if gamma is None:
            raise LookupError(name)
        normed = sole(other(scaled, gamma), "Mul")
        div = next((producers.get(i) for i in normed.input if producers.get(i) is not None
                    and producers[i].op_type == "Div"), None)
        if div is None or len(readers[div.output[0]]) != 1 or scalar(div.input[0]) != 1.0:
            raise LookupError(name)
        x = other(normed, div.output[0])
        sqrt = sole(div.input[1], "Sqrt")
        add = sole(sqrt.input[0], "Add")
        mean = next((producers.get(i) for i in add.input if producers.get(i) is not None
                     and producers[i].op_type == "ReduceMean"), None)
        if mean is None or len(readers[mean.output[0]]) != 1:
            raise LookupError(name)
        eps = scalar(other(add, mean.output[0]))
        axes = attr(mean, "axes") if len(mean.input) < 2 else const(mean.input[1])
        if eps is None or axes is None or [int(a) for a in list(axes)] != [-1] or attr(mean, "keepdims", 1) != 1:
            raise LookupError(name)
        square = sole(mean.input[0], "Pow")
        if square.input[0] != x or scalar(square.input[1]) != 2.0:
            raise LookupError(name)
        if len(inits[gamma].dims) != 1:
            raise LookupError(name)
        return x, gamma, eps, [scaled, normed, div, sqrt, add, mean, square]

    def swiglu(name):
        """``(g · σ(g)) · u`` with ``g, u = Split(z)`` ending in ``name`` → (z, its nodes)."""
        product = sole(name, "Mul")
        gated = next((producers.get(i) for i in product.input if producers.get(i) is not None
                      and producers[i].op_type == "Mul" and any(producers.get(j) is not None and
                                                               producers[j].op_type == "Sigmoid"
                                                               for j in producers[i].input)), None)
        if gated is None or len(readers[gated.output[0]]) != 1:
            raise LookupError(name)
        up = other(product, gated.output[0])
        sigmoid = next(producers[j] for j in gated.input if producers.get(j) is not None
                       and producers[j].op_type == "Sigmoid")
        gate = sigmoid.input[0]
        if other(gated, sigmoid.output[0]) != gate or len(readers[sigmoid.output[0]]) != 1:
            raise LookupError(name)
        split = producers.get(gate)
        if (split is None or split.op_type != "Split" or list(split.output) != [gate, up]
                or attr(split, "axis", 0) not in (-1, 2) or len(readers[gate]) != 2 or len(readers[up]) != 1):
            raise LookupError(name)
        sizes = const(split.input[1]) if len(split.input) > 1 else None
        if sizes is None or sizes.size != 2 or sizes[0] != sizes[1]:
            raise LookupError(name)
        z = split.input[0]
        if len(readers[z]) != 1 or z in outputs:
            raise LookupError(name)
        return z, [product, gated, sigmoid, split]

    def int8(node):
        return node.op_type == "MatMulBlockQ" and attr(node, "compute", 0) == 1

    counts = {"rms_norm": 0, "swiglu": 0, "residual": 0}
    drop = set()
    for node in [n for n in graph.node if int8(n)]:
        try:
            x, gamma, eps, nodes = rms_norm(node.input[0])
            kind, extra = PROLOGUE_RMS_NORM, {"epsilon": eps}
        except (LookupError, StopIteration, TypeError, ValueError):
            try:
                x, nodes = swiglu(node.input[0])
                kind, extra, gamma = PROLOGUE_SWIGLU, {}, None
            except (LookupError, StopIteration, TypeError, ValueError):
                continue
        node.input[0] = x
        if gamma is not None:
            while len(node.input) < 5:
                node.input.append("")
            node.input.append(gamma)
        node.attribute.extend([helper.make_attribute("prologue", kind)] +
                              [helper.make_attribute(k, v) for k, v in extra.items()])
        drop.update(id(n) for n in nodes)
        counts["rms_norm" if kind == PROLOGUE_RMS_NORM else "swiglu"] += 1
    for node in [n for n in graph.node if int8(n)]:  # Y = R + X·W
        y = node.output[0]
        found = readers.get(y, [])
        if len(found) != 1 or found[0].op_type != "Add" or y in outputs or id(found[0]) in drop:
            continue
        add = found[0]
        residual = [i for i in add.input if i != y]
        if len(residual) != 1:
            continue
        source = producers.get(residual[0])
        if source is not None and position[id(source)] > position[id(node)]:
            continue  # computed after the projection: not a residual stream
        while len(node.input) < 4:
            node.input.append("")
        if len(node.input) == 4:
            node.input.append(residual[0])
        else:
            node.input[4] = residual[0]
        node.output[0] = add.output[0]
        drop.add(id(add))
        counts["residual"] += 1
    if not any(counts.values()):
        return counts
    nodes = [n for n in graph.node if id(n) not in drop]
    graph.ClearField("node")
    graph.node.extend(nodes)
    return counts
