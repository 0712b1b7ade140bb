"""ModelSpec: the normalized facts about a model that every stage after the frontend reads.

Stages never look at a HuggingFace config directly: the frontend translates it once
(`llmc.compiler.frontend.model_spec_from_config`) and the spec travels in the engine manifest,
so the runtime knows the model without importing transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelSpec:
    family: str  # "llama" | "mistral" | "qwen2" | "phi3"
    architecture: str  # the HF class name, e.g. "LlamaForCausalLM"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    norm_eps: float
    activation: str
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
