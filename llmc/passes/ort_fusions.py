"""ONNX Runtime fusions: rewrite standard-op patterns into ORT's fused CPU kernels (com.microsoft).

They run after lowering because they target one backend's kernels; a TensorRT lowering would
fuse the same patterns into its own plugins instead.

- skip_rmsnorm: `RMSNormalization(a + b)` whose sum is also the residual stream ->
  `SkipSimplifiedLayerNormalization(a, b)`, which returns both the normalized value and the sum
  from one pass over the row (the Add and the norm each read and wrote the row before).
- swiglu: `(g * Sigmoid(g)) * up` -> `QuickGelu(g, alpha=1) * up`: SiLU as one kernel instead of
  a Sigmoid whose output is written and read back.
"""

from __future__ import annotations

import onnx_ir as ir

from llmc.passes.base import BuildContext, RewriteRule, RulePass, producer, weight

MS_DOMAIN = "com.microsoft"


class SkipRMSNorm(RewriteRule):
    name = "skip_rmsnorm"

    def match(self, node, ctx: BuildContext):
        if node.op_type != "RMSNormalization" or node.domain not in ("", "ai.onnx"):
            return None
        return {"norm": node, "add": producer(node.inputs[0], "Add")}

    def check(self, m, ctx: BuildContext):
        norm, add = m["norm"], m["add"]
        if add is None:
            return "the normalized input is not a residual Add (first layer's norm reads the embedding)"
        gamma = weight(norm.inputs[1])
        if gamma is None or gamma.ndim != 1:
            return "scale is not a constant 1-D weight"
        if len(norm.inputs) > 2 and norm.inputs[2] is not None:
            return "RMSNormalization has a bias"
        rank = len(add.outputs[0].shape) if add.outputs[0].shape is not None else None
        axis = norm.attributes.get_int("axis", -1)
        if rank is None or axis not in (-1, rank - 1):
            return f"normalizes over axis {axis}, not the last axis of a rank-{rank} input"
        if norm.attributes.get_int("stash_type", 1) != 1:
            return "stash_type is not float32"
        a, b = add.inputs
        if a.shape is None or b.shape is None or a.shape != b.shape or len(a.shape) != 3:
            return "the Add's operands are not both [batch, seq, hidden]"
        if add.outputs[0].is_graph_output():
            return "the residual sum is a graph output"
        return None

    def rewrite(self, m, ctx: BuildContext, model: ir.Model):
        norm, add = m["norm"], m["add"]
        fused = ir.Node(MS_DOMAIN, "SkipSimplifiedLayerNormalization",
                        [add.inputs[0], add.inputs[1], norm.inputs[1]],
                        attributes=[ir.AttrFloat32("epsilon", norm.attributes.get_float("epsilon", 1e-5))],
                        num_outputs=4, name=f"{norm.name}_skip")
        out, _, _, total = fused.outputs
        for new, old in ((out, norm.outputs[0]), (total, add.outputs[0])):
            new.type, new.shape = old.type, old.shape
        out.name, total.name = f"{norm.outputs[0].name}_skip", f"{add.outputs[0].name}_skip"
        model.graph.insert_before(add, fused)
        ir.convenience.replace_all_uses_with(norm.outputs[0], out)
        ir.convenience.replace_all_uses_with(add.outputs[0], total)
        model.graph.remove([norm, add], safe=True)
        model.opset_imports.setdefault(MS_DOMAIN, 1)


class SwiGLU(RewriteRule):
    name = "swiglu"

    def match(self, node, ctx: BuildContext):
        if node.op_type != "Mul" or node.domain not in ("", "ai.onnx"):
            return None
        for slot in (0, 1):  # Mul(silu, up) or Mul(up, silu)
            silu = producer(node.inputs[slot], "Mul")
            if silu is None:
                continue
            for g_slot in (0, 1):
                sigmoid = producer(silu.inputs[1 - g_slot], "Sigmoid")
                if sigmoid is not None and sigmoid.inputs[0] is silu.inputs[g_slot]:
                    return {"mul": node, "silu": silu, "sigmoid": sigmoid, "gate": silu.inputs[g_slot],
                            "up": node.inputs[1 - slot]}
        return None

    def check(self, m, ctx: BuildContext):
        if len(m["silu"].outputs[0].uses()) != 1 or len(m["sigmoid"].outputs[0].uses()) != 1:
            return "SiLU or its Sigmoid has other consumers"
        return None

    def rewrite(self, m, ctx: BuildContext, model: ir.Model):
        mul, silu, sigmoid = m["mul"], m["silu"], m["sigmoid"]
        act = ir.Node(MS_DOMAIN, "QuickGelu", [m["gate"]], attributes=[ir.AttrFloat32("alpha", 1.0)],
                      name=f"{silu.name}_silu")
        act.outputs[0].type, act.outputs[0].shape = silu.outputs[0].type, silu.outputs[0].shape
        act.outputs[0].name = f"{silu.outputs[0].name}_silu"
        model.graph.insert_before(silu, act)
        mul.replace_input_with(list(mul.inputs).index(silu.outputs[0]), act.outputs[0])
        model.graph.remove([silu, sigmoid], safe=True)
        model.opset_imports.setdefault(MS_DOMAIN, 1)


class ORTFusions(RulePass):
    name = "ort-fusions"
    description = "fuse residual Add + RMSNorm and SiLU(gate) * up into ONNX Runtime's fused CPU kernels"
    rules = (SkipRMSNorm(), SwiGLU())
