"""lm-head-scale: a constant scalar applied to the logits (Granite's `logits / logits_scaling`,
the division that opens Gemma 2's final softcap) becomes part of the LM head's weight.

h W / c = h (W / c): the head is again the MatMul that writes `logits`, which is what
logits-indices, quantize-weights (the LM head's format), draft-vocab and greedy-tokens look for.
Granite's scalings are powers of two, so the scaled weight's values and the logits are exactly
transformers'; any other scalar moves a logit by at most an ulp. The scaled weight is computed a
column range at a time from the head's own (a tied model's embedding table stays as it is for the
Gather).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from llmc.contract.model_spec import ModelSpec
from llmc.passes import lazy
from llmc.passes.graph import ONNX_DOMAINS, is_lm_head_output, matmul_tensor
from llmc.passes.rewrite import Rule, RulePass


class ScaleIntoLMHead(Rule):
    name = "logits_scale_folded"

    def __init__(self, op_type: str):
        self.op_type = op_type  # Div or Mul

    def pattern(self, op, x, w, c):
        return getattr(op, self.op_type)(op.MatMul(x, w, _name="head"), c)

    def match(self, node):
        m = super().match(node)
        return m if m is not None and is_lm_head_output(m.outputs[0]) else None

    def check(self, m):
        scale = m.c.const_value
        if scale is None or m.c.producer() is not None or int(np.prod(scale.shape.numpy(), dtype=np.int64)) != 1:
            return "the logits are scaled by something other than a constant scalar"
        if m.head.domain not in ONNX_DOMAINS or len(m.head.outputs[0].uses()) != 1:
            return "the LM head's output has other readers than the scaling"
        w = matmul_tensor(m.w)
        if w is None or len(w.dims) != 2 or w.numpy_dtype() != np.float32:
            return "the LM head's weight is not a constant 2-D float32 tensor"
        return None

    def rewrite(self, op, m):
        w, c = matmul_tensor(m.w), np.float32(m.c.const_value.numpy().reshape(()))
        scaled = (lambda a, b: w.columns(a, b) / c) if self.op_type == "Div" else (lambda a, b: w.columns(a, b) * c)
        head = lazy.Lazy(np.float32, w.dims, scaled, axis=1, step=lazy.float_step(w.dims[0]),
                         name=f"{m.head.name}.scaled")
        logits = op.MatMul(m.x, op.initializer(head, f"{m.head.name}.scaled_weight"))
        logits.shape, logits.type = m.outputs[0].shape, m.outputs[0].type
        return logits


class LMHeadScale(RulePass):
    name = "lm-head-scale"
    description = "fold a constant scaling of the logits into the LM head's weight"

    def rules(self, spec: ModelSpec):
        return [ScaleIntoLMHead("Div"), ScaleIntoLMHead("Mul")]
