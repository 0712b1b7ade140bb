"""A hybrid model's recurrent layers as ops torch.export traces into single ONNX nodes.

transformers runs LFM2's short convolution and Qwen3.5's Gated DeltaNet through module-level
functions (`causal_conv1d_forward`, `torch_chunk_gated_delta_rule`) that its own code marks as
the place a runtime managing the state plugs in. Without a cache they trace into a padded Conv1d
and a chunked loop of dozens of ops that no pass would recognize, and neither form can carry a
state from one step to the next. While a model is exported (`exportable`), this module puts in
their place torch custom ops over the same tensors, which the exporter writes as
`llmc.cpu::CausalConv1d` and `llmc.cpu::GatedDeltaRule` (plugins/cpu/recurrent.py: their
meaning); run in torch they call transformers' own functions, so the traced model computes what
transformers computes. The recurrent-state pass then gives each node its state pool.
"""

from __future__ import annotations

import contextlib
import functools
import sys

# The transformers modules whose recurrent functions the export replaces, by family.
MODULES = {"lfm2": "transformers.models.lfm2.modeling_lfm2",
           "qwen3_5": "transformers.models.qwen3_5.modeling_qwen3_5",
           "qwen3_5_text": "transformers.models.qwen3_5.modeling_qwen3_5"}
ACTIVATIONS = {None: 0, "silu": 1, "swish": 1}  # CausalConv1d's `activation`


@functools.cache
def register() -> None:
    """Define torch's `llmc::causal_conv1d` and `llmc::gated_delta_rule` (once). Run in torch, they
    are transformers' own functions (its Qwen3.5 module's, which LFM2's copy)."""
    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

    conv, delta = qwen3_5.causal_conv1d_fn, qwen3_5.torch_recurrent_gated_delta_rule

    @torch.library.custom_op("llmc::causal_conv1d", mutates_args=(), schema=(
        "(Tensor x, Tensor weight, Tensor? bias, int activation) -> Tensor"))
    def causal_conv1d(x, weight, bias, activation):
        return conv(x.transpose(1, 2), weight, bias, activation="silu" if activation else None).transpose(1, 2)

    @causal_conv1d.register_fake
    def _(x, weight, bias, activation):
        return torch.empty_like(x)

    @torch.library.custom_op("llmc::gated_delta_rule", mutates_args=(), schema=(
        "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, int num_k_heads, int num_v_heads, int k_head_dim, "
        "int v_head_dim) -> Tensor"))
    def gated_delta_rule(q, k, v, g, beta, num_k_heads, num_v_heads, k_head_dim, v_head_dim):
        return delta(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0].contiguous()

    @gated_delta_rule.register_fake
    def _(q, k, v, g, beta, num_k_heads, num_v_heads, k_head_dim, v_head_dim):
        return torch.empty_like(v)


def _conv_forward(conv1d, hidden_states, cache=None, layer_idx=None, activation=None, **kwargs):
    """transformers' causal_conv1d_forward without a cache: [B, C, S] in and out."""
    import torch

    if cache is not None:
        raise NotImplementedError("llmc exports the convolution without transformers' cache")
    weight = conv1d.weight.reshape(conv1d.weight.shape[0], conv1d.weight.shape[-1])
    out = torch.ops.llmc.causal_conv1d(hidden_states.transpose(1, 2), weight, conv1d.bias, ACTIVATIONS[activation])
    return out.transpose(1, 2)


def _delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' torch_chunk_gated_delta_rule from a zero state, as Qwen3.5 calls it without a cache."""
    import torch

    if initial_state is not None or output_final_state or not use_qk_l2norm_in_kernel:
        raise NotImplementedError("llmc's GatedDeltaRule starts from its own state and l2-normalizes q and k")
    (hk, dk), (hv, dv) = query.shape[-2:], value.shape[-2:]
    return torch.ops.llmc.gated_delta_rule(query, key, value, g.float(), beta.float(), hk, hv, dk, dv), None


