"""Rewrite onto llmc's own CPU kernels (`llmc.cpu` custom ops, llmc/kernels/).

ONNX Runtime has no paged attention on CPU, and composing one from standard ops costs a
gathered copy of every row's blocks per layer plus ~16 small nodes (docs/attention_cpu.md).
The kernels take the tensors as the projections produce them:

- paged_attention: `llmc::PagedAttention` -> `llmc.cpu::PagedAttention`, which writes the step's
  K/V into the pool and attends over the row's blocks where they lie. Its pools are head-major
  (llmc/kv_layout.py), so it takes every layer or none and the engine says so. Its inputs are
  token-major ([B, S, H*D], what the projection MatMul writes), so the Reshape/Transpose pairs
  around the op go. Two foldings ride along and are counted on their own:
  - rope_fused: Q and K's `RotaryEmbedding` (same cos/sin) is applied inside the kernel;
  - qkv_packed: when Q, K and V are the three parts of one Split of the merged projection,
    the kernel reads the unsplit tensor and the Split's copy goes.
- swiglu: `QuickGelu(gate) * up` over the two halves of the merged gate/up projection ->
  `llmc.cpu::SwiGLU(gate_up)`: no Split copy, one pass over the row.

A second pass, packed-matmul, runs last (after the layout pass has settled which weights are
stored transposed) and moves every constant-weight MatMul onto `llmc.cpu::PackedMatMul`, its
weight stored as column panels [ceil(N/32), K, 32]. Each panel streams once while up to 12 rows
accumulate in registers, so a decode step of 8 or 16 rows costs about one read of the weights;
ORT's MLAS GEMM was measured 13-23% slower there (docs/attention_cpu.md).

A third pass, lossless-weights (on with `llmc build --lossless-weights`), adds to each packed GEMM
a copy of its weight in a lossless format 12.5% smaller (llmc/kernels/lossless.py); the kernel
reads it for steps of up to 8 rows, where the weight stream bounds the time, and gives the same
bits as the fp32 weight. It costs the copy's memory: the engine holds both.

Runs only where the kernel library is built (`llmc.kernels.library_path()`); otherwise the
pass does nothing and says why, and ort-lower composes standard ops as before.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from llmc import kernels, kv_layout
from llmc.ir_builder import OpBuilder
from llmc.kernels import lossless
from llmc.passes.base import (BuildContext, PassResult, RewriteRule, RulePass, const_ints, producer,
                              take_graph_output, weight)
from llmc.passes.cleanup import remove_dead_code
from llmc.plugins import paged_attention as pa

HEADS_TO_TOKENS = (0, 2, 1, 3)  # [B, H, S, D] <-> [B, S, H, D]


def _token_major(value: ir.Value, head_dim: int) -> ir.Value | None:
    """X when `value` is Transpose(Reshape(X, [B, S, H, D]), perm=[0, 2, 1, 3]) with X 3-D: the
    heads split off X's last axis, which is the layout the kernel reads."""
    transpose = producer(value, "Transpose")
    if transpose is None or tuple(transpose.attributes.get_ints("perm", ())) != HEADS_TO_TOKENS:
        return None
    reshape = producer(transpose.inputs[0], "Reshape")
    if reshape is None:
        return None
    source, split = reshape.inputs[0], reshape.outputs[0].shape
    if source.shape is None or len(source.shape) != 3 or split is None or len(split) != 4 or split[3] != head_dim:
        return None
    return source


def _rope(value: ir.Value):
    """(inner value, RotaryEmbedding node) when `value` is a RotaryEmbedding's output over 4-D
    [B, H, S, D] with per-token cos/sin (no position_ids), else (value, None)."""
    node = producer(value, "RotaryEmbedding")
    if node is None or (len(node.inputs) > 3 and node.inputs[3] is not None):
        return value, None
    return node.inputs[0], node


def _rope_attrs(node: ir.Node) -> tuple[int, int]:
    return node.attributes.get_int("interleaved", 0), node.attributes.get_int("rotary_embedding_dim", 0)


def _splits_last_axis(split: ir.Node) -> bool:
    axis, shape = split.attributes.get_int("axis", 0), split.inputs[0].shape
    return axis == -1 or (shape is not None and axis == len(shape) - 1)


