"""Blockwise weight quantizers: how a weight [K, N] becomes integers and scales.

A weight is cut into blocks of `block_size` consecutive rows (along K, the dot product's axis)
per column; each block gets a scale (and, asymmetric, a zero point) so that
weight ~ (q - zero_point) * scale: ONNX DequantizeLinear(axis=0, block_size) semantics. Scales are
rounded to float16, which is how llmc's kernels store them, so the canonical graph and the
kernels compute with the same numbers.

- `rtn`: round to nearest with the block's range mapped onto the integer range.
- `search`: per block, a grid of candidate scales; for each, the integers it rounds to and then
  the scale that fits those integers best by (weighted) least squares; the candidate with the
  least weighted error wins (the approach of llama.cpp's make_qx_quants). Data-free, the weight
  of every element is 1; activation-aware (`importance`), each row k is weighted by the mean
  square of the activation it multiplies, so the error minimized is the layer's expected output
  error rather than the weight's.

Symmetric blocks, what builds use by default, are quantized by the same arithmetic in C where the
install has llmc's kernel library (plugins/cpu/quantize.c, bit-identical); numpy is its reference
and the path for asymmetric blocks. In numpy the work goes tile by tile, a tile being one row of
blocks by up to a few thousand columns: its temporaries stay in the CPU's cache, the extra memory
is a few MB whatever the weight's size, and the tiles are shared out over the cores (numpy lets go
of the GIL inside its loops). Blocks are independent and each block's sums add its rows in the
same order as over the whole weight, so tiling changes no result.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

# Symmetric ranges: int4 and int6 use all their levels (the extreme value may take -8 / -32);
# int8 stays within +-127 so the kernels' signed byte products cannot saturate.
SYMMETRIC_RANGE = {4: (-8, 7), 6: (-32, 31), 8: (-127, 127)}
SEARCH_STEPS = 10  # candidates on each side of the plain scale, 0.1 of a level apart (llama.cpp's nstep)
# Weight elements in a tile. Measured on a 2-core EPYC (1 MB L2 a core, 32 MB L3), int4 search:
# 16K elements 52 ns an element, 32K 40, 48K-128K 33-37 (numpy's per-call cost falls off, the
# buffers still sit in cache). 64K: four float32 buffers, 1 MB a thread.
TILE = 1 << 16


@dataclass
class QuantizedWeight:
    q: np.ndarray  # [K, N] int8 (symmetric) or uint8 (asymmetric; int4 values in the low nibble's range)
    scale: np.ndarray  # [K / B, N] float32, each exactly a float16
    zero_point: np.ndarray | None  # [K / B, N] uint8, asymmetric only
    bits: int
    block_size: int
    # [2, N] float64: each column's squared error (w - dequantized) and squared norm, summed while
    # each tile was in cache; what the build report's relative error is made of.
    errors: np.ndarray | None = None

    def dequantize(self) -> np.ndarray:
        zp = 0 if self.zero_point is None else self._rows(self.zero_point).astype(np.float32)
        return (self.q.astype(np.float32) - zp) * self._rows(self.scale)

    def _rows(self, per_block: np.ndarray) -> np.ndarray:
        return np.repeat(per_block, self.block_size, axis=0)


def quantize(w: np.ndarray, bits: int, block_size: int, symmetric: bool = True, method: str = "search",
             importance: np.ndarray | None = None) -> QuantizedWeight:
    """`w` [K, N] float32 (K a multiple of block_size); `importance` [K] (mean square activation)
    weighs the error of each row for the search. Symmetric blocks go to llmc's C quantizer where
    the install has it (plugins/cpu/quantize.c: the same results, ~10x faster a core)."""
    native = _native_quantizer() if symmetric else None
    if native is not None:
        return _quantize_native(native, w, bits, block_size, method, importance)
    return quantize_numpy(w, bits, block_size, symmetric, method, importance)


def quantize_numpy(w: np.ndarray, bits: int, block_size: int, symmetric: bool = True, method: str = "search",
                   importance: np.ndarray | None = None) -> QuantizedWeight:
    """`quantize` in numpy: the reference of the C quantizer, and the asymmetric one."""
    k, n = w.shape
    q = np.empty((k, n), np.int8 if symmetric else np.uint8)
    scale = np.empty((k // block_size, n), np.float32)
    zero_point = None if symmetric else np.empty((k // block_size, n), np.uint8)
    errors = np.empty((2, k // block_size, n), np.float64)  # per row of blocks: tiles never share a slot
    # Without importance every weight is 1, and multiplying by 1 changes nothing: skip it.
    weight = None if importance is None or method == "rtn" else importance.astype(np.float32).reshape(k, 1)
    chunks = column_chunks(n, block_size)
    tiles = [(row, c0, c1) for row in range(0, k, block_size) for c0, c1 in chunks]
    workers = min(_cores(), len(tiles))

    def work(first: int) -> None:
        buffers = np.empty((4, block_size * max(c1 - c0 for c0, c1 in chunks)), np.float32)
        for row, c0, c1 in tiles[first::workers]:
            x, t, p, s = (b[:block_size * (c1 - c0)].reshape(block_size, c1 - c0) for b in buffers)
            rows = slice(row, row + block_size)
            x[...] = w[rows, c0:c1]
            tile_weight = None if weight is None else weight[rows]
            if method == "rtn":
                tile_scale, zp = (_rtn_symmetric if symmetric else _rtn_asymmetric)(x, bits, t)
            else:
                search = _search_symmetric if symmetric else _search_asymmetric
                tile_scale, zp = search(x, bits, tile_weight, t, p, s)
            tile_scale = _f16(tile_scale)
            q[rows, c0:c1] = _round_to(x, tile_scale, zp, bits, symmetric, t)
            scale[row // block_size, c0:c1] = tile_scale[0]
            restored = np.multiply(t if zp is None else np.subtract(t, zp, out=t), tile_scale, out=t)
            errors[0, row // block_size, c0:c1] = np.square(np.subtract(x, restored, out=t), out=t).sum(axis=0)
            errors[1, row // block_size, c0:c1] = np.square(x, out=t).sum(axis=0)
            if zero_point is not None:
                zero_point[row // block_size, c0:c1] = zp[0]

    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(work, range(workers)))
    elif workers:
        work(0)
    return QuantizedWeight(q, scale, zero_point, bits, block_size, errors.sum(axis=1))


def _quantize_native(native, w, bits, block_size, method, importance) -> QuantizedWeight:
    if w.dtype != np.float32 or w.strides[0] % 4 or w.strides[1] % 4:
        w = np.ascontiguousarray(w, np.float32)  # a transposed view is read as it lies
    k, n = w.shape
    if k % block_size:
        raise ValueError(f"cannot quantize a {list(w.shape)} weight in blocks of {block_size} rows")
    q = np.empty((k, n), np.int8)
    scale = np.empty((k // block_size, n), np.float32)
    errors = np.empty((2, k // block_size, n), np.float32)
    weight = None if importance is None or method == "rtn" else np.ascontiguousarray(importance, np.float32)
    workers = max(1, min(_cores(), k // block_size))

    def work(first: int) -> None:  # ctypes lets go of the GIL for the call
        status = native(w.ctypes.data, k, n, w.strides[0] // 4, w.strides[1] // 4, bits, block_size,
                        int(method != "rtn"), None if weight is None else weight.ctypes.data, q.ctypes.data,
                        scale.ctypes.data, errors.ctypes.data, first, workers)
        if status:
            raise ValueError(f"llmc's C quantizer does not take int{bits} blocks of {block_size}")

    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(work, range(workers)))
    else:
        work(0)
    return QuantizedWeight(q, scale, None, bits, block_size, errors.astype(np.float64).sum(axis=1))


@functools.cache
def _native_for(path) -> object | None:
    import ctypes

    from llmc.plugins.cpu.library import native

    try:
        fn = native(path).llmc_quantize_symmetric
    except (OSError, AttributeError):  # a library from before the quantizer was in it
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, i64, i64, ctypes.c_int, i64, ctypes.c_int, ptr, ptr, ptr, ptr, i64, i64]
    fn.restype = ctypes.c_int
    return fn


def _native_quantizer():
    from llmc.plugins.cpu.library import library_path

    path = library_path()
    return None if path is None else _native_for(path)


def column_chunks(n: int, block_size: int) -> list[tuple[int, int]]:
    """The column ranges of the tiles: as even as can be, so no tile is a sliver."""
    count = -(-n // max(1, TILE // block_size))
    return [(n * i // count, n * (i + 1) // count) for i in range(count)]


def relative_error(w: np.ndarray, stored: np.ndarray | QuantizedWeight) -> float:
    """||w - stored|| / ||w||, `stored` as the weight it reads back as (or a quantization of w): the
    per-tensor figure the build report lists."""
    restored = stored.dequantize() if isinstance(stored, QuantizedWeight) else stored.astype(np.float32)
    norm = float(np.linalg.norm(w))
    return float(np.linalg.norm(w - restored)) / norm if norm else 0.0


# -- helpers: a tile is [B, columns], one block per column; per-block values are [1, columns].
# Full-size work goes into the tile's buffers (t, p, s) in place; the expressions and their order of
# operations are the same as over the whole weight, so every rounding is too.


_TINY = np.float32(np.finfo(np.float16).smallest_normal)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _f16(scale: np.ndarray) -> np.ndarray:
    """Scales as float16 values (never 0, so an all-zero block still divides)."""
    scale = scale.astype(np.float16).astype(np.float32)
    small = np.abs(scale) < _TINY
    if small.any():  # rare: most tiles skip the masked writes
        scale[small] = np.where(scale[small] < 0, -_TINY, _TINY)
    return scale


def _extreme(x):
    """Each block's value of largest magnitude, with its sign (in a tie of signs, the first's)."""
    high, low = x.max(axis=0, keepdims=True), x.min(axis=0, keepdims=True)
    extreme = np.where(high >= -low, high, low)
    tied = np.flatnonzero((high == -low) & (high != 0))
    # argmax along a block is slow (numpy copies to make the axis contiguous): only where needed.
    extreme[0, tied] = x[np.abs(x[:, tied]).argmax(axis=0), tied]
    return extreme


def _round_to(x, scale, zp, bits, symmetric, out) -> np.ndarray:
    low, high = SYMMETRIC_RANGE[bits] if symmetric else (0, 2 ** bits - 1)
    np.rint(np.divide(x, scale, out=out), out=out)
    if zp is not None:
        out += zp
    return out.clip(low, high, out=out)


def _block_sum(p):
    """Per block (column of the tile), the sum of its rows, in row order whatever the weight's
    layout: a streamed build quantizes contiguous column ranges, and this keeps a range's result
    the whole weight's."""
    return np.add.reduce(p, axis=0, keepdims=True)


