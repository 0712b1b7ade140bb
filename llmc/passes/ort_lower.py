"""ONNX Runtime lowering of `llmc::PagedAttention`.

The op's body is already written in ops ORT runs on CPU (ScatterND write, GatherND paged read,
Attention with a causal/window mask; see plugins/paged_attention.py). Lowering composes the same
two emitters differently from the op's function: the step metadata (write slots, read indices,
mask) is built once per step from the graph inputs, and each layer emits only its own write,
read and attention. In-place cache updates come from the runtime binding `kv_cache_out.{i}` to
the same OrtValue as `kv_cache.{i}`; the manifest records that aliasing.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import common as ir_passes

from llmc.ir_builder import OpBuilder
from llmc.passes.base import BuildContext, Pass, PassResult, graph_input, take_graph_output
from llmc.passes.paged_kv import BLOCK_TABLES, PAST_LENS, QUERY_LENS
from llmc.plugins import paged_attention as pa


def _attr(node: ir.Node, name: str):
    return node.attributes[name].value


class LowerPagedAttentionORT(Pass):
    name = "ort-lower"
    description = "lower llmc::PagedAttention to ONNX Runtime CPU ops, step metadata shared by all layers"

    def run(self, model: ir.Model, ctx: BuildContext) -> PassResult:
        graph = model.graph
        nodes = [n for n in graph if n.domain == pa.DOMAIN and n.op_type == pa.OP_TYPE]
        if not nodes:  # none left to compose: llmc's CPU kernels took them all (cpu-kernels)
            return PassResult(False, {})

        meta_ops = OpBuilder(name_prefix="paged_meta_")
        ids_shape = meta_ops.Shape(graph_input(graph, "input_ids"))
        batch = meta_ops.Slice(ids_shape, meta_ops.const([0]), meta_ops.const([1]))
        seq = meta_ops.Slice(ids_shape, meta_ops.const([1]), meta_ops.const([2]))
        block_size = meta_ops.const([ctx.block_size])
        kv_width = meta_ops.const([ctx.spec.num_kv_heads * ctx.spec.head_dim])
        heads = meta_ops.const([ctx.spec.num_heads])
        metas: dict[int, pa.StepMetadata] = {}
        for node in nodes:  # one metadata set per distinct window (usually one for the model)
            window = int(_attr(node, "sliding_window"))
            if window not in metas:
                metas[window] = pa.emit_step_metadata(
                    meta_ops, graph_input(graph, PAST_LENS), graph_input(graph, QUERY_LENS),
                    graph_input(graph, BLOCK_TABLES), batch, seq, block_size, meta_ops.const(window), heads,
                    kv_width)
        graph.insert_before(nodes[0], meta_ops.nodes)

        for i, node in enumerate(nodes):
            ops = OpBuilder(name_prefix=f"{node.name}_")
            q, k, v, cache = node.inputs[:4]
            output, cache_out = pa.emit_layer_attention(
                ops, q, k, v, cache, metas[int(_attr(node, "sliding_window"))],
                num_heads=int(_attr(node, "num_heads")), num_kv_heads=int(_attr(node, "num_kv_heads")),
                scale=float(_attr(node, "scale")), softcap=float(_attr(node, "softcap")))
            graph.insert_before(node, ops.nodes)
            old_out, old_cache = node.outputs
            output.type, output.shape = old_out.type, old_out.shape
            ir.convenience.replace_all_uses_with(old_out, output)
            # The ScatterND output itself must be the graph output: that is what ORT writes in place.
            take_graph_output(graph, old_cache, cache_out)
            graph.remove(node, safe=True)

        ir_passes.RemoveUnusedNodesPass()(model)
        ir_passes.RemoveUnusedFunctionsPass()(model)
        model.opset_imports.pop(pa.DOMAIN, None)
        return PassResult(True, {"paged_attention_lowered": len(nodes), "shared_step_metadata": len(metas)})
