"""Row-exact attention for int8-compute step graphs: :func:`exact_attention` swaps every
attention of an ``onnx-ops`` step graph for the lade kernels' ``AttentionRows``
(:mod:`lade_export.kernels`).

Why. Row-exact weight kernels (``MatMulBlockQ``: each output row computed from its own
input row alone) are not enough for int8 activations: ONNX Runtime's attention is not bit
for bit the same in a one-token and a many-token step (its sums over past + step columns
are grouped by length, and the cache part and the step part are added), last-bit
differences that float32 weights pass on smoothly but rounding activations to int8
amplifies, so lookahead outputs leave greedy's. ``AttentionRows`` computes a query row
over the keys it sees in position order in one pass: every row of a step is then the same
bits as alone, and lookahead (Fu et al. 2023, arXiv 2402.02057) equals greedy again. The
measured gaps are in bench/results/design-figures.md (*Quantized step graphs*).

The pattern matched is the ``onnx-ops`` attention of :mod:`lade_export.graph` (scores
against the cache and against this step, concatenated, scaled, masked by ``Where``,
softmax, then the two value products added). An int8 build therefore takes the
``onnx-ops`` attention; :func:`lade_export.export.quantize.quantize_step_graph` applies
this rewrite.
"""

from __future__ import annotations


def _producer_skipping_casts(producers: dict, name: str):
    node = producers.get(name)
    while node is not None and node.op_type == "Cast":
        node = producers.get(node.input[0])
    return node


def _transposed_input(producers, name, graph, perm):
    """The graph input that ``name`` is a ``Transpose(perm)`` of, or None."""
    node = producers.get(name)
    if node is None or node.op_type != "Transpose" or node.input[0] not in {i.name for i in graph.input}:
        return None
    got = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
    return node.input[0] if got == perm else None


def exact_attention(graph) -> int:
    """Replace every attention of an ``onnx-ops`` step graph (:mod:`lade_export.graph`: scores
    against the cache and against this step, concatenated, scaled, masked by ``Where``, softmax,
    then the two value products added) by one ``AttentionRows`` of the lade kernels, which computes
    each query row over the keys it sees in position order, in one pass over cache and step, so
    that a row's bits do not depend on the step's width (what int8 activations need for exact
    lookahead; :mod:`lade_export.kernels`). The cache's keys and values are fed to it as the
    graph's sequence-major inputs, read in place (``past_layout=1``; the graph's Transposes of
    the past, a copy of the whole cache per layer, go), so a row costs the key blocks it sees.
    Nodes left without consumers are dropped.

    Returns:
        the number of attentions replaced.

    Raises:
        ValueError: a ``Softmax`` of the graph is not inside that pattern.
    """
    from onnx import helper, numpy_helper

    from ..kernels import DOMAIN

    producers = {o: n for n in graph.node for o in n.output}
    consumers = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    inits = {i.name: i for i in graph.initializer}
    replaced, drop, insert = 0, set(), {}

    def only(name, op):
        found = [n for n in consumers.get(name, []) if n.op_type != "Cast"] or \
            [m for n in consumers.get(name, []) if n.op_type == "Cast" for m in consumers.get(n.output[0], [])]
        if len(found) != 1 or found[0].op_type != op:
            raise ValueError(f"attention pattern: {name} does not feed one {op}")
        return found[0]

    for softmax in [n for n in graph.node if n.op_type == "Softmax"]:
        where = _producer_skipping_casts(producers, softmax.input[0])
        if where is None or where.op_type != "Where":
            raise ValueError(f"attention pattern: {softmax.name} does not follow a Where")
        reshape = producers[where.input[2]]
        scale_mul = producers[reshape.input[0]]
        scale = next(numpy_helper.to_array(inits[i]) for i in scale_mul.input if i in inits)
        concat = next(producers[i] for i in scale_mul.input if i not in inits)
        past_scores, step_scores = (producers[i] for i in concat.input)
        fill = float(numpy_helper.to_array(inits[where.input[1]]))
        if (reshape.op_type, scale_mul.op_type, concat.op_type, past_scores.op_type, step_scores.op_type) != \
                ("Reshape", "Mul", "Concat", "MatMul", "MatMul") or fill > -1e30 or scale.size != 1:
            raise ValueError(f"attention pattern: {softmax.name}'s scores are not the onnx-ops form")
        view = only(softmax.output[0], "Reshape")
        slices = [n for n in consumers[view.output[0]] if n.op_type == "Slice"]
        products = [only(sl.output[0], "MatMul") for sl in slices]
        add = only(products[0].output[0], "Add")
        starts = [int(numpy_helper.to_array(inits[sl.input[1]]).ravel()[0]) if sl.input[1] in inits else None
                  for sl in slices]
        past_values, step_values = (products if starts[0] == 0 else products[::-1])
        past_k, past_v = past_scores.input[1], past_values.input[1]
        in_place = {}
        cache_k, cache_v = (_transposed_input(producers, name, graph, perm)
                            for name, perm in ((past_k, [0, 2, 3, 1]), (past_v, [0, 2, 1, 3])))
        if cache_k is not None and cache_v is not None:  # read the cache in place: no Transpose of the past
            past_k, past_v, in_place = cache_k, cache_v, {"past_layout": 1}
        rows = helper.make_node("AttentionRows", [past_scores.input[0], past_k, step_scores.input[1],
                                                  past_v, step_values.input[1], where.input[0]],
                                list(add.output), name=f"{softmax.name}_rows", domain=DOMAIN, scale=float(scale),
                                **in_place)
        for n in (past_scores, step_scores, concat, scale_mul, reshape, where, softmax, view, *slices, *products, add):
            drop.add(n.name)
        insert[add.name] = rows
        replaced += 1
    nodes = [insert.get(n.name, n) for n in graph.node if n.name not in drop or n.name in insert]
    while True:  # drop what now feeds nothing (shape arithmetic of the old pattern)
        used = {i for n in nodes for i in n.input} | {o.name for o in graph.output}
        kept = [n for n in nodes if any(o in used for o in n.output)]
        if len(kept) == len(nodes):
            break
        nodes = kept
    graph.ClearField("node")
    graph.node.extend(nodes)
    return replaced



