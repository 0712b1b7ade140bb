"""ONNX Runtime lowering of `llmc::PagedAttention`.

The op's function body is already written in ops ORT runs on CPU (ScatterND write, GatherND
paged read, Attention with a causal/window mask), so lowering inlines it. Common-subexpression
elimination then merges the per-layer copies of the slot and mask computation, which depend
only on the shared graph inputs, so they run once per step instead of once per layer.
In-place cache updates come from the runtime binding `kv_cache_out.{i}` to the same OrtValue
as `kv_cache.{i}`; the manifest records that aliasing.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import common as ir_passes

from llmc.passes.base import BuildContext, Pass, PassResult, count_nodes
from llmc.plugins import paged_attention as pa


class LowerPagedAttentionORT(Pass):
    name = "ort-lower"
    description = "inline llmc::PagedAttention into ONNX Runtime CPU ops and share per-step metadata"

    def run(self, model: ir.Model, ctx: BuildContext) -> PassResult:
        paged = sum(1 for n in model.graph if n.domain == pa.DOMAIN and n.op_type == pa.OP_TYPE)
        if not paged:
            return PassResult(False, {}, ["no llmc::PagedAttention nodes to lower"])
        ir_passes.InlinePass(criteria=lambda f: f.domain == pa.DOMAIN)(model)
        inlined = count_nodes(model)
        ir_passes.CommonSubexpressionEliminationPass()(model)
        ir_passes.RemoveUnusedNodesPass()(model)
        ir_passes.RemoveUnusedFunctionsPass()(model)
        model.opset_imports.pop(pa.DOMAIN, None)
        return PassResult(True, {"paged_attention_lowered": paged,
                                 "shared_nodes_merged": inlined - count_nodes(model)})
