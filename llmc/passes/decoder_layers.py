"""decoder-layers: each decoder layer's five kernel nodes -> one `llmc.cpu::DecoderLayer`.

After packed-matmul a pre-norm layer is SkipRMSNormMatMul (QKV) -> PagedAttention (packed QKV)
-> PackedMatMul (O) -> SkipRMSNormMatMul (gate/up) -> SwiGLUMatMul (down). The fused node runs the
same kernels in the same order, so its outputs are the five nodes' bit for bit; what goes is four
ONNX Runtime node dispatches and four ParallelFor fork/joins a layer, which a small model's decode
step pays beyond its weight stream (docs/attention_cpu.md, "One node per layer"). The first layer,
whose input norm is ONNX's RMSNormalization (no residual yet), keeps its five nodes.

The node's inputs: x, skip, gamma1, w_qkv, the attention's pool and step inputs (past_lens,
query_lens, block_tables, cos, sin, positions), w_o, gamma2, w_gate_up, w_down, the QKV bias
(Qwen2's Add after the projection, optional), then each GEMM's lossless copy (optional), then
the attention's QK-norm weights (optional: Qwen3's).
Attributes: the attention's, and each GEMM's under a prefix (`qkv_`, `o_`, `gate_up_`, `down_`),
the norms' epsilons as `qkv_epsilon` and `gate_up_epsilon`. Outputs: the down projection, the
residual after the attention (the second norm's sum), the pool.
"""

from __future__ import annotations

import onnx_ir as ir

from llmc.contract.model_spec import ModelSpec
from llmc.passes.cpu_kernels import kernel_library_missing
from llmc.passes.rewrite import Rule, RulePass
from llmc.plugins import cpu

GEMM_PREFIXES = ("qkv_", "o_", "gate_up_", "down_")
ATTENTION_INPUTS = 10  # q, k, v, pool, past_lens, query_lens, block_tables, cos, sin, positions
QK_NORM_INPUTS = 2  # then the attention's q_norm and k_norm weights, last among the layer's inputs too


class DecoderLayer(Rule):
    name = "decoder_layer"

    def __init__(self, residual_first: bool, qkv_bias: bool):
        # The second norm adds the attention's projection to the residual; the exporter writes the
        # residual first, and a sum's order does not change its bits, so either order fuses.
        self.residual_first = residual_first
        self.qkv_bias = qkv_bias  # Qwen2's: an Add after the QKV projection

    def pattern(self, op, x, skip, gamma1, w_qkv, bias, k, v, pool, past_lens, query_lens, block_tables, w_o,
                gamma2, w_gate_up, w_down):
        gemm = dict(_domain=cpu.DOMAIN, _other_inputs=True)
        qkv, residual = op.SkipRMSNormMatMul(x, skip, gamma1, w_qkv, _outputs=2, _name="qkv", **gemm)
        if self.qkv_bias:
            qkv = op.Add(qkv, op.weight(bias), _commute=True)
        attended, pool_out = op.PagedAttention(qkv, k, v, pool, past_lens, query_lens, block_tables, _outputs=2,
                                               _name="attention", **gemm)
        o = op.PackedMatMul(attended, w_o, _name="o", **gemm)
        pair = (residual, o) if self.residual_first else (o, residual)
        gate_up, after_attention = op.SkipRMSNormMatMul(*pair, gamma2, w_gate_up, _outputs=2, _name="gate_up", **gemm)
        down = op.SwiGLUMatMul(gate_up, w_down, _name="down", **gemm)
        return down, after_attention, pool_out

    def check(self, m):
        if self.qkv_bias:
            bias = m.bias.const_value
            if bias is None or bias.shape != (m.qkv.attributes.get_int("n", 0),) or bias.dtype != ir.DataType.FLOAT:
                return "the Add after the QKV projection is not a float32 bias of its width"
        if m.k is not None or m.v is not None:
            return "the attention reads Q, K and V apart, not packed"
        if len(m.o.outputs) > 1 and m.o.outputs[1] is not None:
            return "the O projection also returns its argmax"
        if len(m.attention.inputs) > ATTENTION_INPUTS + QK_NORM_INPUTS:
            return "the attention has sinks, which the layer node does not take"
        return None

    def rewrite(self, op, m):
        gemms = (m.qkv, m.o, m.gate_up, m.down)
        weights = [node.inputs[cpu.PACKED_GEMMS[node.op_type].weight_input] for node in gemms]
        lossless = [_lossless_copy(node) for node in gemms]
        extra = list(m.attention.inputs[7:ATTENTION_INPUTS]) + [None] * (ATTENTION_INPUTS - len(m.attention.inputs))
        attrs = {a.name: a for a in m.attention.attributes.values()}
        for prefix, node in zip(GEMM_PREFIXES, gemms):
            attrs |= {prefix + a.name: a.value for a in node.attributes.values()}
        norms = list(m.attention.inputs[ATTENTION_INPUTS:]) + [None] * (QK_NORM_INPUTS - len(m.attention.inputs[
            ATTENTION_INPUTS:]))
        inputs = [m.x, m.skip, m.gamma1, weights[0], m.pool, m.past_lens, m.query_lens, m.block_tables, *extra,
                  weights[1], m.gamma2, weights[2], weights[3], m.bias if self.qkv_bias else None, *lossless, *norms]
        while inputs[-1] is None:
            inputs.pop()
        down, after_attention, pool_out = op.DecoderLayer(*inputs, domain=cpu.DOMAIN, num_outputs=3, **attrs)
        for new, old in zip((down, after_attention, pool_out), m.outputs):
            new.type, new.shape = old.type, old.shape
        return down, after_attention, pool_out


def _lossless_copy(node):
    """A packed GEMM's optional last input: its weight's lossless copy (lossless-weights), or None."""
    at = cpu.PACKED_GEMMS[node.op_type].weight_input + 1
    return node.inputs[at] if len(node.inputs) > at else None


class DecoderLayers(RulePass):
    name = "decoder-layers"
    description = "run each decoder layer's five kernel nodes as one node (one dispatch, one parallel run)"

    def requires(self, model, spec):
        return kernel_library_missing()

    def rules(self, spec: ModelSpec):
        return [DecoderLayer(first, bias) for first in (True, False) for bias in (False, True)]

