"""native-gqa: attend with the K/V heads as stored instead of copies expanded to the query heads.

HF's `repeat_kv` exports as Unsqueeze(axis 2) -> Expand -> Reshape, materializing n_rep copies
of K and V per step. ONNX Attention (opset 23) does grouped-query attention itself when K/V
have fewer heads than Q, so the expansion can go.
"""

from __future__ import annotations

from llmc.contract.model_spec import ModelSpec
from llmc.passes.graph import const_ints
from llmc.passes.rewrite import Rule, RulePass


class DropKVExpansion(Rule):
    name = "attention_gqa"

    def __init__(self, num_heads: int, num_kv_heads: int):
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads

    def pattern(self, op, q, k, v, k_axes, k_shape, k_target, v_axes, v_shape, v_target):
        # The expansion goes once nothing reads it: the pass's dead-code sweep removes it.
        def expanded(x, axes, shape, target):
            return op.Reshape(op.Expand(op.Unsqueeze(x, axes, _keep=True), shape, _keep=True), target, _keep=True)

        return op.Attention(q, expanded(k, k_axes, k_shape, k_target), expanded(v, v_axes, v_shape, v_target),
                            _other_inputs=True, _name="attention")

    def check(self, m):
        if self.num_heads % self.num_kv_heads:
            return f"{self.num_heads} query heads are not a multiple of {self.num_kv_heads} KV heads"
        if const_ints(m.k_axes) != [2] or const_ints(m.v_axes) != [2]:
            return "expansion does not unsqueeze the head axis (axis 2)"
        for source in (m.k, m.v):
            if source.shape is not None and len(source.shape) == 4 and source.shape[1] != self.num_kv_heads:
                return f"K/V source has {source.shape[1]} heads, expected {self.num_kv_heads}"
        return None

    def rewrite(self, op, m):
        attention = m.attention
        return op.like(attention, m.q, m.k, m.v, *attention.inputs[3:])


class NativeGQA(RulePass):
    name = "native-gqa"
    description = "remove the K/V head expansion before Attention (ONNX Attention does GQA natively)"

    def rules(self, spec: ModelSpec):
        return [DropKVExpansion(spec.num_heads, spec.num_kv_heads)]