def _packed_source(sources, ctx: BuildContext) -> ir.Value | None:
    """The merged projection when Q, K, V are outputs 0, 1, 2 of one last-axis Split of it."""
    split = producer(sources[0], "Split")
    if split is None or list(split.outputs) != list(sources) or not _splits_last_axis(split):
        return None
    spec = ctx.spec
    sizes = const_ints(split.inputs[1]) if len(split.inputs) > 1 else None
    want = [spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim]
    return split.inputs[0] if sizes == want else None


def _hand_over(graph: ir.Graph, old: ir.Value, new: ir.Value, suffix: str) -> None:
    """`new` takes `old`'s place: its type and shape, its consumers and its graph-output slot."""
    new.name, new.type, new.shape = f"{old.name}_{suffix}", old.type, old.shape
    if old.is_graph_output():  # e.g. the LM head of an all-positions engine
        take_graph_output(graph, old, new)
    ir.convenience.replace_all_uses_with(old, new)


class PagedAttentionKernel(RewriteRule):
    name = "paged_attention"

    def match(self, node, ctx: BuildContext):
        if node.domain != pa.DOMAIN or node.op_type != pa.OP_TYPE:
            return None
        q, rope_q = _rope(node.inputs[0])
        k, rope_k = _rope(node.inputs[1])
        return {"node": node, "q": q, "k": k, "v": node.inputs[2], "rope_q": rope_q, "rope_k": rope_k}

    def check(self, m, ctx: BuildContext):
        reason = self._check_layer(m)
        if reason is not None:
            return reason
        # The kernel's pools are head-major (llmc/kv_layout.py) and an engine has one layout:
        # every layer moves onto the kernel, or none does.
        for node in m["node"].graph:
            other = self.match(node, ctx) if node is not m["node"] else None
            reason = self._check_layer(other) if other is not None else None
            if reason is not None:
                return f"{node.name} cannot use the kernel ({reason}), and all layers share one pool layout"
        return None

    @staticmethod
    def _check_layer(m) -> str | None:
        rope_q, rope_k = m["rope_q"], m["rope_k"]
        if (rope_q is None) != (rope_k is None):
            return "only one of Q and K has a RotaryEmbedding"
        if rope_q is not None:
            if list(rope_q.inputs[1:3]) != list(rope_k.inputs[1:3]):
                return "Q and K rotate with different cos/sin"
            if _rope_attrs(rope_q) != _rope_attrs(rope_k):
                return "Q and K's RotaryEmbedding attributes differ"
        return None

    def rewrite(self, m, ctx: BuildContext, model: ir.Model):
        node, graph = m["node"], model.graph
        spec = ctx.spec
        ops = OpBuilder(name_prefix=f"{node.name}_kernel_")
        sources = []
        for value in (m["q"], m["k"], m["v"]):
            source = _token_major(value, spec.head_dim)
            if source is None:  # not produced token-major: transpose it here
                source = ops.Reshape(ops.Transpose(value, perm=HEADS_TO_TOKENS), ops.const([0, 0, -1]))
            sources.append(source)
        packed = _packed_source(sources, ctx)
        qkv = [packed, None, None] if packed is not None else sources
        rope = m["rope_q"]
        cos_sin = list(rope.inputs[1:3]) if rope is not None else [None, None]
        interleaved, rotary_dim = _rope_attrs(rope) if rope is not None else (0, 0)
        if rotary_dim:
            # Partial rotation: the kernel learns the rotated width from cos's last dim.
            cos_sin = [ops.Slice(v, ops.const([0]), ops.const([rotary_dim // 2]), ops.const([-1]))
                       for v in cos_sin]
        attrs = {f.name: node.attributes[f.name].value for f in dataclasses.fields(pa.PagedAttentionAttrs)}
        kernel = ir.Node(kernels.DOMAIN, "PagedAttention", [*qkv, *node.inputs[3:7], *cos_sin],
                         attributes=[ir.convenience.convert_attribute(k, v) for k, v in
                                     {**attrs, "rotary_interleaved": interleaved}.items()],
                         num_outputs=2, name=f"{node.name}_kernel")
        out, cache_out = kernel.outputs
        out.name = f"{node.outputs[0].name}_tokens"
        out.type = node.outputs[0].type
        graph.insert_before(node, [*ops.nodes, kernel])

        old_out, old_cache = node.outputs
        merged = self._merged_heads(old_out, spec)
        if merged is not None:
            ir.convenience.replace_all_uses_with(merged, out)
            reshape = merged.producer()
            graph.remove([reshape, reshape.inputs[0].producer()], safe=True)
        else:
            back = OpBuilder(name_prefix=f"{node.name}_kernel_out_")
            heads = back.Transpose(back.Reshape(out, back.const([0, 0, spec.num_heads, spec.head_dim])),
                                   perm=HEADS_TO_TOKENS)
            graph.insert_after(kernel, back.nodes)
            ir.convenience.replace_all_uses_with(old_out, heads)
        take_graph_output(graph, old_cache, cache_out)
        graph.remove(node, safe=True)
        model.opset_imports[kernels.DOMAIN] = kernels.VERSION
        return {"rope_fused": int(rope is not None), "qkv_packed": int(packed is not None)}

    @staticmethod
    def _merged_heads(value: ir.Value, spec) -> ir.Value | None:
        """Reshape(Transpose(value, [0, 2, 1, 3]), [B, S, H*D]): the heads merged back, which is
        exactly what the kernel writes."""
        uses = value.uses()
        if len(uses) != 1:
            return None
        transpose = uses[0].node
        if transpose.op_type != "Transpose" or tuple(transpose.attributes.get_ints("perm", ())) != HEADS_TO_TOKENS:
            return None
        t_uses = transpose.outputs[0].uses()
        if len(t_uses) != 1 or t_uses[0].node.op_type != "Reshape":
            return None
        merged = t_uses[0].node.outputs[0]
        if merged.shape is None or len(merged.shape) != 3 or merged.shape[2] != spec.num_heads * spec.head_dim:
            return None
        return merged


class SwiGLUKernel(RewriteRule):
    name = "swiglu"

    def match(self, node, ctx: BuildContext):
        if node.op_type != "Mul" or node.domain not in ("", "ai.onnx"):
            return None
        for slot in (0, 1):
            act = node.inputs[slot].producer() if node.inputs[slot] is not None else None
            if act is not None and act.op_type == "QuickGelu" and act.domain == "com.microsoft":
                return {"mul": node, "act": act, "gate": act.inputs[0], "up": node.inputs[1 - slot]}
        return None

    def check(self, m, ctx: BuildContext):
        if m["act"].attributes.get_float("alpha", 1.702) != 1.0:
            return "QuickGelu is not SiLU (alpha != 1)"
        split = producer(m["gate"], "Split")
        if split is None or list(split.outputs) != [m["gate"], m["up"]]:
            return "gate and up are not the two halves of one Split"
        if not _splits_last_axis(split):
            return "the Split is not along the last axis"
        sizes = const_ints(split.inputs[1]) if len(split.inputs) > 1 else None
        if sizes is None or len(sizes) != 2 or sizes[0] != sizes[1]:
            return "gate and up are not equal halves"
        if len(m["act"].outputs[0].uses()) != 1:
            return "SiLU(gate) has other consumers"
        m["whole"] = split.inputs[0]
        return None

    def rewrite(self, m, ctx: BuildContext, model: ir.Model):
        mul = m["mul"]
        kernel = ir.Node(kernels.DOMAIN, "SwiGLU", [m["whole"]], name=f"{mul.name}_swiglu")
        out = kernel.outputs[0]
        out.name, out.type, out.shape = f"{mul.outputs[0].name}_swiglu", mul.outputs[0].type, mul.outputs[0].shape
        model.graph.insert_before(mul, kernel)
        ir.convenience.replace_all_uses_with(mul.outputs[0], out)
        model.graph.remove(mul, safe=True)
        model.opset_imports[kernels.DOMAIN] = kernels.VERSION


def pack_weight(w: np.ndarray) -> np.ndarray:
    """[K, N] -> column panels [ceil(N / PANEL), K, PANEL], the last one zero-padded."""
    k, n = w.shape
    panels = -(-n // kernels.PANEL)
    padded = np.zeros((k, panels * kernels.PANEL), np.float32)
    padded[:, :n] = w
    return np.ascontiguousarray(padded.reshape(k, panels, kernels.PANEL).transpose(1, 0, 2))


class PackedMatMul(RewriteRule):
    name = "packed_matmul"

    def match(self, node, ctx: BuildContext):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            return None
        return {"matmul": node, "weight": weight(node.inputs[1])}

    def check(self, m, ctx: BuildContext):
        w, x = m["weight"], m["matmul"].inputs[0]
        if w is None:
            return "the weight is not a constant initializer"
        if w.ndim != 2 or w.dtype != np.float32:
            return f"the weight is {w.ndim}-D {w.dtype}, not 2-D float32"
        if x.shape is not None and len(x.shape) < 2:
            return "the activation is 1-D"
        return None

    def rewrite(self, m, ctx: BuildContext, model: ir.Model):
        matmul, w = m["matmul"], m["weight"]
        n = w.shape[1]
        packed = ir.Value(name=f"{matmul.inputs[1].name}.packed", const_value=ir.tensor(pack_weight(w)))
        model.graph.register_initializer(packed)
        kernel = ir.Node(kernels.DOMAIN, "PackedMatMul", [matmul.inputs[0], packed],
                         attributes=[ir.AttrInt64("n", n)], name=f"{matmul.name}_packed")
        model.graph.insert_before(matmul, kernel)
        _hand_over(model.graph, matmul.outputs[0], kernel.outputs[0], "packed")
        original = matmul.inputs[1]
        model.graph.remove(matmul, safe=True)
        if not original.uses() and not original.is_graph_output():  # drop it now: build RSS stays flat
            model.graph.initializers.pop(original.name, None)
        model.opset_imports[kernels.DOMAIN] = kernels.VERSION


class SkipRMSNormMatMul(RewriteRule):
    """SkipSimplifiedLayerNormalization whose normed output feeds only a PackedMatMul -> one
    `llmc.cpu::SkipRMSNormMatMul(x, skip, gamma, w)` returning (product, residual sum). The norm
    is a sliver of arithmetic; what goes is a node and its dispatch (~10 us each at batch 1,
    twice per layer)."""

    name = "skip_rmsnorm_matmul"

    def match(self, node, ctx: BuildContext):
        if node.domain != kernels.DOMAIN or node.op_type != "PackedMatMul":
            return None
        norm = node.inputs[0].producer() if node.inputs[0] is not None else None
        if norm is None or norm.op_type != "SkipSimplifiedLayerNormalization" or norm.domain != "com.microsoft":
            return None
        return {"matmul": node, "norm": norm}

    def check(self, m, ctx: BuildContext):
        norm = m["norm"]
        normed, *stats = norm.outputs[:3]
        if len(normed.uses()) != 1 or normed.is_graph_output():
            return "the normed value has other consumers"
        if any(v.uses() or v.is_graph_output() for v in stats):
            return "the norm's mean or inverse std-dev is used"
        if len(norm.inputs) > 3 and norm.inputs[3] is not None:
            return "the norm has a bias input"
        return None

    def rewrite(self, m, ctx: BuildContext, model: ir.Model):
        matmul, norm = m["matmul"], m["norm"]
        fused = ir.Node(kernels.DOMAIN, "SkipRMSNormMatMul", [*norm.inputs[:3], matmul.inputs[1]],
                        attributes=[matmul.attributes["n"],
                                    ir.AttrFloat32("epsilon", norm.attributes.get_float("epsilon", 1e-5))],
                        num_outputs=2, name=f"{matmul.name}_normed")
        model.graph.insert_before(norm, fused)
        _hand_over(model.graph, matmul.outputs[0], fused.outputs[0], "fused")
        if len(norm.outputs) > 3:  # the residual sum
            _hand_over(model.graph, norm.outputs[3], fused.outputs[1], "fused")
        model.graph.remove([matmul, norm], safe=True)


class SwiGLUMatMul(RewriteRule):
    """`llmc.cpu::SwiGLU` feeding only a PackedMatMul (the down projection) ->
    `llmc.cpu::SwiGLUMatMul(gate_up, w)`: the activation computed on the way into the GEMM, one
    node and its dispatch fewer per layer."""

    name = "swiglu_matmul"

    def match(self, node, ctx: BuildContext):
        if node.domain != kernels.DOMAIN or node.op_type != "PackedMatMul":
            return None
        act = node.inputs[0].producer() if node.inputs[0] is not None else None
        if act is None or act.op_type != "SwiGLU" or act.domain != kernels.DOMAIN:
            return None
        return {"matmul": node, "act": act}

    def check(self, m, ctx: BuildContext):
        out = m["act"].outputs[0]
        if len(out.uses()) != 1 or out.is_graph_output():
            return "the activation has other consumers"
        return None

    def rewrite(self, m, ctx: BuildContext, model: ir.Model):
        matmul, act = m["matmul"], m["act"]
        fused = ir.Node(kernels.DOMAIN, "SwiGLUMatMul", [act.inputs[0], matmul.inputs[1]],
                        attributes=[matmul.attributes["n"]], name=f"{matmul.name}_activated")
        model.graph.insert_before(act, fused)
        _hand_over(model.graph, matmul.outputs[0], fused.outputs[0], "fused")
        model.graph.remove([matmul, act], safe=True)


class LosslessWeight(RewriteRule):
    """A packed GEMM (PackedMatMul, SkipRMSNormMatMul, SwiGLUMatMul) gets its weight's lossless
    copy as the optional last input."""

    name = "lossless_weight"
    WEIGHT_INPUT = {"PackedMatMul": 1, "SkipRMSNormMatMul": 3, "SwiGLUMatMul": 1}

    def match(self, node, ctx: BuildContext):
        index = self.WEIGHT_INPUT.get(node.op_type) if node.domain == kernels.DOMAIN else None
        if index is None or len(node.inputs) != index + 1:  # not a packed GEMM, or already done
            return None
        return {"node": node, "weight": node.inputs[index]}

    def check(self, m, ctx: BuildContext):
        w = weight(m["weight"])
        if w is None:
            return "the weight is not a constant initializer"
        if (why := lossless.supports(w)) is not None:
            return why
        m["copy"] = lossless.encode(w)
        share = lossless.exceptions(m["copy"], w.shape[1], m["node"].attributes["n"].as_int()) / w.size
        if share > lossless.MAX_EXCEPTION_SHARE:
            return f"{share:.1%} of its floats have a top byte outside their panel's 16 commonest"
        return None

    def rewrite(self, m, ctx: BuildContext, model: ir.Model):
        node, w = m["node"], m["weight"]
        copy = ir.Value(name=f"{w.name}.lossless", const_value=ir.tensor(m["copy"]))
        model.graph.register_initializer(copy)
        node.resize_inputs(len(node.inputs) + 1)
        node.replace_input_with(len(node.inputs) - 1, copy)


class _KernelPass(RulePass):
    """A rule pass whose rewrites target llmc's kernel library: it stands aside without it."""

    def run(self, model: ir.Model, ctx: BuildContext):
        if kernels.library_path() is None:
            return PassResult(False, {}, [f"llmc's CPU kernel library is not built ({kernels.MISSING_HINT})"])
        return super().run(model, ctx)

    def finish(self, model: ir.Model, ctx: BuildContext, counts) -> None:
        if counts:
            remove_dead_code(model)


class CPUKernels(_KernelPass):
    name = "cpu-kernels"
    description = "run PagedAttention (with its RoPE and packed QKV) and SwiGLU on llmc's CPU kernels"
    rules = (PagedAttentionKernel(), SwiGLUKernel())

    def finish(self, model: ir.Model, ctx: BuildContext, counts) -> None:
        super().finish(model, ctx, counts)
        if counts.get(PagedAttentionKernel.name):
            spec = ctx.spec
            shape = ir.Shape(kv_layout.pool_shape(kv_layout.HEAD_MAJOR, "num_blocks", ctx.block_size,
                                                  spec.num_kv_heads, spec.head_dim))
            for value in [*model.graph.inputs, *model.graph.outputs]:
                if value.name.startswith(("kv_cache.", "kv_cache_out.")):
                    value.shape = shape
            model.metadata_props[kv_layout.METADATA_KEY] = kv_layout.HEAD_MAJOR


class PackedMatMuls(_KernelPass):
    name = "packed-matmul"
    description = ("run constant-weight MatMuls on llmc's panel-packed kernel (weights stored packed), "
                   "a residual add + RMSNorm or a SwiGLU before one folded in")
    rules = (PackedMatMul(), SkipRMSNormMatMul(), SwiGLUMatMul())
    fixed_point = True  # the fold matches the PackedMatMuls the first sweep made


class LosslessWeights(_KernelPass):
    name = "lossless-weights"
    description = ("with --lossless-weights: also store each packed weight in a lossless format 12.5% smaller, "
                   "which decode steps of up to 8 rows read")
    rules = (LosslessWeight(),)

    def run(self, model: ir.Model, ctx: BuildContext):
        if not ctx.lossless_weights:  # off by default: not a near-miss for --explain to list
            return PassResult(False, {}, [])
        return super().run(model, ctx)
