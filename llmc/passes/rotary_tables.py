"""rotary-tables: the kernel attention's cos/sin as tables indexed by position, computed at build time.

The exported graph computes each step's RoPE angles from `position_ids` with a handful of small
standard ops (Unsqueeze, Cast, Mul by inv_freq, Cos, Sin; more for scaled RoPE variants). Run once
per step, after the previous step streamed the weights through every cache, each costs ONNX
Runtime several microseconds cold (docs/quantization.md). Their values depend on the position
alone, so the pass evaluates that subgraph once over every position of the engine's context, with
ONNX Runtime's own kernels (the same float32 values the graph computes, bit for bit), and hands
`llmc.cpu::PagedAttention` the tables and `position_ids`: the op reads row positions[b, j].
Each distinct cos/sin pair gets its own tables (Gemma 3 rotates its local and global layers
with two RoPE bases).

It stands aside where the angles are not a function of one position alone (longrope picks its
factors from the longest position of the row): the tables are checked against the subgraph run on
single positions, short runs and a batch, and any difference leaves the graph as it was.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from llmc.contract import graph_io as io
from llmc.contract.model_spec import ModelSpec
from llmc.passes.cpu_kernels import kernel_library_missing
from llmc.passes.graph import graph_input
from llmc.passes.manager import Pass, PassResult
from llmc.plugins import cpu

COS, SIN, POSITIONS = 7, 8, 9  # llmc.cpu::PagedAttention's optional inputs (then q_norm, k_norm: ops.h)


def _cone(outputs: list[ir.Value], source: ir.Value) -> list[ir.Node] | str:
    """The nodes computing `outputs`, in graph order, when their only non-constant input is
    `source`; else why not."""
    seen, stack = set(), list(outputs)
    while stack:
        value = stack.pop()
        if value is source or value.const_value is not None:
            continue
        node = value.producer()
        if node is None:
            return f"the angles read the graph input {value.name!r}"
        if node.domain not in ("", "ai.onnx") or any(
                a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            return f"the angles go through {node.domain}::{node.op_type}"
        if id(node) not in seen:
            seen.add(id(node))
            stack += [v for v in node.inputs if v is not None]
    return [node for node in outputs[0].graph if id(node) in seen]


def _named(tensor: onnx.TensorProto, name: str) -> onnx.TensorProto:
    tensor.name = name
    return tensor


def _evaluator(nodes: list[ir.Node], source: ir.Value, outputs: list[ir.Value], opsets: dict[str, int]):
    """f(position_ids [B, S] int64) -> the outputs, by ONNX Runtime on the subgraph alone."""
    import onnxruntime as ort

    inside = {v for n in nodes for v in n.outputs}
    constants = {v.name: v for n in nodes for v in n.inputs
                 if v is not None and v is not source and v not in inside}
    graph = onnx.helper.make_graph(
        [ir.serde.serialize_node(n) for n in nodes], "rotary_angles",
        [onnx.helper.make_tensor_value_info(source.name, onnx.TensorProto.INT64, ["B", "S"])],
        [onnx.helper.make_tensor_value_info(v.name, onnx.TensorProto.FLOAT, None) for v in outputs],
        [_named(ir.serde.serialize_tensor(v.const_value), name) for name, v in constants.items()])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the graph's own ops
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [v.name for v in outputs]
    return lambda positions: session.run(names, {source.name: positions})


def _tables(evaluate, rows: int, head_dim: int) -> tuple[np.ndarray, np.ndarray] | str:
    """The [rows, rotary_dim / 2] cos/sin tables, or why the angles are not per position."""
    cos, sin = evaluate(np.arange(rows, dtype=np.int64)[None, :])
    if cos.ndim != 3 or cos.shape[:2] != (1, rows) or 2 * cos.shape[2] > head_dim or sin.shape != cos.shape:
        return f"the angles of {rows} positions have shape {cos.shape}, expected (1, {rows}, rotary_dim / 2)"
    cos, sin = cos[0], sin[0]
    half = cos.shape[1]
    probes = [[[0]], [[1]], [[rows - 1]], [[0, 1, 2]], [[rows - 3, rows - 2, rows - 1]], [[5], [rows // 2]]]
    for probe in probes:
        positions = np.array(probe, dtype=np.int64)
        got = evaluate(positions)
        if any(g.shape != positions.shape + (half,) or not np.array_equal(g, t[positions])
               for g, t in zip(got, (cos, sin))):
            return f"the angles at positions {probe} differ from the same positions among all of them"
    return np.ascontiguousarray(cos), np.ascontiguousarray(sin)


class RotaryTables(Pass):
    name = "rotary-tables"
    description = "the kernel attention's RoPE cos/sin as position-indexed tables computed at build time"

    def __init__(self, max_context: int | None = None):
        self.max_context = max_context  # the table's rows; the build sets it once it has resolved it

    def requires(self, model: ir.Model, spec: ModelSpec) -> str | None:
        if self.max_context is None:
            return "the engine's max context is not known"
        if graph_input(model.graph, io.POSITION_IDS) is None:
            return "the graph has no position_ids input"
        return kernel_library_missing()

    def apply(self, model: ir.Model, spec: ModelSpec) -> PassResult:
        attention = [n for n in model.graph if n.domain == cpu.DOMAIN and n.op_type == "PagedAttention"
                     and len(n.inputs) > SIN and n.inputs[COS] is not None
                     and (len(n.inputs) <= POSITIONS or n.inputs[POSITIONS] is None)]
        pairs: dict[tuple[ir.Value, ir.Value], list[ir.Node]] = {}  # one per RoPE base (Gemma 3 has two)
        for node in attention:
            pairs.setdefault((node.inputs[COS], node.inputs[SIN]), []).append(node)
        source = graph_input(model.graph, io.POSITION_IDS)
        misses, tabled, removed = [], 0, 0
        for index, ((cos, sin), users) in enumerate(pairs.items()):
            nodes = _cone([cos, sin], source)
            if isinstance(nodes, str):
                misses.append(nodes)
                continue
            tables = _tables(_evaluator(nodes, source, [cos, sin], dict(model.opset_imports)),
                             self.max_context, spec.head_dim)
            if isinstance(tables, str):
                misses.append(tables)
                continue
            prefix = "rotary" if len(pairs) == 1 else f"rotary.{index}"
            values = []
            for name, table in zip((f"{prefix}.cos_table", f"{prefix}.sin_table"), tables):
                value = ir.Value(name=name, shape=ir.Shape(table.shape), type=ir.TensorType(ir.DataType.FLOAT),
                                 const_value=ir.tensor(table, name=name))
                model.graph.register_initializer(value)
                values.append(value)
            for node in users:
                node.replace_input_with(COS, values[0])
                node.replace_input_with(SIN, values[1])
                if len(node.inputs) <= POSITIONS:  # a QK-norm's weights may follow it already
                    node.resize_inputs(POSITIONS + 1)
                node.replace_input_with(POSITIONS, source)
            tabled += len(users)
            for node in reversed(nodes):  # the angle ops now read by nothing (one may feed something else too)
                if all(not v.uses() and not v.is_graph_output() for v in node.outputs):
                    model.graph.remove(node, safe=True)
                    removed += 1
        if not tabled:
            return PassResult(False, {}, misses)
        return PassResult(True, {"tables": tabled, "angle_ops_removed": removed}, misses)
