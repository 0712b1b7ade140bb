"""logits-indices: run the LM head only on the tokens the step asks logits for.

A prefill of S tokens otherwise pays S x vocab x hidden MACs for logits nobody reads. The step
names the tokens it wants in `logits_indices` [N], flat indices into its [B*S] token grid
(llmc.contract.graph_io); the final hidden state [B, S, H] is flattened to [B*S, H], those N
rows are gathered, and the LM head MatMul turns them into `logits` [N, V]. One graph serves a
decode or prefill step (each row's last token), scoring (every position) and speculative
verification (k+1 positions of a row), at a head cost proportional to N. A final softcap after the
head (Gemma 2) is elementwise: it runs on the N rows as it is.
"""

from __future__ import annotations

import onnx_ir as ir

from llmc.contract import graph_io as io
from llmc.contract.model_spec import ModelSpec
from llmc.passes.graph import graph_input, is_lm_head_output, logits_tail
from llmc.passes.paged_kv_cache import contract_input_order
from llmc.passes.rewrite import Rule, RulePass


class GatherBeforeLMHead(Rule):
    name = "lm_head_gather"

    def pattern(self, op, hidden, w):
        return op.MatMul(hidden, w)

    def match(self, node):
        m = super().match(node)
        return m if m is not None and is_lm_head_output(m.outputs[0]) else None

    def check(self, m):
        shape = m.hidden.shape
        if shape is None or len(shape) != 3 or not isinstance(shape[2], int):
            return f"the LM head reads {shape}, expected [B, S, H] with a fixed H"
        return None

    def rewrite(self, op, m):
        width = m.hidden.shape[2]
        indices = op.step_input(io.LOGITS_INDICES)
        # Gathered before the head, not after: the head then computes N rows and writes [N, V]
        # straight into the bound logits buffer.
        picked = op.Gather(op.Reshape(m.hidden, op.const([-1, width])), indices, axis=0)  # [N, H]
        logits = op.MatMul(picked, m.w)
        old = m.outputs[0].shape
        logits.shape = ir.Shape([io.NUM_LOGITS, old[2]]) if old is not None else None
        for node in logits_tail(m.outputs[0]):  # a final softcap's values are [N, V] now too
            node.outputs[0].shape = logits.shape
        return logits


class LogitsIndices(RulePass):
    name = "logits-indices"
    description = "compute logits only for the tokens the step's logits_indices names"
    required = True  # logits_indices is a step input of the engine contract

    def requires(self, model: ir.Model, spec: ModelSpec) -> str | None:
        if graph_input(model.graph, io.QUERY_LENS) is None:
            return "the graph has no query_lens input; run paged-kv-cache first"
        logits = next((v for v in model.graph.outputs if v.name == io.LOGITS), None)
        head = logits.producer() if logits is not None else None
        while head is not None and head.op_type != "MatMul" and logits_tail(head.inputs[0]) is not None:
            head = head.inputs[0].producer()  # back through a final softcap
        if head is None or head.op_type != "MatMul":
            return f"logits come from {head.op_type if head else 'no node'}, expected the LM head MatMul"
        if logits.shape is not None and len(logits.shape) != 3:
            return f"logits have rank {len(logits.shape)}, expected [B, S, V]"
        return None

    def rules(self, spec: ModelSpec):
        return [GatherBeforeLMHead()]

    def finish(self, model: ir.Model, spec: ModelSpec, counts) -> None:
        contract_input_order(model)
