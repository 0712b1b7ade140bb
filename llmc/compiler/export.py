"""torch.export -> ONNX (opset 23): the canonical graph the passes start from.

The canonical graph is the model without any cache: the token ids and their positions [B,S] in
(llmc.contract.graph_io.TOKEN_INPUTS), logits [B,S,V] out. At opset 23 the exporter's optimizer
already emits RMSNormalization, RotaryEmbedding and Attention; KV-cache I/O is added later by a
pass, not by the exporter.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings

from llmc.contract import graph_io
from llmc.contract.model_spec import ModelSpec
from llmc.errors import ModelError, first_line

OPSET = 23
# ORT 1.31 reads IR <= 13 while onnx 1.23 writes 14 by default; opset 23 needs IR 11.
IR_VERSION = 11


def export_onnx(hf_model, spec: ModelSpec):
    """Export `hf_model` with dynamic batch and sequence dims and return an onnx_ir Model."""
    import torch

    from llmc.compiler.rope import make_rope_per_row

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
        with _quiet():
            program = torch.onnx.export(
                LogitsOnly(hf_model),
                (input_ids, position_ids),
                dynamo=True,
                opset_version=OPSET,
                input_names=list(graph_io.TOKEN_INPUTS),
                output_names=[graph_io.LOGITS],
                dynamic_shapes={name: dims for name in graph_io.TOKEN_INPUTS},
                verbose=False,
                optimize=True,
            )
    except Exception as exc:
        while exc.__cause__ is not None:  # torch.onnx wraps the exporter's own reason
            exc = exc.__cause__
        raise ModelError(f"torch.export of {spec.architecture} failed ({first_line(exc)}); "
                         "this model's code is not exportable: report it with the model's config.json") from None
    model = program.model
    model.ir_version = IR_VERSION
    return model


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
