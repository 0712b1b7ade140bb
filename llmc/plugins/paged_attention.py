"""`llmc::PagedAttention`: the one attention op every model is rewritten to.

This module is the op's single source of truth, used by both sides of the compiler:
- the spec (inputs, outputs, attributes, shape rule) that passes and backends agree on;
- `build_function()`: the op's meaning written in standard ONNX ops (opset 23). Attached to a
  model as a model-local function it makes a rewritten graph runnable by ONNX Runtime as is,
  which is what per-pass verification needs, and inlining it *is* the ORT lowering;
- `reference()`: a numpy implementation, the oracle for kernels (ORT lowering, TRT plugin).

Semantics (llmc.contract.graph_io, design §4). Row b holds `query_lens[b]` valid new tokens (the rest of S is padding).
New token j has position p = past_lens[b] + j; its K/V are written to block
`block_tables[b, p // block_size]` at offset `p % block_size`, then its query attends to
positions 0..p of row b (only positions > p - sliding_window when a window is set). Writes for
padding tokens go to block 0, which the KV cache manager reserves as a scratch block and never
hands to a sequence.

Cache layout: token-major (llmc.contract.kv_layout), `[2, num_blocks, block_size, num_kv_heads,
head_dim]` (K then V). A block is contiguous per K/V, so a paged read is one GatherND copy of
exactly the blocks a row uses, and a write is one ScatterND. `kv_cache_out` is the updated cache; backends alias it
to `kv_cache` (ORT: IOBinding to the same OrtValue; TRT: the plugin writes in place).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from llmc.contract.graph_io import BLOCK_TABLES, PAST_LENS, QUERY_LENS, SCRATCH_BLOCK

DOMAIN = "llmc"
OP_TYPE = "PagedAttention"
VERSION = 1
ONNX_OPSET = 23

INPUTS = ("query", "key", "value", "cache", PAST_LENS, QUERY_LENS, BLOCK_TABLES)
OUTPUTS = ("output", "cache_out")
# An attention with sinks (gpt-oss; compiler/attention.py) takes them [num_heads] after these: a
# logit per head that joins each row's softmax and weighs no value. A model's layers all have the
# input or none does (-inf: no sink), since the op's function is one per model.
SINKS = "sinks"
# A kernel that applies the query's and key's RoPE itself (llmc.cpu's, TensorRT's plugin) takes
# their ONNX RotaryEmbedding's per-token cos/sin [B, S, R/2] after these, with the attribute
# `rotary_interleaved`: the op is then RotaryEmbedding(query), RotaryEmbedding(key), then itself.
# llmc.cpu's also takes `positions` ([B, S] int64, the step's position_ids) after them, and then
# cos/sin are tables [positions, R/2] whose row positions[b, j] rotates token (b, j)
# (llmc/passes/rotary_tables.py builds them).
OPTIONAL_INPUTS = ("cos", "sin", "positions")


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


def output_shapes(query_shape, cache_shape):
    """Shape rule shared by graph checks and the TensorRT plugin: output is query-shaped and
    the cache keeps its shape."""
    return tuple(query_shape), tuple(cache_shape)


@dataclass
class StepMetadata:
    """Per-step values every layer's attention shares: they depend only on the step's inputs."""

    write_index: object  # [2, B, S, 3] (kv, block, offset) for the ScatterND write
    read_index: tuple  # ([B, M, 2], [B, M, 2]) (kv, block) for the K and V GatherND reads
    mask: object  # [B, 1, S, T] bool: causal, and within the sliding window if any
    kv_rows: object  # shape [0, -1, Hkv*D]: gathered blocks [B, M, bs, Hkv, D] as [B, T, Hkv*D]
    q_rows: object  # shape [B, S, -1]: [B, S, Hq, D] as [B, S, Hq*D]
    out_heads: object  # shape [B, S, Hq, -1]: the attention output split into heads again


def emit_step_metadata(ops, past_lens, query_lens, block_tables, batch, seq, block_size, window, heads,
                       kv_width) -> StepMetadata:
    """Slots, mask and reshape targets of one step. `batch`, `seq`, `block_size`, `heads` (Hq)
    and `kv_width` (Hkv*D) are 1-element int64 values and `window` a scalar (0 = no window)."""
    import onnx_ir as ir

    const, i64 = ops.const, ir.DataType.INT64
    zero, one, minus_one = const([0]), const([1]), const([-1])

    # Positions and write slots of the new tokens ([B, S]); padding goes to the scratch block.
    j = ops.Range(const(0), ops.Squeeze(seq, zero), const(1))
    pos = ops.Add(ops.Unsqueeze(ops.Cast(past_lens, to=i64), one), ops.Unsqueeze(j, zero))
    valid = ops.Less(ops.Unsqueeze(j, zero), ops.Unsqueeze(ops.Cast(query_lens, to=i64), one))
    table = ops.Cast(block_tables, to=i64)
    width = ops.Slice(ops.Shape(table), one, const([2]))
    col = ops.Min(ops.Div(pos, block_size), ops.Sub(width, one))
    block = ops.Where(valid, ops.GatherElements(table, col, axis=1), const(SCRATCH_BLOCK))
    slot = ops.Concat(ops.Unsqueeze(block, minus_one), ops.Unsqueeze(ops.Mod(pos, block_size), minus_one), axis=-1)
    kv_sel = ops.Expand(const([[[[0]]], [[[1]]]]), ops.Concat(const([2]), batch, seq, one, axis=0))
    slots = ops.Expand(ops.Unsqueeze(slot, zero), ops.Concat(const([2]), ops.Shape(slot), axis=0))
    write_index = ops.Concat(kv_sel, slots, axis=-1)

    table_idx = ops.Unsqueeze(table, minus_one)
    sel_shape = ops.Shape(table_idx)
    read_index = tuple(ops.Concat(ops.Expand(const([[[which]]]), sel_shape), table_idx, axis=-1)
                       for which in (0, 1))

    t = ops.Range(const(0), ops.Squeeze(ops.Mul(width, block_size), zero), const(1))
    pos3, t3 = ops.Unsqueeze(pos, minus_one), ops.Unsqueeze(t, const([0, 1]))
    lowest = ops.Where(ops.Greater(window, const(0)), ops.Sub(pos3, window), const(-1))
    mask = ops.Unsqueeze(ops.And(ops.LessOrEqual(t3, pos3), ops.Greater(t3, lowest)), one)
    # Explicit dims with allowzero=1 rather than 0-copies, so a later reshape of these reshapes
    # provably does not depend on them and may skip them.
    return StepMetadata(write_index, read_index, mask, kv_rows=ops.Concat(const([0, -1]), kv_width, axis=0),
                        q_rows=ops.Concat(batch, seq, minus_one, axis=0),
                        out_heads=ops.Concat(batch, seq, heads, minus_one, axis=0))


def emit_layer_attention(ops, q, k, v, cache, meta: StepMetadata, *, num_heads, num_kv_heads, scale, softcap,
                         sinks=None):
    """One layer: write the new K/V in place, read the row's blocks, attend. Returns
    (output [B, Hq, S, D], updated cache). Attribute arguments may be RefAttrs (in the function).
    With `sinks` the keys and values gain a zero row whose score the additive mask sets to the
    head's sink (compiler/attention.py, sink_function)."""
    const, perm = ops.const, (0, 2, 1, 3)
    # One ScatterND writes K and V together: a single op whose input is the graph's cache input
    # and whose output is the graph's cache output is what lets ORT update the pool in place.
    new_kv = ops.Concat(ops.Unsqueeze(ops.Transpose(k, perm=perm), const([0])),
                        ops.Unsqueeze(ops.Transpose(v, perm=perm), const([0])), axis=0)
    cache_out = ops.ScatterND(cache, meta.write_index, new_kv)
    keys, values = (ops.Reshape(ops.GatherND(cache_out, idx), meta.kv_rows) for idx in meta.read_index)
    q3 = ops.Reshape(ops.Transpose(q, perm=perm), meta.q_rows, allowzero=1)
    mask = meta.mask
    if sinks is not None:
        keys, values, mask = emit_sinks(ops, q, keys, values, mask, sinks, axis=1)
    y3 = ops.Attention(q3, keys, values, mask, q_num_heads=num_heads, kv_num_heads=num_kv_heads,
                       scale=scale, softcap=softcap)
    y4 = ops.Reshape(y3, meta.out_heads, allowzero=1)
    return ops.Transpose(y4, perm=perm), cache_out


