"""`llmc::PagedAttention`: the one attention op every model is rewritten to.

This module is the op's single source of truth, used by both sides of the compiler:
- the spec (inputs, outputs, attributes, shape rule) that passes and backends agree on;
- `build_function()`: the op's meaning written in standard ONNX ops (opset 23). Attached to a
  model as a model-local function it makes a rewritten graph runnable by ONNX Runtime as is,
  which is what per-pass verification needs, and inlining it *is* the ORT lowering;
- `reference()`: a numpy implementation, the oracle for kernels (ORT lowering, TRT plugin).

Semantics (design §4). Row b holds `query_lens[b]` valid new tokens (the rest of S is padding).
New token j has position p = past_lens[b] + j; its K/V are written to block
`block_tables[b, p // block_size]` at offset `p % block_size`, then its query attends to
positions 0..p of row b (only positions > p - sliding_window when a window is set). Writes for
padding tokens go to block 0, which the KV cache manager reserves as a scratch block and never
hands to a sequence.

Cache layout: kv_cache is `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K then V).
A block is contiguous per K/V, so a paged read is one GatherND copy of exactly the blocks a
row uses, and a write is one ScatterND. `kv_cache_out` is the updated cache; backends alias it
to `kv_cache` (ORT: IOBinding to the same OrtValue; TRT: the plugin writes in place).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DOMAIN = "llmc"
OP_TYPE = "PagedAttention"
VERSION = 1
ONNX_OPSET = 23
SCRATCH_BLOCK = 0

INPUTS = ("query", "key", "value", "kv_cache", "past_lens", "query_lens", "block_tables")
OUTPUTS = ("output", "kv_cache_out")


@dataclass(frozen=True)
class PagedAttentionAttrs:
    num_heads: int
    num_kv_heads: int
    scale: float
    sliding_window: int = 0  # 0: attend to the whole prefix
    softcap: float = 0.0

    def as_dict(self) -> dict:
        return {
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "scale": float(self.scale),
            "sliding_window": self.sliding_window,
            "softcap": float(self.softcap),
        }


def output_shapes(query_shape, kv_cache_shape):
    """Shape rule shared by graph checks and the TensorRT plugin: output is query-shaped and
    the cache keeps its shape."""
    return tuple(query_shape), tuple(kv_cache_shape)


def cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int):
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def build_function():
    """The op as an ONNX model-local function (domain llmc), in opset-23 ops ORT runs on CPU."""
    import onnx_ir as ir

    from llmc.ir_builder import OpBuilder

    q, k, v, cache, past_lens, query_lens, block_tables = (ir.Value(name=n) for n in INPUTS)
    attr_names = ("num_heads", "num_kv_heads", "scale", "sliding_window", "softcap")
    fn_graph = ir.Graph(
        inputs=[q, k, v, cache, past_lens, query_lens, block_tables],
        outputs=[],
        nodes=[],
        opset_imports={"": ONNX_OPSET},
        name=OP_TYPE,
    )
    b = OpBuilder(fn_graph)

    def ref(name: str, attr_type: ir.AttributeType) -> ir.RefAttr:
        return ir.RefAttr(name, name, attr_type)

    const = b.const
    i64 = ir.DataType.INT64
    zero, one = const([0]), const([1])
    minus_one = const([-1])

    # Per-token positions, write slots and validity ([B, S]).
    q_shape = b.Shape(q)
    batch, seq = b.Slice(q_shape, zero, one), b.Slice(q_shape, const([2]), const([3]))
    j = b.Range(const(0), b.Squeeze(seq, zero), const(1))  # [S]
    past = b.Cast(past_lens, to=i64)
    pos = b.Add(b.Unsqueeze(past, one), b.Unsqueeze(j, zero))  # [B, S]
    valid = b.Less(b.Unsqueeze(j, zero), b.Unsqueeze(b.Cast(query_lens, to=i64), one))
    block_size = b.Slice(b.Shape(cache), const([2]), const([3]))
    table = b.Cast(block_tables, to=i64)
    last_col = b.Sub(b.Slice(b.Shape(table), one, const([2])), one)
    col = b.Min(b.Div(pos, block_size), last_col)
    block = b.Where(valid, b.GatherElements(table, col, axis=1), const(SCRATCH_BLOCK))
    offset = b.Mod(pos, block_size)

    # One ScatterND writes K and V together: a single op whose input is the graph's cache input
    # and whose output is the graph's cache output is what lets ORT update the pool in place.
    slot = b.Concat(b.Unsqueeze(block, minus_one), b.Unsqueeze(offset, minus_one), axis=-1)
    slot_shape = b.Concat(const([2]), b.Shape(slot), axis=0)
    kv_sel = b.Expand(const([[[[0]]], [[[1]]]]), b.Concat(const([2]), batch, seq, one, axis=0))
    write_idx = b.Concat(kv_sel, b.Expand(b.Unsqueeze(slot, zero), slot_shape), axis=-1)
    perm = (0, 2, 1, 3)
    new_kv = b.Concat(
        b.Unsqueeze(b.Transpose(k, perm=perm), zero),
        b.Unsqueeze(b.Transpose(v, perm=perm), zero),
        axis=0,
    )  # [2, B, S, Hkv, D]
    cache_out = b.ScatterND(cache, write_idx, new_kv)

    # Paged read: gather each row's blocks, K and V separately, into [B, T, Hkv*D].
    table_idx = b.Unsqueeze(table, minus_one)
    sel_shape = b.Shape(table_idx)
    hidden_kv = b.Mul(
        b.Slice(b.Shape(cache), const([3]), const([4])), b.Slice(b.Shape(cache), const([4]), const([5]))
    )
    flat = b.Concat(batch, minus_one, hidden_kv, axis=0)

    def read(which: int):
        sel = b.Expand(const([[[which]]]), sel_shape)
        return b.Reshape(b.GatherND(cache_out, b.Concat(sel, table_idx, axis=-1)), flat)

    keys, values = read(0), read(1)

    # Causal (and sliding-window) mask over the gathered positions: [B, 1, S, T].
    total = b.Mul(b.Slice(b.Shape(table), one, const([2])), block_size)
    t = b.Range(const(0), b.Squeeze(total, zero), const(1))
    pos3 = b.Unsqueeze(pos, minus_one)
    window = b.Constant(value_int=ref("sliding_window", ir.AttributeType.INT))
    lowest = b.Where(b.Greater(window, const(0)), b.Sub(pos3, window), const(-1))
    t3 = b.Unsqueeze(t, const([0, 1]))
    mask = b.Unsqueeze(b.And(b.LessOrEqual(t3, pos3), b.Greater(t3, lowest)), one)

    q3 = b.Reshape(b.Transpose(q, perm=perm), b.Concat(batch, seq, minus_one, axis=0))
    y3 = b.Attention(
        q3,
        keys,
        values,
        mask,
        q_num_heads=ref("num_heads", ir.AttributeType.INT),
        kv_num_heads=ref("num_kv_heads", ir.AttributeType.INT),
        scale=ref("scale", ir.AttributeType.FLOAT),
        softcap=ref("softcap", ir.AttributeType.FLOAT),
    )
    y4 = b.Reshape(y3, b.Concat(batch, seq, b.Slice(q_shape, one, const([2])), minus_one, axis=0))
    output = b.Transpose(y4, perm=perm)

    fn_graph.outputs.extend([output, cache_out])
    output.name, cache_out.name = OUTPUTS
    return ir.Function(DOMAIN, OP_TYPE, graph=fn_graph, attributes=[ir.Attr(n, ir.AttributeType.UNDEFINED, None) for n in attr_names])


def reference(query, key, value, kv_cache, past_lens, query_lens, block_tables, *, num_heads,
              num_kv_heads, scale, sliding_window=0, softcap=0.0):
    """Numpy oracle. Returns (output, updated cache); the input cache is not modified."""
    cache = kv_cache.copy()
    batch, _, seq, head_dim = query.shape
    block_size = cache.shape[2]
    group = num_heads // num_kv_heads
    out = np.zeros_like(query)
    for b in range(batch):
        for j in range(seq):
            p = int(past_lens[b]) + j
            blk = int(block_tables[b, p // block_size]) if j < query_lens[b] else SCRATCH_BLOCK
            cache[0, blk, p % block_size] = key[b, :, j]
            cache[1, blk, p % block_size] = value[b, :, j]
        for j in range(int(query_lens[b])):
            p = int(past_lens[b]) + j
            lo = max(0, p - sliding_window + 1) if sliding_window else 0
            ks = np.stack([cache[0, block_tables[b, t // block_size], t % block_size] for t in range(lo, p + 1)])
            vs = np.stack([cache[1, block_tables[b, t // block_size], t % block_size] for t in range(lo, p + 1)])
            for h in range(num_heads):
                scores = ks[:, h // group] @ query[b, h, j] * scale
                if softcap:
                    scores = softcap * np.tanh(scores / softcap)
                w = np.exp(scores - scores.max())
                out[b, h, j] = (w / w.sum()) @ vs[:, h // group]
    return out, cache
