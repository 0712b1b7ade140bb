"""packed-matmul: constant-weight MatMuls onto llmc's panel-packed GEMM (llmc.plugins.cpu).

It runs last, once the layout pass has settled which weights are stored transposed. Each weight
is stored as column panels [ceil(N/32), K, 32]; a panel streams once while up to 12 rows
accumulate in registers, so a decode step of 8 or 16 rows costs about one read of the weights
(ORT's own GEMM measured slower there: docs/attention_cpu.md). Two folds ride on it:
- skip_rmsnorm_matmul: a SkipSimplifiedLayerNormalization whose normed output feeds only a
  PackedMatMul -> `llmc.cpu::SkipRMSNormMatMul(x, skip, gamma, w)`, returning the product and the
  residual sum: the norm is computed on the way into the GEMM;
- swiglu_matmul: `llmc.cpu::SwiGLU` feeding only a PackedMatMul (the down projection) ->
  `llmc.cpu::SwiGLUMatMul(gate_up, w)`.
The folds remove nodes and their dispatch, not arithmetic.

Weights quantize-weights stored in fewer bits are lowered here too: `MatMul(x,
DequantizeLinear(q, scale[, zero_point]))` -> PackedMatMul over llmc's blockwise int8/int6/int4 format,
`MatMul(x, Cast(w16))` -> PackedMatMul over 16-bit panels (llmc.plugins.cpu.quant), the node's
`weight_format` attribute saying which; the folds carry it along.
"""

from __future__ import annotations

import numpy as np

from llmc.contract.model_spec import ModelSpec
from llmc.contract.options import QUANT_BLOCK_SIZES
from llmc.passes.cpu_kernels import kernel_library_missing
from llmc.passes import lazy
from llmc.passes.graph import tensor
from llmc.passes.quantize_weights import BITS_KEY, INT_TYPES, METADATA_KEY
from llmc.passes.quantize_weights import SIXTEEN_BIT as STORED_16BIT
from llmc.passes.rewrite import Rule, RulePass
from llmc.plugins import cpu
from llmc.plugins.cpu import quant


class PackedMatMul(Rule):
    name = "packed_matmul"

    def pattern(self, op, x, w):
        return op.MatMul(x, w)

    def check(self, m):
        w = tensor(m.w)
        if w is None:
            return "the weight is not a constant initializer"
        if len(w.dims) != 2 or w.numpy_dtype() != np.float32:
            return f"the weight is {len(w.dims)}-D {w.numpy_dtype()}, not 2-D float32"
        if m.x.shape is not None and len(m.x.shape) < 2:
            return "the activation is 1-D"
        return None

    def rewrite(self, op, m):
        w = tensor(m.w)
        k, n = w.dims
        packed = panels(np.float32, (k, cpu.PANEL), k, n, lambda a, b: cpu.pack_weight(w.columns(a, b)))
        return op.PackedMatMul(m.x, op.initializer(packed, f"{m.w.name}.packed"), domain=cpu.DOMAIN, n=n)