def emit_sinks(ops, q, keys, values, mask, sinks, axis: int):
    """Attention sinks in standard ops: `keys` and `values` (their positions along `axis`) gain a
    zero row, and the boolean `mask` (True where a key is seen, broadcastable to [B, Hq, S, T]; q
    is [B, Hq, S, D]) becomes the additive one [B, Hq, S, T + 1] whose last column, the zero key's
    score, is each head's sink. Returns (keys, values, mask) for ONNX Attention."""
    const = ops.const
    length = ops.Shape(keys, start=axis, end=axis + 1)
    keys, values = (ops.Concat(x, ops.ConstantOfShape(ops.Concat(
        ops.Shape(x, start=0, end=axis), const([1]), ops.Shape(x, start=axis + 1), axis=0)), axis=axis)
        for x in (keys, values))
    rows = ops.Shape(q, start=0, end=3)  # [B, Hq, S]
    bias = ops.Expand(ops.Where(mask, const(0.0, np.float32), const(-np.inf, np.float32)),
                      ops.Concat(rows, length, axis=0))
    column = ops.Expand(ops.Reshape(sinks, const([1, -1, 1, 1])), ops.Concat(rows, const([1]), axis=0))
    return keys, values, ops.Concat(bias, column, axis=3)


def build_function(sinks: bool = False):
    """The op as an ONNX model-local function (domain llmc), in opset-23 ops ORT runs on CPU; with
    `sinks`, of the op taking them (SINKS)."""
    import onnx_ir as ir

    from llmc.ir_builder import OpBuilder

    q, k, v, cache, past_lens, query_lens, block_tables = (ir.Value(name=n) for n in INPUTS)
    sink_input = ir.Value(name=SINKS) if sinks else None
    fn_graph = ir.Graph(inputs=[q, k, v, cache, past_lens, query_lens, block_tables, *([sink_input] if sinks else [])],
                        outputs=[],
                        nodes=[], opset_imports={"": ONNX_OPSET}, name=OP_TYPE)
    ops = OpBuilder(fn_graph)
    INT, FLOAT = ir.AttributeType.INT, ir.AttributeType.FLOAT

    def ref(name, attr_type):
        return ir.RefAttr(name, name, attr_type)

    q_shape, cache_shape_ = ops.Shape(q), ops.Shape(cache)

    def dim(shape, i):
        return ops.Slice(shape, ops.const([i]), ops.const([i + 1]))

    window = ops.Constant(value_int=ref("sliding_window", INT))
    meta = emit_step_metadata(ops, past_lens, query_lens, block_tables, dim(q_shape, 0), dim(q_shape, 2),
                              dim(cache_shape_, 2), window, dim(q_shape, 1),
                              ops.Mul(dim(cache_shape_, 3), dim(cache_shape_, 4)))
    output, cache_out = emit_layer_attention(
        ops, q, k, v, cache, meta, num_heads=ref("num_heads", INT),
        num_kv_heads=ref("num_kv_heads", INT), scale=ref("scale", FLOAT), softcap=ref("softcap", FLOAT),
        sinks=sink_input)
    fn_graph.outputs.extend([output, cache_out])
    output.name, cache_out.name = OUTPUTS
    attrs = [ir.Attr(f.name, ir.AttributeType.UNDEFINED, None) for f in dataclasses.fields(PagedAttentionAttrs)]
    return ir.Function(DOMAIN, OP_TYPE, graph=fn_graph, attributes=attrs)


