"""simplify-layout: drop the transposes and reshapes the export and the lowering put back to back.

The exporter moves Q/K/V to [B, H, S, D] for attention and the output back to [B, S, H*D]; the
ORT lowering attends in the 3-D [B, S, H*D] layout, so it transposes straight back. Each
Transpose is a copy and every node costs a kernel dispatch, which at decode (S = 1) is most
of what these tiny tensors cost.

- weight_layout: Transpose of a weight -> the weight stored transposed. The exporter leaves
  one where a weight is shared in two layouts (tied embeddings: Gather reads [V, H], the LM
  head MatMul wants [H, V]); storing both beats transposing the whole matrix at load or per step.
- rope_3d: [B,S,H,D] -> Transpose -> RotaryEmbedding -> Transpose back, on a Reshape of a 3-D
  x -> RotaryEmbedding on x in its 3-D form (num_heads given), then the same Reshape.
- transpose_pair: Transpose(Transpose(x, p1), p2) with p2 after p1 the identity -> x.
- reshape_chain: Reshape(Reshape(x, s1), s2) -> Reshape(x, s2) when s2 cannot refer to the
  intermediate's dims (allowzero=1, or a constant without zeros).
"""

from __future__ import annotations

import numpy as np

from llmc.contract.model_spec import ModelSpec
from llmc.passes import lazy
from llmc.passes.graph import const_ints, perm, tensor
from llmc.passes.rewrite import Rule, RulePass

SWAP_HEADS_AND_SEQ = (0, 2, 1, 3)


class WeightLayout(Rule):
    name = "weight_layout"

    def pattern(self, op, data):
        return op.Transpose(op.weight(data), _name="transpose")

    def check(self, m):
        if m.outputs[0].is_graph_output():
            return "the transposed weight is a graph output"
        return None

    def rewrite(self, op, m):
        data = tensor(m.data)
        order = perm(m.transpose) or tuple(reversed(range(len(data.dims))))
        if order == (1, 0):  # a tied LM head: the embedding table read by columns, never whole
            return op.initializer(lazy.transposed(data), f"{m.data.name}.transposed")
        return op.initializer(np.ascontiguousarray(data.numpy().transpose(order)), f"{m.data.name}.transposed")


class Rope3D(Rule):
    name = "rope_3d"

    def pattern(self, op, x, target, cos, sin):
        split = op.Reshape(x, target, _keep=True, _name="split")
        before = op.Transpose(split, _name="before")
        rope = op.RotaryEmbedding(before, cos, sin, _other_inputs=True, _name="rope")
        return op.Transpose(rope, _name="back")

    def check(self, m):
        if perm(m.back) != SWAP_HEADS_AND_SEQ or perm(m.before) != SWAP_HEADS_AND_SEQ:
            return "RoPE is not between a [B,S,H,D] -> [B,H,S,D] transpose and its inverse"
        heads = m.split.outputs[0].shape
        if m.x.shape is None or len(m.x.shape) != 3:
            return "the tensor split into heads is not 3-D [B,S,H*D]"
        if heads is None or len(heads) != 4 or not isinstance(heads[2], int):
            return "number of heads is not static"
        if len(m.rope.inputs) > 3 and m.rope.inputs[3] is not None:
            return "RoPE takes position_ids (cache indexed in the op), not precomputed cos/sin"
        return None

    def rewrite(self, op, m):
        attrs = {a.name: a for a in m.rope.attributes.values() if a.name != "num_heads"}
        rope3 = op.RotaryEmbedding(m.x, m.cos, m.sin, domain=m.rope.domain, num_heads=m.split.outputs[0].shape[2],
                                   **attrs)
        rope3.type, rope3.shape = m.x.type, m.x.shape
        return op.like(m.split, rope3, m.target)


class TransposePair(Rule):
    name = "transpose_pair"

    def pattern(self, op, x):
        return op.Transpose(op.Transpose(x, _keep=True, _name="inner"), _name="outer")

    def check(self, m):
        p1, p2 = perm(m.inner), perm(m.outer)
        if p1 is None or p2 is None:
            return "a Transpose has no explicit perm"
        if [p1[i] for i in p2] != list(range(len(p1))):
            return f"perms {p1} then {p2} do not cancel"
        if m.outputs[0].is_graph_output():
            return "the result is a graph output"
        return None

    def rewrite(self, op, m):
        return m.x


class ReshapeChain(Rule):
    name = "reshape_chain"

    def pattern(self, op, x, inner_shape, shape):
        return op.Reshape(op.Reshape(x, inner_shape, _keep=True), shape, _name="outer")

    def check(self, m):
        if m.outer.attributes.get_int("allowzero", 0) != 1:
            target = const_ints(m.shape)
            if target is None or 0 in target:
                return "outer shape may copy dims (0) of the intermediate"
        return None

    def rewrite(self, op, m):
        return op.like(m.outer, m.x, m.shape)


class SimplifyLayout(RulePass):
    name = "simplify-layout"
    description = "store weights transposed, cancel back-to-back head transposes, RoPE in 3-D, merge reshapes"
    fixed_point = True

    def rules(self, spec: ModelSpec):
        return [WeightLayout(), Rope3D(), TransposePair(), ReshapeChain()]
