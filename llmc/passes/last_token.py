"""Last-token logits: run the LM head only on each row's last valid token.

A prefill of S tokens otherwise pays S x vocab x hidden MACs for logits nobody reads. The
hidden state of row b's token `query_lens[b] - 1` is gathered before the LM head MatMul, so
`logits` becomes [B, V].
"""

from __future__ import annotations

import onnx_ir as ir

from llmc.ir_builder import OpBuilder
from llmc.passes.base import BuildContext, PassResult, RewriteRule, RulePass, graph_input
from llmc.passes.paged_kv import QUERY_LENS

LOGITS = "logits"


class GatherBeforeLMHead(RewriteRule):
    name = "lm_head_last_token"

    def match(self, node, ctx: BuildContext):
        if not any(o.is_graph_output() and o.name == LOGITS for o in node.outputs):
            return None
        return {"lm_head": node}

    def check(self, m, ctx: BuildContext):
        node = m["lm_head"]
        if node.op_type != "MatMul":
            return f"logits come from {node.op_type}, expected the LM head MatMul"
        if node.graph is None or graph_input(node.graph, QUERY_LENS) is None:
            return "graph has no query_lens input; run paged-kv-cache first"
        shape = node.outputs[0].shape
        if shape is not None and len(shape) != 3:
            return f"logits have rank {len(shape)}, expected [B, S, V]"
        return None

    def rewrite(self, m, ctx: BuildContext, model: ir.Model):
        head = m["lm_head"]
        graph = model.graph
        hidden = head.inputs[0]
        ops = OpBuilder(name_prefix="last_token_")  # detached: nodes are inserted below
        last = ops.Sub(ops.Cast(graph_input(graph, QUERY_LENS), to=ir.DataType.INT64), ops.const(1))
        width = ops.Slice(ops.Shape(hidden), ops.const([2]), ops.const([3]))
        index = ops.Expand(ops.Reshape(last, ops.const([-1, 1, 1])),
                           ops.Concat(ops.const([1, 1]), width, axis=0))  # broadcasts to [B, 1, H]
        # Squeezed before the head, not after: the head then writes [B, V] straight into the
        # bound logits buffer, where a Squeeze after it copied B x V floats every step.
        picked = ops.Squeeze(ops.GatherElements(hidden, index, axis=1), ops.const([1]))  # [B, H]
        graph.insert_before(head, ops.nodes)
        head.replace_input_with(0, picked)
        logits = head.outputs[0]
        if logits.shape is not None:
            logits.shape = ir.Shape([logits.shape[0], logits.shape[2]])


class LastTokenLogits(RulePass):
    name = "last-token-logits"
    description = "compute logits for each row's last valid token only"
    rules = (GatherBeforeLMHead(),)

    def run(self, model, ctx):
        if not ctx.last_token_logits:
            return PassResult(False, {}, ["disabled: the build asked for logits at all positions"])
        return super().run(model, ctx)
