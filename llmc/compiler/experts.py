"""A mixture-of-experts layer's experts as one op, which transformers can call and torch.export can
trace into one ONNX node.

transformers 5 runs a MoE block as a router (a Linear, softmax and top-k, each family's own
normalisation) and an experts module whose forward is chosen through its ExpertsInterface. Its
implementations loop over the experts a step hit, or gather every chosen expert's weights per
token: the first does not trace (the loop's length is data), the second traces into a copy of
each chosen expert's weights per token. This module registers one more implementation, `llmc`: a
torch custom op over the hidden rows, the chosen ids and weights and the stacked expert weights,
which the exporter writes as `llmc.cpu::Experts`, whose kernel reads each chosen expert once per
step (plugins/cpu/experts.c). The router stays ordinary ONNX. Run in torch, the op computes what
transformers' eager experts compute.
"""

from __future__ import annotations

import functools

NAME = "llmc"
# The gate activations the kernel takes (its `activation` attribute: LLMC_ACT_* in kernels.h).
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}


def unsupported(module) -> str | None:
    """What an experts module has that the op lacks, or None."""
    if not getattr(module, "has_gate", True) or getattr(module, "has_bias", False):
        return "experts without a gated MLP, or with biases"
    if getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True):
        return "expert weights stored transposed or with gate and up interleaved"
    if type(module)._apply_gate.__name__ != "_default_apply_gate":
        return "a gate activation of the family's own (as gpt-oss's clamped SwiGLU)"
    if _activation(module) is None:
        return f"the expert activation {module.config.hidden_act!r}"
    return None


def _activation(module) -> int | None:
    return ACTIVATIONS.get(getattr(module.config, "hidden_act", None))


@functools.cache
def register() -> None:
    """Define torch's `llmc::experts` op and register it with transformers as `llmc` (once)."""
    import torch
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    @torch.library.custom_op("llmc::experts", mutates_args=(), schema=(
        "(Tensor hidden, Tensor ids, Tensor weights, Tensor gate_up, Tensor down, int activation) -> Tensor"))
    def experts(hidden, ids, weights, gate_up, down, activation):
        act = torch.nn.functional.silu if activation == 0 else (
            lambda g: torch.nn.functional.gelu(g, approximate="tanh"))
        out = torch.zeros_like(hidden)
        for e in torch.unique(ids).tolist():
            token, slot = torch.where(ids == e)
            gate, up = torch.nn.functional.linear(hidden[token], gate_up[e]).chunk(2, dim=-1)
            y = torch.nn.functional.linear(act(gate) * up, down[e]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    @experts.register_fake
    def _(hidden, ids, weights, gate_up, down, activation):
        return torch.empty_like(hidden)

    def forward(module, hidden_states, top_k_index, top_k_weights):
        return torch.ops.llmc.experts(hidden_states, top_k_index, top_k_weights.to(hidden_states.dtype),
                                      module.gate_up_proj, module.down_proj, _activation(module))

    ALL_EXPERTS_FUNCTIONS.register(NAME, forward)


@functools.cache
def _schema_registered() -> None:
    """llmc.cpu::Experts's ONNX schema, registered with onnx so the exporter can write the node."""
    import onnx
    from onnx.defs import OpSchema

    from llmc.plugins import cpu

    formal = OpSchema.FormalParameter
    schema = OpSchema(
        "Experts", cpu.DOMAIN, cpu.VERSION,
        doc="A mixture-of-experts layer's experts (llmc/plugins/cpu/kernels.h, llmc_experts).",
        inputs=[formal("hidden", "T"), formal("ids", "tensor(int64)"), formal("weights", "T"),
                formal("gate_up", "T"), formal("down", "T")],
        outputs=[formal("out", "T")],
        type_constraints=[("T", ["tensor(float)"], "float32")],
        attributes=[OpSchema.Attribute("activation", OpSchema.AttrType.INT, "LLMC_ACT_*", required=False),
                    OpSchema.Attribute("packed", OpSchema.AttrType.INT, "0: checkpoint layout; 1: panels",
                                       required=False)],
    )
    onnx.defs.register_schema(schema)


def onnx_translations() -> dict:
    """torch.onnx.export's custom_translation_table entry for `llmc::experts` (empty when the op
    was never registered: no model of this process uses it)."""
    import torch

    if not hasattr(torch.ops.llmc, "experts"):
        return {}
    from onnxscript import values

    from llmc.plugins import cpu

    _schema_registered()
    kernels = values.Opset(cpu.DOMAIN, cpu.VERSION)

    def experts(hidden, ids, weights, gate_up, down, activation: int = 0):
        return kernels.Experts(hidden, ids, weights, gate_up, down, activation=activation)

    return {torch.ops.llmc.experts.default: experts}
