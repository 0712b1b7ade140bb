"""Activation statistics for activation-aware quantization, from the canonical graph.

The canonical graph (before the KV rewrite) maps token ids and positions to logits in one call,
so a plain ONNX Runtime session over a copy of it, with every constant-weight MatMul's input
added as an output, sees what each projection multiplies on real text.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from llmc.contract import graph_io as io


def mean_square_inputs(model: ir.Model, windows: np.ndarray) -> dict[str, np.ndarray]:
    """{MatMul node name: mean of x^2 over every calibration token, per input row k} for the
    MatMuls with a constant right operand; `windows` is [W, S] token ids, run one window a call."""
    import onnxruntime as ort

    from llmc.passes.quantize_weights import matmul_tensor

    copy = ir.from_proto(ir.to_proto(model))
    watched = {}
    for node in copy.graph:
        if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and matmul_tensor(node.inputs[1]) is not None:
            x = node.inputs[0]
            if not x.is_graph_output():
                copy.graph.outputs.append(x)
            watched[node.name] = x.name
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(ir.to_proto(copy).SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    sums: dict[str, np.ndarray] = {}
    count = 0
    for window in windows:
        ids = np.asarray(window, np.int64)[None, :]
        feeds = {io.INPUT_IDS: ids, io.POSITION_IDS: np.arange(ids.shape[1], dtype=np.int64)[None, :]}
        outputs = dict(zip(names, session.run(None, feeds)))
        for value in set(watched.values()):
            x = outputs[value].reshape(-1, outputs[value].shape[-1]).astype(np.float64)
            sums[value] = sums.get(value, 0) + (x * x).sum(axis=0)
        count += ids.size
    return {node: (sums[value] / max(count, 1)).astype(np.float32) for node, value in watched.items()}
