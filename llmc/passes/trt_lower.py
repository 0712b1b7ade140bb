"""The TensorRT lowering: the graph TensorRT's ONNX parser builds a network from.

- trt-plugin: every `llmc::PagedAttention` becomes the node TensorRT's parser hands to llmc's
  plugin (llmc/plugins/cuda): op_type PagedAttention (the plugin's name) in the domain `llmc`,
  with the attributes `plugin_namespace` "llmc" and `plugin_version` "1" beside the op's own.
  The parser takes the namespace from the attribute, and since TensorRT 10.10 also from the
  domain; both say llmc. The op's model-local function goes: the parser inlines a local function
  before it looks for a plugin. The plugin means what the function and the numpy reference
  mean, the KV write in place inside it; where Q and K are rotated alike it also applies their
  RotaryEmbedding (the op's optional cos/sin inputs and `rotary_interleaved`; rope_fused), so
  the rotated K goes straight to the pool.
- trt-precision: TensorRT 11 builds only strongly typed networks, so the graph's types are its
  precision. Every float32 tensor becomes fp16 or bf16: weights, constants, casts, every value
  and the KV pools. Blockwise `DequantizeLinear` weights (int8/int4) follow their scales' type.
  Two things stay float32: the rotary angles (cos/sin are computed in fp32 and rounded once, as
  transformers does) and the logits, cast back for sampling and log-probabilities.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from llmc.contract import graph_io as io
from llmc.contract.model_spec import ModelSpec
from llmc.errors import LlmcError
from llmc.passes.manager import Pass, PassResult
from llmc.passes.graph import const_ints, producer, rotary, shared_rotary
from llmc.passes.rewrite import Rule, RulePass, rotary_operands
from llmc.plugins import cpu
from llmc.plugins import paged_attention as pa

PLUGIN_DOMAIN = pa.DOMAIN
PLUGIN_NAMESPACE = "llmc"
PLUGIN_VERSION = str(pa.VERSION)
PRECISIONS = {"fp16": ir.DataType.FLOAT16, "bf16": ir.DataType.BFLOAT16}


class PluginNode(Rule):
    name = "paged_attention_plugin"

    def pattern(self, op, q, k, v, cache, past_lens, query_lens, block_tables):
        return op.PagedAttention(q, k, v, cache, past_lens, query_lens, block_tables, _domain=pa.DOMAIN,
                                 _outputs=2, _name="node")

    def check(self, m):
        return "already the plugin's node" if "plugin_namespace" in m.node.attributes else None

    def rewrite(self, op, m):
        q, k, rope = m.q, m.k, None
        if shared_rotary(m.q, m.k) is None:  # Q and K rotated alike (or not at all): the plugin rotates
            (q, rope), (k, _) = rotary(m.q), rotary(m.k)
        cos, sin, interleaved = rotary_operands(op, rope)
        op.count("rope_fused", int(rope is not None))
        attrs = {f.name: m.node.attributes[f.name] for f in dataclasses.fields(pa.PagedAttentionAttrs)}
        inputs = [q, k, m.v, m.cache, m.past_lens, m.query_lens, m.block_tables] + ([cos, sin] if rope else [])
        return op.PagedAttention(*inputs, domain=PLUGIN_DOMAIN, num_outputs=2, plugin_namespace=PLUGIN_NAMESPACE,
                                 plugin_version=PLUGIN_VERSION, rotary_interleaved=interleaved, **attrs)


class TensorRTPlugin(RulePass):
    name = "trt-plugin"
    description = "PagedAttention as llmc's TensorRT plugin node (llmc::PagedAttention v1)"
    required = True  # TensorRT has no paged attention of its own

    def rules(self, spec: ModelSpec):
        return [PluginNode()]

    def apply(self, model: ir.Model, spec: ModelSpec):
        if any(n.domain == pa.DOMAIN and n.op_type == pa.OP_TYPE and len(n.inputs) > len(pa.INPUTS) for n in model.graph):
            raise LlmcError("llmc's TensorRT attention plugin has no attention sinks yet; build this model with "
                            "--backend onnxruntime")
        if any(n.domain == cpu.DOMAIN and n.op_type == "Experts" for n in model.graph):
            raise LlmcError("the TensorRT backend has no plugin for mixture-of-experts layers (llmc.cpu::Experts) "
                            "yet; build this model with --backend onnxruntime")
        return super().apply(model, spec)

    def finish(self, model: ir.Model, spec: ModelSpec, counts) -> None:
        # TensorRT's parser inlines a model-local function before it looks for a plugin, so the op's
        # function (paged-kv-cache attached it for ORT) must not travel with the plugin's nodes.
        model.functions.pop((pa.DOMAIN, pa.OP_TYPE, ""), None)  # the function's identifier: no need to build it


def plugin_nodes(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.domain == PLUGIN_DOMAIN and n.op_type == pa.OP_TYPE
            and "plugin_namespace" in n.attributes]


def with_reference_plugin(model: ir.Model) -> ir.Model:
    """A copy of a lowered model that ONNX Runtime runs, for checking the lowering's numbers on a
    CPU: each plugin node becomes what it means, its folded RotaryEmbedding (if any) before the
    op's function, attached again."""
    copy = ir.from_proto(ir.to_proto(model))
    for node in plugin_nodes(copy):
        if len(node.inputs) > len(pa.INPUTS):
            _unfold_rotary(copy.graph, node)
    body = pa.build_function()
    extra = [ir.Attr(name, ir.AttributeType.UNDEFINED, None)
             for name in ("plugin_namespace", "plugin_version", "rotary_interleaved")]
    function = ir.Function(PLUGIN_DOMAIN, pa.OP_TYPE, graph=body.graph, attributes=[*body.attributes.values(), *extra])
    copy.functions[function.identifier()] = function
    copy.opset_imports[""] = max(copy.opset_imports.get("", 0), pa.ONNX_OPSET)
    return copy


