"""ModelSpec: the normalized facts about a model that every stage after the frontend reads.

Stages never look at a HuggingFace config directly: the frontend translates it once
(`llmc.compiler.frontend.model_spec_from_config`) and the spec travels in the engine manifest,
so the runtime knows the model without importing transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from llmc.contract.codec import added

LayerType = Literal["full_attention", "sliding_attention", "conv", "linear_attention"]
# The kinds of layer that keep a recurrent state instead of a KV cache (a hybrid's).
RECURRENT_LAYERS = ("conv", "linear_attention")


@dataclass(frozen=True)
class ModelSpec:
    family: str  # a llmc.compiler.frontend.Family's name, e.g. "llama", "gemma3"
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
    # Per layer, when the layers differ (Qwen2's max_window_layers); () when every layer attends
    # the same way (all within sliding_window if it is set, else all in full).
    layer_types: tuple[LayerType, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gemma 3's sliding layers rotate with their own base (rope_theta and rope_scaling are the
    # full-attention layers'); None: every layer rotates alike.
    rope_local_theta: float | None = added(None)
    # tanh caps, 0 when none: on the attention scores (Gemma 2), on the logits (Gemma 2).
    attn_logit_softcap: float = added(0.0)
    final_logit_softcap: float = added(0.0)
    gated_mlp: bool = added(True)  # gate, up and down projections; False: two (StarCoder2's fc1, fc2)
    # Mixture of experts (0: a dense model): experts a sparse layer holds, how many each token runs,
    # and each expert's intermediate size.
    num_experts: int = added(0)
    experts_per_token: int = added(0)
    expert_intermediate_size: int = added(0)
    # A hybrid's recurrent layers (layer_types RECURRENT_LAYERS): one's parameters, in place of
    # attention's.
    recurrent_parameters: int = added(0)

    def __post_init__(self):
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types lists {len(self.layer_types)} layers, num_layers is {self.num_layers}")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that attend (and have a KV pool), in order: all but a hybrid's recurrent ones."""
        return tuple(i for i in range(self.num_layers)
                     if not self.layer_types or self.layer_types[i] not in RECURRENT_LAYERS)

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind in RECURRENT_LAYERS)

    def window(self, layer: int) -> int:
        """The sliding window of layer `layer` in tokens; 0 for full attention."""
        if not self.sliding_window or (self.layer_types and self.layer_types[layer] != "sliding_attention"):
            return 0
        return self.sliding_window

    def parameter_count(self) -> int:
        """The parameters the config implies (projections, embeddings; norms and biases, a rounding
        error, left out): what a build compares with the bytes on disk before any work."""
        attention = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size
        if self.num_experts:  # every layer's experts and router (a dense layer or shared expert among them: close)
            mlp = self.num_experts * (3 * self.hidden_size * self.expert_intermediate_size + self.hidden_size)
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        mixers = len(self.attention_layers) * attention + len(self.recurrent_layers) * self.recurrent_parameters
        return mixers + self.num_layers * mlp + embeddings

    @property
    def longrope_boundary(self) -> int | None:
        """The sequence length beyond which longrope rotates with its long factors (None: not
        longrope). The graph reads each row's length from its largest position id
        (llmc.contract.graph_io.POSITION_IDS)."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) != "longrope":
            return None
        return int(scaling["original_max_position_embeddings"])
