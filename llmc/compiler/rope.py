"""RoPE whose frequencies depend on the sequence length, made exportable and per row.

transformers picks such frequencies per forward call from the longest position in the whole
batch (`max(position_ids) + 1`). For one sequence that is its length, which is what the model
was trained with; in a batch of unrelated requests it would make each request's output depend
on its neighbours. Before export, llmc replaces the rotary module's forward so the choice is
made per row, from the row's own largest position id (the runtime fills a row's padding slots
with the last position of its known sequence; llmc.contract.graph_io).

- longrope (Phi-3 128k, Phi-3.5): short factors while the row's length is at most
  original_max_position_embeddings, long factors beyond. A sequence that crosses the boundary
  mid-generation keeps its cached keys and rotates new tokens with the long factors, exactly as
  transformers does for a single sequence.
- dynamic (NTK): the frequencies only change beyond max_position_embeddings, which an engine's
  max context never exceeds (the build refuses it), so the fixed frequencies are exact.

A multimodal RoPE (Qwen3.5's text model: sections of the frequencies rotated by the temporal,
height and width position of an image patch) gets the same plain forward: text tokens have one
position for all three, so every section rotates by it, and the exported graph is ordinary RoPE
rather than a scatter per section.
"""

from __future__ import annotations

import types


def make_rope_per_row(hf_model) -> int:
    """Patch every length-dependent rotary module of `hf_model` in place; returns how many."""
    patched = 0
    for module in hf_model.modules():
        kind = getattr(module, "rope_type", None)
        if not isinstance(kind, str) or not hasattr(module, "inv_freq"):
            continue
        if hasattr(module, "mrope_section") and kind == "default":
            module.forward = types.MethodType(_text_frequencies, module)
        elif kind == "longrope":
            _per_row_longrope(module)
        elif "dynamic" in kind:
            module.forward = types.MethodType(_fixed_frequencies, module)
        else:
            continue
        patched += 1
    return patched


def _fixed_frequencies(self, x, position_ids):
    return _cos_sin(self, x, position_ids, self.inv_freq)


def _text_frequencies(self, x, position_ids):
    """A multimodal RoPE's frequencies for text, whose sections' positions ([3, B, S]) are one."""
    return _cos_sin(self, x, position_ids[0] if position_ids.ndim == 3 else position_ids, self.inv_freq)


def _per_row_longrope(module) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    boundary = module.config.rope_parameters["original_max_position_embeddings"]
    long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](module.config, None, seq_len=boundary + 1)
    module.register_buffer("long_inv_freq", long_inv_freq, persistent=False)
    module.original_max_position_embeddings = boundary
    module.forward = types.MethodType(_longrope_forward, module)


def _longrope_forward(self, x, position_ids):
    import torch

    row_len = position_ids.amax(dim=1, keepdim=True) + 1  # [B, 1]
    long = (row_len > self.original_max_position_embeddings)[..., None]  # [B, 1, 1]
    inv_freq = torch.where(long, self.long_inv_freq, self.original_inv_freq)  # [B, 1, D/2]
    return _cos_sin(self, x, position_ids, inv_freq)


def _cos_sin(self, x, position_ids, inv_freq):
    """transformers' rotary forward (Llama, Mistral, Qwen2, Phi-3 share it) for given frequencies."""
    import torch

    freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)
