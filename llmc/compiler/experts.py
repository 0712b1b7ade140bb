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

gpt-oss's experts differ in three ways the op takes as they are: biases after both products, its
clamped SwiGLU (activation 2: `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`, g =
min(gate, limit)), and stacks stored transposed ([E, hidden, 2 inter], gate and up columns
interleaved), which `to_kernel_layout` turns into the op's layout once: the module's parameters
here, the checkpoint's tensors as they are read (weights.KernelLayout).
"""

from __future__ import annotations

import functools

NAME = "llmc"
# The gate activations the kernel takes (its `activation` attribute: LLMC_ACT_* in kernels.h).
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}
CLAMPED_SWIGLU = 2  # llmc.plugins.cpu.ACT_CLAMPED_SWIGLU


def unsupported(module) -> str | None:
    """What an experts module has that the op lacks, or None."""
    if not getattr(module, "has_gate", True):
        return "experts without a gated MLP"
    if _clamped(module):
        return None
    if getattr(module, "has_bias", False):
        return "biases on experts whose gate activation is not gpt-oss's"
    if getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True):
        return "expert weights stored transposed or with gate and up interleaved, with a gate activation not gpt-oss's"
    if type(module)._apply_gate.__name__ != "_default_apply_gate":
        return "a gate activation of the family's own"
    if _activation(module) is None:
        return f"the expert activation {module.config.hidden_act!r}"
    return None


def _clamped(module) -> bool:
    """gpt-oss's experts, or a family's copy of them: alpha and limit, and a gate that clamps."""
    import inspect

    return hasattr(module, "alpha") and hasattr(module, "limit") and "clamp" in inspect.getsource(
        type(module)._apply_gate)


def _activation(module) -> int | None:
    return CLAMPED_SWIGLU if _clamped(module) else ACTIVATIONS.get(getattr(module.config, "hidden_act", None))


def layout(module) -> tuple[bool, bool]:
    """(transposed, interleaved): how an experts module stores its stacks."""
    return bool(getattr(module, "is_transposed", False)), not getattr(module, "is_concatenated", True)


def to_kernel_layout(name: str, w, transposed: bool, interleaved: bool):
    """Stack `name` (gate_up_proj, gate_up_proj_bias or down_proj; a torch tensor or numpy array,
    experts first) as the op reads it: [E, 2 inter, hidden] with gate rows then up rows, [E, 2
    inter], [E, hidden, inter]."""
    import numpy as np

    if name == "gate_up_proj_bias":
        return _halves(w, -1, interleaved)
    if transposed and name in ("gate_up_proj", "down_proj"):
        w = w.transpose(0, 2, 1) if isinstance(w, np.ndarray) else w.transpose(1, 2)
    return _halves(w, 1, interleaved) if name == "gate_up_proj" else w


def _halves(w, axis: int, interleaved: bool):
    """Gate then up along `axis`, from interleaved gate, up, gate, up, ... where they are."""
    if not interleaved:
        return w
    index = [slice(None)] * w.ndim
    parts = []
    for start in (0, 1):
        index[axis] = slice(start, None, 2)
        parts.append(w[tuple(index)])
    import numpy as np

    if isinstance(w, np.ndarray):
        return np.ascontiguousarray(np.concatenate(parts, axis=axis))
    import torch

    return torch.cat(parts, dim=axis).contiguous()


def convert_module(module) -> None:
    """An experts module's stacks in the op's layout (its fake or real parameters replaced)."""
    import torch

    transposed, interleaved = layout(module)
    if transposed or interleaved:
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj"):
            if (param := getattr(module, name, None)) is not None:
                module._parameters[name] = torch.nn.Parameter(
                    to_kernel_layout(name, param.detach(), transposed, interleaved), requires_grad=False)
        module.is_transposed, module.is_concatenated = False, True


@functools.cache
def register() -> None:
    """Define torch's `llmc::experts` op and register it with transformers as `llmc` (once)."""
    import torch
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    @torch.library.custom_op("llmc::experts", mutates_args=(), schema=(
        "(Tensor hidden, Tensor ids, Tensor weights, Tensor gate_up, Tensor down, Tensor? gate_up_bias, "
        "Tensor? down_bias, int activation, float alpha, float limit) -> Tensor"))
    def experts(hidden, ids, weights, gate_up, down, gate_up_bias, down_bias, activation, alpha, limit):
        out = torch.zeros_like(hidden)
        for e in torch.unique(ids).tolist():
            token, slot = torch.where(ids == e)
            both = torch.nn.functional.linear(hidden[token], gate_up[e],
                                              None if gate_up_bias is None else gate_up_bias[e])
            y = torch.nn.functional.linear(_gated(both, activation, alpha, limit), down[e],
                                           None if down_bias is None else down_bias[e])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out

    @experts.register_fake
    def _(hidden, ids, weights, gate_up, down, gate_up_bias, down_bias, activation, alpha, limit):
        return torch.empty_like(hidden)

    def forward(module, hidden_states, top_k_index, top_k_weights):
        return torch.ops.llmc.experts(
            hidden_states, top_k_index, top_k_weights.to(hidden_states.dtype), module.gate_up_proj,
            module.down_proj, getattr(module, "gate_up_proj_bias", None), getattr(module, "down_proj_bias", None),
            _activation(module), float(getattr(module, "alpha", 0.0)), float(getattr(module, "limit", 0.0)))

    ALL_EXPERTS_FUNCTIONS.register(NAME, forward)


def _gated(both, activation: int, alpha: float, limit: float):
    """act(gate) * up over [rows, 2 inter] (gate columns, then up columns)."""
    import torch

    gate, up = both.chunk(2, dim=-1)
    if activation == CLAMPED_SWIGLU:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(gate * alpha)
    act = torch.nn.functional.silu if activation == 0 else (lambda g: torch.nn.functional.gelu(g, approximate="tanh"))
    return act(gate) * up


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
                formal("gate_up", "T"), formal("down", "T"),
                formal("gate_up_bias", "T", param_option=OpSchema.FormalParameterOption.Optional),
                formal("down_bias", "T", param_option=OpSchema.FormalParameterOption.Optional)],
        outputs=[formal("out", "T")],
        type_constraints=[("T", ["tensor(float)"], "float32")],
        attributes=[OpSchema.Attribute("activation", OpSchema.AttrType.INT, "LLMC_ACT_*", required=False),
                    OpSchema.Attribute("packed", OpSchema.AttrType.INT, "0: checkpoint layout; 1: panels",
                                       required=False),
                    OpSchema.Attribute("alpha", OpSchema.AttrType.FLOAT, "clamped SwiGLU's", required=False),
                    OpSchema.Attribute("limit", OpSchema.AttrType.FLOAT, "clamped SwiGLU's", required=False)],
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

    def experts(hidden, ids, weights, gate_up, down, gate_up_bias=None, down_bias=None, activation: int = 0,
                alpha: float = 0.0, limit: float = 0.0):
        clamp = dict(alpha=alpha, limit=limit) if activation == CLAMPED_SWIGLU else {}  # only that one's attributes
        return kernels.Experts(hidden, ids, weights, gate_up, down, gate_up_bias, down_bias, activation=activation,
                               **clamp)

    return {torch.ops.llmc.experts.default: experts}
