"""KV-cache I/O rewrite: every Attention becomes `llmc::PagedAttention` over a paged block pool.

Before: `Attention(q, k, v, causal_mask)` recomputes attention over the whole sequence each call.
After: the graph takes the design-§4 inputs (`past_lens`, `query_lens`, `block_tables`, one
`kv_cache.{i}` pool per layer), writes each new token's K/V into its block and attends over
the row's cached prefix, and returns the updated pools as `kv_cache_out.{i}`. The causal-mask
subgraph the exporter built from position_ids becomes dead and is removed.
"""

from __future__ import annotations

import math

import onnx_ir as ir

from llmc.passes.base import BuildContext, RewriteRule, RulePass, graph_input, producer
from llmc.passes.cleanup import remove_dead_code
from llmc.plugins import paged_attention as pa

PAST_LENS, QUERY_LENS, BLOCK_TABLES = "past_lens", "query_lens", "block_tables"


def cache_input_name(layer: int) -> str:
    return f"kv_cache.{layer}"


def cache_output_name(layer: int) -> str:
    return f"kv_cache_out.{layer}"


class AttentionToPaged(RewriteRule):
    name = "paged_attention"

    def match(self, node, ctx: BuildContext):
        if node.op_type != "Attention" or node.domain not in ("", "ai.onnx"):
            return None
        return {"attention": node}

    def check(self, m, ctx: BuildContext):
        node = m["attention"]
        spec = ctx.spec
        if len(node.inputs) > 4 and any(v is not None for v in node.inputs[4:]):
            return "Attention already has past key/value inputs"
        if any(o.uses() for o in node.outputs[1:]):
            return "Attention's present key/value outputs are used"
        q, k = node.inputs[0], node.inputs[1]
        if q.shape is not None and len(q.shape) != 4:
            return f"expected 4D [B,H,S,D] query, got rank {len(q.shape)}"
        if producer(k, "Reshape") and producer(producer(k, "Reshape").inputs[0], "Expand"):
            return "K/V are still expanded to the query heads; run native-gqa first"
        if k.shape is not None and len(k.shape) == 4 and k.shape[1] != spec.num_kv_heads:
            return f"K has {k.shape[1]} heads, expected {spec.num_kv_heads}"
        return None

    def rewrite(self, m, ctx: BuildContext, model: ir.Model):
        node = m["attention"]
        spec, graph = ctx.spec, model.graph
        layer = sum(1 for v in graph.inputs if v.name.startswith("kv_cache."))
        cache = ir.Value(
            name=cache_input_name(layer),
            type=ir.TensorType(ir.DataType.FLOAT),
            shape=ir.Shape(pa.cache_shape("num_blocks", ctx.block_size, spec.num_kv_heads, spec.head_dim)),
        )
        graph.inputs.append(cache)
        attrs = pa.PagedAttentionAttrs(
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            scale=node.attributes.get_float("scale", 1.0 / math.sqrt(spec.head_dim)),
            sliding_window=spec.sliding_window or 0,
            softcap=node.attributes.get_float("softcap", 0.0),
        )
        inputs = [node.inputs[0], node.inputs[1], node.inputs[2], cache,
                  graph_input(graph, PAST_LENS), graph_input(graph, QUERY_LENS),
                  graph_input(graph, BLOCK_TABLES)]
        paged = ir.Node(
            pa.DOMAIN, pa.OP_TYPE, inputs,
            attributes=[ir.convenience.convert_attribute(k, v) for k, v in attrs.as_dict().items()],
            num_outputs=2, name=f"paged_attention_{layer}",
        )
        out, cache_out = paged.outputs
        out.name = f"paged_attention_{layer}_out"
        out.type, out.shape = node.outputs[0].type, node.outputs[0].shape
        cache_out.name = cache_output_name(layer)
        cache_out.type, cache_out.shape = cache.type, cache.shape
        graph.insert_before(node, paged)
        ir.convenience.replace_all_uses_with(node.outputs[0], out)
        graph.remove(node, safe=True)
        graph.outputs.append(cache_out)


class PagedKVCache(RulePass):
    name = "paged-kv-cache"
    description = "rewrite every Attention into llmc::PagedAttention with paged KV-cache graph I/O"
    rules = (AttentionToPaged(),)

    def prepare(self, model: ir.Model, ctx: BuildContext) -> None:
        graph = model.graph
        i32 = ir.TensorType(ir.DataType.INT32)
        for name, shape in ((PAST_LENS, ["batch"]), (QUERY_LENS, ["batch"]),
                            (BLOCK_TABLES, ["batch", "max_blocks"])):
            if graph_input(graph, name) is None:
                graph.inputs.append(ir.Value(name=name, type=i32, shape=ir.Shape(shape)))

    def finish(self, model: ir.Model, ctx: BuildContext, counts) -> None:
        graph = model.graph
        if not counts:
            # Nothing rewritten: leave the interface as it was.
            for name in (PAST_LENS, QUERY_LENS, BLOCK_TABLES):
                value = graph_input(graph, name)
                if value is not None and not value.uses():
                    graph.inputs.remove(value)
            return
        function = pa.build_function()
        model.functions[function.identifier()] = function
        model.opset_imports[pa.DOMAIN] = pa.VERSION
        remove_dead_code(model)
        # The causal mask came from position_ids; an explicit attention_mask input, if the
        # export had one, is no longer read by anything.
        for value in list(graph.inputs):
            if value.name == "attention_mask" and not value.uses():
                graph.inputs.remove(value)
