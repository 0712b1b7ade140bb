"""The quantized and 16-bit weight formats of llmc's GEMM kernel (layout in kernels.h, quant.c).

The packed-GEMM ops (PackedMatMul, SkipRMSNormMatMul, SwiGLUMatMul) take the node attribute
`weight_format` (WEIGHT_FORMATS) and, for the quantized formats, `block_size` (32, 64 or 128) and
`zero_points` (1 when blocks are asymmetric). The 16-bit formats are the fp32 column panels
[ceil(N / 32), K, 32] with uint16 elements, widened to fp32 in the tile. The quantized ones follow
ONNX DequantizeLinear along K (axis 0): w[k, c] = (q[k, c] - zp[k // B, c]) * scale[k // B, c];
they are one uint8 blob of 32-column panels, each K / B blocks of [32 float16 scales | 32 int8 zero
points (asymmetric only) | B / 4 groups of 4 k steps: 32 columns x 4 bytes (int8), 64 bytes of
nibbles (int4), or those nibbles as the low 4 bits and 32 bytes of the high 2 (int6)], so a decode
step streams each block's scales with its weights. Symmetric int4 at B = 32 is 4.5 bits a weight,
int6 6.5. int6 has no ONNX type: the graph holds it as int8 in [-32, 31] (or uint8 in [0, 63]).

The kernel quantizes activations on the fly (per row and block, symmetric int8) and sums integer
products; `reference` is that arithmetic in numpy, the oracle of the tests.
"""

from __future__ import annotations

import numpy as np

from llmc.plugins.cpu import PANEL

WEIGHT_FORMATS = {"fp32": 0, "bf16": 1, "fp16": 2, "int8": 3, "int4": 4, "int6": 5}
QUANT_BITS = (8, 6, 4)
BLOCK_SIZES = (32, 64, 128)
_SCALES = PANEL * 2  # a block's float16 scales, bytes
_ZERO_POINTS = PANEL  # its int8 zero points (asymmetric only)


def _group_bytes(bits: int) -> int:
    return {8: 4, 6: 3, 4: 2}[bits] * PANEL


