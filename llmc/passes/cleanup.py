"""cleanup: constant folding, common subexpressions, duplicate initializers, dead nodes."""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import common as ir_passes

from llmc.contract.model_spec import ModelSpec
from llmc.passes.graph import count_nodes
from llmc.passes.manager import Pass, PassResult
from llmc.passes.rewrite import remove_dead_code


class Cleanup(Pass):
    name = "cleanup"
    description = "fold constants, merge common subexpressions and duplicate weights, drop dead nodes"

    def apply(self, model: ir.Model, spec: ModelSpec) -> PassResult:
        import onnxscript.optimizer

        nodes = count_nodes(model)
        inits = len(model.graph.initializers)
        onnxscript.optimizer.fold_constants(model)
        after_fold = count_nodes(model)
        ir_passes.CommonSubexpressionEliminationPass()(model)
        after_cse = count_nodes(model)
        # The exporter already merges identical weights; this catches small duplicates passes create.
        ir_passes.DeduplicateInitializersPass()(model)
        dead = remove_dead_code(model)
        counts = {
            "folded": nodes - after_fold,
            "cse_merged": after_fold - after_cse,
            "dead_removed": dead,
            "initializers_merged": inits - len(model.graph.initializers),
        }
        return PassResult(any(counts.values()), counts)
