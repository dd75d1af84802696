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
    from onnx import helper

    from .graph_match import GraphIndex, NoMatch, replace_nodes

    g = GraphIndex(graph)

    def rms_norm(name):
        """``γ · (x · (1 / sqrt(mean(x²) + ε)))`` ending in ``name`` → (x, γ, ε, its nodes)."""
        scaled = g.sole(name, "Mul")
        gamma = next((i for i in scaled.input if i in g.inits), None)
        if gamma is None or len(g.inits[gamma].dims) != 1:
            raise NoMatch(name)
        normed = g.sole(g.other_input(scaled, gamma), "Mul")
        div = next((g.producers[i] for i in normed.input if i in g.producers and g.producers[i].op_type == "Div"), None)
        if div is None or len(g.readers[div.output[0]]) != 1 or g.scalar(div.input[0]) != 1.0:
            raise NoMatch(name)
        x = g.other_input(normed, div.output[0])
        sqrt = g.sole(div.input[1], "Sqrt")
        add = g.sole(sqrt.input[0], "Add")
        mean = next((g.producers[i] for i in add.input if i in g.producers and g.producers[i].op_type == "ReduceMean"),
                    None)
        if mean is None or len(g.readers[mean.output[0]]) != 1:
            raise NoMatch(name)
        eps = g.scalar(g.other_input(add, mean.output[0]))
        axes = g.attr(mean, "axes") if len(mean.input) < 2 else g.const(mean.input[1])
        if eps is None or axes is None or [int(a) for a in list(axes)] != [-1] or g.attr(mean, "keepdims", 1) != 1:
            raise NoMatch(name)
        square = g.sole(mean.input[0], "Pow")
        if square.input[0] != x or g.scalar(square.input[1]) != 2.0:
            raise NoMatch(name)
        return x, gamma, eps, [scaled, normed, div, sqrt, add, mean, square]

    def swiglu(name):
        """``(g · σ(g)) · u`` with ``g, u = Split(z)`` ending in ``name`` → (z, its nodes)."""
        product = g.sole(name, "Mul")
        gated = next((g.producers[i] for i in product.input if i in g.producers and g.producers[i].op_type == "Mul"
                      and any(j in g.producers and g.producers[j].op_type == "Sigmoid"
                              for j in g.producers[i].input)), None)
        if gated is None or len(g.readers[gated.output[0]]) != 1:
            raise NoMatch(name)
        up = g.other_input(product, gated.output[0])
        sigmoid = next(g.producers[j] for j in gated.input if j in g.producers and g.producers[j].op_type == "Sigmoid")
        gate = sigmoid.input[0]
        if g.other_input(gated, sigmoid.output[0]) != gate or len(g.readers[sigmoid.output[0]]) != 1:
            raise NoMatch(name)
        split = g.produced_by(gate, "Split")
        if (list(split.output) != [gate, up] or g.attr(split, "axis", 0) not in (-1, 2)
                or len(g.readers[gate]) != 2 or len(g.readers[up]) != 1):
            raise NoMatch(name)
        sizes = g.const(split.input[1]) if len(split.input) > 1 else None
        if sizes is None or sizes.size != 2 or sizes[0] != sizes[1]:
            raise NoMatch(name)
        z = split.input[0]
        if len(g.readers[z]) != 1 or z in g.outputs:
            raise NoMatch(name)
        return z, [product, gated, sigmoid, split]

    def int8(node):
        return node.op_type == "MatMulBlockQ" and g.attr(node, "compute", 0) == 1

    counts = {"rms_norm": 0, "swiglu": 0, "residual": 0}
    drop = set()
    for node in [n for n in graph.node if int8(n)]:
        try:
            x, gamma, eps, nodes = rms_norm(node.input[0])
            kind, extra = PROLOGUE_RMS_NORM, {"epsilon": eps}
        except NoMatch:
            try:
                x, nodes = swiglu(node.input[0])
                kind, extra, gamma = PROLOGUE_SWIGLU, {}, None
            except NoMatch:
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
        try:
            add = g.reader(y, "Add")
            residual = g.other_input(add, y)
        except NoMatch:
            continue
        source = g.producers.get(residual)
        if id(add) in drop or (source is not None and g.position[id(source)] > g.position[id(node)]):
            continue  # computed after the projection: not a residual stream
        while len(node.input) < 4:
            node.input.append("")
        if len(node.input) == 4:
            node.input.append(residual)
        else:
            node.input[4] = residual
        node.output[0] = add.output[0]
        drop.add(id(add))
        counts["residual"] += 1
    if any(counts.values()):
        replace_nodes(graph, drop, {})
    return counts
