"""ort-lower: `llmc::PagedAttention` composed from ONNX Runtime's CPU ops, where llmc's own
kernels did not take it (cpu-kernels).

The op's body is already written in ops ORT runs on CPU (ScatterND write, GatherND paged read,
Attention with a causal/window mask; see plugins/paged_attention.py). Lowering composes the same
two emitters differently from the op's function: the step metadata (write slots, read indices,
mask) is built once per step, by the first layer's rewrite, and every layer emits only its own
write, read and attention. In-place cache updates come from the runtime binding each layer's cache
output to the same buffer as its input.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import common as ir_passes

from llmc.contract import graph_io as io
from llmc.contract.model_spec import ModelSpec
from llmc.passes.rewrite import Rule, RulePass
from llmc.plugins import paged_attention as pa


def _attr(node: ir.Node, name: str):
    return node.attributes[name].value


class LowerPagedAttention(Rule):
    name = "paged_attention_lowered"

    def __init__(self, spec: ModelSpec, block_size: int):
        self.spec, self.block_size = spec, block_size
        self._metadata: dict[int, pa.StepMetadata] = {}  # per sliding window (usually one per model)

    def pattern(self, op, q, k, v, cache):
        return op.PagedAttention(q, k, v, cache, _other_inputs=True, _domain=pa.DOMAIN, _outputs=2, _name="node")

    def rewrite(self, op, m):
        node = m.node
        window = int(_attr(node, "sliding_window"))
        if window not in self._metadata:
            self._metadata[window] = self._step_metadata(op, window)
            op.count("shared_step_metadata")
        return pa.emit_layer_attention(
            op, m.q, m.k, m.v, m.cache, self._metadata[window], num_heads=int(_attr(node, "num_heads")),
            num_kv_heads=int(_attr(node, "num_kv_heads")), scale=float(_attr(node, "scale")),
            softcap=float(_attr(node, "softcap")), sinks=node.inputs[len(pa.INPUTS)] if len(node.inputs) > len(pa.INPUTS) else None)

    def _step_metadata(self, op, window: int) -> pa.StepMetadata:
        spec = self.spec
        ids_shape = op.Shape(op.graph_input(io.INPUT_IDS))
        batch = op.Slice(ids_shape, op.const([0]), op.const([1]))
        seq = op.Slice(ids_shape, op.const([1]), op.const([2]))
        return pa.emit_step_metadata(
            op, op.graph_input(io.PAST_LENS), op.graph_input(io.QUERY_LENS), op.graph_input(io.BLOCK_TABLES),
            batch, seq, op.const([self.block_size]), op.const(window), op.const([spec.num_heads]),
            op.const([spec.num_kv_heads * spec.head_dim]))


class LowerPagedAttentionORT(RulePass):
    name = "ort-lower"
    description = "lower llmc::PagedAttention to ONNX Runtime CPU ops, step metadata shared by all layers"
    required = True

    def __init__(self, block_size: int):
        self.block_size = block_size

    def rules(self, spec: ModelSpec):
        return [LowerPagedAttention(spec, self.block_size)]

    def finish(self, model: ir.Model, spec: ModelSpec, counts) -> None:
        ir_passes.RemoveUnusedFunctionsPass()(model)
        model.opset_imports.pop(pa.DOMAIN, None)
