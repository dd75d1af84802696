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
    from .graph_match import replace_nodes

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
            drop.add(id(n))
        insert[id(add)] = rows
        replaced += 1
    replace_nodes(graph, drop, insert)  # and what now feeds nothing (shape arithmetic of the old pattern)
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


#: One node per layer for the attention from the fused query/key/value projection on (lade kernels).
ROTARY_OP = "RotaryAttentionRows"


def fuse_rotary_attention(graph) -> int:
    """Replace, layer by layer, the subgraph from the fused query/key/value projection's output to
    the input of the output projection by one ``RotaryAttentionRows`` of the lade kernels: the
    ``Split`` of the projection, the head reshapes, the rotary embedding of the query and key heads
    (rotate-half form, Su et al. 2021, arXiv 2104.09864), the float16 rounding of this step's keys and
    values (:func:`half_precision_cache`), the transposes around ``AttentionRowsHalfCache`` and the
    attention itself. The operator performs the same operations in the same order (the kernels'
    source says which), so the graph computes the same bits with ~30 fewer nodes per layer — nodes
    that ONNX Runtime dispatches one after another on one thread while the other waits
    (``bench/results/step-costs.md``: ~1.8 µs a node, ~0.9 ms of a one-token step per 480 nodes).

    Applies to a graph that :func:`exact_attention` and :func:`half_precision_cache` rewrote (the
    int8 path's graph as :mod:`lade_export.graph` exports it). A layer whose nodes are not exactly
    that form (another rotary form, a projection that is not fused, a tensor with other readers) is
    left as it is; every layer stays correct either way.

    Returns:
        the number of layers fused.
    """
    from onnx import TensorProto, helper

    from ..kernels import DOMAIN
    from .graph_match import GraphIndex, NoMatch, replace_nodes

    g = GraphIndex(graph)

    def transpose(name, perm):
        node = g.sole(name, "Transpose")
        if list(g.attr(node, "perm", [])) != perm:
            raise NoMatch(name)
        return node

    def cast(name, to, may_be_output=False):
        node = g.produced_by(name, "Cast")
        if g.attr(node, "to") != to or (not may_be_output and (len(g.readers.get(name, [])) != 1 or name in g.outputs)):
            raise NoMatch(name)
        return node

    def slice_of(name, x, start, end_at_least):
        node = g.sole(name, "Slice")
        starts, ends = g.const(node.input[1]), g.const(node.input[2])
        axes = g.const(node.input[3]) if len(node.input) > 3 and node.input[3] else None
        steps = g.const(node.input[4]) if len(node.input) > 4 and node.input[4] else None
        if (node.input[0] != x or starts is None or ends is None or axes is None or starts.size != 1
                or int(starts.ravel()[0]) != start or int(ends.ravel()[0]) < end_at_least
                or int(axes.ravel()[0]) not in (3, -1) or (steps is not None and int(steps.ravel()[0]) != 1)):
            raise NoMatch(name)
        return node

    def rotary(name):
        """``x·cos + rotate_half(x)·sin``, x a Reshape's output → (that Reshape, cos, sin, D/2, the nodes)."""
        add = g.produced_by(name, "Add")
        muls = [g.produced_by(i, "Mul") for i in add.input]
        concats = [i for m in muls for i in m.input if g.producers.get(i) is not None
                   and g.producers[i].op_type == "Concat"]
        if len(muls) != 2 or len(concats) != 1:
            raise NoMatch(name)
        concat = g.producers[concats[0]]
        turned = next(m for m in muls if concat.output[0] in m.input)
        plain = next(m for m in muls if m is not turned)
        sin = g.other_input(turned, concat.output[0])
        if g.attr(concat, "axis") not in (3, -1) or len(concat.input) != 2 or len(g.readers[concat.output[0]]) != 1:
            raise NoMatch(name)
        neg = g.sole(concat.input[0], "Neg")
        low, high = g.produced_by(concat.input[1], "Slice"), g.produced_by(neg.input[0], "Slice")
        x = low.input[0]
        half = g.scalar(high.input[1])
        if half is None or g.scalar(low.input[2]) != half:
            raise NoMatch(name)
        half = int(half)
        slice_of(high.output[0], x, half, 2 * half)
        slice_of(low.output[0], x, 0, half)
        cos = g.other_input(plain, x)
        view = g.produced_by(x, "Reshape")
        if (any(len(g.readers[m.output[0]]) != 1 for m in muls) or x in g.outputs or name in g.outputs
                or {id(r) for r in g.readers[x]} != {id(plain), id(high), id(low)} or len(g.readers[name]) != 1):
            raise NoMatch(name)
        return view, cos, sin, half, [add, *muls, concat, neg, high, low]

    fused, drop, insert = 0, set(), {}
    for attention in [n for n in graph.node if n.op_type == HALF_CACHE_OP]:
        try:
            if g.attr(attention, "past_layout", 0) != 1:
                raise NoMatch(attention.name)
            q, cache_k, k, cache_v, v, masked = attention.input
            # Q [B, KV, G·S, D] = Reshape(Transpose(rotary(Reshape(q_flat))))
            q_view = g.sole(q, "Reshape")
            q_heads = transpose(q_view.input[0], [0, 2, 1, 3])
            q_split, cos, sin, half, q_rotary = rotary(q_heads.input[0])
            # K [B, KV, D, S] = Transpose(Cast32(Cast16(rotary(Reshape(k_flat))))), the Cast16 the present key
            k_heads = transpose(k, [0, 2, 3, 1])
            k_wide = cast(k_heads.input[0], TensorProto.FLOAT)
            k_half = cast(k_wide.input[0], TensorProto.FLOAT16, may_be_output=True)
            k_split, k_cos, k_sin, k_half_width, k_rotary = rotary(k_half.input[0])
            # V [B, KV, S, D] = Transpose(Cast32(Cast16(Reshape(v_flat)))), the Cast16 the present value
            v_heads = transpose(v, [0, 2, 1, 3])
            v_wide = cast(v_heads.input[0], TensorProto.FLOAT)
            v_half = cast(v_wide.input[0], TensorProto.FLOAT16, may_be_output=True)
            v_split = g.sole(v_half.input[0], "Reshape")
            present_k, present_v = k_half.output[0], v_half.output[0]
            if ((k_cos, k_sin, k_half_width) != (cos, sin, half) or not {present_k, present_v} <= g.outputs
                    or [id(r) for r in g.readers[present_k]] != [id(k_wide)]
                    or [id(r) for r in g.readers[present_v]] != [id(v_wide)]):
                raise NoMatch(attention.name)
            split = g.produced_by(q_split.input[0], "Split")
            if (list(split.output) != [q_split.input[0], k_split.input[0], v_split.input[0]]
                    or any(len(g.readers[o]) != 1 for o in split.output) or g.attr(split, "axis", 0) not in (2, -1)):
                raise NoMatch(attention.name)
            sizes = g.const(split.input[1]) if len(split.input) > 1 else None
            d = 2 * half
            if sizes is None or sizes.size != 3 or any(int(z) % d for z in sizes) or sizes[1] != sizes[2]:
                raise NoMatch(attention.name)
            heads, kv_heads = int(sizes[0]) // d, int(sizes[1]) // d
            if heads % kv_heads:
                raise NoMatch(attention.name)
            # out: Reshape([B, H, S, D]) → Transpose → Reshape([B, S, H·D]), each the only reader of the last
            o_view = g.reader(attention.output[0], "Reshape")
            o_heads = g.reader(o_view.output[0], "Transpose")
            if list(g.attr(o_heads, "perm", [])) != [0, 2, 1, 3]:
                raise NoMatch(attention.name)
            o_flat = g.reader(o_heads.output[0], "Reshape")
        except NoMatch:
            continue
        scale = g.attr(attention, "scale")
        node = helper.make_node(ROTARY_OP, [split.input[0], cos, sin, cache_k, cache_v, masked],
                                [o_flat.output[0], present_k, present_v], name=f"{attention.name}_rotary",
                                domain=DOMAIN, scale=float(scale), heads=heads, kv_heads=kv_heads)
        for n in (split, q_split, *q_rotary, q_heads, q_view, k_split, *k_rotary, k_half, k_wide, k_heads, v_split,
                  v_half, v_wide, v_heads, attention, o_view, o_heads, o_flat):
            drop.add(id(n))
        insert[id(attention)] = node
        fused += 1
    if fused:
        replace_nodes(graph, drop, insert)
    return fused