def _sums(x, q, weight, p, s):
    """Per block, sum(weight * q * x) and sum(weight * q * q)."""
    wq = q if weight is None else np.multiply(weight, q, out=p)
    sum_xq = _block_sum(np.multiply(wq, x, out=s))
    return sum_xq, _block_sum(np.multiply(wq, q, out=s))


def _error(x, scale, q, weight, out):
    """Per block, the weighted squared error of x ~ scale * q."""
    e = np.square(np.subtract(x, np.multiply(scale, q, out=out), out=out), out=out)
    return _block_sum(e if weight is None else np.multiply(weight, e, out=out))


def _rtn_symmetric(x, bits, t):
    return np.abs(x, out=t).max(axis=0, keepdims=True) / SYMMETRIC_RANGE[bits][1], None


def _rtn_asymmetric(x, bits, t):
    levels = 2 ** bits - 1
    low = np.minimum(x.min(axis=0, keepdims=True), 0)
    high = np.maximum(x.max(axis=0, keepdims=True), 0)
    scale = _f16((high - low) / levels)
    return scale, np.clip(np.rint(-low / scale), 0, levels)


def _search_symmetric(x, bits, weight, t, p, s):
    low, high = SYMMETRIC_RANGE[bits]
    # The extreme value lands on the end of the range with more room (int4: -8), as in llama.cpp.
    edge = low if -low > high else high
    extreme = _extreme(x)
    safe = np.where(extreme == 0, 1, extreme)
    best_scale = extreme / edge
    best_fit = np.full(extreme.shape, -np.inf, np.float32)
    for step in range(-SEARCH_STEPS, SEARCH_STEPS + 1):
        q = np.multiply(x, (edge + 0.1 * step) / safe, out=t)
        q = np.rint(q, out=q).clip(low, high, out=q)
        sum_xq, sum_qq = _sums(x, q, weight, p, s)
        # With q fixed the best scale is sum_xq / sum_qq and the error falls by sum_xq^2 / sum_qq.
        empty = ~(sum_qq > 0)
        np.putmask(sum_qq, empty, 1)
        fit = sum_xq ** 2 / sum_qq
        np.putmask(fit, empty, -np.inf)
        better = fit > best_fit
        np.putmask(best_fit, better, fit)
        np.putmask(best_scale, better, sum_xq / sum_qq)
    return _refit_f16(x, weight, best_scale, bits, t, p), None


