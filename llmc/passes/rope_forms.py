"""rope-forms: RoPE that transformers writes in forms the exporter's fusions miss becomes ONNX's
RotaryEmbedding, which llmc's attention kernel folds and rotary-tables tabulates.

- interleaved_rope: the exporter's fusions recognize the rotate-half RoPE most families use, not
  the interleaved form (dims 2i and 2i + 1 rotate together) that ERNIE 4.5, Helium and GLM write as

    x * repeat_interleave(cos[..., :D/2], 2) + stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
                                             * repeat_interleave(sin[..., :D/2], 2)

  which exports as a dozen Slice, Neg, Unsqueeze, Concat, Expand and Reshape nodes per Q and K;
  `RotaryEmbedding(x, cos[..., :D/2], sin[..., :D/2], interleaved=1)` computes the same.
- partial_rope: a rotation of each head's first R dims only (StableLM, GLM, Nemotron) exports as
  Concat(RotaryEmbedding(x[..., :R]), x[..., R:]), which is RotaryEmbedding(x) with
  rotary_embedding_dim R.
- halves_rope: gpt-oss writes rotate-half RoPE out over the two halves of each head, with cos and
  sin of half the head's width: Concat(x1 cos - x2 sin, x2 cos + x1 sin), x1, x2 = Split(x), which
  is `RotaryEmbedding(x, cos, sin)` as ONNX defines it.
- scaled_rope: Ministral 3 (Llama 4's attention scaling) multiplies each query token by a scale
  after its RoPE, so the attention's Q is no RotaryEmbedding's output and the kernel that applies
  RoPE itself stands aside. A rotation is linear, so Mul(RotaryEmbedding(x), s), s one value per
  token, is RotaryEmbedding(Mul(x, s)).
"""

from __future__ import annotations

import onnx_ir as ir

from llmc.contract.model_spec import ModelSpec
from llmc.passes.graph import const_ints, producer
from llmc.passes.rewrite import Rule, RulePass

LAST = (-1, 3)  # the head_dim axis of a [B, H, S, D] tensor
HUGE = 2 ** 62  # a Slice end past any dim ("to the end")


def _slice(value: ir.Value | None) -> tuple[ir.Value, int, int, int] | None:
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


def _width(value: ir.Value) -> int | None:
    """The static last dim of a 4-D tensor."""
    shape = value.shape
    return shape[3] if shape is not None and len(shape) == 4 and isinstance(shape[3], int) else None


