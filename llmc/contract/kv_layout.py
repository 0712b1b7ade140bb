"""How a layer's KV pool lays out its blocks: the one fact lowering and runtime must share about it.

The runtime only hands block ids around; what a block holds is the lowering's business, so an
engine names its layout (manifest `kv_cache.layout`, and the graph's metadata while it is built):

- token-major `[2, num_blocks, block_size, num_kv_heads, head_dim]`: a block is its tokens'
  K (or V) rows. llmc::PagedAttention's contract, and the standard-op lowerings.
- head-major `[2, num_blocks, num_kv_heads, block_size, head_dim]`, each (block, KV head) key
  tile stored transposed as `[head_dim, block_size]`: llmc's CPU attention kernel. A tile is
  one contiguous run and scoring it needs no horizontal sums (docs/attention_cpu.md).
"""

from __future__ import annotations

import numpy as np

TOKEN_MAJOR = "token-major"
HEAD_MAJOR = "head-major"
LAYOUTS = (TOKEN_MAJOR, HEAD_MAJOR)
METADATA_KEY = "llmc.kv_cache_layout"  # in the ONNX model's metadata_props


def pool_shape(layout: str, num_blocks, block_size: int, num_kv_heads: int, head_dim: int) -> tuple:
    if layout == HEAD_MAJOR:
        return (2, num_blocks, num_kv_heads, block_size, head_dim)
    if layout == TOKEN_MAJOR:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)
    raise ValueError(f"unknown KV-cache layout {layout!r} (known: {', '.join(LAYOUTS)})")


def of_model(model) -> str:
    """The layout an onnx_ir model's pools use (token-major unless a pass said otherwise)."""
    return model.metadata_props.get(METADATA_KEY, TOKEN_MAJOR)


def set_layout(model, layout: str) -> None:
    """Record on an onnx_ir model the layout its pools now use."""
    model.metadata_props[METADATA_KEY] = layout


def to_token_major(pool: np.ndarray, layout: str) -> np.ndarray:
    """A pool in `layout` as the token-major array of the same contents (to compare pools)."""
    if layout == TOKEN_MAJOR:
        return pool
    n, h, bs, d = pool.shape[1:]
    keys = pool[0].reshape(n, h, d, bs).transpose(0, 3, 1, 2)  # tiles [D, bs] -> [N, bs, H, D]
    values = pool[1].transpose(0, 2, 1, 3)  # [N, H, bs, D] -> [N, bs, H, D]
    return np.stack([keys, values])


def from_token_major(pool: np.ndarray, layout: str) -> np.ndarray:
    if layout == TOKEN_MAJOR:
        return pool
    n, bs, h, d = pool.shape[1:]
    keys = pool[0].transpose(0, 2, 3, 1).reshape(n, h, bs, d)  # tiles [D, bs], in an [N, H, bs, D] array
    values = pool[1].transpose(0, 2, 1, 3)
    return np.stack([keys, values])
