"""interleaved-rope: RoPE on interleaved pairs, written out as ops, becomes ONNX's RotaryEmbedding.

The exporter's fusions recognize the rotate-half RoPE most families use, not the interleaved
form (dims 2i and 2i + 1 rotate together) that ERNIE 4.5 writes as

    x * repeat_interleave(cos[..., :D/2], 2) + stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
                                             * repeat_interleave(sin[..., :D/2], 2)

which exports as a dozen Slice, Neg, Unsqueeze, Concat, Expand and Reshape nodes per Q and K.
`RotaryEmbedding(x, cos[..., :D/2], sin[..., :D/2], interleaved=1)` computes the same, and from
there the rotation folds into llmc's attention kernel and its angles into rotary-tables' tables,
as for every other family.
"""

from __future__ import annotations

import onnx_ir as ir

from llmc.contract.model_spec import ModelSpec
from llmc.passes.graph import const_ints, producer
from llmc.passes.rewrite import Rule, RulePass

LAST = (-1, 3)  # the head_dim axis of a [B, H, S, D] tensor
HUGE = 2 ** 62  # a Slice end past any dim ("to the end")


def _slice(value: ir.Value) -> tuple[ir.Value, int, int, int] | None:
    """(data, start, end, step) of a Slice along the last axis of a 4-D tensor."""
    node = producer(value, "Slice")
    if node is None or len(node.inputs) < 4:
        return None
    starts, ends, axes = (const_ints(v) for v in node.inputs[1:4])
    steps = const_ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else [1]
    if None in (starts, ends, axes, steps) or len(axes) != 1 or axes[0] not in LAST:
        return None
    return node.inputs[0], starts[0], ends[0], steps[0]


def _unsqueezed(value: ir.Value, axes: tuple[int, ...]) -> ir.Value | None:
    node = producer(value, "Unsqueeze")
    return node.inputs[0] if node is not None and const_ints(node.inputs[1]) in [[a] for a in axes] else None


def _doubled_half(value: ir.Value, head_dim: int) -> ir.Value | None:
    """The angles A [B, S, D] when `value` is repeat_interleave(Unsqueeze(A, 1)[..., :D/2], 2)
    as exported: Reshape(Expand(Unsqueeze(Slice(...), 4), [1, 1, 1, 1, 2]), [..., D])."""
    reshape = producer(value, "Reshape")
    expand = producer(reshape.inputs[0], "Expand") if reshape is not None else None
    if expand is None or const_ints(expand.inputs[1]) != [1, 1, 1, 1, 2]:
        return None
    sliced = _unsqueezed(expand.inputs[0], (4, -1))
    half = _slice(sliced) if sliced is not None else None
    if half is None or half[1:] != (0, head_dim // 2, 1):
        return None
    return _unsqueezed(half[0], (1,))


def _rotated_pairs(value: ir.Value, x: ir.Value) -> bool:
    """Whether `value` is stack((-x[..., 1::2], x[..., 0::2]), -1) flattened back to [.., D]."""
    reshape = producer(value, "Reshape")
    concat = producer(reshape.inputs[0], "Concat") if reshape is not None else None
    if concat is None or len(concat.inputs) != 2 or concat.attributes.get_int("axis", 0) not in (-1, 4):
        return False
    odd, even = (_unsqueezed(v, (-1, 4)) for v in concat.inputs)
    neg = producer(odd, "Neg") if odd is not None else None
    odd_slice = _slice(neg.inputs[0]) if neg is not None else None
    even_slice = _slice(even) if even is not None else None
    if odd_slice is None or even_slice is None:
        return False
    return (odd_slice[0] is x and even_slice[0] is x and odd_slice[1] == 1 and even_slice[1] == 0
            and odd_slice[3] == even_slice[3] == 2 and min(odd_slice[2], even_slice[2]) >= HUGE // 2)


class InterleavedRope(Rule):
    name = "interleaved_rope"

    def __init__(self, head_dim: int):
        self.head_dim = head_dim
        # Each angle tensor's first half, made once: Q and K then rotate with the same cos/sin
        # values, which the attention kernel's fold of the rotation asks for.
        self.halves: dict[ir.Value, ir.Value] = {}

    def pattern(self, op, x, cos, rotated, sin):
        return op.Add(op.Mul(x, cos, _name="by_cos"), op.Mul(rotated, sin, _name="by_sin"))

    def check(self, m):
        if m.x.shape is None or len(m.x.shape) != 4 or m.x.shape[3] != self.head_dim:
            return "not a [B, H, S, head_dim] tensor"
        if not _rotated_pairs(m.rotated, m.x):
            return "the second term is not x's interleaved pairs rotated"
        if _doubled_half(m.cos, self.head_dim) is None or _doubled_half(m.sin, self.head_dim) is None:
            return "cos and sin are not the first half of the angles, each repeated twice in place"
        return None

    def rewrite(self, op, m):
        cos, sin = (self._half(op, _doubled_half(v, self.head_dim)) for v in (m.cos, m.sin))
        out = op.RotaryEmbedding(m.x, cos, sin, interleaved=1)
        out.type, out.shape = m.x.type, m.x.shape
        return out


    def _half(self, op, angles: ir.Value) -> ir.Value:
        """angles[..., :D/2], reused where an earlier rewrite of this pass made it (the sweep goes in
        graph order, so it was placed before this match's root)."""
        made = self.halves.get(angles)
        if made is None or made.producer() is None or made.producer().graph is None:
            made = op.Slice(angles, op.const([0]), op.const([self.head_dim // 2]), op.const([-1]))
            self.halves[angles] = made
        return made


class InterleavedRoPE(RulePass):
    name = "interleaved-rope"
    description = "RoPE on interleaved pairs, written as ops (ERNIE 4.5), as ONNX RotaryEmbedding(interleaved=1)"

    def rules(self, spec: ModelSpec):
        return [InterleavedRope(spec.head_dim)]
