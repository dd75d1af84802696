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
    from onnx import TensorProto, helper, numpy_helper

    from ..kernels import DOMAIN

    producers = {o: n for n in graph.node for o in n.output}
    readers = {}
    for n in graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    inits = {i.name: i for i in graph.initializer}
    outputs = {o.name for o in graph.output}

    def const(name):
        if name in inits:
            return numpy_helper.to_array(inits[name])
        node = producers.get(name)
        if node is not None and node.op_type == "Constant":
            return next((numpy_helper.to_array(a.t) for a in node.attribute if a.name == "value"), None)
        return None

    def attr(node, name, default=None):
        a = next((a for a in node.attribute if a.name == name), None)
        if a is None:
            return default
        return helper.get_attribute_value(a)

    def sole(name, op):
        """The producer of ``name`` if it is an ``op`` and ``name`` has no other reader (nor is a graph output)."""
        node = producers.get(name)
        if node is None or node.op_type != op or len(readers.get(name, [])) != 1 or name in outputs:
            raise LookupError(name)
        return node

    def reader(name, op):
        """The one reader of ``name``, an ``op`` (``name`` not a graph output)."""
        found = readers.get(name, [])
        if len(found) != 1 or found[0].op_type != op or name in outputs:
            raise LookupError(name)
        return found[0]

    def transpose(name, perm):
        node = sole(name, "Transpose")
        if list(attr(node, "perm", [])) != perm:
            raise LookupError(name)
        return node

    def cast(name, to, may_be_output=False):
        node = producers.get(name)
        if node is None or node.op_type != "Cast" or attr(node, "to") != to:
            raise LookupError(name)
        if not may_be_output and (len(readers.get(name, [])) != 1 or name in outputs):
            raise LookupError(name)
        return node

    def slice_of(name, x, start, end_at_least):
        node = sole(name, "Slice")
        starts, ends = const(node.input[1]), const(node.input[2])
        axes = const(node.input[3]) if len(node.input) > 3 and node.input[3] else None
        steps = const(node.input[4]) if len(node.input) > 4 and node.input[4] else None
        if (node.input[0] != x or starts is None or ends is None or axes is None or starts.size != 1
                or int(starts.ravel()[0]) != start or int(ends.ravel()[0]) < end_at_least
                or int(axes.ravel()[0]) not in (3, -1) or (steps is not None and int(steps.ravel()[0]) != 1)):
            raise LookupError(name)
        return node

    def rotary(name):
        """``x·cos + rotate_half(x)·sin``, x a Reshape's output → (that Reshape, cos, sin, D/2, the nodes)."""
        add = producers.get(name)
        if add is None or add.op_type != "Add":
            raise LookupError(name)
        muls = [producers.get(i) for i in add.input]
        if any(m is None or m.op_type != "Mul" for m in muls):
            raise LookupError(name)
        turned = next((m for m in muls if any(producers.get(i) is not None and producers[i].op_type == "Concat"
                                              for i in m.input)), None)
        plain = next((m for m in muls if m is not turned), None)
        if turned is None or plain is None:
            raise LookupError(name)
        concat = next(producers[i] for i in turned.input if producers.get(i) is not None
                      and producers[i].op_type == "Concat")
        sin = next(i for i in turned.input if i != concat.output[0])
        if attr(concat, "axis") not in (3, -1) or len(concat.input) != 2 or len(readers[concat.output[0]]) != 1:
            raise LookupError(name)
        neg = sole(concat.input[0], "Neg")
        low = producers.get(concat.input[1])
        high = producers.get(neg.input[0])
        if low is None or high is None or low.op_type != "Slice" or high.op_type != "Slice":
            raise LookupError(name)
        x = low.input[0]
        half_start = const(high.input[1])
        if half_start is None:
            raise LookupError(name)
        half = int(half_start.ravel()[0])
        slice_of(high.output[0], x, half, 2 * half)
        slice_of(low.output[0], x, 0, half)
        if int(const(low.input[2]).ravel()[0]) != half or x not in plain.input:
            raise LookupError(name)
        cos = next(i for i in plain.input if i != x)
        for m in muls:
            if len(readers[m.output[0]]) != 1:
                raise LookupError(name)
        view = producers.get(x)
        if (view is None or view.op_type != "Reshape" or x in outputs or name in outputs
                or {id(r) for r in readers[x]} != {id(plain), id(high), id(low)} or len(readers[name]) != 1):
            raise LookupError(name)
        return view, cos, sin, half, [add, *muls, concat, neg, high, low]

    fused, drop, insert = 0, set(), {}
    for attention in [n for n in graph.node if n.op_type == HALF_CACHE_OP]:
        try:
            if not any(a.name == "past_layout" and a.i == 1 for a in attention.attribute):
                raise LookupError(attention.name)
            q, cache_k, k, cache_v, v, masked = attention.input
            # Q [B, KV, G·S, D] = Reshape(Transpose(rotary(Reshape(q_flat))))
            q_view = sole(q, "Reshape")
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
            v_split = sole(v_half.input[0], "Reshape")
            present_k, present_v = k_half.output[0], v_half.output[0]
            if ((k_cos, k_sin, k_half_width) != (cos, sin, half) or present_k not in outputs or present_v not in outputs
                    or {r.name for r in readers[present_k]} != {k_wide.name}
                    or {r.name for r in readers[present_v]} != {v_wide.name}):
                raise LookupError(attention.name)
            split = producers.get(q_split.input[0])
            if (split is None or split.op_type != "Split" or list(split.output) !=
                    [q_split.input[0], k_split.input[0], v_split.input[0]]
                    or any(len(readers[o]) != 1 for o in split.output) or attr(split, "axis", 0) not in (2, -1)):
                raise LookupError(attention.name)
            sizes = const(split.input[1]) if len(split.input) > 1 else None
            d = 2 * half
            if sizes is None or sizes.size != 3 or any(int(z) % d for z in sizes) or sizes[1] != sizes[2]:
                raise LookupError(attention.name)
            heads, kv_heads = int(sizes[0]) // d, int(sizes[1]) // d
            if heads % kv_heads:
                raise LookupError(attention.name)
            # out: Reshape([B, H, S, D]) → Transpose → Reshape([B, S, H·D]), each the only reader of the last
            o_view = reader(attention.output[0], "Reshape")
            o_heads = reader(o_view.output[0], "Transpose")
            if list(attr(o_heads, "perm", [])) != [0, 2, 1, 3]:
                raise LookupError(attention.name)
            o_flat = reader(o_heads.output[0], "Reshape")
        except (LookupError, StopIteration, ValueError, TypeError):
            continue
        scale = next(a.f for a in attention.attribute if a.name == "scale")
        node = helper.make_node(ROTARY_OP, [split.input[0], cos, sin, cache_k, cache_v, masked],
                                [o_flat.output[0], present_k, present_v], name=f"{attention.name}_rotary",
                                domain=DOMAIN, scale=float(scale), heads=heads, kv_heads=kv_heads)
        for n in (split, q_split, *q_rotary, q_heads, q_view, k_split, *k_rotary, k_half, k_wide, k_heads, v_split,
                  v_half, v_wide, v_heads, attention, o_view, o_heads, o_flat):
            drop.add(id(n))
        insert[id(attention)] = node
        fused += 1
    if not fused:
        return 0
    nodes = [insert.get(id(n), n) for n in graph.node if id(n) not in drop or id(n) in insert]
    while True:  # drop what now feeds nothing (the shape arithmetic of the reshapes)
        used = {i for n in nodes for i in n.input} | outputs
        kept = [n for n in nodes if any(o in used for o in n.output)]
        if len(kept) == len(nodes):
            break
        nodes = kept
    graph.ClearField("node")
    graph.node.extend(nodes)
    return fused