def _search_asymmetric(x, bits, weight, t, p, s):
    levels = 2 ** bits - 1
    low = np.minimum(x.min(axis=0, keepdims=True), 0)
    high = np.maximum(x.max(axis=0, keepdims=True), 0)
    span = np.where(high > low, high - low, 1)
    best = (np.full(low.shape, np.inf, np.float32), span / levels, np.zeros_like(low))
    for step in range(-SEARCH_STEPS, SEARCH_STEPS + 1):
        scale = _f16(span / (levels + 0.1 * step))
        zp = np.clip(np.rint(-low / scale), 0, levels)
        q = _round_to(x, scale, zp, bits, False, t)
        q -= zp
        sum_xq, sum_qq = _sums(x, q, weight, p, s)
        positive = sum_qq > 0
        fitted = _f16(np.where(positive, sum_xq / np.where(positive, sum_qq, 1), scale))
        err = _error(x, fitted, q, weight, p)
        better = err < best[0]
        best = (np.where(better, err, best[0]), np.where(better, fitted, best[1]), np.where(better, zp, best[2]))
    return best[1], best[2]


def _refit_f16(x, weight, scale, bits, t, p):
    """The chosen scale, rounded to float16, and its neighbours: whichever gives the least error
    once the integers are rounded again with it."""
    scale = _f16(scale)
    best, best_err = scale, None
    for candidate in (scale, _f16(np.nextafter(scale.astype(np.float16), np.float16(np.inf)).astype(np.float32)),
                      _f16(np.nextafter(scale.astype(np.float16), np.float16(-np.inf)).astype(np.float32))):
        err = _error(x, candidate, _round_to(x, candidate, None, bits, True, t), weight, p)
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best, best_err = np.where(better, candidate, best), np.where(better, err, best_err)
    return best
