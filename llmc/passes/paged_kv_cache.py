"""paged-kv-cache: every Attention becomes `llmc::PagedAttention` over a paged block pool.

Before: `Attention(q, k, v, causal_mask)` recomputes attention over the whole sequence each call.
After: the graph takes the paged step inputs (llmc.contract.graph_io: past_lens, query_lens,
block_tables and one pool per layer), writes each new token's K/V into its block and attends over
the row's cached prefix, and returns each updated pool as the layer's cache output. The causal
mask the exporter built from position_ids becomes dead and goes. `llmc::SinkAttention` (attention
with sinks: compiler/attention.py) becomes the same op with its sinks as one input more.
"""

from __future__ import annotations

import math

import onnx_ir as ir

import numpy as np

from llmc.compiler import attention as sink_attention
from llmc.contract import graph_io as io
from llmc.contract import kv_layout
from llmc.contract.model_spec import ModelSpec
from llmc.passes.graph import producer
from llmc.passes.rewrite import Rule, RulePass
from llmc.plugins import paged_attention as pa



class AttentionToPaged(Rule):
    name = "paged_attention"

    def __init__(self, spec: ModelSpec, block_size: int, sinks: bool = False):
        self.spec, self.block_size, self.sinks = spec, block_size, sinks

    def pattern(self, op, q, k, v):
        if self.sinks:
            return op.SinkAttention(q, k, v, _other_inputs=True, _domain=sink_attention.DOMAIN, _name="attention")
        return op.Attention(q, k, v, _other_inputs=True, _name="attention")

    def check(self, m):
        node = m.attention
        if not self.sinks and len(node.inputs) > 4 and any(v is not None for v in node.inputs[4:]):
            return "Attention already has past key/value inputs"
        if m.q.shape is not None and len(m.q.shape) != 4:
            return f"expected 4D [B,H,S,D] query, got rank {len(m.q.shape)}"
        reshape = producer(m.k, "Reshape")
        if reshape is not None and producer(reshape.inputs[0], "Expand") is not None:
            return "K/V are still expanded to the query heads; run native-gqa first"
        if m.k.shape is not None and len(m.k.shape) == 4 and m.k.shape[1] != self.spec.num_kv_heads:
            return f"K has {m.k.shape[1]} heads, expected {self.spec.num_kv_heads}"
        return None

    def rewrite(self, op, m):
        spec, node = self.spec, m.attention
        layer = sum(io.is_cache(v.name) for v in op.graph.inputs)  # layers rewritten so far
        cache = op.graph_input(io.cache_input(layer), ir.DataType.FLOAT, kv_layout.pool_shape(
            kv_layout.TOKEN_MAJOR, io.NUM_BLOCKS, self.block_size, spec.num_kv_heads, spec.head_dim))
        attrs = pa.PagedAttentionAttrs(
            num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
            scale=node.attributes.get_float("scale", 1.0 / math.sqrt(spec.head_dim)),
            sliding_window=spec.window(spec.attention_layers[layer]), softcap=node.attributes.get_float("softcap", 0.0))
        out, cache_out = op.op(
            pa.OP_TYPE, m.q, m.k, m.v, cache, op.step_input(io.PAST_LENS), op.step_input(io.QUERY_LENS),
            op.step_input(io.BLOCK_TABLES), *node.inputs[4:5] if self.sinks else (),
            domain=pa.DOMAIN, num_outputs=2, **attrs.as_dict())
        cache_out.type, cache_out.shape = cache.type, cache.shape
        op.graph_output(cache_out, io.cache_output(layer))
        return out


class PagedKVCache(RulePass):
    name = "paged-kv-cache"
    description = "rewrite every Attention into llmc::PagedAttention with paged KV-cache graph I/O"
    required = True

    def __init__(self, block_size: int):
        self.block_size = block_size

    def rules(self, spec: ModelSpec):
        return [AttentionToPaged(spec, self.block_size), AttentionToPaged(spec, self.block_size, sinks=True)]

    def finish(self, model: ir.Model, spec: ModelSpec, counts) -> None:
        # The op's meaning as a model-local function: the rewritten graph runs in ORT as is.
        paged = [n for n in model.graph if n.domain == pa.DOMAIN and n.op_type == pa.OP_TYPE]
        sinks = any(len(n.inputs) > len(pa.INPUTS) for n in paged)
        if sinks:  # one function per model: a layer without sinks takes -inf ones
            none = None
            for node in paged:
                if len(node.inputs) == len(pa.INPUTS):
                    if none is None:
                        none = ir.Value(name="attention.no_sinks", const_value=ir.tensor(
                            np.full(spec.num_heads, -np.inf, np.float32)))
                        model.graph.register_initializer(none)
                    node.resize_inputs(len(pa.INPUTS) + 1)
                    node.replace_input_with(len(pa.INPUTS), none)
        function = pa.build_function(sinks)
        model.functions[function.identifier()] = function
        model.functions.pop((sink_attention.DOMAIN, sink_attention.SINK_OP, ""), None)
        contract_input_order(model)


def contract_input_order(model: ir.Model) -> None:
    """Sort the graph's inputs into the contract's order (new inputs are appended after the pools)."""
    names = [v.name for v in model.graph.inputs]
    paged = io.GraphIO.paged(sum(map(io.is_cache, names)), num_states=sum(map(io.is_state, names)))
    order = {name: i for i, name in enumerate(paged.inputs)}
    inputs = sorted(model.graph.inputs, key=lambda v: order.get(v.name, len(order)))
    model.graph.inputs.clear()
    model.graph.inputs.extend(inputs)
