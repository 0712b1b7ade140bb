"""Activation statistics for activation-aware quantization, from the canonical graph, a segment at a
time.

The canonical graph (before the KV rewrite) maps token ids and positions to logits, so ONNX
Runtime can run it on real text and see what each projection multiplies. It runs in segments of
consecutive nodes holding at most `segment_bytes` of float32 weights (half a decoder layer of an
8B model; a small model is one segment): each segment is a session of its own, fed its weights as
arrays read from the checkpoint when it starts and dropped when it ends, and the values earlier
segments computed for every calibration window. Memory holds one segment's weights and the
activations crossing it, never the model (the sequential calibration of llm-compressor and
AutoAWQ, cut where the bytes say rather than where a layer ends). Only the nodes the watched
inputs depend on run: the LM head's logits, the widest activation, are never computed.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from llmc.contract import graph_io as io
from llmc.errors import LlmcError, first_line
from llmc.passes.graph import matmul_tensor

SEGMENT_BYTES = 512 << 20
WEIGHT_BYTES = 1 << 16  # initializers as large as this are fed to a segment's session as inputs


def mean_square_inputs(model: ir.Model, windows: np.ndarray,
                       segment_bytes: int = SEGMENT_BYTES) -> dict[str, np.ndarray]:
    """{MatMul node name: mean of x^2 over every calibration token, per input row k} for the
    MatMuls with a constant right operand; `windows` is [W, S] token ids, run one window a call."""
    watched = {node.name: node.inputs[0] for node in model.graph
               if node.op_type == "MatMul" and node.domain in ("", "ai.onnx")
               and matmul_tensor(node.inputs[1]) is not None}
    targets = set(watched.values())
    segments = _segments(_needed(model, targets), segment_bytes)
    last_read = {}  # value -> the last segment that reads it
    for i, nodes in enumerate(segments):
        for node in nodes:
            for v in node.inputs:
                if v is not None:
                    last_read[v] = i
    # Per window, the values computed so far that a later segment reads.
    ids, positions = (next(v for v in model.graph.inputs if v.name == name) for name in (io.INPUT_IDS, io.POSITION_IDS))
    live = [{ids: np.asarray(w, np.int64)[None, :], positions: np.arange(len(w), dtype=np.int64)[None, :]}
            for w in windows]
    sums: dict[ir.Value, np.ndarray] = {}
    for i, nodes in enumerate(segments):
        produced = {v for node in nodes for v in node.outputs}
        inputs = [v for v in dict.fromkeys(v for node in nodes for v in node.inputs)
                  if v is not None and v not in produced and not _constant(v)]
        outputs = [v for v in produced if v in targets or last_read.get(v, -1) > i]
        session, weights = _session(model, nodes, {v.name: live[0][v] for v in inputs}, outputs)
        for values in live:
            try:
                results = session.run([v.name for v in outputs], {**{v.name: values[v] for v in inputs}, **weights})
            except Exception as exc:  # ORT's own failure, deep in its stack: say where, in one line
                raise LlmcError(f"calibration failed in segment {i + 1} of {len(segments)} of the graph "
                                f"({first_line(exc)}); build with --quant-method search, and report it") from None
            values.update((v, x) for v, x in zip(outputs, results) if last_read.get(v, -1) > i)
            for v, x in zip(outputs, results):
                if v in targets:
                    x = x.reshape(-1, x.shape[-1]).astype(np.float64)
                    sums[v] = sums.get(v, 0) + (x * x).sum(axis=0)
            for v in [v for v in values if last_read.get(v, -1) <= i]:
                del values[v]
        del session, weights
    count = max(1, sum(len(w) for w in windows))
    return {node: (sums[x] / count).astype(np.float32) for node, x in watched.items()}


def _constant(value: ir.Value) -> bool:
    return value.const_value is not None and value.producer() is None


def _needed(model: ir.Model, targets: set[ir.Value]) -> list[ir.Node]:
    """The nodes `targets` depend on, each after the nodes it reads from (graph order otherwise:
    a pass may have appended a node that earlier ones read)."""
    order = {node: i for i, node in enumerate(model.graph)}
    done, out = set(), []
    for target in sorted((v.producer() for v in targets if v.producer() is not None), key=order.__getitem__):
        stack = [(target, False)]
        while stack:
            node, expanded = stack.pop()
            if node in done:
                continue
            if expanded:
                done.add(node)
                out.append(node)
                continue
            stack.append((node, True))
            producers = {v.producer() for v in node.inputs if v is not None} - {None} - done
            stack.extend((p, False) for p in sorted(producers, key=order.__getitem__, reverse=True))
    return out


def _segments(nodes: list[ir.Node], limit: int) -> list[list[ir.Node]]:
    """`nodes` cut in order into runs whose weights (counted where first read) stay within `limit`
    bytes; a weight larger than that is a run alone."""
    segments, current, held, seen = [], [], 0, set()
    for node in nodes:
        weights = [v for v in node.inputs if v is not None and _constant(v) and v not in seen]
        size = sum(v.const_value.nbytes for v in weights)
        if current and held + size > limit:
            segments.append(current)
            current, held = [], 0
        current.append(node)
        held += size
        seen.update(weights)
    return segments + [current] if current else segments


def _session(model: ir.Model, nodes: list[ir.Node], inputs: dict[str, np.ndarray], outputs: list[ir.Value]):
    """A session of `nodes` alone, fed `inputs` (a window's values, for their types), and the
    weights it takes as inputs too: arrays, each computed once from its lazy source, which ONNX
    Runtime reads where they lie (an initializer it would copy)."""
    import onnxruntime as ort

    constants = list(dict.fromkeys(v for node in nodes for v in node.inputs if v is not None and _constant(v)))
    # Shapes and indices stay in the proto, where shape inference reads them.
    weights = {v.name: np.ascontiguousarray(v.const_value.numpy()) for v in constants
               if v.const_value.nbytes >= WEIGHT_BYTES}
    graph = onnx.helper.make_graph(
        [ir.serde.serialize_node(node) for node in nodes], "segment",
        [_declared(name, array) for name, array in {**inputs, **weights}.items()],
        [ir.serde.serialize_value(v) for v in outputs],
        [_named(ir.serde.serialize_tensor(v.const_value), v.name) for v in constants if v.name not in weights])
    proto = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid(domain, version)
                                                         for domain, version in model.opset_imports.items()])
    proto.ir_version = model.ir_version
    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise LlmcError(f"calibration could not load a segment of the graph in ONNX Runtime ({first_line(exc)}); "
                        "build with --quant-method search, and report it") from None
    return session, weights


def _declared(name: str, array: np.ndarray) -> onnx.ValueInfoProto:
    """An input of the array's type and rank (a pass's new value may carry no type)."""
    return onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(array.dtype),
                                              [None] * array.ndim)


def _named(tensor: onnx.TensorProto, name: str) -> onnx.TensorProto:
    tensor.name = name  # a lazy value's tensor may be nameless; the graph reads it by the value's
    return tensor