def panels(dtype, panel_shape: tuple[int, ...], k: int, n: int, pack, flat: bool = False) -> lazy.Lazy:
    """A packed [k, n] weight: ceil(n / PANEL) panels of `panel_shape` (`flat`: one 1-D blob of them),
    made and written a range of panels at a time, each range the float32 columns of CHUNK_BYTES:
    `pack(first column, end column)` packs the panels those columns fill."""
    count = -(-n // cpu.PANEL)
    shape = (count * int(np.prod(panel_shape)),) if flat else (count, *panel_shape)
    return lazy.Lazy(dtype, shape, lambda a, b: pack(a * cpu.PANEL, min(b * cpu.PANEL, n)), units=count,
                     step=lazy.float_step(k * cpu.PANEL))


# What an initializer's numpy dtype says about the format of a weight DequantizeLinear or Cast
# reads: the inverse of the types quantize-weights stores them in (an 8-bit type may hold int6).
BITS = {np.dtype(kind): bits for (bits, _), kind in INT_TYPES.items() if bits != 6}
SIXTEEN_BIT = {np.dtype(kind): name for name, kind in STORED_16BIT.items()}


class QuantizedPackedMatMul(Rule):
    """MatMul(x, DequantizeLinear(q, scale[, zero_point], axis=0, block_size)) -> PackedMatMul over
    llmc's blockwise integer format."""

    name = "packed_matmul_quantized"

    def pattern(self, op, x, q, scale):
        return op.MatMul(x, op.DequantizeLinear(q, scale, _other_inputs=True, _name="dq"))

    def check(self, m):
        q, scale = tensor(m.q), tensor(m.scale)
        zero_point = m.dq.inputs[2] if len(m.dq.inputs) > 2 else None
        if q is None or scale is None or (zero_point is not None and tensor(zero_point) is None):
            return "the quantized weight, its scales or zero points are not constant initializers"
        bits = BITS.get(q.numpy_dtype())
        if bits is None or len(q.dims) != 2:
            return f"the quantized weight is {len(q.dims)}-D {q.numpy_dtype()}, not 2-D int4/uint4/int8/uint8"
        block = m.dq.attributes.get_int("block_size", 0)
        if m.dq.attributes.get_int("axis", 1) != 0 or block not in QUANT_BLOCK_SIZES:
            return f"not blocks along K of {'/'.join(map(str, QUANT_BLOCK_SIZES))} (axis 0)"
        if scale.numpy_dtype() != np.float32 or scale.dims != (q.dims[0] // block, q.dims[1]):
            return f"the scales are {scale.numpy_dtype()} {list(scale.dims)}, not float32 [K / block, N]"
        return None

    def rewrite(self, op, m):
        q, scale = tensor(m.q), tensor(m.scale)
        zero_point = tensor(m.dq.inputs[2]) if len(m.dq.inputs) > 2 else None
        bits, block = BITS[q.numpy_dtype()], m.dq.attributes.get_int("block_size", 0)
        integers = np.uint8 if zero_point is not None else np.int8
        if bits == 8:  # int6 comes as int8: stored in the fewest bits that hold it, the same integers
            hint = m.q.metadata_props.get(BITS_KEY)  # quantize-weights knows; anything else is looked at
            bits = int(hint) if hint else quant.narrowest_bits(
                q.numpy().astype(integers), None if zero_point is None else zero_point.numpy().astype(np.uint8))
        k, n = q.dims

        def pack(a, b):
            zp = None if zero_point is None else zero_point.columns(a, b).astype(np.uint8)
            return quant.pack_quantized(q.columns(a, b).astype(integers), scale.columns(a, b), zp, bits, block)

        size = quant.quantized_bytes(k, n, bits, block, zero_point is not None)
        blob = panels(np.uint8, (size // -(-n // cpu.PANEL),), k, n, pack, flat=True)
        return op.PackedMatMul(m.x, op.initializer(blob, f"{m.q.name}.packed"), domain=cpu.DOMAIN, n=n,
                               weight_format=quant.WEIGHT_FORMATS[f"int{bits}"], block_size=block,
                               zero_points=int(zero_point is not None))


class SixteenBitPackedMatMul(Rule):
    """MatMul(x, Cast(w16, to=float)) -> PackedMatMul over 16-bit panels (fp32 arithmetic)."""

    name = "packed_matmul_16bit"

    def pattern(self, op, x, w):
        return op.MatMul(x, op.Cast(w, _name="cast"))

    def check(self, m):
        w = tensor(m.w)
        if w is None or len(w.dims) != 2 or w.numpy_dtype() not in SIXTEEN_BIT:
            return "the weight is not a constant 2-D bfloat16/float16 initializer"
        return None

    def rewrite(self, op, m):
        w = tensor(m.w)
        name, (k, n) = SIXTEEN_BIT[w.numpy_dtype()], w.dims
        packed = panels(np.uint16, (k, cpu.PANEL), k, n,
                        lambda a, b: quant.pack_16bit(w.columns(a, b).astype(np.float32), name))
        return op.PackedMatMul(m.x, op.initializer(packed, f"{m.w.name}.packed"), domain=cpu.DOMAIN, n=n,
                               weight_format=quant.WEIGHT_FORMATS[name])


def _gemm_attributes(node) -> dict:
    """The weight's description a packed GEMM carries (n, format, block size...), for a fold to keep."""
    return {a.name: a for a in node.attributes.values()}


class SkipRMSNormMatMul(Rule):
    name = "skip_rmsnorm_matmul"

    def pattern(self, op, x, skip, gamma, w):
        normed, _, _, total = op.SkipSimplifiedLayerNormalization(x, skip, gamma, _domain="com.microsoft",
                                                                  _outputs=4, _name="norm")
        return op.PackedMatMul(normed, w, _domain=cpu.DOMAIN, _name="matmul"), total

    def rewrite(self, op, m):
        return op.SkipRMSNormMatMul(m.x, m.skip, m.gamma, m.w, domain=cpu.DOMAIN, num_outputs=2,
                                    **_gemm_attributes(m.matmul),
                                    epsilon=m.norm.attributes.get_float("epsilon", 1e-5))


class SwiGLUMatMul(Rule):
    name = "swiglu_matmul"

    def pattern(self, op, gate_up, w):
        return op.PackedMatMul(op.SwiGLU(gate_up, _domain=cpu.DOMAIN, _name="act"), w, _domain=cpu.DOMAIN,
                               _name="matmul")

    def rewrite(self, op, m):
        return op.SwiGLUMatMul(m.gate_up, m.w, domain=cpu.DOMAIN, **_gemm_attributes(m.matmul),
                               activation=m.act.attributes.get_int("activation", cpu.ACT_SILU))


class PackedExperts(Rule):
    """llmc.cpu::Experts over the stacked weights as the checkpoint holds them -> over each expert
    packed as a PackedMatMul weight (packed=1), so its two products run on the same tiles."""

    name = "packed_experts"

    def __init__(self):
        self.records: dict[str, dict] = {}  # the MXFP4 stacks, for the manifest's quantization table

    def pattern(self, op, x, ids, weights, gate_up, down):
        return op.Experts(x, ids, weights, gate_up, down, _domain=cpu.DOMAIN, _name="experts", _other_inputs=True)

    def match(self, node):
        m = super().match(node)
        return m if m is not None and not m.experts.attributes.get_int("packed", 0) else None

    def check(self, m):
        stacks = [tensor(m.gate_up), tensor(m.down)]
        if any(w is None or len(w.dims) != 3 or w.numpy_dtype() != np.float32 for w in stacks):
            return "the expert weights are not constant 3-D float32 initializers"
        return None

    def rewrite(self, op, m):
        if all(isinstance(tensor(v), lazy.Mxfp4Stack) for v in (m.gate_up, m.down)):
            return self._mxfp4(op, m)
        stacks = {}
        for value in (m.gate_up, m.down):
            w = tensor(value)
            experts, n, k = w.dims
            stacks[value.name] = op.initializer(lazy.Lazy(
                np.float32, (experts, -(-n // cpu.PANEL), k, cpu.PANEL),
                lambda a, b, w=w: cpu.pack_experts(w.rows(a, b))), f"{value.name}.packed")
        return op.like(m.experts, m.x, m.ids, m.weights, *stacks.values(), *m.experts.inputs[5:], packed=1)

    def _mxfp4(self, op, m):
        """Stacks a checkpoint stores in MXFP4: each expert's codes and scales as they are, in the
        panels the kernel reads (weight_format mxfp4)."""
        blobs = []
        for value in (m.gate_up, m.down):
            w = tensor(value)
            experts, n, k = w.dims
            # stored as released: the checkpoint's own values, no error
            self.records[f"{value.name}.mxfp4"] = {"role": "experts", "format": "mxfp4", "shape": [experts, n, k],
                                                   "relative_error": 0.0}
            blobs.append(op.initializer(lazy.Lazy(
                np.uint8, (experts, quant.mxfp4_bytes(k, n)),
                lambda a, b, w=w: quant.pack_mxfp4_experts(*w.codes(a, b))), f"{value.name}.mxfp4"))
        op.count(MXFP4_EXPERTS)
        return op.like(m.experts, m.x, m.ids, m.weights, *blobs, *m.experts.inputs[5:], packed=1,
                       weight_format=quant.WEIGHT_FORMATS["mxfp4"], block_size=quant.MXFP4_BLOCK, zero_points=0)


MXFP4_EXPERTS = "packed_experts_mxfp4"  # counted beside packed_experts: the kernel's activations are quantized


class QuantizedPackedExperts(Rule):
    """llmc.cpu::Experts over two `DequantizeLinear(q, scale[, zero_point], axis=2, block_size)`
    stacks (quantize-weights' QuantizeExperts) -> over each expert's blob in llmc's blockwise
    format, the experts' blobs one after another ([E, bytes] uint8)."""

    name = "packed_experts_quantized"

    def pattern(self, op, x, ids, weights, q_gate_up, s_gate_up, q_down, s_down):
        return op.Experts(x, ids, weights,
                          op.DequantizeLinear(q_gate_up, s_gate_up, _other_inputs=True, _name="dq_gate_up"),
                          op.DequantizeLinear(q_down, s_down, _other_inputs=True, _name="dq_down"),
                          _domain=cpu.DOMAIN, _name="experts", _other_inputs=True)

    @staticmethod
    def _stacks(m):
        """(q, scale, zero point or None, (bits, block, asymmetric)) of gate_up and of down."""
        for dq, q, scale in ((m.dq_gate_up, m.q_gate_up, m.s_gate_up), (m.dq_down, m.q_down, m.s_down)):
            zero_point = tensor(dq.inputs[2]) if len(dq.inputs) > 2 else None
            q, scale = tensor(q), tensor(scale)
            bits = None if q is None else BITS.get(q.numpy_dtype())
            if bits == 8:  # int6 lives in int8: quantize-weights' hint says which
                bits = int(dq.inputs[0].metadata_props.get(BITS_KEY, 8))
            yield q, scale, zero_point, (bits, dq.attributes.get_int("block_size", 0), len(dq.inputs) > 2), \
                dq.attributes.get_int("axis", 1)

    def check(self, m):
        formats = set()
        for q, scale, zero_point, (bits, block, asymmetric), axis in self._stacks(m):
            if q is None or scale is None or (asymmetric and zero_point is None):
                return "the quantized experts, their scales or zero points are not constant initializers"
            if bits is None or len(q.dims) != 3 or axis != 2 or block not in QUANT_BLOCK_SIZES or (
                    scale.dims != (*q.dims[:2], q.dims[2] // block)):
                return "not 3-D int4/uint4/int8/uint8 stacks in blocks along K (axis 2) with float32 scales"
            formats.add((bits, block, asymmetric))
        return None if len(formats) == 1 else "gate_up and down are in different formats; the kernel takes one"

    def rewrite(self, op, m):
        stacks = []
        for q, scale, zero_point, (bits, block, asymmetric), _ in self._stacks(m):
            experts, n, k = q.dims
            integers = np.uint8 if asymmetric else np.int8

            def pack(a, b, q=q, scale=scale, zero_point=zero_point, bits=bits, block=block, integers=integers):
                zp = None if zero_point is None else zero_point.rows(a, b).astype(np.uint8)
                return quant.pack_quantized_experts(q.rows(a, b).astype(integers), scale.rows(a, b), zp, bits, block)

            size = quant.quantized_bytes(k, n, bits, block, asymmetric)
            stacks.append(op.initializer(lazy.Lazy(np.uint8, (experts, size), pack), f"{m.experts.name}.{n}x{k}.packed"))
        return op.like(m.experts, m.x, m.ids, m.weights, *stacks, *m.experts.inputs[5:], packed=1,
                       weight_format=quant.WEIGHT_FORMATS[f"int{bits}"], block_size=block, zero_points=int(asymmetric))


class PackedMatMuls(RulePass):
    name = "packed-matmul"
    description = ("run constant-weight MatMuls on llmc's panel-packed kernel (weights stored packed), "
                   "a residual add + RMSNorm or a SwiGLU before one folded in")
    fixed_point = True  # the folds match the PackedMatMuls the first sweep made

    def requires(self, model, spec):
        return kernel_library_missing()

    def apply(self, model, spec):
        result = super().apply(model, spec)
        # The integer kernels also quantize the activations (per row and block, int8): lossy where they run.
        self.lossy = bool(result.counts.get(QuantizedPackedMatMul.name) or result.counts.get(QuantizedPackedExperts.name)
                          or result.counts.get(MXFP4_EXPERTS))
        return result

    def rules(self, spec: ModelSpec):
        self.experts = PackedExperts()
        return [PackedMatMul(), QuantizedPackedMatMul(), SixteenBitPackedMatMul(), SkipRMSNormMatMul(), SwiGLUMatMul(),
                self.experts, QuantizedPackedExperts()]

    def finish(self, model, spec, counts) -> None:
        if self.experts.records:
            model.meta.setdefault(METADATA_KEY, {}).update(self.experts.records)