def quantized_bytes(k: int, n: int, bits: int, block_size: int, zero_points: bool) -> int:
    """The size of a quantized blob (llmc_quant_bytes in quant.c)."""
    block = _SCALES + (_ZERO_POINTS if zero_points else 0) + block_size // 4 * _group_bytes(bits)
    return -(-n // PANEL) * (k // block_size) * block


def _check(q: np.ndarray, zero_point, bits: int, block_size: int) -> None:
    if bits not in QUANT_BITS or block_size not in BLOCK_SIZES or q.ndim != 2 or q.shape[0] % block_size:
        raise ValueError(f"cannot pack a {list(q.shape)} int{bits} weight with block_size {block_size}: "
                         f"bits must be one of {QUANT_BITS}, block_size one of {BLOCK_SIZES} and dividing K")
    low, high = value_range(bits, zero_point is None)
    for name, v in (("q", q), ("zero_point", zero_point)):
        if v is not None and v.size and (v.min() < low or v.max() > high):
            raise ValueError(f"{name} holds values outside [{low}, {high}] for int{bits}")


def value_range(bits: int, symmetric: bool) -> tuple[int, int]:
    """The integers a format holds: symmetric [-2^(b-1), 2^(b-1) - 1], else [0, 2^b - 1]."""
    return (-(1 << bits - 1), (1 << bits - 1) - 1) if symmetric else (0, (1 << bits) - 1)


def narrowest_bits(q: np.ndarray, zero_point: np.ndarray | None) -> int:
    """The fewest bits of QUANT_BITS that hold every value of an int8/uint8 weight exactly: int6
    stored in the graph as int8 packs as int6, the same integers in fewer bytes."""
    symmetric = zero_point is None
    for bits in sorted(QUANT_BITS):
        low, high = value_range(bits, symmetric)
        if all(v is None or not v.size or (v.min() >= low and v.max() <= high) for v in (q, zero_point)):
            return bits
    return 8


def pack_quantized(q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, bits: int,
                   block_size: int) -> np.ndarray:
    """q [K, N] (int8 symmetric / uint8 asymmetric, int4 values in the low range), scale [K / B, N]
    float32 (stored as float16: exact for the scales llmc's quantizers make), zero_point [K / B, N]
    or None -> the blob (uint8, 1-D) the ops take with weight_format WEIGHT_FORMATS[f"int{bits}"]."""
    _check(q, zero_point, bits, block_size)
    k, n = q.shape
    blocks, panels = k // block_size, -(-n // PANEL)
    cols = panels * PANEL
    stored = np.zeros((k, cols), np.int16)
    if bits == 8:  # asymmetric: q - 128 and zp - 128, so the kernel's bytes are signed either way
        stored[:, :n] = q.astype(np.int16) - (0 if zero_point is None else 128)
    else:  # symmetric int4/int6 stored + 8/+ 32: the unsigned operand the kernel's vpmaddubsw wants
        stored[:, :n] = q.astype(np.int16) + (1 << bits - 1 if zero_point is None else 0)
    half = np.zeros((blocks, cols), np.float16)  # padding columns: scale 0
    half[:, :n] = scale.astype(np.float16)
    if not np.isfinite(half).all():
        raise ValueError("a scale is beyond float16's range")
    parts = [half.reshape(blocks, panels, PANEL).transpose(1, 0, 2).copy().view(np.uint8)]
    if zero_point is not None:
        zp = np.zeros((blocks, cols), np.int16)
        zp[:, :n] = zero_point.astype(np.int16) - (128 if bits == 8 else 0)
        parts.append(zp.astype(np.int8).reshape(blocks, panels, PANEL).transpose(1, 0, 2).view(np.uint8))
    # [K, cols] -> [panel, block, group, column, k in group]
    groups = stored.reshape(blocks, block_size // 4, 4, panels, PANEL).transpose(3, 0, 1, 4, 2)
    if bits == 8:
        body = groups.astype(np.int8).view(np.uint8)
    else:  # per 16 columns one 32-byte vector: columns c (low nibble) and c + 8 (high), 4 k each
        g = groups.astype(np.uint8).reshape(panels, blocks, block_size // 4, 2, 2, 8, 4)
        body = (g[..., 0, :, :] & 15) | (g[..., 1, :, :] & 15) << 4
        if bits == 6:  # then 32 bytes: column c % 8 + 8j's high 2 bits at bits 2j of byte c % 8 * 4 + k
            high = g.reshape(panels, blocks, block_size // 4, 4, 8, 4) >> 4
            plane = high[..., 0, :, :] | high[..., 1, :, :] << 2 | high[..., 2, :, :] << 4 | high[..., 3, :, :] << 6
            body = np.concatenate([body.reshape(panels, blocks, block_size // 4, 64),
                                   plane.reshape(panels, blocks, block_size // 4, 32)], axis=3)
    parts.append(body.reshape(panels, blocks, -1))
    return np.ascontiguousarray(np.concatenate(parts, axis=2)).ravel()


def pack_quantized_experts(q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, bits: int,
                           block_size: int) -> np.ndarray:
    """Stacked expert weights as the checkpoint lays them out, q [E, N, K] with scale (and
    zero_point) [E, N, K / B] -> [E, bytes]: each expert's blob as pack_quantized makes it for its
    [K, N] weight, what llmc.cpu::Experts reads with a quantized weight_format."""
    return np.stack([pack_quantized(q[e].T, scale[e].T, None if zero_point is None else zero_point[e].T, bits,
                                    block_size) for e in range(len(q))])


def pack_16bit(w: np.ndarray, dtype: str) -> np.ndarray:
    """[K, N] float32 -> uint16 panels [ceil(N / 32), K, 32]: bf16 (round to nearest even) or fp16."""
    from llmc.plugins.cpu import pack_weight

    return to_16bit(pack_weight(w.astype(np.float32)), dtype)


def to_16bit(w: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> its bf16 or fp16 bits (uint16), elementwise."""
    w = np.ascontiguousarray(w, np.float32)
    if dtype == "fp16":
        return w.astype(np.float16).view(np.uint16)
    if dtype != "bf16":
        raise ValueError(f"16-bit dtype is bf16 or fp16, not {dtype!r}")
    bits = w.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(w), (bits >> 16).astype(np.uint16) | 0x40, rounded)  # NaN stays NaN


def from_16bit(h: np.ndarray, dtype: str) -> np.ndarray:
    """The float32 values of 16-bit bits: what the kernel multiplies by."""
    if dtype == "fp16":
        return h.view(np.float16).astype(np.float32)
    return (h.astype(np.uint32) << 16).view(np.float32)


def quantize_activations(x: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows [M, K] -> (xq [M, K / B, B] int8 values as int64, sx [M, K / B] float32), as the kernel:
    sx = max|x| / 127 per block, xq = round-half-even(x * (1 / sx)), all in float32; a block
    with sx = 0 quantizes to zeros."""
    m, k = x.shape
    xb = x.astype(np.float32).reshape(m, k // block_size, block_size)
    sx = np.abs(xb).max(-1) / np.float32(127)
    ok = (sx > 0) & np.isfinite(sx)
    sx = np.where(ok, sx, np.float32(0)).astype(np.float32)
    inv = np.float32(1) / np.where(ok, sx, np.float32(1))
    xq = np.clip(np.rint(xb * inv[..., None]), -127, 127)
    return np.where(ok[..., None], xq, 0).astype(np.int64), sx


def reference(x: np.ndarray, q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, bits: int,
              block_size: int) -> np.ndarray:
    """x [..., K] @ the quantized weight, with the kernel's arithmetic: activations quantized per
    row and block, exact integer sums per block, then scale * sx per block (float64 here)."""
    _check(q, zero_point, bits, block_size)
    k, n = q.shape
    rows = x.reshape(-1, k)
    xq, sx = quantize_activations(rows, block_size)
    w = q.astype(np.int64).reshape(k // block_size, block_size, n)
    if zero_point is not None:
        w = w - zero_point.astype(np.int64)[:, None, :]
    dots = np.einsum("mbk,bkn->mbn", xq, w)  # integers
    s = scale.astype(np.float16).astype(np.float64)
    y = np.einsum("mbn,mb,bn->mn", dots.astype(np.float64), sx.astype(np.float64), s)
    return y.reshape(*x.shape[:-1], n)
