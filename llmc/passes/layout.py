"""Layout simplification after lowering: drop the head transposes the export and the lowering
put back to back.

The exporter moves Q/K/V to [B, H, S, D] for attention and the output back to [B, S, H*D]; the
ORT lowering attends in the 3-D [B, S, H*D] layout, so it transposes straight back. Each
Transpose is a copy and every node costs a kernel dispatch, which at decode (S = 1) is most
of what these tiny tensors cost.

- weight_layout: Transpose of a weight -> the weight stored transposed. The exporter leaves
  one where a weight is shared in two layouts (tied embeddings: Gather reads [V, H], the LM
  head MatMul wants [H, V]); storing both beats transposing 4 x V x H bytes at load or per step.
- transpose_pair: Transpose(Transpose(x, p1), p2) with p2 after p1 the identity -> x.
- rope_3d: [B,S,H,D] -> Transpose -> RotaryEmbedding -> Transpose back, on a Reshape of a 3-D
  x -> RotaryEmbedding on x in its 3-D form (num_heads given), then the same Reshape.
- reshape_chain: Reshape(Reshape(x, s1), s2) -> Reshape(x, s2) when s2 cannot refer to the
  intermediate's dims (allowzero=1, or a constant without zeros).
"""

from __future__ import annotations

import onnx_ir as ir

import numpy as np

from llmc.passes.base import BuildContext, RewriteRule, RulePass, const_ints, producer, weight

SWAP_HEADS_AND_SEQ = (0, 2, 1, 3)


def _perm(node: ir.Node) -> tuple[int, ...] | None:
    attr = node.attributes.get("perm")
    return tuple(attr.value) if attr is not None else None


def _only_consumer(value: ir.Value, node: ir.Node) -> bool:
    return not value.is_graph_output() and all(user is node for user, _ in value.uses())


class WeightLayout(RewriteRule):
    name = "weight_layout"

    def match(self, node, ctx: BuildContext):
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
            return None
        data = weight(node.inputs[0])
        return {"transpose": node, "data": data} if data is not None else None

    def check(self, m, ctx: BuildContext):
        if m["transpose"].outputs[0].is_graph_output():
            return "the transposed weight is a graph output"
        return None

    def rewrite(self, m, ctx: BuildContext, model: ir.Model):
        node, source = m["transpose"], m["transpose"].inputs[0]
        perm = _perm(node) or tuple(reversed(range(m["data"].ndim)))
        stored = ir.Value(name=f"{source.name}.transposed",
                          const_value=ir.tensor(np.ascontiguousarray(m["data"].transpose(perm))))
        model.graph.register_initializer(stored)
        ir.convenience.replace_all_uses_with(node.outputs[0], stored)
        model.graph.remove(node, safe=True)
        if not source.uses() and not source.is_graph_output():
            model.graph.initializers.pop(source.name)


class TransposePair(RewriteRule):
    name = "transpose_pair"

    def match(self, node, ctx: BuildContext):
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
            return None
        inner = producer(node.inputs[0], "Transpose")
        return {"outer": node, "inner": inner} if inner is not None else None

    def check(self, m, ctx: BuildContext):
        p1, p2 = _perm(m["inner"]), _perm(m["outer"])
        if p1 is None or p2 is None:
            return "a Transpose has no explicit perm"
        if [p1[i] for i in p2] != list(range(len(p1))):
            return f"perms {p1} then {p2} do not cancel"
        if m["outer"].outputs[0].is_graph_output():
            return "the result is a graph output"
        return None

    def rewrite(self, m, ctx: BuildContext, model: ir.Model):
        outer, inner = m["outer"], m["inner"]
        ir.convenience.replace_all_uses_with(outer.outputs[0], inner.inputs[0])
        model.graph.remove(outer, safe=True)
        if not inner.outputs[0].uses() and not inner.outputs[0].is_graph_output():
            model.graph.remove(inner, safe=True)


