"""Read-only questions rules ask of a graph; changing it is the framework's job (rewrite.py)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from llmc.contract import graph_io as io
from llmc.passes import lazy

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
    """The numpy contents of a constant initializer (a weight), or None. This computes a lazy
    weight whole: a rule that needs only its dtype and shape, or its columns, asks `tensor`."""
    if value is None or value.const_value is None or not value.is_initializer():
        return None
    return value.const_value.numpy()


def tensor(value: ir.Value | None) -> lazy.Lazy | None:
    """A constant initializer's tensor as a Lazy one (dtype, dims, columns on demand), or None."""
    if value is None or value.const_value is None or not value.is_initializer():
        return None
    return lazy.of(value.const_value)


def perm(node: ir.Node) -> tuple[int, ...] | None:
    """A Transpose's explicit perm."""
    attr = node.attributes.get("perm")
    return tuple(attr.value) if attr is not None else None


def matmul_tensor(value: ir.Value | None) -> lazy.Lazy | None:
    """A MatMul's constant right operand as a lazy [K, N]: an initializer, or a Transpose of one
    (the LM head of a tied model reads the embedding table transposed)."""
    if (found := tensor(value)) is not None:
        return found
    node = producer(value, "Transpose")
    if node is None or (table := tensor(node.inputs[0])) is None or len(table.dims) != 2:
        return None
    return lazy.transposed(table) if perm(node) in (None, (1, 0)) else None


def matmul_weight(value: ir.Value | None) -> np.ndarray | None:
    """matmul_tensor's values, whole."""
    found = matmul_tensor(value)
    return None if found is None else found.numpy()


def rotary(value: ir.Value) -> tuple[ir.Value, ir.Node | None]:
    """(inner value, RotaryEmbedding node) when `value` is a RotaryEmbedding's output over 4-D
    [B, H, S, D] with per-token cos/sin (no position_ids), else (value, None)."""
    node = producer(value, "RotaryEmbedding")
    if node is None or (len(node.inputs) > 3 and node.inputs[3] is not None):
        return value, None
    return node.inputs[0], node


def rotary_attrs(node: ir.Node) -> tuple[int, int]:
    """(interleaved, rotary_embedding_dim) of a RotaryEmbedding."""
    return node.attributes.get_int("interleaved", 0), node.attributes.get_int("rotary_embedding_dim", 0)


def shared_rotary(q: ir.Value, k: ir.Value) -> str | None:
    """Why Q and K's RotaryEmbedding cannot be folded into an attention kernel as one rotation, or
    None (both rotated alike, or neither)."""
    (_, rope_q), (_, rope_k) = rotary(q), rotary(k)
    if (rope_q is None) != (rope_k is None):
        return "only one of Q and K has a RotaryEmbedding"
    if rope_q is not None:
        if list(rope_q.inputs[1:3]) != list(rope_k.inputs[1:3]):
            return "Q and K rotate with different cos/sin"
        if rotary_attrs(rope_q) != rotary_attrs(rope_k):
            return "Q and K's RotaryEmbedding attributes differ"
    return None


# What may lie between the LM head and the logits output: Gemma 2's final softcap, c * tanh(x / c).
# Each is increasing elementwise (a positive scalar constant), so the head's rows and argmax are
# the logits' rows and argmax.
_SOFTCAP_OPS = ("Div", "Mul", "Tanh")


def logits_tail(value: ir.Value) -> list[ir.Node] | None:
    """The nodes from `value` to the graph's logits output when `value` is the logits or the final
    softcap's input ([] for the logits themselves), else None."""
    tail = []
    while not (value.is_graph_output() and value.name == io.LOGITS):
        uses = value.uses()
        if value.is_graph_output() or len(uses) != 1:
            return None
        node = uses[0].node
        if node.op_type not in _SOFTCAP_OPS or node.domain not in ONNX_DOMAINS or node.inputs[0] is not value:
            return None
        if node.op_type != "Tanh":
            c = node.inputs[1].const_value if len(node.inputs) == 2 and node.inputs[1] is not None else None
            if c is None or node.inputs[1].producer() is not None or c.size != 1 or not c.numpy().item() > 0:
                return None
        tail.append(node)
        value = node.outputs[0]
    return tail


def is_lm_head_output(value: ir.Value) -> bool:
    return logits_tail(value) is not None


def count_nodes(model: ir.Model) -> int:
    return sum(1 for _ in model.graph)