@contextlib.contextmanager
def exportable(model):
    """While exporting `model`: its family's recurrent functions replaced by llmc's ops."""
    module = sys.modules.get(MODULES.get(getattr(model.config, "model_type", ""), ""))
    if module is None:
        yield
        return
    register()
    replaced = {name: getattr(module, name) for name in ("causal_conv1d_forward", "torch_chunk_gated_delta_rule",
                                                         "torch_recurrent_gated_delta_rule") if hasattr(module, name)}
    new = {"causal_conv1d_forward": _conv_forward, "torch_chunk_gated_delta_rule": _delta_rule,
           "torch_recurrent_gated_delta_rule": _delta_rule}
    try:
        for name in replaced:
            setattr(module, name, new[name])
        yield
    finally:
        for name, fn in replaced.items():
            setattr(module, name, fn)


@functools.cache
def _schemas_registered() -> None:
    """The two ops' ONNX schemas, registered with onnx so the exporter can write their nodes."""
    import onnx
    from onnx.defs import OpSchema

    from llmc.plugins import cpu
    from llmc.plugins.cpu import recurrent as ref

    formal, optional = OpSchema.FormalParameter, OpSchema.FormalParameterOption.Optional
    state_inputs = [formal("state", "T", param_option=optional),
                    formal("past_lens", "tensor(int32)", param_option=optional),
                    formal("query_lens", "tensor(int32)", param_option=optional),
                    formal("state_slots", "tensor(int32)", param_option=optional)]
    outputs = [formal("y", "T"), formal("state_out", "T", param_option=optional)]
    onnx.defs.register_schema(OpSchema(
        ref.CONV_OP, cpu.DOMAIN, cpu.VERSION, doc="A causal depthwise convolution with its state (kernels.h).",
        inputs=[formal("x", "T"), formal("weight", "T"), formal("bias", "T", param_option=optional), *state_inputs],
        outputs=outputs, type_constraints=[("T", ["tensor(float)"], "float32")],
        attributes=[OpSchema.Attribute("activation", OpSchema.AttrType.INT, "0: none, 1: SiLU", required=False)]))
    onnx.defs.register_schema(OpSchema(
        ref.DELTA_OP, cpu.DOMAIN, cpu.VERSION, doc="The gated delta rule with its state (kernels.h).",
        inputs=[formal(name, "T") for name in ("q", "k", "v", "g", "beta")] + state_inputs,
        outputs=outputs, type_constraints=[("T", ["tensor(float)"], "float32")],
        attributes=[OpSchema.Attribute(name, OpSchema.AttrType.INT, "", required=False)
                    for name in ("num_k_heads", "num_v_heads", "k_head_dim", "v_head_dim")]))


def onnx_translations() -> dict:
    """torch.onnx.export's custom_translation_table entries for the two ops (none when they were
    never registered: no model of this process has recurrent layers)."""
    import torch

    if not hasattr(torch.ops.llmc, "causal_conv1d"):
        return {}
    from onnxscript import values

    from llmc.plugins import cpu
    from llmc.plugins.cpu import recurrent as ref

    _schemas_registered()
    kernels = values.Opset(cpu.DOMAIN, cpu.VERSION)

    def causal_conv1d(x, weight, bias=None, activation: int = 0):
        return getattr(kernels, ref.CONV_OP)(x, weight, bias, activation=activation)[0]  # no state: output 0

    def gated_delta_rule(q, k, v, g, beta, num_k_heads: int, num_v_heads: int, k_head_dim: int, v_head_dim: int):
        return getattr(kernels, ref.DELTA_OP)(q, k, v, g, beta, num_k_heads=num_k_heads, num_v_heads=num_v_heads,
                                             k_head_dim=k_head_dim, v_head_dim=v_head_dim)[0]

    return {torch.ops.llmc.causal_conv1d.default: causal_conv1d,
            torch.ops.llmc.gated_delta_rule.default: gated_delta_rule}
