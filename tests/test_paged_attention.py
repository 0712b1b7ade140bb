"""llmc::PagedAttention: the ONNX function body (what ORT runs) against the numpy reference."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from llmc.contract import kv_layout
from llmc.plugins import paged_attention as pa


def _pool_shape(num_blocks, block_size, kv_heads, head_dim):
    return kv_layout.pool_shape(kv_layout.TOKEN_MAJOR, num_blocks, block_size, kv_heads, head_dim)


def _single_op_model(attrs: pa.PagedAttentionAttrs, head_dim: int, block_size: int, inline: bool,
                     sinks: bool = False):
    f32, i32 = ir.DataType.FLOAT, ir.DataType.INT32
    shapes = [(f32, ["B", attrs.num_heads, "S", head_dim]), (f32, ["B", attrs.num_kv_heads, "S", head_dim]),
              (f32, ["B", attrs.num_kv_heads, "S", head_dim]),
              (f32, _pool_shape("N", block_size, attrs.num_kv_heads, head_dim)),
              (i32, ["B"]), (i32, ["B"]), (i32, ["B", "M"])] + ([(f32, [attrs.num_heads])] if sinks else [])
    names = pa.INPUTS + ((pa.SINKS,) if sinks else ())
    inputs = [ir.Value(name=n, type=ir.TensorType(t), shape=ir.Shape(s)) for n, (t, s) in zip(names, shapes)]
    node = ir.Node(pa.DOMAIN, pa.OP_TYPE, inputs, num_outputs=2,
                   attributes=[ir.convenience.convert_attribute(k, v) for k, v in attrs.as_dict().items()])
    for out, name, like in zip(node.outputs, pa.OUTPUTS, (inputs[0], inputs[3])):
        out.name, out.type, out.shape = name, like.type, like.shape
    graph = ir.Graph(inputs, node.outputs, nodes=[node], opset_imports={"": 23, pa.DOMAIN: 1})
    model = ir.Model(graph, ir_version=11, functions=[pa.build_function(sinks)])
    if inline:
        from onnx_ir.passes.common import InlinePass

        InlinePass()(model)
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("inline", [False, True])
def test_function_matches_reference(window, inline, sinks):
    rng = np.random.default_rng(0)
    heads, kv_heads, head_dim, block_size, num_blocks = 4, 2, 8, 4, 16
    attrs = pa.PagedAttentionAttrs(heads, kv_heads, scale=0.3, sliding_window=window)
    sess = _single_op_model(attrs, head_dim, block_size, inline, sinks)
    past = np.array([3, 6, 0], np.int32)
    qlens = np.array([5, 2, 4], np.int32)  # ragged: rows 1 and 2 are padded
    tables = np.array([[7, 2, 9, 0], [4, 11, 1, 6], [13, 3, 0, 0]], np.int32)
    batch, seq = 3, 5
    values = [rng.standard_normal((batch, heads, seq, head_dim)).astype(np.float32),
              rng.standard_normal((batch, kv_heads, seq, head_dim)).astype(np.float32),
              rng.standard_normal((batch, kv_heads, seq, head_dim)).astype(np.float32),
              rng.standard_normal(_pool_shape(num_blocks, block_size, kv_heads, head_dim)).astype(np.float32),
              past, qlens, tables]
    feeds = dict(zip(pa.INPUTS, values))
    if sinks:  # one head without a sink (-inf), one far above its scores
        feeds[pa.SINKS] = np.array([0.5, -np.inf, 6.0, -1.5], np.float32)
    out, cache = sess.run(None, feeds)
    ref_out, ref_cache = pa.reference(**feeds, **attrs.as_dict())
    for b in range(batch):
        np.testing.assert_allclose(out[b, :, : qlens[b]], ref_out[b, :, : qlens[b]], atol=1e-5)
    # Every block but the scratch block must hold exactly what the reference wrote.
    np.testing.assert_array_equal(cache[:, 1:], ref_cache[:, 1:])
    # The new tokens' K landed where the tables say, not anywhere else.
    b, j = 1, 1
    p = past[b] + j
    np.testing.assert_array_equal(cache[0, tables[b, p // block_size], p % block_size], values[1][b, :, j])


def test_shape_rule():
    assert pa.output_shapes((2, 4, 3, 8), (2, 10, 4, 2, 8)) == ((2, 4, 3, 8), (2, 10, 4, 2, 8))
