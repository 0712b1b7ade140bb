"""Merge sibling projections: MatMuls that read the same activation become one wider MatMul.

Q, K and V read the same normalized hidden state, and so do the MLP's gate and up projections.
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

from llmc.passes.base import BuildContext, RewriteRule, RulePass, weight


def _bias_adds(siblings: list[ir.Node]) -> tuple[list[ir.Node], list[np.ndarray]] | None:
    """Each sibling's sole consumer when all are `Add(out, constant 1-D bias)` matching its width."""
    adds, biases = [], []
    for node in siblings:
        uses = node.outputs[0].uses()
        if len(uses) != 1 or uses[0].node.op_type != "Add" or uses[0].node.domain not in ("", "ai.onnx"):
            return None
        add = uses[0].node
        bias = weight(add.inputs[1 - uses[0].idx])
        if bias is None or bias.ndim != 1 or add.outputs[0].is_graph_output():
            return None
        adds.append(add)
        biases.append(bias)
    return adds, biases


def _matmul_consumers(value: ir.Value, count: int) -> list[ir.Node] | None:
    """The MatMuls reading `value` as their left operand, in graph order (uses() is unordered),
    if there are exactly `count` of them; None otherwise (without scanning the graph)."""
    users = {id(node): node for node, slot in value.uses() if node.op_type == "MatMul" and slot == 0}
    if len(users) != count:
        return None
    graph = next(iter(users.values())).graph
    return [n for n in graph if id(n) in users]


class MergeSiblingMatMuls(RewriteRule):
    """`arity` MatMuls sharing input A with constant 2-D weights -> MatMul(A, concat(W)) + Split."""

    def __init__(self, name: str, arity: int, what: str):
        self.name, self.arity, self.what = name, arity, what

    def match(self, node, ctx: BuildContext):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            return None
        siblings = _matmul_consumers(node.inputs[0], self.arity)
        if siblings is None or siblings[0] is not node:
            return None  # anchored at the first sibling, so a group is seen once
        return {"activation": node.inputs[0], "siblings": siblings}

    def check(self, m, ctx: BuildContext):
        weights = [weight(n.inputs[1]) for n in m["siblings"]]
        if any(w is None for w in weights):
            return f"{self.what}: a weight is not a constant initializer"
        if any(w.ndim != 2 for w in weights):
            return f"{self.what}: weights are not 2-D"
        if len({w.shape[0] for w in weights}) != 1 or len({w.dtype for w in weights}) != 1:
            return f"{self.what}: weights differ in K or dtype"
        if any(n.outputs[0].is_graph_output() for n in m["siblings"]):
            return f"{self.what}: a projection is a graph output"
        m["weights"] = weights
        return None

    def rewrite(self, m, ctx: BuildContext, model: ir.Model):
        graph, siblings, weights = model.graph, m["siblings"], m["weights"]
        merged = ir.Value(name=f"{siblings[0].name}.{self.name}.weight",
                          const_value=ir.tensor(np.concatenate(weights, axis=1)))
        graph.register_initializer(merged)
        matmul = ir.Node("", "MatMul", [m["activation"], merged], name=f"{siblings[0].name}_{self.name}")
        widths = ir.Value(name=f"{matmul.name}.split",
                          const_value=ir.tensor(np.array([w.shape[1] for w in weights], np.int64)))
        graph.register_initializer(widths)
        merged_out, replaced, new_nodes = matmul.outputs[0], siblings, [matmul]
        merged_out.type = siblings[0].outputs[0].type
        bias_adds = _bias_adds(siblings)
        if bias_adds is not None and all(b.shape[0] == w.shape[1] for b, w in zip(bias_adds[1], weights)):
            replaced = bias_adds[0]
            bias = ir.Value(name=f"{matmul.name}.bias", const_value=ir.tensor(np.concatenate(bias_adds[1])))
            graph.register_initializer(bias)
            add = ir.Node("", "Add", [merged_out, bias], name=f"{matmul.name}_bias")
            add.outputs[0].type = merged_out.type
            merged_out = add.outputs[0]
            new_nodes.append(add)
        split = ir.Node("", "Split", [merged_out, widths], attributes=[ir.AttrInt64("axis", -1)],
                        num_outputs=len(siblings), name=f"{matmul.name}_split")
        graph.insert_before(siblings[0], [*new_nodes, split])
        for old, new in zip(replaced, split.outputs):
            new.type, new.shape = old.outputs[0].type, old.outputs[0].shape
            ir.convenience.replace_all_uses_with(old.outputs[0], new)
        graph.remove([*replaced, *siblings] if replaced is not siblings else siblings, safe=True)


class MergeMatMuls(RulePass):
    name = "merge-matmuls"
    description = "merge the Q/K/V projections and the gate/up projections into one MatMul each"
    rules = (MergeSiblingMatMuls("qkv_merge", 3, "Q/K/V projections"),
             MergeSiblingMatMuls("gate_up_merge", 2, "gate/up projections"))

    def finish(self, model, ctx, counts):
        from llmc.passes.cleanup import remove_dead_code

        if counts:
            remove_dead_code(model)  # the per-projection weights are no longer read
