"""Blockwise weight quantizers, in numpy: how a weight [K, N] becomes integers and scales.

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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Symmetric ranges: int4 and int6 use all their levels (the extreme value may take -8 / -32);
# int8 stays within +-127 so the kernels' signed byte products cannot saturate.
SYMMETRIC_RANGE = {4: (-8, 7), 6: (-32, 31), 8: (-127, 127)}
SEARCH_STEPS = 10  # candidates on each side of the plain scale, 0.1 of a level apart (llama.cpp's nstep)


@dataclass
class QuantizedWeight:
    q: np.ndarray  # [K, N] int8 (symmetric) or uint8 (asymmetric; int4 values in the low nibble's range)
    scale: np.ndarray  # [K / B, N] float32, each exactly a float16
    zero_point: np.ndarray | None  # [K / B, N] uint8, asymmetric only
    bits: int
    block_size: int

    def dequantize(self) -> np.ndarray:
        zp = 0 if self.zero_point is None else self._rows(self.zero_point).astype(np.float32)
        return (self.q.astype(np.float32) - zp) * self._rows(self.scale)

    def _rows(self, per_block: np.ndarray) -> np.ndarray:
        return np.repeat(per_block, self.block_size, axis=0)


def quantize(w: np.ndarray, bits: int, block_size: int, symmetric: bool = True, method: str = "search",
             importance: np.ndarray | None = None) -> QuantizedWeight:
    """`w` [K, N] float32 (K a multiple of block_size); `importance` [K] (mean square activation)
    weighs the error of each row for the search."""
    k, n = w.shape
    blocks = w.astype(np.float32).reshape(k // block_size, block_size, n)
    if method == "rtn":
        scale, zp = (_rtn_symmetric if symmetric else _rtn_asymmetric)(blocks, bits)
    else:
        weight = np.ones_like(blocks) if importance is None else \
            np.broadcast_to(importance.astype(np.float32).reshape(k // block_size, block_size, 1), blocks.shape)
        scale, zp = (_search_symmetric if symmetric else _search_asymmetric)(blocks, bits, weight)
    scale = _f16(scale)
    q = _round_to(blocks, scale, zp, bits, symmetric)
    dtype = np.int8 if symmetric else np.uint8
    zero_point = None if symmetric else zp[:, 0, :].astype(np.uint8)
    return QuantizedWeight(q.reshape(k, n).astype(dtype), scale[:, 0, :], zero_point, bits, block_size)


def relative_error(w: np.ndarray, stored: np.ndarray | QuantizedWeight) -> float:
    """||w - stored|| / ||w||, `stored` as the weight it reads back as (or a quantization of w): the
    per-tensor figure the build report lists."""
    restored = stored.dequantize() if isinstance(stored, QuantizedWeight) else stored.astype(np.float32)
    norm = float(np.linalg.norm(w))
    return float(np.linalg.norm(w - restored)) / norm if norm else 0.0


# -- helpers: blocks are [K / B, B, N]; per-block values [K / B, 1, N] ------------------------------


def _f16(scale: np.ndarray) -> np.ndarray:
    """Scales as float16 values (never 0, so an all-zero block still divides)."""
    scale = scale.astype(np.float16).astype(np.float32)
    tiny = np.float32(np.finfo(np.float16).smallest_normal)
    return np.where(np.abs(scale) < tiny, np.where(scale < 0, -tiny, tiny), scale)


def _round_to(blocks, scale, zp, bits, symmetric) -> np.ndarray:
    low, high = SYMMETRIC_RANGE[bits] if symmetric else (0, 2 ** bits - 1)
    return np.clip(np.rint(blocks / scale) + (0 if zp is None else zp), low, high)


def _extreme(blocks: np.ndarray) -> np.ndarray:
    """Each block's value of largest magnitude, with its sign."""
    at = np.abs(blocks).argmax(axis=1)[:, None, :]
    return np.take_along_axis(blocks, at, axis=1)


