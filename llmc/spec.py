"""ModelSpec: the normalized facts about a model that every stage after the frontend reads.

Stages never look at a HuggingFace config directly: the frontend translates it once
(`llmc.compiler.frontend.model_spec_from_config`) and the spec travels in the engine manifest,
so the runtime knows the model without importing transformers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
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
    dtype: str = "float32"
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown ModelSpec fields: {sorted(unknown)}")
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)

    def kv_bytes_per_token(self, bytes_per_element: int = 4) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element
