"""The TensorRT lowering: the graph TensorRT's ONNX parser builds a network from.

- trt-plugin: every `llmc::PagedAttention` becomes the node TensorRT's parser hands to llmc's
  plugin (llmc/plugins/cuda): op_type PagedAttention (the plugin's name), the attributes
  `plugin_namespace` "llmc" and `plugin_version` "1" beside the op's own, in the domain
  `trt.plugins` (where ONNX Runtime's TensorRT provider also looks for TensorRT plugins). The
  plugin means exactly what the op's function and numpy reference mean: the KV write happens
  inside it, in place.
- trt-precision: TensorRT 11 builds only strongly typed networks, so the graph's types are its
  precision. Every float32 tensor becomes fp16 or bf16: weights, constants, casts, every value
  and the KV pools. Blockwise `DequantizeLinear` weights (int8/int4) follow their scales' type.
  The logits are cast back to float32, which sampling and log-probabilities read.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from llmc.contract import graph_io as io
from llmc.contract.model_spec import ModelSpec
from llmc.passes.manager import Pass, PassResult
from llmc.passes.rewrite import Rule, RulePass
from llmc.plugins import paged_attention as pa

PLUGIN_DOMAIN = "trt.plugins"
PLUGIN_NAMESPACE = "llmc"
PLUGIN_VERSION = str(pa.VERSION)
PRECISIONS = {"fp16": ir.DataType.FLOAT16, "bf16": ir.DataType.BFLOAT16}


class PluginNode(Rule):
    name = "paged_attention_plugin"

    def pattern(self, op, q, k, v, cache, past_lens, query_lens, block_tables):
        return op.PagedAttention(q, k, v, cache, past_lens, query_lens, block_tables, _domain=pa.DOMAIN,
                                 _outputs=2, _name="node")

    def rewrite(self, op, m):
        attrs = {f.name: m.node.attributes[f.name] for f in dataclasses.fields(pa.PagedAttentionAttrs)}
        return op.PagedAttention(m.q, m.k, m.v, m.cache, m.past_lens, m.query_lens, m.block_tables,
                                 domain=PLUGIN_DOMAIN, num_outputs=2, plugin_namespace=PLUGIN_NAMESPACE,
                                 plugin_version=PLUGIN_VERSION, **attrs)


class TensorRTPlugin(RulePass):
    name = "trt-plugin"
    description = "PagedAttention as llmc's TensorRT plugin node (llmc::PagedAttention v1)"
    required = True  # TensorRT has no paged attention of its own

    def rules(self, spec: ModelSpec):
        return [PluginNode()]

    def finish(self, model: ir.Model, spec: ModelSpec, counts) -> None:
        # TensorRT's parser inlines a model-local function before it looks for a plugin, so the op's
        # function (paged-kv-cache attached it for ORT) must not travel under the plugin's name.
        model.functions.pop(pa.build_function().identifier(), None)
        model.opset_imports.pop(pa.DOMAIN, None)


def plugin_nodes(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.domain == PLUGIN_DOMAIN and n.op_type == pa.OP_TYPE]


def with_reference_plugin(model: ir.Model) -> ir.Model:
    """A copy of a lowered model that ONNX Runtime runs: the plugin's meaning (the op's function)
    attached under the plugin's domain. For checking the lowering's numbers on a CPU."""
    copy = ir.from_proto(ir.to_proto(model))
    body = pa.build_function()
    extra = [ir.Attr(name, ir.AttributeType.UNDEFINED, None) for name in ("plugin_namespace", "plugin_version")]
    function = ir.Function(PLUGIN_DOMAIN, pa.OP_TYPE, graph=body.graph, attributes=[*body.attributes.values(), *extra])
    copy.functions[function.identifier()] = function
    return copy


class TensorRTPrecision(Pass):
    name = "trt-precision"
    description = "every float32 tensor as fp16 or bf16 (a strongly typed network); logits cast back to float32"
    required = True
    lossy = True  # rounds every weight and activation to 16 bits

    def __init__(self, precision: str):
        self.precision = precision
        self.dtype = PRECISIONS[precision]

    def apply(self, model: ir.Model, spec: ModelSpec) -> PassResult:
        graph, target, counts = model.graph, self.dtype, {"weights": 0, "constants": 0, "casts": 0, "values": 0}
        for value in graph.initializers.values():
            if value.const_value is not None and value.const_value.dtype == ir.DataType.FLOAT:
                value.const_value = _converted(value.const_value, target, value.name)
                counts["weights"] += 1
        for node in graph:
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.TENSOR and attr.value.dtype == ir.DataType.FLOAT:
                    node.attributes[attr.name] = ir.AttrTensor(attr.name, _converted(attr.value, target, attr.name))
                    counts["constants"] += 1
            if node.op_type == "Cast" and node.domain == "" and node.attributes.get_int("to") == ir.DataType.FLOAT:
                node.attributes["to"] = ir.AttrInt64("to", target)
                counts["casts"] += 1
        for value in _all_values(graph):
            if value.type is not None and value.dtype == ir.DataType.FLOAT:
                value.type = ir.TensorType(target)
                counts["values"] += 1
        self._logits_in_float32(graph)
        return PassResult(any(counts.values()), counts)

    @staticmethod
    def _logits_in_float32(graph: ir.Graph) -> None:
        slot = next(i for i, v in enumerate(graph.outputs) if v.name == io.LOGITS)
        low = graph.outputs[slot]
        low.name = f"{io.LOGITS}.{low.dtype.name.lower()}"
        cast = ir.node("Cast", [low], attributes={"to": ir.DataType.FLOAT}, name="logits_to_float32")
        cast.outputs[0].name, cast.outputs[0].type, cast.outputs[0].shape = io.LOGITS, ir.TensorType(
            ir.DataType.FLOAT), low.shape
        graph.append(cast)
        graph.outputs[slot] = cast.outputs[0]


def _all_values(graph: ir.Graph):
    yield from graph.inputs
    for node in graph:
        yield from node.outputs


def _converted(tensor, target: ir.DataType, name: str | None) -> ir.Tensor:
    array = tensor.numpy()
    if target == ir.DataType.BFLOAT16:
        import ml_dtypes

        return ir.tensor(array.astype(ml_dtypes.bfloat16), name=name)
    return ir.tensor(array.astype(np.float16), name=name)