#: ``AttentionRows`` over a float16 cache (the lade kernels' op of that name).
HALF_CACHE_OP = "AttentionRowsHalfCache"


def half_precision_cache(graph) -> int:
    """Store the KV cache of a graph whose every attention is an in-place ``AttentionRows``
    (:func:`exact_attention` with ``past_layout=1``) in float16: the ``past_key_values.*``
    inputs and ``present.*`` outputs become float16 and each attention becomes
    ``AttentionRowsHalfCache``, which widens the cached keys and values to float32 exactly.
    This step's keys and values are rounded to float16 and back before its attention sees
    them (a ``Cast`` pair on the tensor the ``present`` output is), so a token's key and
    value have the same bits whether a row reads them from this step or from the cache:
    lookahead output stays greedy output (Fu et al. 2023, arXiv 2402.02057), and a row's
    bits stay independent of the step. Halves the cache's bytes, which a one-token step at
    long contexts spends most of its attention time reading (``bench/results/step-costs.md``).

    Returns:
        the number of attentions changed (0: the graph is left as it was, for instance
        attentions that read a transposed cache).
    """
    from onnx import TensorProto, helper

    attentions = [n for n in graph.node if n.op_type == "AttentionRows"]
    if not attentions or not all(any(a.name == "past_layout" and a.i == 1 for a in n.attribute) for n in attentions):
        return 0
    cache_inputs = {n.input[1] for n in attentions} | {n.input[3] for n in attentions}
    graph_inputs = {i.name: i for i in graph.input}
    if not cache_inputs <= set(graph_inputs):
        return 0
    if any(name in n.input for n in graph.node if n.op_type != "AttentionRows" for name in cache_inputs):
        return 0  # another consumer of the cache would need float32
    for name in cache_inputs:
        graph_inputs[name].type.tensor_type.elem_type = TensorProto.FLOAT16
    presents = [o for o in graph.output if o.name.startswith("present.")]
    names = {o.name for o in presents}
    producer_at = {o: k for k, n in enumerate(graph.node) for o in n.output if o in names}
    readers = {}  # present name -> (node, input index) of every node that reads it
    for n in graph.node:
        for k, i in enumerate(n.input):
            if i in names:
                readers.setdefault(i, []).append((n, k))
    after = {}  # node index -> Cast nodes to insert after it
    for out in presents:
        name = out.name
        at = producer_at[name]
        producer = graph.node[at]
        wide, rounded = f"{name}/float32", f"{name}/rounded"
        producer.output[list(producer.output).index(name)] = wide
        for n, k in readers.get(name, []):
            n.input[k] = rounded
        after.setdefault(at, []).extend([
            helper.make_node("Cast", [wide], [name], name=f"{name}/to_float16", to=TensorProto.FLOAT16),
            helper.make_node("Cast", [name], [rounded], name=f"{name}/to_float32", to=TensorProto.FLOAT),
        ])
        out.type.tensor_type.elem_type = TensorProto.FLOAT16
    for n in attentions:
        n.op_type = HALF_CACHE_OP
    nodes = []
    for k, n in enumerate(graph.node):
        nodes.append(n)
        nodes.extend(after.get(k, []))
    graph.ClearField("node")
    graph.node.extend(nodes)
    return len(attentions)
