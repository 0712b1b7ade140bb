"""lossless-weights (`llmc build --lossless-weights`): each packed GEMM also gets its weight in
llmc's lossless 28-bit format (llmc.plugins.cpu.lossless) as an optional last input.

The kernel reads the copy for steps of up to 8 rows, where the weight stream bounds the time, and
gives the same bits as the fp32 weight; the engine holds both copies.
"""

from __future__ import annotations

from llmc.contract.model_spec import ModelSpec
from llmc.passes.cpu_kernels import kernel_library_missing
from llmc.passes.graph import weight
from llmc.passes.rewrite import Rule, RulePass
from llmc.plugins import cpu
from llmc.plugins.cpu import lossless


class LosslessWeight(Rule):
    name = "lossless_weight"

    def __init__(self, op_type: str):
        self.op_type, self.gemm = op_type, cpu.PACKED_GEMMS[op_type]

    def pattern(self, op, x):
        return getattr(op, self.op_type)(x, _domain=cpu.DOMAIN, _other_inputs=True, _outputs=self.gemm.num_outputs,
                                         _name="node")

    def check(self, m):
        if len(m.node.inputs) != self.gemm.weight_input + 1:
            return "it already has a lossless copy"
        if m.node.attributes.get_int("weight_format", 0) != 0:
            return "its weight is not stored in fp32 (quantize-weights)"
        w = weight(m.node.inputs[self.gemm.weight_input])
        if w is None:
            return "the weight is not a constant initializer"
        if (why := lossless.supports(w)) is not None:
            return why
        share = lossless.exception_share(w)
        if share > lossless.MAX_EXCEPTION_SHARE:
            return f"{share:.1%} of its floats have a top byte outside their panel's 16 commonest"
        return None

    def rewrite(self, op, m):
        source = m.node.inputs[self.gemm.weight_input]
        copy = op.initializer(lossless.encode(weight(source)), f"{source.name}.lossless")
        return op.like(m.node, *m.node.inputs, copy, num_outputs=self.gemm.num_outputs)


class LosslessWeights(RulePass):
    name = "lossless-weights"
    description = ("also store each packed weight in a lossless format 12.5% smaller, "
                   "which decode steps of up to 8 rows read")

    def requires(self, model, spec):
        return kernel_library_missing()

    def rules(self, spec: ModelSpec):
        return [LosslessWeight(op_type) for op_type in cpu.PACKED_GEMMS]
