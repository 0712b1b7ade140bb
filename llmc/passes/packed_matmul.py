"""packed-matmul: constant-weight MatMuls onto llmc's panel-packed GEMM (llmc.plugins.cpu).

It runs last, once the layout pass has settled which weights are stored transposed. Each weight
is stored as column panels [ceil(N/32), K, 32]; a panel streams once while up to 12 rows
accumulate in registers, so a decode step of 8 or 16 rows costs about one read of the weights
(ORT's own GEMM measured slower there: docs/attention_cpu.md). Two folds ride on it:
- skip_rmsnorm_matmul: a SkipSimplifiedLayerNormalization whose normed output feeds only a
  PackedMatMul -> `llmc.cpu::SkipRMSNormMatMul(x, skip, gamma, w)`, returning the product and the
  residual sum: the norm is computed on the way into the GEMM;
- swiglu_matmul: `llmc.cpu::SwiGLU` feeding only a PackedMatMul (the down projection) ->
  `llmc.cpu::SwiGLUMatMul(gate_up, w)`.
The folds remove nodes and their dispatch, not arithmetic.
"""

from __future__ import annotations

import numpy as np

from llmc.contract.model_spec import ModelSpec
from llmc.passes.cpu_kernels import kernel_library_missing
from llmc.passes.graph import weight
from llmc.passes.rewrite import Rule, RulePass
from llmc.plugins import cpu


class PackedMatMul(Rule):
    name = "packed_matmul"

    def pattern(self, op, x, w):
        return op.MatMul(x, w)

    def check(self, m):
        w = weight(m.w)
        if w is None:
            return "the weight is not a constant initializer"
        if w.ndim != 2 or w.dtype != np.float32:
            return f"the weight is {w.ndim}-D {w.dtype}, not 2-D float32"
        if m.x.shape is not None and len(m.x.shape) < 2:
            return "the activation is 1-D"
        return None

    def rewrite(self, op, m):
        w = weight(m.w)
        packed = op.initializer(cpu.pack_weight(w), f"{m.w.name}.packed")
        return op.PackedMatMul(m.x, packed, domain=cpu.DOMAIN, n=w.shape[1])


class SkipRMSNormMatMul(Rule):
    name = "skip_rmsnorm_matmul"

    def pattern(self, op, x, skip, gamma, w):
        normed, _, _, total = op.SkipSimplifiedLayerNormalization(x, skip, gamma, _domain="com.microsoft",
                                                                  _outputs=4, _name="norm")
        return op.PackedMatMul(normed, w, _domain=cpu.DOMAIN, _name="matmul"), total

    def rewrite(self, op, m):
        return op.SkipRMSNormMatMul(m.x, m.skip, m.gamma, m.w, domain=cpu.DOMAIN, num_outputs=2,
                                    n=m.matmul.attributes["n"],
                                    epsilon=m.norm.attributes.get_float("epsilon", 1e-5))


class SwiGLUMatMul(Rule):
    name = "swiglu_matmul"

    def pattern(self, op, gate_up, w):
        return op.PackedMatMul(op.SwiGLU(gate_up, _domain=cpu.DOMAIN), w, _domain=cpu.DOMAIN, _name="matmul")

    def rewrite(self, op, m):
        return op.SwiGLUMatMul(m.gate_up, m.w, domain=cpu.DOMAIN, n=m.matmul.attributes["n"])


class PackedMatMuls(RulePass):
    name = "packed-matmul"
    description = ("run constant-weight MatMuls on llmc's panel-packed kernel (weights stored packed), "
                   "a residual add + RMSNorm or a SwiGLU before one folded in")
    fixed_point = True  # the folds match the PackedMatMuls the first sweep made

    def requires(self, model, spec):
        return kernel_library_missing()

    def rules(self, spec: ModelSpec):
        return [PackedMatMul(), SkipRMSNormMatMul(), SwiGLUMatMul()]