def _rtn_symmetric(blocks, bits):
    return np.abs(blocks).max(axis=1, keepdims=True) / SYMMETRIC_RANGE[bits][1], None


def _rtn_asymmetric(blocks, bits):
    levels = 2 ** bits - 1
    low = np.minimum(blocks.min(axis=1, keepdims=True), 0)
    high = np.maximum(blocks.max(axis=1, keepdims=True), 0)
    scale = _f16((high - low) / levels)
    return scale, np.clip(np.rint(-low / scale), 0, levels)


def _search_symmetric(blocks, bits, weight):
    low, high = SYMMETRIC_RANGE[bits]
    # The extreme value lands on the end of the range with more room (int4: -8), as in llama.cpp.
    edge = low if -low > high else high
    extreme = _extreme(blocks)
    safe = np.where(extreme == 0, 1, extreme)
    best_scale = extreme / edge
    best_fit = np.full(extreme.shape, -np.inf, np.float32)
    for step in range(-SEARCH_STEPS, SEARCH_STEPS + 1):
        inverse = (edge + 0.1 * step) / safe
        q = np.clip(np.rint(blocks * inverse), low, high)
        wq = weight * q
        sum_xq, sum_qq = (wq * blocks).sum(axis=1, keepdims=True), (wq * q).sum(axis=1, keepdims=True)
        # With q fixed the best scale is sum_xq / sum_qq and the error falls by sum_xq^2 / sum_qq.
        fit = np.where(sum_qq > 0, sum_xq ** 2 / np.where(sum_qq > 0, sum_qq, 1), -np.inf)
        better = fit > best_fit
        best_fit = np.where(better, fit, best_fit)
        best_scale = np.where(better, sum_xq / np.where(sum_qq > 0, sum_qq, 1), best_scale)
    return _refit_f16(blocks, weight, best_scale, None, bits, True), None


def _search_asymmetric(blocks, bits, weight):
    levels = 2 ** bits - 1
    low = np.minimum(blocks.min(axis=1, keepdims=True), 0)
    high = np.maximum(blocks.max(axis=1, keepdims=True), 0)
    span = np.where(high > low, high - low, 1)
    best = (np.full(low.shape, np.inf, np.float32), span / levels, np.zeros_like(low))
    for step in range(-SEARCH_STEPS, SEARCH_STEPS + 1):
        scale = _f16(span / (levels + 0.1 * step))
        zp = np.clip(np.rint(-low / scale), 0, levels)
        q = np.clip(np.rint(blocks / scale) + zp, 0, levels) - zp
        wq = weight * q
        sum_qq = (wq * q).sum(axis=1, keepdims=True)
        fitted = _f16(np.where(sum_qq > 0, (wq * blocks).sum(axis=1, keepdims=True) / np.where(sum_qq > 0, sum_qq, 1),
                               scale))
        err = (weight * (blocks - fitted * q) ** 2).sum(axis=1, keepdims=True)
        better = err < best[0]
        best = (np.where(better, err, best[0]), np.where(better, fitted, best[1]), np.where(better, zp, best[2]))
    return best[1], best[2]


def _refit_f16(blocks, weight, scale, zp, bits, symmetric):
    """The chosen scale, rounded to float16, and its neighbours: whichever gives the least error
    once the integers are rounded again with it."""
    scale = _f16(scale)
    best, best_err = scale, None
    for candidate in (scale, _f16(np.nextafter(scale.astype(np.float16), np.float16(np.inf)).astype(np.float32)),
                      _f16(np.nextafter(scale.astype(np.float16), np.float16(-np.inf)).astype(np.float32))):
        q = _round_to(blocks, candidate, zp, bits, symmetric)
        err = (weight * (blocks - candidate * q) ** 2).sum(axis=1, keepdims=True)
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best, best_err = np.where(better, candidate, best), np.where(better, err, best_err)
    return best
