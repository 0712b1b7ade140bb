"""ort-fusions: standard-op patterns into ONNX Runtime's fused CPU kernels (com.microsoft).

They run after the KV-cache rewrite because they target one backend's kernels; a TensorRT
lowering would fuse the same patterns into its own plugins instead.

- skip_rmsnorm: `RMSNormalization(a + b)` whose sum is also the residual stream ->
  `SkipSimplifiedLayerNormalization(a, b)`, which returns both the normalized value and the sum
  from one pass over the row (the Add and the norm each read and wrote the row before).
- swiglu: `(g * Sigmoid(g)) * up` -> `QuickGelu(g, alpha=1) * up`: SiLU as one kernel instead of
  a Sigmoid whose output is written and read back.
"""

from __future__ import annotations

from llmc.contract.model_spec import ModelSpec
from llmc.passes.graph import weight
from llmc.passes.rewrite import Rule, RulePass

MS_DOMAIN = "com.microsoft"


class SkipRMSNorm(Rule):
    name = "skip_rmsnorm"

    def pattern(self, op, a, b, gamma):
        total = op.Add(a, b, _name="add")
        return op.RMSNormalization(total, gamma, _other_inputs=True, _name="norm"), total

    def check(self, m):
        norm, add = m.norm, m.add
        gamma = weight(m.gamma)
        if gamma is None or gamma.ndim != 1:
            return "scale is not a constant 1-D weight"
        if len(norm.inputs) > 2 and norm.inputs[2] is not None:
            return "RMSNormalization has a bias"
        rank = len(add.outputs[0].shape) if add.outputs[0].shape is not None else None
        axis = norm.attributes.get_int("axis", -1)
        if rank is None or axis not in (-1, rank - 1):
            return f"normalizes over axis {axis}, not the last axis of a rank-{rank} input"
        if norm.attributes.get_int("stash_type", 1) != 1:
            return "stash_type is not float32"
        if m.a.shape is None or m.b.shape is None or m.a.shape != m.b.shape or len(m.a.shape) != 3:
            return "the Add's operands are not both [batch, seq, hidden]"
        if add.outputs[0].is_graph_output():
            return "the residual sum is a graph output"
        return None

    def rewrite(self, op, m):
        normed, _, _, total = op.SkipSimplifiedLayerNormalization(
            m.a, m.b, m.gamma, domain=MS_DOMAIN, num_outputs=4,
            epsilon=m.norm.attributes.get_float("epsilon", 1e-5))
        return normed, total


class SwiGLU(Rule):
    name = "swiglu"

    def pattern(self, op, gate, up):
        silu = op.Mul(gate, op.Sigmoid(gate), _commute=True)
        return op.Mul(silu, up, _commute=True)

    def rewrite(self, op, m):
        return op.Mul(op.QuickGelu(m.gate, domain=MS_DOMAIN, alpha=1.0), m.up)


class ORTFusions(RulePass):
    name = "ort-fusions"
    description = "fuse residual Add + RMSNorm and SiLU(gate) * up into ONNX Runtime's fused CPU kernels"

    def rules(self, spec: ModelSpec):
        return [SkipRMSNorm(), SwiGLU()]
