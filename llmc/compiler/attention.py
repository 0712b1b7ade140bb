"""An attention transformers can call and torch.export can trace into one ONNX Attention, softcap included.

transformers' SDPA path exports as ONNX Attention, which the passes rewrite into paged attention;
but SDPA has no logit softcap, so transformers refuses it for Gemma 2 (`_supports_sdpa = False`),
whose eager attention exports as a dozen loose ops no pass would recognize. This module registers
one more attention implementation with transformers, `llmc`: a torch custom op carrying the scale
and the softcap as attributes, which the exporter writes as `Attention(q, k, v, mask, scale=,
softcap=)` (ONNX applies the softcap before the mask, as Gemma 2's eager code does). Run in torch
it computes what transformers' eager attention computes.

Attention sinks (gpt-oss: `s_aux`, a learned logit per head that joins each row's softmax and
weighs no value) have no ONNX form, so an attention with sinks exports as `llmc::SinkAttention(q,
k, v, mask, sinks, scale=, softcap=)`, whose meaning in standard ONNX (`sink_function`) travels with
the model as a model-local function: one zero key and value more, the sink the mask's value at
that key. The paged rewrite takes the node whole.
"""

from __future__ import annotations

import functools

NAME = "llmc"
DOMAIN, SINK_OP = "llmc", "SinkAttention"


def implementation_for(model_class) -> str:
    """The attention implementation to build `model_class` with: SDPA where it accepts it, else llmc's."""
    if getattr(model_class, "_supports_sdpa", True) and not _has_sinks(model_class):
        return "sdpa"
    register()
    return NAME


def _has_sinks(model_class) -> bool:
    """Whether the family's attention passes sinks (`s_aux`), which SDPA would drop."""
    import inspect
    import sys

    return "s_aux=" in inspect.getsource(sys.modules[model_class.__module__])


@functools.cache
def register() -> None:
    """Define torch's `llmc::attention` op and register it with transformers as `llmc` (once)."""
    import torch
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    @torch.library.custom_op("llmc::attention", mutates_args=(), schema=(
        "(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? sinks, float scale, float softcap) -> Tensor"))
    def attention(q, k, v, mask, sinks, scale, softcap):
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        if mask is None:
            causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
            mask = causal[None, None]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
        if sinks is not None:  # a column more in the softmax, dropped after it
            column = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
            return torch.matmul(torch.softmax(torch.cat([scores, column], dim=-1).float(), dim=-1)[..., :-1]
                                .to(q.dtype), v)
        return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)

    @attention.register_fake
    def _(q, k, v, mask, sinks, scale, softcap):
        return q.new_empty((*q.shape[:-1], v.shape[-1]))

    def forward(module, query, key, value, attention_mask, scaling=None, softcap=None, s_aux=None, **kwargs):
        scale = module.head_dim ** -0.5 if scaling is None else scaling
        if s_aux is not None and softcap:
            raise ValueError("attention sinks with a logit softcap: llmc's attention has no such form")
        out = torch.ops.llmc.attention(query, key, value, attention_mask, s_aux, float(scale), float(softcap or 0.0))
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(NAME, forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # a boolean mask, True where a key is seen, or None: causal


def onnx_translations() -> dict:
    """torch.onnx.export's custom_translation_table entry for `llmc::attention` (empty when the op
    was never registered: no model of this process uses it)."""
    import torch

    if not hasattr(torch.ops.llmc, "attention"):
        return {}
    from onnxscript.onnx_opset import opset23 as op

    from onnxscript import values

    _sink_schema_registered()
    llmc = values.Opset(DOMAIN, 1)

    def attention(q, k, v, mask=None, sinks=None, scale: float = 1.0, softcap: float = 0.0):
        if sinks is None:
            out, _, _, _ = op.Attention(q, k, v, mask, scale=scale, softcap=softcap, is_causal=mask is None)
            return out
        if mask is None:  # causal: key t seen by query s where t <= s + (T - S)
            seq, keys = op.Shape(q, start=2, end=3), op.Shape(k, start=2, end=3)
            t = op.Range(op.Constant(value_int=0), op.Squeeze(keys), op.Constant(value_int=1))
            s = op.Range(op.Constant(value_int=0), op.Squeeze(seq), op.Constant(value_int=1))
            mask = op.LessOrEqual(op.Unsqueeze(t, [0]), op.Add(op.Unsqueeze(s, [1]), op.Sub(keys, seq)))
        return llmc.SinkAttention(q, k, v, mask, sinks, scale=scale, softcap=softcap)

    return {torch.ops.llmc.attention.default: attention}


@functools.cache
def _sink_schema_registered() -> None:
    """llmc::SinkAttention's ONNX schema, registered with onnx so the exporter can write the node."""
    import onnx
    from onnx.defs import OpSchema

    formal = OpSchema.FormalParameter
    onnx.defs.register_schema(OpSchema(
        SINK_OP, DOMAIN, 1, doc="Attention with a sink logit per head (llmc/compiler/attention.py).",
        inputs=[formal("q", "T"), formal("k", "T"), formal("v", "T"), formal("mask", "tensor(bool)"),
                formal("sinks", "T")],
        outputs=[formal("out", "T")], type_constraints=[("T", ["tensor(float)"], "float32")],
        attributes=[OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "score scale", required=False),
                    OpSchema.Attribute("softcap", OpSchema.AttrType.FLOAT, "0: none", required=False)]))


def sink_function():
    """llmc::SinkAttention in opset-23 ops: q [B, H, S, D], k and v [B, Hkv, T, D], a boolean mask
    broadcastable to [B, H, S, T] (True where a key is seen), sinks [H], as the paged op's function
    takes them too (paged_attention.emit_sinks)."""
    import onnx_ir as ir

    from llmc.ir_builder import OpBuilder
    from llmc.plugins.paged_attention import emit_sinks

    q, k, v, mask, sinks = (ir.Value(name=n) for n in ("q", "k", "v", "mask", "sinks"))
    graph = ir.Graph(inputs=[q, k, v, mask, sinks], outputs=[], nodes=[], opset_imports={"": 23}, name=SINK_OP)
    ops = OpBuilder(graph)
    keys, values, bias = emit_sinks(ops, q, k, v, mask, sinks, axis=2)
    out = ops.Attention(q, keys, values, bias, scale=ir.RefAttr("scale", "scale", ir.AttributeType.FLOAT),
                        softcap=ir.RefAttr("softcap", "softcap", ir.AttributeType.FLOAT))
    graph.outputs.append(out)
    out.name = "out"
    attrs = [ir.Attr(name, ir.AttributeType.UNDEFINED, None) for name in ("scale", "softcap")]
    return ir.Function(DOMAIN, SINK_OP, graph=graph, attributes=attrs)


def attach_functions(model) -> None:
    """Give the exported model the meaning of llmc::SinkAttention, where it has such nodes."""
    if any(n.domain == DOMAIN and n.op_type == SINK_OP for n in model.graph):
        function = sink_function()
        model.functions[function.identifier()] = function
        model.opset_imports.setdefault(DOMAIN, 1)
