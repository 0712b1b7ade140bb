"""cpu-kernels: attention and SwiGLU onto llmc's own CPU kernels (llmc.plugins.cpu).

ONNX Runtime has no paged attention on CPU, and composing one from standard ops costs a
gathered copy of every row's blocks per layer plus many small nodes (docs/attention_cpu.md).
The kernels take the tensors as the projections produce them:

- paged_attention_kernel: `llmc::PagedAttention` -> `llmc.cpu::PagedAttention`, which writes the
  step's K/V into the pool and attends over the row's blocks where they lie. Its pools are
  head-major (llmc.contract.kv_layout) and an engine has one layout, so every layer moves or none
  does. It reads token-major [B, S, H*D] inputs, what the projection MatMul writes, so the
  Reshape/Transpose pairs around the op go. Two foldings ride along and are counted on their own:
  - rope_fused: Q and K's `RotaryEmbedding` (same cos/sin) is applied inside the kernel;
  - qkv_packed: when Q, K and V are the three parts of one Split of the merged projection,
    the kernel reads the unsplit tensor and the Split's copy goes;
  - qk_norm_fused: Q and K's RMSNormalization over each head (Qwen3, Gemma 3) is applied inside
    the kernel, before the rotation, so Q and K reach it as the projection wrote them (and
    packed, where they are one Split's).
- heads_merged: the kernel writes [B, S, H*D]; where the graph split that into heads only to
  transpose and merge them back, the round trip goes.
- swiglu: `QuickGelu(gate) * up` over the two halves of the merged gate/up projection ->
  `llmc.cpu::SwiGLU(gate_up)`: no Split copy, one pass over the row. Gemma's GeGLU
  (`Gelu(gate, approximate="tanh") * up`) is the same op with `activation` 1 (counted as geglu).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from llmc.contract import graph_io as io
from llmc.contract import kv_layout
from llmc.contract.model_spec import ModelSpec
from llmc.passes.graph import const_ints, perm, producer, rotary, shared_rotary, tensor
from llmc.passes.rewrite import Rule, RulePass, rotary_operands
from llmc.plugins import cpu
from llmc.plugins import paged_attention as pa
from llmc.plugins.cpu.library import MISSING_HINT, library_path

HEADS_TO_TOKENS = (0, 2, 1, 3)  # [B, H, S, D] <-> [B, S, H, D]
SINKS = 12  # llmc.cpu::PagedAttention's input (ops.h: IN_SINKS)


def _token_major(value: ir.Value, head_dim: int, norm_ok: bool = False) -> tuple[ir.Value | None, ir.Node | None]:
    """(X, None) when `value` is Transpose(Reshape(X, [B, S, H, D]), perm=[0, 2, 1, 3]) with X 3-D:
    the heads split off X's last axis, which is the layout the kernel reads. With `norm_ok`, also
    (X, the norm) when an RMSNormalization over each head lies before or after the Transpose
    (QK-norm), which the kernel then applies. (None, None) otherwise."""
    # The norm is over each head's last axis, so it may lie on either side of the Transpose
    # (Qwen3 normalizes before it, Gemma 3 after).
    after = producer(value, "RMSNormalization") if norm_ok else None
    transpose = producer(after.inputs[0] if after is not None else value, "Transpose")
    if transpose is None or perm(transpose) != HEADS_TO_TOKENS:
        return None, None
    before = producer(transpose.inputs[0], "RMSNormalization") if norm_ok and after is None else None
    norm = after or before
    if norm is not None and _head_norm(norm, head_dim) is None:
        return None, None
    reshape = producer((before or transpose).inputs[0], "Reshape")
    if reshape is None:
        return None, None
    source, split = reshape.inputs[0], reshape.outputs[0].shape
    if source.shape is None or len(source.shape) != 3 or split is None or len(split) != 4 or split[3] != head_dim:
        return None, None
    return source, norm


def _head_norm(norm: ir.Node, head_dim: int) -> float | None:
    """The epsilon of an RMSNormalization over each head's last axis with a constant [head_dim]
    float32 weight (what the kernel's QK-norm computes), else None."""
    weight = tensor(norm.inputs[1]) if len(norm.inputs) > 1 else None
    axis = norm.attributes.get_int("axis", -1)
    if weight is None or weight.dims != (head_dim,) or weight.numpy_dtype() != np.float32 or axis not in (-1, 3) \
            or norm.attributes.get_int("stash_type", 1) != 1:
        return None
    return norm.attributes.get_float("epsilon", 1e-5)


def _splits_last_axis(split: ir.Node) -> bool:
    axis, shape = split.attributes.get_int("axis", 0), split.inputs[0].shape
    return axis == -1 or (shape is not None and axis == len(shape) - 1)


def _packed_source(sources: list[ir.Value], spec: ModelSpec) -> ir.Value | None:
    """The merged projection when Q, K, V are outputs 0, 1, 2 of one last-axis Split of it."""
    split = producer(sources[0], "Split")
    if split is None or list(split.outputs) != list(sources) or not _splits_last_axis(split):
        return None
    sizes = const_ints(split.inputs[1]) if len(split.inputs) > 1 else None
    want = [spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim]
    return split.inputs[0] if sizes == want else None


class PagedAttentionKernel(Rule):
    name = "paged_attention_kernel"
    all_or_none = True  # the kernel's pools are head-major, and an engine has one pool layout

    def __init__(self, spec: ModelSpec):
        self.spec = spec

    def pattern(self, op, q, k, v, cache, past_lens, query_lens, block_tables):
        return op.PagedAttention(q, k, v, cache, past_lens, query_lens, block_tables, _domain=pa.DOMAIN,
                                 _outputs=2, _name="node", _other_inputs=True)

    def check(self, m):
        return shared_rotary(m.q, m.k)

    def rewrite(self, op, m):
        spec, node = self.spec, m.node
        (q, rope), (k, _) = rotary(m.q), rotary(m.k)
        # QK-norm goes into the kernel when Q and K both have it, with one epsilon.
        normed = [_token_major(value, spec.head_dim, norm_ok=True) for value in (q, k)]
        norms = [norm for _, norm in normed]
        epsilon = _head_norm(norms[0], spec.head_dim) if None not in norms else None
        fuse_norms = epsilon is not None and epsilon == _head_norm(norms[1], spec.head_dim)
        sources = []
        for value, found in zip((q, k, m.v), normed + [None]):
            source = found[0] if fuse_norms and found else _token_major(value, spec.head_dim)[0]
            if source is None:  # not produced token-major: transpose it here
                source = op.Reshape(op.Transpose(value, perm=HEADS_TO_TOKENS), op.const([0, 0, -1]))
            sources.append(source)
        packed = _packed_source(sources, spec)
        qkv = [packed, None, None] if packed is not None else sources
        cos, sin, interleaved = rotary_operands(op, rope)
        attrs = {f.name: node.attributes[f.name] for f in dataclasses.fields(pa.PagedAttentionAttrs)}
        extra, positions = {}, [cos, sin]
        if fuse_norms:
            positions += [None, norms[0].inputs[1], norms[1].inputs[1]]  # no positions yet: rotary-tables adds them
            extra["qk_norm_epsilon"] = epsilon
        if len(node.inputs) > len(pa.INPUTS):  # sinks, after every other optional input
            positions += [None] * (SINKS - len(pa.INPUTS) - len(positions)) + [node.inputs[len(pa.INPUTS)]]
        out, cache_out = op.PagedAttention(*qkv, m.cache, m.past_lens, m.query_lens, m.block_tables, *positions,
                                           domain=cpu.DOMAIN, num_outputs=2, rotary_interleaved=interleaved,
                                           **attrs, **extra)
        out.type = node.outputs[0].type
        op.count("rope_fused", int(rope is not None))
        op.count("qkv_packed", int(packed is not None))
        if fuse_norms:
            op.count("qk_norm_fused")
        heads = op.Transpose(op.Reshape(out, op.const([0, 0, spec.num_heads, spec.head_dim])), perm=HEADS_TO_TOKENS)
        return heads, cache_out


class MergedHeads(Rule):
    """Reshape(Transpose(Transpose(Reshape(x, [0, 0, H, D]), p), p), [B, S, H*D]) -> x, for the
    round trip the kernel's token-major output starts and the exporter's head merge ends."""

    name = "heads_merged"

    def __init__(self, spec: ModelSpec):
        self.spec = spec

    def pattern(self, op, x, split, target):
        inner = op.Transpose(op.Reshape(x, split), _name="inner")
        return op.Reshape(op.Transpose(inner, _name="outer"), target)

    def check(self, m):
        spec, width = self.spec, self.spec.num_heads * self.spec.head_dim
        if const_ints(m.split) != [0, 0, spec.num_heads, spec.head_dim]:
            return "the heads are not split off the last axis"
        if perm(m.inner) != HEADS_TO_TOKENS or perm(m.outer) != HEADS_TO_TOKENS:
            return "the transposes do not swap heads and sequence"
        merged = m.outputs[0].shape
        if merged is None or len(merged) != 3 or merged[2] != width:
            return "the heads are not merged back to [B, S, H*D]"
        return None

    def rewrite(self, op, m):
        return m.x


class SwiGLUKernel(Rule):
    """act(gate) * up over the two halves of the merged gate/up projection, act SiLU (as ORT's
    fusions leave it: QuickGelu with alpha 1) or Gemma's tanh-approximated GELU (GeGLU)."""

    name = "swiglu"

    def __init__(self, op_type: str):
        self.op_type = op_type  # QuickGelu or Gelu

    def pattern(self, op, whole, sizes):
        gate, up_half = op.Split(whole, sizes, _outputs=2, _keep=True, _name="split")
        domain = "com.microsoft" if self.op_type == "QuickGelu" else ""
        act = getattr(op, self.op_type)(gate, _domain=domain, _name="act")
        return op.Mul(act, up_half, _commute=True)

    def check(self, m):
        if self.op_type == "QuickGelu" and m.act.attributes.get_float("alpha", 1.702) != 1.0:
            return "QuickGelu is not SiLU (alpha != 1)"
        if self.op_type == "Gelu" and m.act.attributes.get_string("approximate", "none") != "tanh":
            return "the Gelu is exact (erf), not the tanh approximation the kernel computes"
        if not _splits_last_axis(m.split):
            return "the Split is not along the last axis"
        sizes = const_ints(m.sizes)
        if sizes is None or len(sizes) != 2 or sizes[0] != sizes[1]:
            return "gate and up are not equal halves"
        return None

    def rewrite(self, op, m):
        activation = cpu.ACT_GELU_TANH if self.op_type == "Gelu" else cpu.ACT_SILU
        if activation == cpu.ACT_GELU_TANH:
            op.count("geglu")
        return op.SwiGLU(m.whole, domain=cpu.DOMAIN, activation=activation)


class CPUKernels(RulePass):
    name = "cpu-kernels"
    description = "run PagedAttention (with its RoPE and packed QKV) and SwiGLU on llmc's CPU kernels"
    fixed_point = True  # the head round trip is there once the attention rewrite made it

    def __init__(self, block_size: int, kv_dtype: str = "fp32"):
        self.block_size = block_size
        self.kv_dtype = kv_dtype  # the pools' storage; only this kernel reads anything but fp32
        self.lossy = kv_dtype != "fp32"  # the cache rounds what it stores

    def requires(self, model, spec):
        return kernel_library_missing()

    def rules(self, spec: ModelSpec):
        return [PagedAttentionKernel(spec), MergedHeads(spec), SwiGLUKernel("QuickGelu"), SwiGLUKernel("Gelu")]

    def finish(self, model: ir.Model, spec: ModelSpec, counts) -> None:
        if counts.get(PagedAttentionKernel.name):
            shape = ir.Shape(kv_layout.pool_shape(kv_layout.HEAD_MAJOR, io.NUM_BLOCKS, self.block_size,
                                                  spec.num_kv_heads, spec.head_dim, self.kv_dtype))
            element = ir.DataType.from_numpy(kv_layout.numpy_dtype(self.kv_dtype))
            for value in [*model.graph.inputs, *model.graph.outputs]:
                if io.is_cache(value.name):
                    value.shape = shape
                    value.type = ir.TensorType(element)
            kv_layout.set_layout(model, kv_layout.HEAD_MAJOR)


def kernel_library_missing() -> str | None:
    """Why passes that emit llmc.cpu ops cannot run here, or None."""
    if library_path() is None:
        return f"llmc's CPU kernel library is not built ({MISSING_HINT})"
    return None