def _unfold_rotary(graph: ir.Graph, node: ir.Node) -> None:
    q, k, *rest = node.inputs[:len(pa.INPUTS)]
    cos, sin = node.inputs[len(pa.INPUTS):]
    cut = producer(cos, "Slice")  # a partial rotation's cos/sin are cut to its half-width (rotary_operands)
    ends = const_ints(cut.inputs[2]) if cut is not None else None
    rotated_dim = 2 * ends[0] if ends else 0
    interleaved = node.attributes.get_int("rotary_interleaved", 0)
    ropes = [ir.node("RotaryEmbedding", [x, cos, sin], attributes={"interleaved": interleaved,
                                                                  "rotary_embedding_dim": rotated_dim})
             for x in (q, k)]
    plain = ir.node(node.op_type, [ropes[0].outputs[0], ropes[1].outputs[0], *rest], domain=node.domain,
                    attributes=dict(node.attributes), num_outputs=2, name=node.name)
    ir.convenience.replace_nodes_and_values(graph, node, [node], [*ropes, plain], list(node.outputs),
                                            list(plain.outputs))


class TensorRTPrecision(Pass):
    name = "trt-precision"
    description = "every float32 tensor as fp16 or bf16 (a strongly typed network); logits cast back to float32"
    required = True
    lossy = True  # rounds every weight and activation to 16 bits

    def __init__(self, precision: str):
        self.precision = precision
        self.dtype = PRECISIONS[precision]

    def apply(self, model: ir.Model, spec: ModelSpec) -> PassResult:
        graph, target = model.graph, self.dtype
        angles, angle_outputs = _rotary_angles(graph)
        counts = {"weights": 0, "constants": 0, "casts": 0, "values": 0, "rotary_fp32": len(angles)}
        for value in graph.initializers.values():
            if value.const_value is not None and value.const_value.dtype == ir.DataType.FLOAT and \
                    not all(user in angles for user, _ in value.uses()):
                value.const_value = _converted(value.const_value, target, value.name)
                counts["weights"] += 1
        for node in graph:
            if node in angles:
                continue
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.TENSOR and attr.value.dtype == ir.DataType.FLOAT:
                    node.attributes[attr.name] = ir.AttrTensor(attr.name, _converted(attr.value, target, attr.name))
                    counts["constants"] += 1
            if node.op_type == "Cast" and node.domain == "" and node.attributes.get_int("to") == ir.DataType.FLOAT:
                node.attributes["to"] = ir.AttrInt64("to", target)
                counts["casts"] += 1
        for value in _all_values(graph):
            if value.type is not None and value.dtype == ir.DataType.FLOAT and value.producer() not in angles:
                value.type = ir.TensorType(target)
                counts["values"] += 1
        for value in angle_outputs:  # the angles' cos/sin, rounded once where the attention reads them
            cast = ir.node("Cast", [value], attributes={"to": target}, name=f"{value.name}.to_{self.precision}")
            cast.outputs[0].type, cast.outputs[0].shape = ir.TensorType(target), value.shape
            graph.insert_after(value.producer(), cast)
            for user, index in list(value.uses()):
                if user is not cast and user not in angles:
                    user.replace_input_with(index, cast.outputs[0])
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


def _rotary_angles(graph: ir.Graph) -> tuple[set[ir.Node], list[ir.Value]]:
    """The nodes computing rotary cos/sin (everything their values depend on), and those values.
    They stay float32: a position times a frequency in fp16 is off by radians at a few thousand
    tokens, so only the cos/sin are rounded, as transformers computes them."""
    roots = []
    for node in graph:
        if node.domain == PLUGIN_DOMAIN and node.op_type == pa.OP_TYPE:  # a plugin node's optional cos/sin
            roots += node.inputs[len(pa.INPUTS):]
        elif node.op_type == "RotaryEmbedding" and node.domain == "":
            roots += node.inputs[1:3]
    roots = [v for v in dict.fromkeys(roots) if v is not None and v.producer() is not None]
    angles: set[ir.Node] = set()
    stack = [v.producer() for v in roots]
    while stack:
        node = stack.pop()
        if node not in angles:
            angles.add(node)
            stack += [v.producer() for v in node.inputs if v is not None and v.producer() is not None]
    return angles, [v for v in roots if v.dtype in (ir.DataType.FLOAT, None)]


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
