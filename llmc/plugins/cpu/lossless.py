"""The lossless weight format of llmc's GEMM kernel (layout in kernels.h, `llmc_linear_lossless`).

A float32's top byte (sign and the 7 high exponent bits) takes few values in a weight matrix: the
16 commonest of a 32-column panel cover nearly all of its weights in trained and in randomly
initialised models alike (docs/attention_cpu.md, "Lossless weights"). Each weight is stored as a
4-bit code into the panel's table plus its low 24 bits, 28 bits in place of 32; the rare weights
whose top byte misses the table are listed as exceptions with their bits. Decoding is exact, so a product over this format equals the
fp32 one bit for bit, while a decode step streams 12.5% fewer bytes.
"""

from __future__ import annotations

import numpy as np

from llmc.plugins.cpu import PANEL

TABLE = 16
GROUP = 4  # k steps per group: a group's planes fill whole 64-byte lines
# Above this share of exceptions (8 bytes each, and a patch in the kernel's loop) the copy stops
# paying for itself: a weight with so spread a range keeps only its fp32 form.
MAX_EXCEPTION_SHARE = 0.01


def _panel_bytes(k: int) -> int:
    return TABLE * 4 + k // GROUP * GROUP * (PANEL * 3 + 16)


def _exception_lists(blob: np.ndarray, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """An encoded weight's per-panel offsets [panels + 1] and its (position, bits) pairs."""
    panels = -(-n // PANEL)
    tail = blob[panels * _panel_bytes(k):]
    offsets = tail[:4 * (panels + 1)].copy().view(np.int32)
    return offsets, tail[4 * (panels + 1):].copy().view(np.int32).reshape(-1, 2)


def exceptions(blob: np.ndarray, k: int, n: int) -> int:
    """How many floats of an encoded weight are listed as exceptions."""
    return int(_exception_lists(blob, k, n)[0][-1])


def _top_bytes(packed: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(packed).view(np.uint32) >> 24).astype(np.uint8)


def _top_byte_counts(top: np.ndarray) -> np.ndarray:
    """[panels, 256]: how often each top byte occurs in each panel."""
    return np.stack([np.bincount(top[p].ravel(), minlength=256) for p in range(top.shape[0])])


def exception_share(packed: np.ndarray) -> float:
    """The share of a packed weight's floats the format would list as exceptions (without encoding it)."""
    counts = _top_byte_counts(_top_bytes(packed))
    return 1.0 - float(np.sort(counts, axis=1)[:, -TABLE:].sum()) / packed.size


def supports(packed: np.ndarray) -> str | None:
    """None if `packed` ([panels, K, 32] float32) can be encoded, else why not."""
    if packed.dtype != np.float32 or packed.ndim != 3 or packed.shape[2] != PANEL:
        return f"the weight is {packed.dtype} {list(packed.shape)}, not a packed float32 [panels, K, {PANEL}]"
    if packed.shape[1] % GROUP:
        return f"K = {packed.shape[1]} is not a multiple of {GROUP}"
    return None


def encode(packed: np.ndarray) -> np.ndarray:
    """[panels, K, 32] float32 -> the format's bytes (uint8, 1-D)."""
    if (why := supports(packed)) is not None:
        raise ValueError(why)
    panels, k, _ = packed.shape
    bits = np.ascontiguousarray(packed).view(np.uint32)
    top = _top_bytes(packed)
    counts = _top_byte_counts(top)
    table = np.argsort(-counts, axis=1, kind="stable")[:, :TABLE].astype(np.uint32)  # commonest first
    code_of = np.full((panels, 256), TABLE, np.uint8)
    np.put_along_axis(code_of, table.astype(np.int64), np.arange(TABLE, dtype=np.uint8)[None, :], axis=1)
    codes = np.take_along_axis(code_of, top.reshape(panels, -1).astype(np.int64), axis=1).reshape(top.shape)
    missed = codes == TABLE
    codes[missed] = 0  # decoded wrong, then patched from the exception list

    groups = k // GROUP
    low = (bits & 0xFFFF).astype(np.uint16).reshape(panels, groups, GROUP * PANEL).view(np.uint8)
    mid = ((bits >> 16) & 0xFF).astype(np.uint8).reshape(panels, groups, GROUP * PANEL)
    pairs = (codes[..., :16] | codes[..., 16:] << 4).reshape(panels, groups, GROUP * 16)
    body = np.concatenate([low, mid, pairs], axis=2).reshape(panels, -1)
    header = (table << 24).view(np.uint8)
    where = np.nonzero(missed)  # C order: by panel, then k, then column
    offsets = np.zeros(panels + 1, np.int32)
    offsets[1:] = np.cumsum(np.bincount(where[0], minlength=panels))
    exceptions = np.stack([(where[1] * PANEL + where[2]).astype(np.int32),
                           bits[missed].view(np.int32)], axis=1)
    return np.concatenate([np.concatenate([header, body], axis=1).ravel(), offsets.view(np.uint8),
                           exceptions.ravel().view(np.uint8)])


def decode(blob: np.ndarray, k: int, n: int) -> np.ndarray:
    """The format's bytes -> [panels, K, 32] float32: the reference the kernel is tested against."""
    panels, groups = -(-n // PANEL), k // GROUP
    panel_bytes = _panel_bytes(k)
    body = blob[:panels * panel_bytes].reshape(panels, panel_bytes)
    table = body[:, :TABLE * 4].copy().view(np.uint32)
    planes = body[:, TABLE * 4:].reshape(panels, groups, -1)
    low = planes[..., :GROUP * PANEL * 2].copy().view(np.uint16).astype(np.uint32)
    mid = planes[..., GROUP * PANEL * 2:GROUP * PANEL * 3].astype(np.uint32)
    pairs = planes[..., GROUP * PANEL * 3:].reshape(panels, groups, GROUP, 16)
    codes = np.concatenate([pairs & 15, pairs >> 4], axis=3).reshape(panels, groups, GROUP * PANEL)
    high = np.take_along_axis(table, codes.reshape(panels, -1).astype(np.int64), axis=1).reshape(codes.shape)
    bits = (low | mid << 16 | high).reshape(panels, k, PANEL)
    offsets, exceptions = _exception_lists(blob, k, n)
    if len(exceptions) != offsets[-1]:
        raise ValueError(f"the blob lists {len(exceptions)} exceptions, its offsets {offsets[-1]}")
    for p in range(panels):
        for pos, value in exceptions[offsets[p]:offsets[p + 1]]:
            bits[p, pos // PANEL, pos % PANEL] = np.int32(value).view(np.uint32)
    return bits.view(np.float32)
