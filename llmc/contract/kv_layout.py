"""How a layer's KV pool lays out its blocks: the one fact lowering and runtime must share about it.

The runtime only hands block ids around; what a block holds is the lowering's business, so an
engine names its layout (manifest `kv_cache.layout`, and the graph's metadata while it is built):

- token-major `[2, num_blocks, block_size, num_kv_heads, head_dim]`: a block is its tokens'
  K (or V) rows. llmc::PagedAttention's contract, and the standard-op lowerings.
- head-major `[2, num_blocks, num_kv_heads, block_size, head_dim]`, each (block, KV head) key
  tile stored transposed as `[head_dim, block_size]`: llmc's CPU attention kernel. A tile is
  one contiguous run and scoring it needs no horizontal sums (docs/attention_cpu.md).

A pool's dtype (manifest `kv_cache.dtype`, `llmc build --kv-cache-dtype`) is the engine's, every
layer alike. fp32 works with either layout, and so do fp16 and bf16 (on the CPU, llmc's kernel
reads them head-major; TensorRT's plugin reads them token-major); int8 is the CPU kernel's:
- fp16 / bf16: the layout's shape with float16 / bfloat16 elements, the rotated K and V
  rounded to nearest even;
- int8: `[2, num_blocks, num_kv_heads, block_size * (head_dim + 4)]` bytes, each (K or V, block,
  KV head) tile `block_size * head_dim` int8 values laid out as the float tiles (keys transposed)
  followed by `block_size` little-endian float32 scales, one per token: scale = max|x| / 127
  over the token's head_dim values, q = round-half-even(x / scale) (0 where the scale is 0),
  read back as q * scale.
The runtime never looks inside a block, so the dtype changes only a block's bytes.
"""

from __future__ import annotations

import numpy as np

TOKEN_MAJOR = "token-major"
HEAD_MAJOR = "head-major"
LAYOUTS = (TOKEN_MAJOR, HEAD_MAJOR)
METADATA_KEY = "llmc.kv_cache_layout"  # in the ONNX model's metadata_props

KV_DTYPES = ("fp32", "fp16", "bf16", "int8")
# The pool's ONNX / ORT element type per dtype (TensorProto.FLOAT, FLOAT16, BFLOAT16, INT8).
ELEMENT_TYPES = {"fp32": 1, "fp16": 10, "bf16": 16, "int8": 3}
SCALE_BYTES = 4  # an int8 tile's per-token scale: float32


def check_dtype(dtype: str, layout: str = HEAD_MAJOR) -> None:
    """Raise ValueError, naming the fix, for a dtype that is unknown or that `layout` cannot hold."""
    if dtype not in KV_DTYPES:
        raise ValueError(f"unknown KV-cache dtype {dtype!r} (known: {', '.join(KV_DTYPES)})")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown KV-cache layout {layout!r} (known: {', '.join(LAYOUTS)})")
    if dtype == "int8" and layout != HEAD_MAJOR:
        raise ValueError(f"an int8 KV cache needs llmc's CPU attention kernel (the head-major layout), not the "
                         f"{layout} pool: build with the cpu-kernels pass enabled, or another --kv-cache-dtype")


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy element type of a pool of `dtype` (bf16: ml_dtypes.bfloat16; ORT's
    ortvalue_from_numpy takes it as its uint16 view, see `ort_value_args`)."""
    check_dtype(dtype)
    if dtype == "bf16":
        import ml_dtypes  # installed with onnx; imported only for bf16 pools

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"fp32": np.float32, "fp16": np.float16, "int8": np.int8}[dtype])


def storage_dtype(dtype: str) -> np.dtype:
    """A numpy type with the pool's element size that ORT's Python binding accepts (bf16: uint16)."""
    check_dtype(dtype)
    return np.dtype({"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16, "int8": np.int8}[dtype])


def ort_value_args(pool: np.ndarray, dtype: str) -> tuple:
    """(array, element type) for `ort.OrtValue.ortvalue_from_numpy_with_onnx_type(*args)`: an
    OrtValue over the pool's own memory (no copy), so IOBinding can update it in place."""
    return pool.view(storage_dtype(dtype)), ELEMENT_TYPES[dtype]


def int8_tile_bytes(block_size, head_dim):
    """An int8 pool's last dim, block_size * (head_dim + 4): one (K or V, block, KV head) tile
    (symbolic when a size is a name)."""
    if isinstance(block_size, int) and isinstance(head_dim, int):
        return block_size * (head_dim + SCALE_BYTES)
    return f"{block_size} * ({head_dim} + {SCALE_BYTES})"


