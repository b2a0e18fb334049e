"""The graph view the QDQ passes edit (export/qdq/graph.py runs them): producer and
consumer maps over an ONNX GraphProto, and the constant and attribute lookups they share."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


class QdqGraph:
    """Producer/consumer/initializer maps over an onnx GraphProto, rebuilt after each edit."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.g = graph
        self.refresh()

    def refresh(self) -> None:
        self.init = {i.name: i for i in self.g.initializer}
        self.producer: dict[str, onnx.NodeProto] = {o: n for n in self.g.node for o in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in self.g.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.outputs = {o.name for o in self.g.output}

    def array(self, name: str) -> np.ndarray:
        return numpy_helper.to_array(self.init[name])

    def set_init(self, name: str, arr: np.ndarray) -> None:
        if name in self.init:
            self.g.initializer.remove(self.init[name])
        self.g.initializer.append(numpy_helper.from_array(arr, name))
        self.init[name] = self.g.initializer[-1]

    def rewire(self, old: str, new: str) -> None:
        for n in self.consumers.get(old, []):
            for k, i in enumerate(n.input):
                if i == old:
                    n.input[k] = new
        for o in self.g.output:
            if o.name == old:  # keep graph output names: rename the producer instead
                raise ValueError("rewire of a graph output")

    def replace(self, old: list[onnx.NodeProto], new: list[onnx.NodeProto]) -> None:
        """Remove ``old`` and put ``new`` where the first of them stood (topological order kept when
        ``new`` reads only what ``old`` read); the maps are stale until :meth:`refresh`."""
        idx = list(self.g.node).index(old[0])
        for n in old:
            self.g.node.remove(n)
        for k, n in enumerate(new):
            self.g.node.insert(idx + k, n)

    def unique(self, base: str) -> str:
        names = set(self.init) | set(self.producer) | {i.name for i in self.g.input}
        k, name = 0, base
        while name in names:
            k += 1
            name = f"{base}_{k}"
        return name


def quant_axis(node: onnx.NodeProto) -> int:
    """A Q/DQ node's ``axis`` attribute (1, ONNX's default, where it has none)."""
    for a in node.attribute:
        if a.name == "axis":
            return int(helper.get_attribute_value(a))
    return 1


def node_attr(node: onnx.NodeProto, name: str, default: object = None) -> object:
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def constant_value(g: QdqGraph, name: str) -> np.ndarray | None:
    """The value of an initializer or of a Constant node's output (None for a computed tensor)."""
    if name in g.init:
        return g.array(name)
    node = g.producer.get(name)
    if node is not None and node.op_type == "Constant":
        for a in node.attribute:
            if a.name == "value":
                return numpy_helper.to_array(a.t)
    return None
