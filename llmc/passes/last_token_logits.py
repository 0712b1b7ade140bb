"""last-token-logits: run the LM head only on each row's last valid token.

A prefill of S tokens otherwise pays S x vocab x hidden MACs for logits nobody reads. The
hidden state of row b's token `query_lens[b] - 1` is gathered before the LM head MatMul, so
`logits` becomes [B, V].
"""

from __future__ import annotations

import onnx_ir as ir

from llmc.contract import graph_io as io
from llmc.contract.model_spec import ModelSpec
from llmc.passes.graph import graph_input
from llmc.passes.rewrite import Rule, RulePass


def _logits(graph: ir.Graph) -> ir.Value | None:
    return next((v for v in graph.outputs if v.name == io.LOGITS), None)


class GatherBeforeLMHead(Rule):
    name = "lm_head_last_token"

    def pattern(self, op, hidden, w):
        return op.MatMul(hidden, w)

    def match(self, node):
        m = super().match(node)
        return m if m is not None and m.outputs[0] is _logits(node.graph) else None

    def rewrite(self, op, m):
        last = op.Sub(op.Cast(op.graph_input(io.QUERY_LENS), to=ir.DataType.INT64), op.const(1))
        width = op.Slice(op.Shape(m.hidden), op.const([2]), op.const([3]))
        index = op.Expand(op.Reshape(last, op.const([-1, 1, 1])),
                          op.Concat(op.const([1, 1]), width, axis=0))  # broadcasts to [B, 1, H]
        # Squeezed before the head, not after: the head then writes [B, V] straight into the
        # bound logits buffer, where a Squeeze after it copied B x V floats every step.
        picked = op.Squeeze(op.GatherElements(m.hidden, index, axis=1), op.const([1]))  # [B, H]
        logits = op.MatMul(picked, m.w)
        old = m.outputs[0].shape
        logits.shape = ir.Shape([old[0], old[2]]) if old is not None else None
        return logits


class LastTokenLogits(RulePass):
    name = "last-token-logits"
    description = "compute logits for each row's last valid token only"

    def requires(self, model: ir.Model, spec: ModelSpec) -> str | None:
        if graph_input(model.graph, io.QUERY_LENS) is None:
            return "the graph has no query_lens input; run paged-kv-cache first"
        logits = _logits(model.graph)
        head = logits.producer() if logits is not None else None
        if head is None or head.op_type != "MatMul":
            return f"logits come from {head.op_type if head else 'no node'}, expected the LM head MatMul"
        if logits.shape is not None and len(logits.shape) != 3:
            return f"logits have rank {len(logits.shape)}, expected [B, S, V]"
        return None

    def rules(self, spec: ModelSpec):
        return [GatherBeforeLMHead()]
