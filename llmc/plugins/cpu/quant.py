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

mxfp4 (weight_format 6) holds an OCP Microscaling checkpoint's weights (gpt-oss's experts) as they
are, rearranged into the same panels: per block of 32 k, 32 E8M0 scale bytes then int4's 64 nibble
bytes a group, each nibble an E2M1 code, 4.25 bits a weight (pack_mxfp4; kernels.h has the layout).

The kernel quantizes activations on the fly (per row and block, symmetric int8) and sums integer
products; `reference` (and `reference_mxfp4`) is that arithmetic in numpy, the oracle of the tests.
"""

from __future__ import annotations

import numpy as np

from llmc.plugins.cpu import PANEL

WEIGHT_FORMATS = {"fp32": 0, "bf16": 1, "fp16": 2, "int8": 3, "int4": 4, "int6": 5, "mxfp4": 6}
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
    groups = _groups(stored, block_size)
    if bits == 8:
        body = groups.astype(np.int8).view(np.uint8)
    else:
        body = _nibbles(groups)
        if bits == 6:  # then 32 bytes: column c % 8 + 8j's high 2 bits at bits 2j of byte c % 8 * 4 + k
            high = groups.astype(np.uint8).reshape(panels, blocks, block_size // 4, 4, 8, 4) >> 4
            plane = high[..., 0, :, :] | high[..., 1, :, :] << 2 | high[..., 2, :, :] << 4 | high[..., 3, :, :] << 6
            body = np.concatenate([body.reshape(panels, blocks, block_size // 4, 64),
                                   plane.reshape(panels, blocks, block_size // 4, 32)], axis=3)
    parts.append(body.reshape(panels, blocks, -1))
    return np.ascontiguousarray(np.concatenate(parts, axis=2)).ravel()


def _groups(stored: np.ndarray, block_size: int) -> np.ndarray:
    """[K, cols] -> [panel, block, group, column, k in group]: the order a blob holds a block's weights."""
    k, cols = stored.shape
    return stored.reshape(k // block_size, block_size // 4, 4, cols // PANEL, PANEL).transpose(3, 0, 1, 4, 2)


def _nibbles(groups: np.ndarray) -> np.ndarray:
    """int4's 64 bytes a group: per 16 columns one 32-byte vector, byte c % 8 * 4 + k holding column
    c (low nibble) and c + 8 (high), 4 k each. [panel, block, group, 32, 4] -> [..., 2, 8, 4] uint8."""
    g = groups.astype(np.uint8).reshape(*groups.shape[:3], 2, 2, 8, 4)
    return (g[..., 0, :, :] & 15) | (g[..., 1, :, :] & 15) << 4


def pack_quantized_experts(q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, bits: int,
                           block_size: int) -> np.ndarray:
    """Stacked expert weights as the checkpoint lays them out, q [E, N, K] with scale (and
    zero_point) [E, N, K / B] -> [E, bytes]: each expert's blob as pack_quantized makes it for its
    [K, N] weight, what llmc.cpu::Experts reads with a quantized weight_format."""
    return np.stack([pack_quantized(q[e].T, scale[e].T, None if zero_point is None else zero_point[e].T, bits,
                                    block_size) for e in range(len(q))])


# -- mxfp4 ----------------------------------------------------------------------------------------

MXFP4_BLOCK = 32  # weights per E8M0 scale, along K
# An E2M1 code's value: bit 3 the sign, code & 7 indexes the magnitudes (transformers' FP4_VALUES).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
_MX_BLOCK_BYTES = PANEL + MXFP4_BLOCK // 4 * _group_bytes(4)  # 32 scale bytes, 8 groups of nibbles: 544
_MX_PADDING_SCALE = 127  # the padding columns' scale byte (2^0: no subnormal in the tile's arithmetic)


def mxfp4_bytes(k: int, n: int) -> int:
    """The size of an mxfp4 blob for a [K, N] weight (llmc_quant_bytes in quant.c)."""
    return -(-n // PANEL) * (k // MXFP4_BLOCK) * _MX_BLOCK_BYTES


def _check_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> None:
    if (blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.ndim != 3 or blocks.shape[2] != 16
            or scales.shape != blocks.shape[:2]):
        raise ValueError(f"mxfp4 weights are blocks uint8 [N, K / 32, 16] and scales uint8 [N, K / 32], not "
                         f"{blocks.dtype} {list(blocks.shape)} and {scales.dtype} {list(scales.shape)}")


def _codes(blocks: np.ndarray) -> np.ndarray:
    """The checkpoint's [N, K / 32, 16] bytes -> E2M1 codes [N, K]: weight k = 32 g + 2 i in the low
    nibble of block g's byte i, k + 1 in its high nibble."""
    return np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(blocks.shape[0], -1)


def pack_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """One weight as an MXFP4 checkpoint holds it (gpt-oss's `*_blocks` uint8 [N, K / 32, 16] and
    `*_scales` uint8 [N, K / 32] of one expert, N the output rows) -> the blob (uint8, 1-D, of
    mxfp4_bytes) the ops read with weight_format WEIGHT_FORMATS["mxfp4"]: the same codes and scale
    bytes, rearranged into column panels."""
    _check_mxfp4(blocks, scales)
    n, nb = scales.shape
    k, panels = nb * MXFP4_BLOCK, -(-n // PANEL)
    codes = np.zeros((k, panels * PANEL), np.uint8)  # padding columns: code 0
    codes[:, :n] = _codes(blocks).T
    e = np.full((nb, panels * PANEL), _MX_PADDING_SCALE, np.uint8)
    e[:, :n] = scales.T
    head = e.reshape(nb, panels, PANEL).transpose(1, 0, 2)
    body = _nibbles(_groups(codes, MXFP4_BLOCK)).reshape(panels, nb, -1)
    return np.ascontiguousarray(np.concatenate([head, body], axis=2)).ravel()


def unpack_mxfp4(blob: np.ndarray, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """pack_mxfp4's inverse: the blob of a [K, N] weight -> (blocks [N, K / 32, 16], scales [N, K / 32])."""
    panels, nb = -(-n // PANEL), k // MXFP4_BLOCK
    if blob.dtype != np.uint8 or blob.size != mxfp4_bytes(k, n) or k % MXFP4_BLOCK:
        raise ValueError(f"not an mxfp4 blob of K = {k}, N = {n} ({mxfp4_bytes(k, n)} bytes)")
    parts = blob.reshape(panels, nb, _MX_BLOCK_BYTES)
    scales = parts[:, :, :PANEL].transpose(1, 0, 2).reshape(nb, -1)[:, :n].T
    body = parts[:, :, PANEL:].reshape(panels, nb, MXFP4_BLOCK // 4, 2, 8, 4)  # [.., half, column % 8, k % 4]
    nibbles = np.stack([body & 15, body >> 4], axis=4)  # [.., half, low / high, column % 8, k % 4]
    codes = nibbles.reshape(panels, nb, MXFP4_BLOCK // 4, PANEL, 4).transpose(1, 2, 4, 0, 3).reshape(k, -1)
    pairs = codes[:, :n].T.reshape(n, nb, 16, 2)
    return np.ascontiguousarray(pairs[..., 0] | pairs[..., 1] << 4), np.ascontiguousarray(scales)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The weight the checkpoint means, float32 [N, K]: FP4_VALUES[code] * 2^(scale - 127), as
    transformers' convert_moe_packed_tensors computes it (ldexp, so scale byte 0 gives the subnormal
    multiples of 2^-128 and 255 overflows: +-inf, but +-2^127 for +-0.5 and +-0 for the zero codes)."""
    _check_mxfp4(blocks, scales)
    exponent = np.repeat(scales.astype(np.int32) - 127, MXFP4_BLOCK, axis=1)
    with np.errstate(over="ignore"):
        return np.ldexp(FP4_VALUES[_codes(blocks)], exponent)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float weights [..., N, K] -> MXFP4 as gpt-oss's checkpoints store them (blocks [..., N, K / 32,
    16], scales [..., N, K / 32]): per 32 values the power of two that brings the largest within 6,
    each value the nearest E2M1 code (ties to the smaller magnitude), two codes a byte. For making
    checkpoints in the released format (tests, benchmarks); llmc never requantizes one."""
    blocks = w.reshape(*w.shape[:-1], -1, MXFP4_BLOCK)
    top = np.abs(blocks).max(-1, keepdims=True)
    exponent = np.where(top > 0, np.ceil(np.log2(np.maximum(top, 1e-30) / 6)), 0).astype(np.int32)
    scaled = blocks / np.exp2(exponent)
    magnitude = np.abs(np.abs(scaled)[..., None] - FP4_VALUES[:8]).argmin(-1)
    codes = (magnitude | ((scaled < 0) & (magnitude > 0)) << 3).astype(np.uint8)
    return (np.ascontiguousarray(codes[..., 0::2] | codes[..., 1::2] << 4),
            np.ascontiguousarray(exponent[..., 0] + 127, dtype=np.uint8))


def mxfp4_factors(scales: np.ndarray) -> np.ndarray:
    """The kernel's factor of each block, float32(2^(e - 127)) / 2 as float64 (the codes read as twice
    their value): 2^(e - 128), and +inf for e = 255, whose 2^128 overflows float32 (kernels.h)."""
    with np.errstate(over="ignore"):
        return np.ldexp(np.float32(1), scales.astype(np.int32) - 127).astype(np.float64) / 2


def reference_mxfp4(x: np.ndarray, blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """x [..., K] @ the mxfp4 weight's transpose ([..., N]), with the kernel's arithmetic: activations
    quantized per row and block of 32, exact integer sums of xq * 2 value per block, then sx *
    2^(e - 128) per block (float64 here; a 255 scale's +inf makes NaN where sx or the sum is 0)."""
    _check_mxfp4(blocks, scales)
    n, nb = scales.shape
    rows = x.reshape(-1, nb * MXFP4_BLOCK)
    xq, sx = quantize_activations(rows, MXFP4_BLOCK)
    twice = (2 * FP4_VALUES[_codes(blocks)]).astype(np.int64).reshape(n, nb, MXFP4_BLOCK)
    dots = np.einsum("mbk,nbk->mbn", xq, twice).astype(np.float64)  # integers
    with np.errstate(invalid="ignore"):
        y = np.einsum("mbn,mb,nb->mn", dots, sx.astype(np.float64), mxfp4_factors(scales))
    return y.reshape(*x.shape[:-1], n)


def pack_mxfp4_experts(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Stacked experts as the checkpoint holds them, blocks [E, N, K / 32, 16] and scales [E, N, K / 32]
    -> [E, bytes]: each expert's pack_mxfp4 blob, what llmc.cpu::Experts reads with weight_format 6."""
    return np.stack([pack_mxfp4(b, s) for b, s in zip(blocks, scales)])


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
