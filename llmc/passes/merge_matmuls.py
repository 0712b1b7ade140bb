"""merge-matmuls: MatMuls that read the same activation become one wider MatMul.

Q, K and V read the same normalized hidden state, and so do the MLP's gate and up projections
and a Gated DeltaNet layer's four input projections (its q/k/v, output gate, beta and decay).
One [K, Nq+Nk+Nv] GEMM instead of three streams the activation once, pays one kernel launch and
thread fork instead of three, and gives the small-M decode GEMMs a wider N to parallelize over.
A Split hands each consumer its columns back, so nothing downstream changes. Projections with
a bias (Qwen2's Q/K/V) keep it on the merged side: when every sibling's only consumer adds a
constant 1-D bias, one Add of the concatenated biases runs before the Split, so the split parts
are the finished projections (which llmc's attention kernel can then read unsplit).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from llmc.contract.model_spec import ModelSpec
from llmc.passes import lazy
from llmc.passes.graph import ONNX_DOMAINS, tensor, weight
from llmc.passes.pattern import Match
from llmc.passes.rewrite import Rule, RulePass


# On a merged weight: which projections it holds (the rule's name), for passes that treat them apart.
PROJECTION_KEY = "llmc.projection"
QKV = "qkv_merge"


def _is_matmul(node: ir.Node) -> bool:
    return node.op_type == "MatMul" and node.domain in ONNX_DOMAINS


def _siblings(value: ir.Value, count: int) -> list[ir.Node] | None:
    """The MatMuls reading `value` as their left operand, in graph order (uses() is unordered), if
    there are exactly `count` of them; None otherwise (without scanning the graph)."""
    users = {id(node): node for node, slot in value.uses() if _is_matmul(node) and slot == 0}
    if len(users) != count:
        return None
    graph = next(iter(users.values())).graph
    return [n for n in graph if id(n) in users]


def _bias_adds(siblings: list[ir.Node]) -> list[ir.Node] | None:
    """Each sibling's sole consumer when all are `Add(out, constant 1-D bias of its width)`."""
    adds = []
    for node in siblings:
        uses = node.outputs[0].uses()
        if len(uses) != 1 or uses[0].node.op_type != "Add" or uses[0].node.domain not in ONNX_DOMAINS:
            return None
        add = uses[0].node
        bias, w = tensor(add.inputs[1 - uses[0].idx]), tensor(node.inputs[1])
        if bias is None or len(bias.dims) != 1 or w is None or len(w.dims) != 2 or bias.dims[0] != w.dims[1] \
                or add.outputs[0].is_graph_output():
            return None
        adds.append(add)
    return adds


class MergeSiblingMatMuls(Rule):
    """`arity` MatMuls sharing input A with constant 2-D weights -> MatMul(A, concat(W)) + Split.

    Siblings are not a tree under one root, so this rule matches them itself rather than through
    a declared pattern: anchored at the first sibling in graph order, so a group is seen once."""

    def __init__(self, name: str, arity: int, what: str):
        self.name, self.arity, self.what = name, arity, what

    def match(self, node: ir.Node) -> Match | None:
        if not _is_matmul(node):
            return None
        siblings = _siblings(node.inputs[0], self.arity)
        if siblings is None or siblings[0] is not node:
            return None
        adds = _bias_adds(siblings)
        replaced = adds if adds is not None else siblings
        return Match(root=node, nodes=siblings + (adds or []), removed=siblings + (adds or []),
                     outputs=[n.outputs[0] for n in replaced],
                     named={"activation": node.inputs[0], "siblings": siblings, "adds": adds})

    def check(self, m):
        weights = [tensor(n.inputs[1]) for n in m.siblings]
        if any(w is None for w in weights):
            return f"{self.what}: a weight is not a constant initializer"
        if any(len(w.dims) != 2 for w in weights):
            return f"{self.what}: weights are not 2-D"
        if len({w.dims[0] for w in weights}) != 1 or len({w.dtype for w in weights}) != 1:
            return f"{self.what}: weights differ in K or dtype"
        if any(n.outputs[0].is_graph_output() for n in m.siblings):
            return f"{self.what}: a projection is a graph output"
        return None

    def rewrite(self, op, m):
        first, weights = m.siblings[0], [tensor(n.inputs[1]) for n in m.siblings]
        merged = op.initializer(lazy.concatenated(weights), f"{first.name}.{self.name}.weight")
        merged.metadata_props[PROJECTION_KEY] = self.name
        out = op.MatMul(m.activation, merged)
        out.type = first.outputs[0].type
        if m.adds is not None:
            biases = [weight(add.inputs[1 - add.inputs.index(n.outputs[0])]) for n, add in zip(m.siblings, m.adds)]
            out = op.Add(out, op.initializer(np.concatenate(biases), f"{first.name}.{self.name}.bias"))
            out.type = first.outputs[0].type
        widths = op.initializer(np.array([w.dims[1] for w in weights], np.int64), f"{first.name}.{self.name}.split")
        return op.Split(out, widths, axis=-1, num_outputs=len(m.siblings))


class MergeMatMuls(RulePass):
    name = "merge-matmuls"
    description = "merge the Q/K/V, the gate/up and a DeltaNet layer's input projections into one MatMul each"

    def rules(self, spec: ModelSpec):
        return [MergeSiblingMatMuls(QKV, 3, "Q/K/V projections"),
                MergeSiblingMatMuls("gate_up_merge", 2, "gate/up projections"),
                MergeSiblingMatMuls("delta_in_merge", 4, "a Gated DeltaNet layer's input projections")]
