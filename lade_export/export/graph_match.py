"""Lookups for the graph rewrites that fold a step graph's nodes into the lade kernels'
operators (:func:`lade_export.export.attention_rows.fuse_rotary_attention`,
:func:`lade_export.export.row_fusion.fuse_row_work`): who produces and who reads a tensor,
its constant value, a node's attribute, and the checks that make a pattern safe to replace
(a tensor read by exactly the node being folded, and not a graph output).

A failed check raises :class:`NoMatch`; a rewrite catches it and leaves that part of the
graph as it is.
"""

from __future__ import annotations


class NoMatch(LookupError):
    """A pattern is not the exact form a rewrite replaces (the tensor or node it names)."""


class GraphIndex:
    """Producers, readers, initializers and outputs of an ONNX ``GraphProto``, taken once.

    Args:
        graph: the graph; the index does not follow later changes to it.
    """

    def __init__(self, graph):
        self.producers = {o: n for n in graph.node for o in n.output}
        self.readers: dict = {}
        for n in graph.node:
            for i in n.input:
                self.readers.setdefault(i, []).append(n)
        self.inits = {i.name: i for i in graph.initializer}
        self.outputs = {o.name for o in graph.output}
        self.position = {id(n): k for k, n in enumerate(graph.node)}

    def const(self, name):
        """The value of an initializer or a ``Constant`` node's output (numpy), else None."""
        from onnx import numpy_helper

        if name in self.inits:
            return numpy_helper.to_array(self.inits[name])
        node = self.producers.get(name)
        if node is not None and node.op_type == "Constant":
            return next((numpy_helper.to_array(a.t) for a in node.attribute if a.name == "value"), None)
        return None

    def scalar(self, name) -> float | None:
        """A one-element constant as a float, else None."""
        value = self.const(name)
        return float(value.ravel()[0]) if value is not None and value.size == 1 else None

    @staticmethod
    def attr(node, name, default=None):
        """A node's attribute value, or ``default`` when absent."""
        from onnx import helper

        a = next((a for a in node.attribute if a.name == name), None)
        return default if a is None else helper.get_attribute_value(a)

    def produced_by(self, name, op):
        """The producer of ``name``, an ``op`` node (other readers allowed).

        Raises:
            NoMatch: no such producer.
        """
        node = self.producers.get(name)
        if node is None or node.op_type != op:
            raise NoMatch(name)
        return node

    def sole(self, name, op):
        """The producer of ``name``, an ``op`` node, when ``name`` has one reader and is no graph output.

        Raises:
            NoMatch: another producer, or another reader.
        """
        node = self.produced_by(name, op)
        if len(self.readers.get(name, [])) != 1 or name in self.outputs:
            raise NoMatch(name)
        return node

    def reader(self, name, op):
        """The one reader of ``name``, an ``op`` node (``name`` no graph output).

        Raises:
            NoMatch: no reader, several, or another op.
        """
        found = self.readers.get(name, [])
        if len(found) != 1 or found[0].op_type != op or name in self.outputs:
            raise NoMatch(name)
        return found[0]

    def other_input(self, node, name):
        """The input of a two-input node that is not ``name``.

        Raises:
            NoMatch: ``node`` does not have exactly one other input.
        """
        rest = [i for i in node.input if i != name]
        if len(rest) != 1:
            raise NoMatch(node.name)
        return rest[0]


def replace_nodes(graph, drop: set, insert: dict) -> None:
    """Rewrite ``graph``'s node list: nodes whose ``id`` is in ``drop`` go, a node whose ``id`` is
    a key of ``insert`` is replaced by its value, then every node that no longer feeds a graph
    output (the shape arithmetic of what went) is dropped, repeatedly."""
    outputs = {o.name for o in graph.output}
    nodes = [insert.get(id(n), n) for n in graph.node if id(n) not in drop or id(n) in insert]
    while True:
        used = {i for n in nodes for i in n.input} | outputs
        kept = [n for n in nodes if any(o in used for o in n.output)]
        if len(kept) == len(nodes):
            break
        nodes = kept
    graph.ClearField("node")
    graph.node.extend(nodes)