def reference(query, key, value, cache, past_lens, query_lens, block_tables, *, num_heads,
              num_kv_heads, scale, sliding_window=0, softcap=0.0, kv_dtype="fp32", sinks=None):
    """Numpy oracle. Returns (output, updated cache); the input cache is not modified.
    `sinks` [num_heads]: each head's sink logit joins its softmax (SINKS).
    `cache` is float32 token-major; with a `kv_dtype` other than fp32 each new token's K and V
    are stored as a pool of that dtype holds them (kv_layout.round_trip: rounded, or quantized
    per token and head), so the oracle attends over the values the CPU kernel reads back."""
    from llmc.contract import kv_layout

    cache = cache.copy()
    batch, _, seq, head_dim = query.shape
    block_size = cache.shape[2]
    group = num_heads // num_kv_heads
    out = np.zeros_like(query)
    for b in range(batch):
        past, qlen = int(past_lens[b]), int(query_lens[b])
        for j in range(seq):
            p = past + j
            blk = int(block_tables[b, p // block_size]) if j < qlen else SCRATCH_BLOCK
            cache[0, blk, p % block_size] = kv_layout.round_trip(key[b, :, j], kv_dtype)
            cache[1, blk, p % block_size] = kv_layout.round_trip(value[b, :, j], kv_dtype)
        if qlen == 0:
            continue
        # The row's whole context gathered once, [Hkv, T, D]; each token attends to a slice of it
        # (the gather per token made 32k-token oracles take minutes).
        positions = np.arange(past + qlen)
        slots = block_tables[b, positions // block_size], positions % block_size
        ks, vs = (cache[i][slots].transpose(1, 0, 2) for i in (0, 1))
        for j in range(qlen):
            p = past + j
            lo = max(0, p - sliding_window + 1) if sliding_window else 0
            q = query[b, :, j].reshape(num_kv_heads, group, head_dim)
            scores = q @ ks[:, lo:p + 1].transpose(0, 2, 1) * scale  # [Hkv, group, T]
            if softcap:
                scores = softcap * np.tanh(scores / softcap)
            top = scores.max(axis=-1, keepdims=True)
            sink = np.zeros_like(top) if sinks is None else np.exp(
                sinks.reshape(num_kv_heads, group, 1) - top)
            w = np.exp(scores - top)
            w /= w.sum(axis=-1, keepdims=True) + sink
            out[b, :, j] = (w @ vs[:, lo:p + 1]).reshape(num_heads, head_dim)
    return out, cache