def pool_shape(layout: str, num_blocks, block_size: int, num_kv_heads: int, head_dim: int,
               dtype: str = "fp32") -> tuple:
    check_dtype(dtype, layout)
    if layout == HEAD_MAJOR and dtype == "int8":
        return (2, num_blocks, num_kv_heads, int8_tile_bytes(block_size, head_dim))
    if layout == HEAD_MAJOR:
        return (2, num_blocks, num_kv_heads, block_size, head_dim)
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: str = "fp32") -> int:
    """K and V of one token in one layer's pool (int8: per KV head, the K and V values and scales)."""
    check_dtype(dtype)
    if dtype == "int8":
        return 2 * num_kv_heads * (head_dim + SCALE_BYTES)
    return 2 * num_kv_heads * head_dim * numpy_dtype(dtype).itemsize


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q int8, scale float32) per vector along x's last axis, as the kernel quantizes a token's
    head: scale = max|x| / 127, q = round-half-even(x / scale), 0 where the scale is 0."""
    x = np.asarray(x, np.float32)
    scale = np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale > 0, np.rint(x / np.where(scale > 0, scale, np.float32(1))), np.float32(0))
    return np.clip(q, -127, 127).astype(np.int8), scale[..., 0].astype(np.float32)


def round_trip(x: np.ndarray, dtype: str) -> np.ndarray:
    """x (float32, vectors along the last axis: a token's head) as a `dtype` pool stores and
    reads it back: rounded to nearest even (fp16, bf16) or quantized per vector (int8)."""
    check_dtype(dtype)
    if dtype == "fp32":
        return x
    x = np.asarray(x, np.float32)
    if dtype == "int8":
        q, scale = quantize_int8(x)
        return q.astype(np.float32) * scale[..., None]
    return x.astype(numpy_dtype(dtype)).astype(np.float32)


def of_model(model) -> str:
    """The layout an onnx_ir model's pools use (token-major unless a pass said otherwise)."""
    return model.metadata_props.get(METADATA_KEY, TOKEN_MAJOR)


def set_layout(model, layout: str) -> None:
    """Record on an onnx_ir model the layout its pools now use."""
    model.metadata_props[METADATA_KEY] = layout


def to_token_major(pool: np.ndarray, layout: str, dtype: str = "fp32", *, head_dim: int | None = None) -> np.ndarray:
    """A pool in `layout` and `dtype` as the float32 token-major array of the values it holds (to
    compare pools; int8 is dequantized, and needs `head_dim`: its tiles do not say it)."""
    check_dtype(dtype, layout)
    if layout == TOKEN_MAJOR:
        return pool.view(numpy_dtype(dtype)).astype(np.float32) if dtype != "fp32" else pool
    if dtype == "int8":
        if head_dim is None:
            raise ValueError("an int8 pool's head_dim is not in its shape: pass head_dim=")
        n, h, width = pool.shape[1:]
        bs = width // (head_dim + SCALE_BYTES)
        tiles = np.ascontiguousarray(pool).view(np.int8)
        q = tiles[..., :bs * head_dim].astype(np.float32)
        scale = np.ascontiguousarray(tiles[..., bs * head_dim:]).view("<f4")  # [2, N, H, bs]
        keys = q[0].reshape(n, h, head_dim, bs) * scale[0][:, :, None, :]
        values = q[1].reshape(n, h, bs, head_dim) * scale[1][..., None]
        return np.stack([keys.transpose(0, 3, 1, 2), values.transpose(0, 2, 1, 3)])
    pool = pool.view(numpy_dtype(dtype)).astype(np.float32) if dtype != "fp32" else pool
    n, h, bs, d = pool.shape[1:]
    keys = pool[0].reshape(n, h, d, bs).transpose(0, 3, 1, 2)  # tiles [D, bs] -> [N, bs, H, D]
    values = pool[1].transpose(0, 2, 1, 3)  # [N, H, bs, D] -> [N, bs, H, D]
    return np.stack([keys, values])


def from_token_major(pool: np.ndarray, layout: str, dtype: str = "fp32") -> np.ndarray:
    """A float32 token-major pool as a pool in `layout` and `dtype` (rounded or quantized as the
    kernel writes)."""
    check_dtype(dtype, layout)
    if layout == TOKEN_MAJOR:
        return pool
    n, bs, h, d = pool.shape[1:]
    keys = pool[0].transpose(0, 2, 3, 1)  # [N, H, D, bs]: the tiles
    values = pool[1].transpose(0, 2, 1, 3)  # [N, H, bs, D]
    if dtype == "int8":
        kq, ks = quantize_int8(pool[0].transpose(0, 2, 1, 3))  # per token and head: [N, H, bs, D]
        vq, vs = quantize_int8(values)
        tiles = [np.concatenate([q.reshape(n, h, bs * d),
                                 np.ascontiguousarray(s, "<f4").view(np.int8).reshape(n, h, SCALE_BYTES * bs)], -1)
                 for q, s in ((kq.transpose(0, 1, 3, 2), ks), (vq, vs))]
        return np.stack(tiles)
    out = np.stack([keys.reshape(n, h, bs, d), values])  # key tiles [D, bs], in an [N, H, bs, D] array
    return out if dtype == "fp32" else out.astype(numpy_dtype(dtype))
