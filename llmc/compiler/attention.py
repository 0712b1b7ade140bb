"""An attention transformers can call and torch.export can trace into one ONNX Attention, softcap included.

transformers' SDPA path exports as ONNX Attention, which the passes rewrite into paged attention;
but SDPA has no logit softcap, so transformers refuses it for Gemma 2 (`_supports_sdpa = False`),
whose eager attention exports as a dozen loose ops no pass would recognize. This module registers
one more attention implementation with transformers, `llmc`: a torch custom op carrying the scale
and the softcap as attributes, which the exporter writes as `Attention(q, k, v, mask, scale=,
softcap=)` (ONNX applies the softcap before the mask, as Gemma 2's eager code does). Run in torch
it computes what transformers' eager attention computes.
"""

from __future__ import annotations

import functools

NAME = "llmc"


def implementation_for(model_class) -> str:
    """The attention implementation to build `model_class` with: SDPA where it accepts it, else llmc's."""
    if getattr(model_class, "_supports_sdpa", True):
        return "sdpa"
    register()
    return NAME


@functools.cache
def register() -> None:
    """Define torch's `llmc::attention` op and register it with transformers as `llmc` (once)."""
    import torch
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    @torch.library.custom_op("llmc::attention", mutates_args=(), schema=(
        "(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, float softcap) -> Tensor"))
    def attention(q, k, v, mask, scale, softcap):
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        if mask is None:
            causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
            mask = causal[None, None]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
        return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)

    @attention.register_fake
    def _(q, k, v, mask, scale, softcap):
        return q.new_empty((*q.shape[:-1], v.shape[-1]))

    def forward(module, query, key, value, attention_mask, scaling=None, softcap=None, **kwargs):
        scale = module.head_dim ** -0.5 if scaling is None else scaling
        out = torch.ops.llmc.attention(query, key, value, attention_mask, float(scale), float(softcap or 0.0))
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(NAME, forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # a boolean mask, True where a key is seen, or None: causal


def onnx_translations() -> dict:
    """torch.onnx.export's custom_translation_table entry for `llmc::attention` (empty when the op
    was never registered: no model of this process uses it)."""
    import torch

    if not hasattr(torch.ops.llmc, "attention"):
        return {}
    from onnxscript.onnx_opset import opset23 as op

    def attention(q, k, v, mask=None, scale: float = 1.0, softcap: float = 0.0):
        out, _, _, _ = op.Attention(q, k, v, mask, scale=scale, softcap=softcap, is_causal=mask is None)
        return out

    return {torch.ops.llmc.attention.default: attention}