def _doubled_half(value: ir.Value, width: int) -> ir.Value | None:
    """The angles A [B, S, D] when `value` is repeat_interleave(Unsqueeze(A, 1)[..., :width/2], 2)
    as exported: Reshape(Expand(Unsqueeze(Slice(...), 4), [1, 1, 1, 1, 2]), [..., width])."""
    reshape = producer(value, "Reshape")
    expand = producer(reshape.inputs[0], "Expand") if reshape is not None else None
    if expand is None or const_ints(expand.inputs[1]) != [1, 1, 1, 1, 2]:
        return None
    sliced = _unsqueezed(expand.inputs[0], (4, -1))
    half = _slice(sliced)
    if half is None or half[1:] != (0, width // 2, 1):
        return None
    return _unsqueezed(half[0], (1,))


def _rotated_pairs(value: ir.Value, x: ir.Value) -> bool:
    """Whether `value` is stack((-x[..., 1::2], x[..., 0::2]), -1) flattened back to [.., D]."""
    reshape = producer(value, "Reshape")
    concat = producer(reshape.inputs[0], "Concat") if reshape is not None else None
    if concat is None or len(concat.inputs) != 2 or concat.attributes.get_int("axis", 0) not in (-1, 4):
        return False
    odd, even = (_unsqueezed(v, (-1, 4)) for v in concat.inputs)
    neg = producer(odd, "Neg")
    odd_slice = _slice(neg.inputs[0]) if neg is not None else None
    even_slice = _slice(even)
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
        width = _width(m.x)  # the head_dim, or the rotated part of it
        if width is None or width > self.head_dim or width % 2:
            return "not a [B, H, S, D] tensor with a static, even D of at most head_dim"
        if not _rotated_pairs(m.rotated, m.x):
            return "the second term is not x's interleaved pairs rotated"
        if _doubled_half(m.cos, width) is None or _doubled_half(m.sin, width) is None:
            return "cos and sin are not the first half of the angles, each repeated twice in place"
        return None

    def rewrite(self, op, m):
        width = _width(m.x)
        cos, sin = (self._half(op, _doubled_half(v, width), width) for v in (m.cos, m.sin))
        out = op.RotaryEmbedding(m.x, cos, sin, interleaved=1)
        out.type, out.shape = m.x.type, m.x.shape
        return out

    def _half(self, op, angles: ir.Value, width: int) -> ir.Value:
        """angles[..., :width/2], reused where an earlier rewrite of this pass made it (the sweep goes
        in graph order, so it was placed before this match's root)."""
        made = self.halves.get(angles)
        if made is None or made.producer() is None or made.producer().graph is None:
            made = op.Slice(angles, op.const([0]), op.const([width // 2]), op.const([-1]))
            self.halves[angles] = made
        return made


class PartialRope(Rule):
    name = "partial_rope"

    def __init__(self, head_dim: int):
        self.head_dim = head_dim

    def pattern(self, op, head, cos, sin, tail):
        rope = op.RotaryEmbedding(head, cos, sin, _name="rope")
        return op.Concat(rope, tail, _name="concat")

    def check(self, m):
        head, tail = _slice(m.head), _slice(m.tail)
        if head is None or tail is None or head[0] is not tail[0]:
            return "the rotated and the passed-through parts are not two slices of one tensor"
        x, rotated = head[0], head[2]
        if _width(x) != self.head_dim or head[1:] != (0, rotated, 1) or tail[1] != rotated or tail[3] != 1 \
                or tail[2] < self.head_dim:
            return "not the first R dims of each head rotated and the rest passed through"
        if m.concat.attributes.get_int("axis", 0) not in LAST:
            return "the parts are not joined along the head's dims"
        if m.rope.attributes.get_int("rotary_embedding_dim", 0) not in (0, rotated):
            return "the RotaryEmbedding rotates part of its input already"
        return None

    def rewrite(self, op, m):
        x, _, rotated, _ = _slice(m.head)
        attrs = {a.name: a for a in m.rope.attributes.values() if a.name != "rotary_embedding_dim"}
        out = op.RotaryEmbedding(x, m.cos, m.sin, rotary_embedding_dim=rotated, **attrs)
        out.type, out.shape = x.type, x.shape
        return out


class HalvesRope(Rule):
    name = "halves_rope"

    def pattern(self, op, x, cos, sin):
        first, second = op.Split(x, _outputs=2, _name="split")
        return op.Concat(op.Sub(op.Mul(first, cos, _commute=True), op.Mul(second, sin, _commute=True)),
                         op.Add(op.Mul(second, cos, _commute=True), op.Mul(first, sin, _commute=True), _commute=True),
                         _name="concat")

    def check(self, m):
        width = _width(m.x)
        if width is None or width % 2:
            return "not a [B, H, S, D] tensor with a static, even D"
        if m.split.attributes.get_int("axis", 0) not in LAST or m.concat.attributes.get_int("axis", 0) not in LAST:
            return "the halves are not split and joined along the head's dims"
        if len(m.split.inputs) > 1 and const_ints(m.split.inputs[1]) != [width // 2] * 2:
            return "the split is not into equal halves"
        for angles in (m.cos, m.sin):
            if _unsqueezed(angles, (1,)) is None or _width(angles) != width // 2:
                return "cos and sin are not [B, 1, S, D/2] angles of each token"
        return None

    def rewrite(self, op, m):
        out = op.RotaryEmbedding(m.x, _unsqueezed(m.cos, (1,)), _unsqueezed(m.sin, (1,)))
        out.type, out.shape = m.x.type, m.x.shape
        return out


class ScaledRope(Rule):
    name = "scaled_rope"

    def pattern(self, op, x, cos, sin, scale):
        return op.Mul(op.RotaryEmbedding(x, cos, sin, _name="rope"), scale)

    def check(self, m):
        shape = m.scale.shape
        if shape is None or len(shape) != 4 or shape[1] != 1 or shape[3] != 1:
            return "the factor is not one value per token ([B, 1, S, 1])"
        if len(m.rope.outputs[0].uses()) != 1:
            return "the rotated tensor has other readers"
        return None

    def rewrite(self, op, m):
        scaled = op.Mul(m.x, m.scale)
        scaled.type, scaled.shape = m.x.type, m.x.shape
        out = op.like(m.rope, scaled, m.cos, m.sin)
        out.type, out.shape = m.x.type, m.x.shape
        return out


class RopeForms(RulePass):
    name = "rope-forms"
    description = ("RoPE in forms the exporter misses (interleaved pairs, part of each head, halves written out, a "
                   "per-token scale after it) as ONNX RotaryEmbedding")
    fixed_point = True  # a partial rotation is an interleaved one's output first (GLM)

    def rules(self, spec: ModelSpec):
        return [InterleavedRope(spec.head_dim), PartialRope(spec.head_dim), HalvesRope(), ScaledRope()]
