"""Read-only questions rules ask of a graph; changing it is the framework's job (rewrite.py)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

ONNX_DOMAINS = ("", "ai.onnx")


def graph_input(graph: ir.Graph, name: str) -> ir.Value | None:
    return next((v for v in graph.inputs if v.name == name), None)


def producer(value: ir.Value | None, op_type: str, domain: str = "") -> ir.Node | None:
    """The node producing `value` if it is an `op_type` of `domain` (default: ONNX's)."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != op_type:
        return None
    return node if node.domain in (ONNX_DOMAINS if domain in ONNX_DOMAINS else (domain,)) else None


def const_ints(value: ir.Value | None) -> list[int] | None:
    """The integer contents of a constant or initializer input, or None if it is not constant."""
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else [int(x) for x in tensor.numpy().reshape(-1)]


def weight(value: ir.Value | None) -> np.ndarray | None:
    """The numpy contents of a constant initializer (a weight), or None."""
    if value is None or value.const_value is None or not value.is_initializer():
        return None
    return value.const_value.numpy()


def perm(node: ir.Node) -> tuple[int, ...] | None:
    """A Transpose's explicit perm."""
    attr = node.attributes.get("perm")
    return tuple(attr.value) if attr is not None else None


def count_nodes(model: ir.Model) -> int:
    return sum(1 for _ in model.graph)
