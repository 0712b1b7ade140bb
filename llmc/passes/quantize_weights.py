"""quantize-weights (`llmc build --quant int8|int4`, `--weight-dtype bf16|fp16`): weights stored
in fewer bits, in standard ONNX, so every backend reads the same graph.

- A constant-weight MatMul becomes `MatMul(x, DequantizeLinear(q, scale[, zero_point], axis=0,
  block_size=B))` for int8/int4 (the Q/DQ form TensorRT consumes and ONNX Runtime runs), or
  `MatMul(x, Cast(w16, to=float))` for bf16/fp16 (16-bit storage, fp32 arithmetic).
- The embedding table's Gather becomes a Gather of the integers and of the scales feeding one
  DequantizeLinear over the gathered rows (blocks along the hidden axis), or a Gather of 16-bit
  rows and a Cast.
The LM head (the MatMul writing `logits`), the embedding and the other projections each take
the format `BuildOptions.format_of` gives their role. `packed-matmul` later lowers DQ/Cast ->
MatMul onto llmc's kernels. The pass runs on the canonical graph (before the KV rewrite), where
a plain session can run calibration text for the activation-aware method. It records what it
did per tensor in the graph's metadata (METADATA_KEY) for the manifest and the build report.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir

from llmc.contract import graph_io as io
from llmc.contract.model_spec import ModelSpec
from llmc.contract.options import QUANT_BITS, BuildOptions
from llmc.passes import lazy
from llmc.passes.calibrate import mean_square_inputs
from llmc.passes.graph import is_lm_head_output, matmul_tensor, tensor, weight
from llmc.passes.manager import PassResult
from llmc.passes.merge_matmuls import PROJECTION_KEY, QKV
from llmc.passes.quantizers import QuantizedWeight, quantize
from llmc.passes.rewrite import Rule, RulePass

METADATA_KEY = "llmc.quantization"
BITS_KEY = "llmc.bits"  # on a quantized weight's integers: the bits its values use
SIXTEEN_BIT = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}
FLOAT = ir.DataType.FLOAT.value
# int6 has no ONNX type: int8 holding 6-bit values, which the CPU lowering packs in 6 bits.
INT_TYPES = {(4, True): ml_dtypes.int4, (4, False): ml_dtypes.uint4, (8, True): np.int8, (8, False): np.uint8,
             (6, True): np.int8, (6, False): np.uint8}


class _Quantizer:
    """What the rules share: the options, the calibration statistics and the per-tensor record."""

    def __init__(self, options: BuildOptions, experts: bool = False):
        self.options = options
        self.experts = experts  # a mixture-of-experts model: its Q/K/V projection takes 8 bits at int4
        self.importance: dict[str, np.ndarray] = {}  # MatMul node name -> mean square input per row k
        self.records: dict[str, dict] = {}

    def integers(self, w: np.ndarray, fmt: str, importance: np.ndarray | None) -> QuantizedWeight:
        o = self.options
        method = "search" if o.quant_method == "awq" else o.quant_method
        return quantize(w, QUANT_BITS[fmt], o.quant_block_size, o.quant_symmetric, method, importance)

    def scaled_integers(self, columns: np.ndarray, fmt: str, s: np.ndarray, importance: np.ndarray):
        """The quantization of s * columns, its search weighing row k by importance[k] / s[k]^2."""
        return self.integers((columns * s[:, None]).astype(np.float32), fmt, (importance / s ** 2).astype(np.float32))

    def lazy_record(self, name: str, role: str, fmt: str, shape) -> np.ndarray:
        """A record whose error is gathered as column ranges are computed: the returned [2, N] array
        takes each column's squared error and squared norm (a column computed twice counts once)."""
        sums = np.zeros((2, shape[1]), np.float64)
        self.records[name] = {"role": role, "format": fmt, "shape": list(shape), "relative_error": sums}
        return sums

    def lazy_integers(self, w: lazy.Lazy, fmt: str, name: str, role: str, row_scale: np.ndarray | None = None,
                      importance: np.ndarray | None = None) -> list[lazy.Lazy]:
        """[q, scale(, zero_point)] of `w` [K, N], each computed column range by column range from one
        quantization of that range (Memo), when first read. With `row_scale` s [K] (AWQ's), of
        s * w, weighing each row's error by its importance / s^2, and the recorded error is that
        of the result the graph computes, dequantized / s, against w."""
        sums = self.lazy_record(name, role, fmt, w.dims)
        kind = INT_TYPES[(QUANT_BITS[fmt], self.options.quant_symmetric)]

        def quantized(a: int, b: int) -> QuantizedWeight:
            # The columns as they come (a checkpoint's rows transposed: the tiles copy them over).
            columns = w.columns(a, b)
            if row_scale is None:
                q = self.integers(columns, fmt, None)
                sums[:, a:b] = q.errors
                return q
            q = self.scaled_integers(columns, fmt, row_scale, importance)
            sums[:, a:b] = np.square(columns - q.dequantize() / row_scale[:, None]).sum(axis=0), \
                np.square(columns).sum(axis=0)
            return q

        memo = lazy.Memo(quantized)
        k, n = w.dims
        block, step = self.options.quant_block_size, lazy.float_step(k)  # all parts slice alike: one memo
        parts = [lazy.Lazy(kind, (k, n), lambda a, b: memo(a, b).q.astype(kind), axis=1, step=step, name=f"{name}.q"),
                 lazy.Lazy(np.float32, (k // block, n), lambda a, b: memo(a, b).scale, axis=1, step=step,
                           name=f"{name}.scale")]
        if not self.options.quant_symmetric:
            parts.append(lazy.Lazy(kind, (k // block, n), lambda a, b: memo(a, b).zero_point.astype(kind), axis=1,
                                   step=step, name=f"{name}.zero_point"))
        return parts

    def sixteen_bit(self, w: lazy.Lazy, fmt: str, name: str, role: str) -> lazy.Lazy:
        sums = self.lazy_record(name, role, fmt, w.dims)
        kind = SIXTEEN_BIT[fmt]

        def stored(a: int, b: int) -> np.ndarray:
            columns = w.columns(a, b)
            half = columns.astype(kind)
            sums[:, a:b] = np.square(columns - half.astype(np.float32)).sum(axis=0), np.square(columns).sum(axis=0)
            return half

        return lazy.Lazy(kind, w.dims, stored, axis=1, step=lazy.float_step(w.dims[0]), name=name)


def finished_records(records: dict[str, dict]) -> dict[str, dict]:
    """The records with each lazily summed error made the relative error ||w - stored|| / ||w||."""
    out = {}
    for name, record in records.items():
        error = record["relative_error"]
        if isinstance(error, np.ndarray):
            err, norm = error.sum(axis=1)
            error = float(np.sqrt(err / norm)) if norm else 0.0
        out[name] = {**record, "relative_error": error}
    return out


def _dequantized(op, parts: list[lazy.Lazy], fmt: str, block_size: int) -> ir.Value:
    """DequantizeLinear of lazy_integers' parts along K, as initializers."""
    values = [op.initializer(part, part.name) for part in parts]
    values[0].metadata_props[BITS_KEY] = str(QUANT_BITS[fmt])  # int6 lives in int8: packed-matmul's hint
    return op.DequantizeLinear(*values, axis=0, block_size=block_size)


class QuantizeMatMul(Rule):
    name = "quantize_matmul"

    def __init__(self, quantizer: _Quantizer):
        self.quantizer = quantizer

    def pattern(self, op, x, w):
        return op.MatMul(x, w)

    def match(self, node):
        m = super().match(node)
        return m if m is not None and self._format(m) != "fp32" else None

    def _role(self, m) -> str:
        return "lm_head" if is_lm_head_output(m.outputs[0]) else "body"

    def _format(self, m) -> str:
        fmt = self.quantizer.options.format_of(self._role(m))
        # A MoE's attention is a small share of its bytes a token and feeds every expert's choice:
        # at int4 its Q/K/V projection is stored in 8 bits, as llama.cpp's Q4_0 stores a MoE's.
        if fmt == "int4" and self.quantizer.experts and m.w.metadata_props.get(PROJECTION_KEY) == QKV:
            return "int8"
        return fmt

    def check(self, m):
        w = matmul_tensor(m.w)
        if w is None:
            return "the weight is not a constant initializer"
        if len(w.dims) != 2 or w.numpy_dtype() != np.float32:
            return f"the weight is {len(w.dims)}-D {w.numpy_dtype()}, not 2-D float32"
        block = self.quantizer.options.quant_block_size
        if self._format(m) in QUANT_BITS and w.dims[0] % block:
            return f"K = {w.dims[0]} is not a multiple of the block size {block}"
        return None

    def rewrite(self, op, m):
        w, fmt, role = matmul_tensor(m.w), self._format(m), self._role(m)
        name = f"{m.root.name}.weight"
        if fmt in SIXTEEN_BIT:
            stored = self.quantizer.sixteen_bit(w, fmt, name, role)
            return op.MatMul(m.x, op.Cast(op.initializer(stored, name), to=FLOAT))
        parts = self.quantizer.lazy_integers(w, fmt, name, role)
        return op.MatMul(m.x, _dequantized(op, parts, fmt, self.quantizer.options.quant_block_size))


class ScaledQuantizeMatMul(QuantizeMatMul):
    """--quant-method awq, a MatMul reading an RMSNormalization's output alone (QKV, gate/up, LM
    head): AWQ's per-channel scaling. x W = (x / s)(s W) for any positive s [K]; rows of W whose
    activations run large are scaled up before quantization, so they get finer steps, and 1 / s is
    folded into the norm's gamma. s = rms(x)^alpha, alpha chosen per MatMul by the activation-
    weighted error of the result on the calibration statistics."""

    name = "quantize_matmul_scaled"
    ALPHAS = (0.0, 0.25, 0.5, 0.75)

    def pattern(self, op, x, gamma, w):
        return op.MatMul(op.RMSNormalization(x, gamma, _name="norm"), w)

    def match(self, node):
        m = super().match(node)
        if m is None or self._format(m) not in QUANT_BITS or node.name not in self.quantizer.importance:
            return None
        return m

    def check(self, m):
        gamma = weight(m.gamma)
        if gamma is None or gamma.ndim != 1:
            return "the norm's gamma is not a constant 1-D initializer"
        return super().check(m)

    def rewrite(self, op, m):
        w, fmt, role = matmul_tensor(m.w), self._format(m), self._role(m)
        importance = self.quantizer.importance[m.root.name].astype(np.float64)
        rms = np.sqrt(np.maximum(importance, 1e-12))
        scales = [(rms / np.exp(np.log(rms).mean())) ** alpha for alpha in self.ALPHAS]  # geometric mean 1
        errors = np.zeros(len(self.ALPHAS))
        # Each candidate's activation-weighted error, column range by column range (a range of the
        # weight at a time, read again from the checkpoint for each candidate).
        step = lazy.float_step(w.dims[0])
        for a in range(0, w.dims[1], step):
            columns = w.columns(a, min(a + step, w.dims[1]))
            for i, s in enumerate(scales):
                q = self.quantizer.scaled_integers(columns, fmt, s, importance)
                errors[i] += float((importance[:, None] * (columns - q.dequantize() / s[:, None]) ** 2).sum())
        best = int(np.argmin(errors))
        name = f"{m.root.name}.weight"
        parts = self.quantizer.lazy_integers(w, fmt, name, role, scales[best], importance)
        op.count(f"awq_alpha_{self.ALPHAS[best]:g}")
        gamma = op.initializer((weight(m.gamma) / scales[best]).astype(np.float32), f"{m.gamma.name}.awq.{m.root.name}")
        normed = op.like(m.norm, m.x, gamma)
        normed.shape, normed.type = m.norm.outputs[0].shape, m.norm.outputs[0].type  # later rules read them
        return op.MatMul(normed, _dequantized(op, parts, fmt, self.quantizer.options.quant_block_size))


class QuantizeEmbedding(Rule):
    name = "quantize_embedding"

    def __init__(self, quantizer: _Quantizer):
        self.quantizer = quantizer

    def pattern(self, op, table, ids):
        return op.Gather(table, ids)

    def match(self, node):
        m = super().match(node)
        if m is None or self.quantizer.options.format_of("embedding") == "fp32":
            return None
        return m if io.INPUT_IDS in _sources(m.ids) else None

    def check(self, m):
        table = tensor(m.table)
        if table is None or len(table.dims) != 2 or table.numpy_dtype() != np.float32:
            return "the embedding table is not a constant 2-D float32 initializer"
        if m.root.attributes.get_int("axis", 0) != 0:
            return "the Gather does not pick rows"
        block = self.quantizer.options.quant_block_size
        if self.quantizer.options.format_of("embedding") in QUANT_BITS and table.dims[1] % block:
            return f"the hidden size {table.dims[1]} is not a multiple of the block size {block}"
        return None

    def rewrite(self, op, m):
        # The table [V, H] is read as its transpose [H, V]: blocks along the hidden axis, a token's
        # row one column, quantized (and stored back as rows) a range of tokens at a time.
        table, fmt = lazy.transposed(tensor(m.table)), self.quantizer.options.format_of("embedding")
        name = f"{m.table.name}.embedding"
        if fmt in SIXTEEN_BIT:
            stored = lazy.transposed(self.quantizer.sixteen_bit(table, fmt, name, "embedding"))
            return op.Cast(op.Gather(op.initializer(stored, name), m.ids, axis=0), to=FLOAT)
        parts = [lazy.transposed(p) for p in self.quantizer.lazy_integers(table, fmt, name, "embedding")]
        gathered = [op.Gather(op.initializer(v, v_name), m.ids, axis=0)
                    for v, v_name in zip(parts, (f"{name}.q", f"{name}.scale", f"{name}.zero_point"))]
        return op.DequantizeLinear(*gathered, axis=-1, block_size=self.quantizer.options.quant_block_size)


class QuantizeExperts(Rule):
    """llmc.cpu::Experts's two stacks [E, N, K] -> `DequantizeLinear(q, scale[, zero_point], axis=2,
    block_size=B)` of each, every expert quantized as its [K, N] projection would be (the body's
    format and method, no calibration); the router, a Gemm, keeps its precision. Computed an
    expert range at a time, when first read."""

    name = "quantize_experts"

    def __init__(self, quantizer: _Quantizer):
        self.quantizer = quantizer

    def pattern(self, op, x, ids, weights, gate_up, down):
        from llmc.plugins import cpu

        return op.Experts(x, ids, weights, gate_up, down, _domain=cpu.DOMAIN, _name="experts", _other_inputs=True)

    def match(self, node):
        m = super().match(node)
        return m if m is not None and self.quantizer.options.format_of("body") in QUANT_BITS else None

    def check(self, m):
        block = self.quantizer.options.quant_block_size
        if any(isinstance(tensor(v), lazy.Mxfp4Stack) for v in (m.gate_up, m.down)):
            return "the experts are the checkpoint's MXFP4, which the engine keeps as released"
        for value in (m.gate_up, m.down):
            w = tensor(value)
            if w is None or len(w.dims) != 3 or w.numpy_dtype() != np.float32:
                return "the expert weights are not constant 3-D float32 initializers"
            if w.dims[2] % block:
                return f"K = {w.dims[2]} is not a multiple of the block size {block}"
        return None

    def rewrite(self, op, m):
        fmt = self.quantizer.options.format_of("body")
        stacks = [self._dequantized(op, tensor(v), fmt, f"{m.experts.name}.{v.name}") for v in (m.gate_up, m.down)]
        return op.like(m.experts, m.x, m.ids, m.weights, *stacks, *m.experts.inputs[5:])

    def _dequantized(self, op, w: lazy.Lazy, fmt: str, name: str) -> ir.Value:
        q = self.quantizer
        experts, n, k = w.dims
        block, symmetric = q.options.quant_block_size, q.options.quant_symmetric
        kind = INT_TYPES[(QUANT_BITS[fmt], symmetric)]
        sums = np.zeros((2, experts), np.float64)
        q.records[name] = {"role": "experts", "format": fmt, "shape": [experts, n, k], "relative_error": sums}

        def quantized(a: int, b: int) -> list[QuantizedWeight]:
            out = []
            for e, each in enumerate(w.rows(a, b)):
                out.append(q.integers(each.T, fmt, None))
                sums[:, a + e] = out[-1].errors.sum(axis=1)
            return out

        memo, step = lazy.Memo(quantized), max(1, lazy.CHUNK_BYTES // (n * k * 4))

        def part(field: str, dtype):
            return lambda a, b: np.stack([getattr(each, field).T for each in memo(a, b)]).astype(dtype)

        parts = [lazy.Lazy(kind, (experts, n, k), part("q", kind), step=step, name=f"{name}.q"),
                 lazy.Lazy(np.float32, (experts, n, k // block), part("scale", np.float32), step=step,
                           name=f"{name}.scale")]
        if not symmetric:
            parts.append(lazy.Lazy(kind, (experts, n, k // block), part("zero_point", kind), step=step,
                                   name=f"{name}.zero_point"))
        values = [op.initializer(p, p.name) for p in parts]
        values[0].metadata_props[BITS_KEY] = str(QUANT_BITS[fmt])
        return op.DequantizeLinear(*values, axis=2, block_size=block)


def _sources(value: ir.Value, depth: int = 4) -> set[str]:
    """The graph inputs `value` derives from through a few nodes (the token ids may be reshaped)."""
    if value.producer() is None:
        return {value.name} if value.name else set()
    if depth == 0:
        return set()
    return {s for v in value.producer().inputs if v is not None for s in _sources(v, depth - 1)}


class QuantizeWeights(RulePass):
    name = "quantize-weights"
    description = "store the weights in fewer bits (int8/int4 blocks or 16-bit), as DequantizeLinear/Cast -> MatMul"
    lossy = True

    def __init__(self, options: BuildOptions, calibration: np.ndarray | None = None):
        self.options = options
        self.calibration = calibration  # [windows, tokens] token ids, for --quant-method awq

    def rules(self, spec: ModelSpec):
        return [ScaledQuantizeMatMul(self.quantizer), QuantizeMatMul(self.quantizer), QuantizeEmbedding(self.quantizer),
                QuantizeExperts(self.quantizer)]

    def apply(self, model: ir.Model, spec: ModelSpec) -> PassResult:
        self.quantizer = _Quantizer(self.options, experts=spec.num_experts > 0)
        if self.options.quant_method == "awq" and self.options.quant != "none":
            if self.calibration is None:
                return PassResult(False, {}, ["--quant-method awq needs calibration text; none was given"])
            self.quantizer.importance = mean_square_inputs(model, self.calibration)
        result = super().apply(model, spec)
        model.meta.setdefault(METADATA_KEY, {}).update(self.quantizer.records)
        return result


def records_of(model: ir.Model) -> dict[str, dict]:
    """What quantize-weights did per tensor (name -> role, format, shape, relative_error). A lazily
    quantized tensor's error is known once its values were computed: ask after the engine is written."""
    return finished_records(model.meta.get(METADATA_KEY, {}))
