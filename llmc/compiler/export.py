"""torch.export -> ONNX (opset 23): the canonical graph the passes start from.

The canonical graph is the model without any cache: the token ids and their positions [B,S] in
(llmc.contract.graph_io.TOKEN_INPUTS), logits [B,S,V] out. At opset 23 the exporter's optimizer
already emits RMSNormalization, RotaryEmbedding and Attention; KV-cache I/O is added later by a
pass, not by the exporter.

The export never needs the weights' values: the module's parameters may be fake tensors (shapes
only, `frontend.skeleton_model`), and every parameter becomes an initializer whose values are read
from `Weights` when a pass or the writer asks (llmc.passes.lazy). The exporter's optimizer runs with
the parameters detached, so it cannot fold them into copies; the one fold it did to weights, a
Linear's transpose, is done here as a lazy transposed view.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings

import numpy as np
import onnx_ir as ir

from llmc.contract import graph_io
from llmc.contract.model_spec import ModelSpec
from llmc.errors import ModelError, first_line

OPSET = 23
# ORT 1.31 reads IR <= 13 while onnx 1.23 writes 14 by default; opset 23 needs IR 11.
IR_VERSION = 11


def export_onnx(hf_model, spec: ModelSpec, weights=None):
    """Export `hf_model` with dynamic batch and sequence dims and return an onnx_ir Model whose
    parameters read from `weights` (llmc.compiler.weights; default: the module's own state dict)."""
    import torch

    from llmc.compiler import attention, experts, recurrent
    from llmc.compiler.frontend import parameter_names
    from llmc.compiler.rope import make_rope_per_row
    from llmc.compiler.weights import StateDictWeights

    make_rope_per_row(hf_model)

    class LogitsOnly(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, position_ids):
            # Explicit position_ids: otherwise the RoPE fusion bakes a [1,S,.] table and B>1 breaks.
            return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits

    # Example dims >= 2 so the exporter does not specialize them to 1.
    input_ids = torch.zeros((2, 8), dtype=torch.int64)
    position_ids = torch.arange(8, dtype=torch.int64).expand(2, 8).contiguous()
    batch = torch.export.Dim("batch", min=1, max=4096)
    seq = torch.export.Dim("seq", min=1, max=max(spec.max_position_embeddings, 16))
    dims = {0: batch, 1: seq}
    try:
        with _quiet(), recurrent.exportable(hf_model):
            program = torch.onnx.export(
                LogitsOnly(hf_model),
                (input_ids, position_ids),
                dynamo=True,
                opset_version=OPSET,
                input_names=list(graph_io.TOKEN_INPUTS),
                output_names=[graph_io.LOGITS],
                dynamic_shapes={name: dims for name in graph_io.TOKEN_INPUTS},
                custom_translation_table={**attention.onnx_translations(), **experts.onnx_translations(),
                                          **recurrent.onnx_translations()},
                verbose=False,
                optimize=False,
            )
    except Exception as exc:
        while exc.__cause__ is not None:  # torch.onnx wraps the exporter's own reason
            exc = exc.__cause__
        raise ModelError(f"torch.export of {spec.architecture} failed ({first_line(exc)}); "
                         "this model's code is not exportable: report it with the model's config.json") from None
    model = program.model
    model.ir_version = IR_VERSION
    # The exporter names an initializer after any one of its parameter's names.
    params = {f"model.{name}": group for group in parameter_names(hf_model).values() for name in group}
    if weights is None:
        weights = StateDictWeights(hf_model.state_dict())
    _optimize(model, params, weights)
    attention.attach_functions(model)  # after the optimizer, which would inline it
    return model


def _optimize(model, params: dict[str, list[str]], weights) -> None:
    """The exporter's own optimizer and fusions over the graph with the parameters detached; then
    each parameter reads from `weights`, and a weight read only by a 2-D Transpose becomes its
    transposed view (what the optimizer's folding made of a Linear)."""
    import onnxscript.optimizer
    import onnxscript.rewriter.onnx_fusions

    from llmc.passes import lazy

    detached = {}
    for name, value in model.graph.initializers.items():
        if name in params:  # the exporter names them model.<the module's parameter name>
            detached[name] = value
            value.const_value = None
    with _quiet():
        onnxscript.optimizer.optimize_ir(model)
        onnxscript.rewriter.onnx_fusions.fuse(model)
    for name, value in detached.items():
        if model.graph.initializers.get(name) is not value:
            continue  # optimized away
        stored = next((n for n in params[name] if weights.has(n)), params[name][0])
        value.const_value = _checkpoint_tensor(weights, stored, value)
        users = value.uses()
        transpose = users[0].node if len(users) == 1 else None
        if transpose is None or transpose.op_type != "Transpose" or len(value.const_value.shape) != 2 or \
                tuple(transpose.attributes.get_ints("perm", [1, 0])) != (1, 0):
            continue
        out = transpose.outputs[0]
        folded = ir.Value(name=f"{stored}.T", const_value=lazy.transposed(value.const_value),
                          shape=ir.Shape(value.const_value.shape[::-1]), type=value.type)
        model.graph.initializers.add(folded)
        out.replace_all_uses_with(folded, replace_graph_outputs=True)
        model.graph.remove(transpose, safe=True)
        model.graph.initializers.pop(name)


def _checkpoint_tensor(weights, name: str, value):
    from llmc.passes import lazy

    shape = tuple(value.shape.numpy()) if value.shape is not None else weights.shape(name)
    if weights.mxfp4(name, 0, 0) is not None:
        return lazy.Mxfp4Stack(shape, lambda a, b: weights.read(name, a, b), lambda a, b: weights.mxfp4(name, a, b),
                               name=name)
    return lazy.Lazy(np.float32, shape, lambda a, b: weights.read(name, a, b), name=name)


@contextlib.contextmanager
def _quiet():
    """The exporter prints progress, warnings and graph dumps meant for its own developers (through
    torch's own log handlers, print and warnings); keep the CLI clean. A failure still raises."""
    disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(disabled)