class Rope3D(RewriteRule):
    name = "rope_3d"

    def match(self, node, ctx: BuildContext):
        if node.op_type != "Transpose" or _perm(node) != SWAP_HEADS_AND_SEQ:
            return None
        rope = producer(node.inputs[0], "RotaryEmbedding")
        before = producer(rope.inputs[0], "Transpose") if rope is not None else None
        split = producer(before.inputs[0], "Reshape") if before is not None else None
        if split is None:
            return None
        return {"back": node, "rope": rope, "before": before, "split": split}

    def check(self, m, ctx: BuildContext):
        rope, before, split = m["rope"], m["before"], m["split"]
        if _perm(before) != SWAP_HEADS_AND_SEQ:
            return "RoPE input is not a [B,S,H,D] -> [B,H,S,D] transpose"
        if not _only_consumer(rope.outputs[0], m["back"]) or not _only_consumer(before.outputs[0], rope):
            return "the [B,H,S,D] tensors have other consumers"
        x, heads_shape = split.inputs[0], split.outputs[0].shape
        if x.shape is None or len(x.shape) != 3:
            return "the tensor split into heads is not 3-D [B,S,H*D]"
        if heads_shape is None or len(heads_shape) != 4 or not isinstance(heads_shape[2], int):
            return "number of heads is not static"
        if len(rope.inputs) > 3 and rope.inputs[3] is not None:
            return "RoPE takes position_ids (cache indexed in the op), not precomputed cos/sin"
        m["x"], m["heads"] = x, heads_shape[2]
        return None

    def rewrite(self, m, ctx: BuildContext, model: ir.Model):
        rope, split, back = m["rope"], m["split"], m["back"]
        attrs = [a for a in rope.attributes.values() if a.name != "num_heads"]
        rope3 = ir.Node(rope.domain, "RotaryEmbedding", [m["x"], rope.inputs[1], rope.inputs[2]],
                        attributes=attrs + [ir.AttrInt64("num_heads", m["heads"])], name=f"{rope.name}_3d")
        rope3.outputs[0].type, rope3.outputs[0].shape = m["x"].type, m["x"].shape
        rope3.outputs[0].name = f"{rope.outputs[0].name}_3d"
        heads = ir.Node("", "Reshape", [rope3.outputs[0], split.inputs[1]], attributes=split.attributes.values(),
                        name=f"{rope.name}_heads")
        heads.outputs[0].type, heads.outputs[0].shape = back.outputs[0].type, back.outputs[0].shape
        heads.outputs[0].name = f"{rope.outputs[0].name}_bshd"
        model.graph.insert_before(back, [rope3, heads])
        ir.convenience.replace_all_uses_with(back.outputs[0], heads.outputs[0])
        model.graph.remove([back, rope, m["before"]], safe=True)
        if not split.outputs[0].uses():
            model.graph.remove(split, safe=True)


class ReshapeChain(RewriteRule):
    name = "reshape_chain"

    def match(self, node, ctx: BuildContext):
        if node.op_type != "Reshape" or node.domain not in ("", "ai.onnx"):
            return None
        inner = producer(node.inputs[0], "Reshape")
        return {"outer": node, "inner": inner} if inner is not None else None

    def check(self, m, ctx: BuildContext):
        outer = m["outer"]
        if outer.attributes.get_int("allowzero", 0) != 1:
            target = const_ints(outer.inputs[1])
            if target is None or 0 in target:
                return "outer shape may copy dims (0) of the intermediate"
        return None

    def rewrite(self, m, ctx: BuildContext, model: ir.Model):
        outer, inner = m["outer"], m["inner"]
        outer.replace_input_with(0, inner.inputs[0])
        if not inner.outputs[0].uses() and not inner.outputs[0].is_graph_output():
            model.graph.remove(inner, safe=True)


class SimplifyLayout(RulePass):
    name = "simplify-layout"
    description = "store weights transposed, cancel back-to-back head transposes, RoPE in 3-D, merge reshapes"
    rules = (WeightLayout(), Rope3D(), TransposePair(), ReshapeChain())
    fixed_point = True
