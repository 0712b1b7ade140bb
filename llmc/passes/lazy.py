"""Weights computed when they are read, a slice at a time: what keeps a build's memory small.

An initializer holding a `Lazy` tensor knows its dtype and shape but computes its values only when
asked, and then a slice along one axis at a time (`part(start, stop)`): a checkpoint tensor's rows
read from disk, a projection's columns transposed, merged, quantized or packed from the columns of
the weight it came from. Passes chain them: the packed int4 weight of a merged QKV projection is a
function of three checkpoint tensors' rows, evaluated only when the engine file is written. Writing
streams it (`tofile`) a slice at a time where its bytes are laid out along that axis, so no step of
a build holds a whole model, and most hold one slice of one tensor.

`numpy()` still gives the whole tensor (verification, small models, the eager paths), and a small
tensor caches it. Nothing here knows what the values mean: the passes pass in the functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx_ir as ir

CHUNK_BYTES = 32 << 20  # what one slice of a streamed tensor may hold
CACHE_BYTES = 1 << 20  # smaller tensors keep their values once computed (norms, biases, tables)

Part = Callable[[int, int], np.ndarray]


class Lazy(ir.LazyTensor):
    """A tensor of `shape` whose slice [start, stop) along `axis` is `part(start, stop)`.

    `units` counts the slices' index along the axis where one unit spans several elements (a packed
    blob's bytes are counted in panels): by default it is shape[axis]."""

    __slots__ = ("axis", "part", "step", "units")

    def __init__(self, dtype: np.dtype, shape: Sequence[int], part: Part, *, axis: int = 0,
                 units: int | None = None, step: int | None = None, name: str | None = None):
        shape = tuple(int(d) for d in shape)
        self.axis, self.part, self.step = axis, part, step
        self.units = shape[axis] if units is None else units
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        super().__init__(lambda: ir.tensor(self._compute()), ir.DataType.from_numpy(np.dtype(dtype)),
                         ir.Shape(shape), cache=nbytes <= CACHE_BYTES, name=name)

    def _compute(self) -> np.ndarray:
        array = np.asarray(self.part(0, self.units))
        return array.reshape(self.shape.numpy()) if self.units != self.shape[self.axis] else array

    def numpy_dtype(self) -> np.dtype:
        return self.dtype.numpy()

    @property
    def dims(self) -> tuple[int, ...]:
        return tuple(self.shape.numpy())

    def columns(self, start: int, stop: int) -> np.ndarray:
        """Columns [start, stop) of a 2-D tensor; computed alone where the tensor is made by columns."""
        if self.axis == 1 and self.units == self.shape[1]:
            return self.part(start, stop)
        return self.numpy()[:, start:stop]

    def rows(self, start: int, stop: int) -> np.ndarray:
        if self.axis == 0 and self.units == self.shape[0]:
            return self.part(start, stop)
        return self.numpy()[start:stop]

    def chunk(self) -> int:
        """How many units a streamed slice takes: `step` where the slice's cost is its source's (a
        quantization's scales cost the float32 columns they come from), else CHUNK_BYTES of its own."""
        if self.step is not None:
            return self.step
        unit_bytes = self.nbytes / max(self.units, 1)
        return max(1, int(CHUNK_BYTES // max(unit_bytes, 1)))

    def tofile(self, file) -> None:
        if self.axis != 0 or self.cache:
            file.write(self.tobytes())
            return
        step = self.chunk()
        for start in range(0, self.units, step):
            # ir.tensor's bytes are ONNX's: 4-bit values two to a byte (the slices hold whole rows).
            file.write(ir.tensor(np.ascontiguousarray(self.part(start, min(start + step, self.units)))).tobytes())


class Mxfp4Stack(Lazy):
    """Stacked experts a checkpoint stores in MXFP4 (gpt-oss as released): float32 values, the
    codes' meaning, where a pass reads them; `codes(start, stop)` the experts' codes and scales as
    stored (llmc.compiler.weights.Weights.mxfp4), which the packing keeps bit for bit."""

    __slots__ = ("codes",)

    def __init__(self, shape: Sequence[int], part: Part, codes: Callable[[int, int], tuple], *, name: str):
        super().__init__(np.float32, shape, part, name=name)
        self.codes = codes


def of(tensor: ir.TensorProtocol) -> Lazy:
    """`tensor` as a Lazy one (an in-memory tensor is sliced where it lies)."""
    if isinstance(tensor, Lazy):
        return tensor
    array = tensor.numpy()
    return Lazy(array.dtype, array.shape, lambda a, b: array[a:b], name=tensor.name)


def transposed(tensor: ir.TensorProtocol) -> Lazy:
    """A 2-D tensor transposed: made by columns from the source's rows (a checkpoint's [out, in]
    projection read as the [in, out] weight a MatMul takes), or by rows from its columns."""
    source = of(tensor)
    rows, cols = source.dims
    if source.axis == 1:
        return Lazy(source.numpy_dtype(), (cols, rows), lambda a, b: source.columns(a, b).T, axis=0, step=source.step)
    return Lazy(source.numpy_dtype(), (cols, rows), lambda a, b: source.rows(a, b).T, axis=1)


def concatenated(tensors: Sequence[ir.TensorProtocol]) -> Lazy:
    """2-D tensors side by side (axis 1), each column range computed from the pieces it covers."""
    pieces = [of(t) for t in tensors]
    bounds = np.cumsum([0] + [p.shape[1] for p in pieces])

    def part(a: int, b: int) -> np.ndarray:
        out = [p.columns(max(a, lo) - lo, min(b, hi) - lo)
               for p, lo, hi in zip(pieces, bounds[:-1], bounds[1:]) if a < hi and b > lo]
        if len(out) == 1:
            return out[0]
        # Checkpoint rows transposed are column-major: joined as rows, they copy contiguously.
        return np.concatenate([o.T for o in out]).T if all(o.flags.f_contiguous for o in out) else \
            np.concatenate(out, axis=1)

    return Lazy(pieces[0].numpy_dtype(), (pieces[0].shape[0], int(bounds[-1])), part, axis=1)


def by_columns(source: Lazy, dtype, shape: Sequence[int], func: Callable[[np.ndarray], np.ndarray]) -> Lazy:
    """func applied to `source`'s columns, column range by column range (an elementwise cast, a
    per-column quantization)."""
    return Lazy(dtype, shape, lambda a, b: func(source.columns(a, b)), axis=1)


def float_step(rows: int) -> int:
    """Units per slice for a tensor each of whose units costs `rows` float32 values to make."""
    return max(1, CHUNK_BYTES // (4 * max(rows, 1)))


class Memo:
    """The last result of an expensive function of a column range, shared by the tensors made from
    it (a quantization's integers, scales and zero points): each asks for the same range in turn."""

    def __init__(self, func: Callable[[int, int], object]):
        self.func, self.key, self.value = func, None, None

    def __call__(self, a: int, b: int):
        if self.key != (a, b):
            self.key, self.value = (a, b), self.func(a, b)
        return self.value

