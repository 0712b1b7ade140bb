"""greedy-tokens: the LM head's packed GEMM also returns each logits row's argmax, as the graph
output `greedy_tokens` [N] int64 (llmc.contract.graph_io).

Each GEMM task takes the largest value of its 32 columns while they are in its cache, and the
op reduces the panels' maxima once the product is done. The runtime's greedy rows read the token
from there instead of scanning the [N, V] logits after the step: those were written by every
core and are out of the reading core's cache, so the scan cost a measurable share of a batch-1
step (docs/attention_cpu.md). Ties and NaNs rank as numpy's argmax ranks them. The logits are
still returned: sampled rows, logprobs and speculative verification read them. Behind a final
softcap (increasing) the head's argmax is the logits' own, save where the cap's tanh rounds two
distinct logits to one float: there the larger wins, not the lower id.
"""

from __future__ import annotations

import onnx_ir as ir

from llmc.contract import graph_io as io
from llmc.contract.model_spec import ModelSpec
from llmc.passes.cpu_kernels import kernel_library_missing
from llmc.passes.graph import is_lm_head_output
from llmc.passes.rewrite import Rule, RulePass
from llmc.plugins import cpu


class LMHeadArgmax(Rule):
    name = "lm_head_argmax"

    def pattern(self, op, x):
        return op.PackedMatMul(x, _domain=cpu.DOMAIN, _other_inputs=True, _name="head")

    def match(self, node):
        m = super().match(node)
        return m if m is not None and is_lm_head_output(m.outputs[0]) else None

    def check(self, m):
        if len(m.head.outputs) > 1:
            return "it already returns the argmax"
        return None

    def rewrite(self, op, m):
        logits, greedy = op.like(m.head, *m.head.inputs, num_outputs=2)
        greedy.type, greedy.shape = ir.TensorType(ir.DataType.INT64), ir.Shape([io.NUM_LOGITS])
        op.graph_output(greedy, io.GREEDY_TOKENS)
        return logits


class GreedyTokens(RulePass):
    name = "greedy-tokens"
    description = "the LM head's GEMM also returns each row's argmax (the greedy token), taken in cache"

    def requires(self, model: ir.Model, spec: ModelSpec) -> str | None:
        return kernel_library_missing()

    def rules(self, spec: ModelSpec):
        return [LMHeadArgmax()]
