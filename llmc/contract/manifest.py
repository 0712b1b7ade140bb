"""manifest.json: what an engine is, typed. The compiler writes a `Manifest`; runtime and bench
read one; nothing else spells its keys.

The manifest is the frozen dataclasses below (schema SCHEMA_VERSION), every key validated on load.
Engines of another schema are refused with a one-line "rebuild it".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from llmc.contract import graph_io, kv_layout
from llmc.contract.codec import ContractError, added, from_json, to_json
from llmc.contract.graph_io import GraphIO, TensorType
from llmc.contract.model_spec import ModelSpec
from llmc.contract.options import BuildOptions
from llmc.contract.profiles import Profile

# 4: model_spec.layer_types. 5: the graph takes logits_indices and returns logits [N, V]; io.logits
# ("last" / "all") is gone, so an older engine's graph cannot serve a step of this runtime.
# 6: quantization; kv_cache.dtype names the pool's storage (fp32, fp16, bf16, int8).
SCHEMA_VERSION = 6
# Sizes that are counts: a hand-edited 0 or negative one would divide by zero or shape nothing.
_SIZES = {"model_spec": ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                         "vocab_size", "max_position_embeddings"),
          "kv_cache": ("block_size", "num_layers", "num_kv_heads", "head_dim")}


@dataclass(frozen=True)
class Source:
    model: str  # what `llmc build` was given: a recipe, a folder or a hub id
    folder: str  # the HF folder it resolved to
    config_sha256: str


@dataclass(frozen=True)
class Backend:
    name: Literal["onnxruntime", "tensorrt"]
    target: Literal["cpu", "cuda"]
    custom_ops: tuple[str, ...]  # custom-op domains the session must load (llmc.plugins)
    # TensorRT: what the plan was built on (a plan runs only on the GPU architecture and the
    # TensorRT version that built it), the plugin library beside it, and the step shapes it holds.
    gpu_arch: str | None = added(None)  # "sm_90"
    tensorrt_version: str | None = added(None)
    plugin_library: str | None = added(None)  # a file of the engine
    profiles: tuple[Profile, ...] = added(())


@dataclass(frozen=True)
class KVCache:
    """How each layer's pool holds its blocks (llmc.contract.kv_layout)."""

    layout: Literal["token-major", "head-major"]
    dtype: Literal["fp32", "fp16", "bf16", "int8"]
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def pool_shape(self, num_blocks) -> tuple:
        return kv_layout.pool_shape(self.layout, num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
                                    self.dtype)

    @property
    def numpy_dtype(self):
        return kv_layout.numpy_dtype(self.dtype)

    @property
    def block_bytes(self) -> int:
        """K and V of one block (with an int8 pool's scales), all layers."""
        per_layer = 1
        for size in self.pool_shape(1):
            per_layer *= size
        return self.num_layers * per_layer * self.numpy_dtype.itemsize


@dataclass(frozen=True)
class StateTensor:
    """One recurrent state of a hybrid's layer, per sequence slot: the pool state.{i} is
    [num_slots, *shape] float32 (llmc.contract.graph_io). A short convolution's last inputs
    ("conv": [kernel - 1, channels]) or a gated delta rule's matrices ("delta": [value heads,
    key head dim, value head dim])."""

    layer: int  # the model's layer
    kind: Literal["conv", "delta"]
    shape: tuple[int, ...]  # one slot's

    @property
    def slot_bytes(self) -> int:
        size = 4
        for dim in self.shape:
            size *= dim
        return size


@dataclass(frozen=True)
class QuantizedTensor:
    role: Literal["body", "lm_head", "embedding", "experts"]  # experts: the body's format, or MXFP4 as released
    format: Literal["bf16", "fp16", "int8", "int6", "int4", "mxfp4"]
    shape: tuple[int, ...]  # [K, N] as the MatMul reads it (the embedding: [hidden, vocab])
    relative_error: float  # ||w - stored|| / ||w||


@dataclass(frozen=True)
class Quantization:
    """How the weights are stored: BuildOptions says what was asked, this what was done."""

    method: Literal["none", "rtn", "search", "awq"]  # none: no integer weights
    block_size: int | None  # weights per block along K (integer formats)
    symmetric: bool | None
    scale_dtype: str | None  # the values every scale holds (float32 tensors of float16 values)
    calibration: str | None  # what activation-aware statistics came from
    tensors: dict[str, QuantizedTensor]  # every weight not stored in fp32, by its graph name

    @property
    def formats(self) -> dict[str, int]:
        """How many tensors each format holds."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.format] = counts.get(t.format, 0) + 1
        return counts


@dataclass(frozen=True)
class Payload:
    """The backend's files."""

    model: str
    weights: str | None  # ONNX external data


@dataclass(frozen=True)
class Tokenizer:
    """The tokenizer transformers loads for the source model, serialized (llmc.compiler.tokenizer)."""

    file: str  # tokenizer.json: all the runtime needs to encode and decode
    config: str  # tokenizer_config.json: how transformers rebuilds it
    chat_template: str | None  # a Jinja template file, for chat requests
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None


@dataclass(frozen=True)
class PassRecord:
    name: str
    changed: bool
    counts: dict[str, int]
    seconds: float
    nodes_before: int
    nodes_after: int
    max_abs_diff: float | None  # None: not verified
    misses: tuple[str, ...]  # why rules did not fire (the first 20)


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    bytes: int


@dataclass(frozen=True)
class Manifest:
    source: Source
    backend: Backend
    model_spec: ModelSpec
    build_options: BuildOptions  # max_context resolved
    kv_cache: KVCache
    io: GraphIO
    payload: Payload
    tokenizer: Tokenizer
    generation_config: str
    passes: tuple[PassRecord, ...]
    quantization: Quantization
    # A draft's LM head columns (--draft-vocab, passes/draft_vocab.py): logits column j is token
    # lm_head_tokens[j]; None: the whole vocabulary, column j is token j.
    lm_head_tokens: tuple[int, ...] | None = added(None)
    # A hybrid's recurrent states, in the order of the graph's state pools; () for a transformer.
    states: tuple[StateTensor, ...] = added(())
    # Filled in by EngineWriter.commit:
    files: dict[str, FileEntry] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    llmc_version: str = ""
    created_at: str = ""

    def __post_init__(self):
        if self.build_options.max_context is None:
            raise ContractError("build_options.max_context: expected the resolved context length, got null")
        for section, names in _SIZES.items():
            for name in names:
                value = getattr(getattr(self, section), name)
                if value < 1:
                    raise ContractError(f"{section}.{name}: expected an integer >= 1, got {value}")
        if self.kv_cache.block_size != self.build_options.block_size:
            raise ContractError(f"kv_cache.block_size {self.kv_cache.block_size} differs from build_options."
                                f"block_size {self.build_options.block_size}")
        attention_layers = len(self.model_spec.attention_layers)
        if self.kv_cache.num_layers != attention_layers:
            raise ContractError(f"kv_cache.num_layers {self.kv_cache.num_layers} differs from the {attention_layers} "
                                "attention layers of model_spec")
        for name in ("num_kv_heads", "head_dim"):
            cache, spec = getattr(self.kv_cache, name), getattr(self.model_spec, name)
            if cache != spec:
                raise ContractError(f"kv_cache.{name} {cache} differs from model_spec.{name} {spec}")
        recurrent = set(self.model_spec.recurrent_layers)
        for i, state in enumerate(self.states):
            if state.layer not in recurrent or not state.shape or min(state.shape) < 1:
                raise ContractError(f"states[{i}]: expected a recurrent layer of model_spec and a shape of sizes "
                                    f">= 1, got layer {state.layer}, shape {list(state.shape)}")
        if self.max_context > self.model_spec.max_position_embeddings:
            raise ContractError(f"build_options.max_context {self.max_context} exceeds model_spec."
                                f"max_position_embeddings {self.model_spec.max_position_embeddings}")
        tokens = self.lm_head_tokens
        if tokens is not None and (not tokens or tokens[0] < 0 or tokens[-1] >= self.model_spec.vocab_size
                                   or any(a >= b for a, b in zip(tokens, tokens[1:]))):
            raise ContractError(f"lm_head_tokens: expected ascending token ids below model_spec.vocab_size "
                                f"{self.model_spec.vocab_size}")
        if self.io != GraphIO.paged(self.kv_cache.num_layers, self.io.greedy_tokens, len(self.states)):
            states = f" with {len(self.states)} recurrent states" if self.states else ""
            raise ContractError(f"io: not the paged-attention interface of an engine of {self.kv_cache.num_layers} "
                                f"attention layers{states}")

    @property
    def max_context(self) -> int:
        return self.build_options.max_context

    @property
    def logits_width(self) -> int:
        """Columns of the graph's logits: the vocabulary, or a draft head's kept tokens."""
        return self.model_spec.vocab_size if self.lm_head_tokens is None else len(self.lm_head_tokens)

    def role_files(self) -> dict[str, str | None]:
        """Every file the runtime opens, by what it is for (the EngineFiles field it fills); None
        where the engine has no such file."""
        return {"model": self.payload.model, "weights": self.payload.weights, "tokenizer": self.tokenizer.file,
                "tokenizer_config": self.tokenizer.config, "chat_template": self.tokenizer.chat_template,
                "generation_config": self.generation_config}

    def graph_types(self) -> tuple[dict[str, TensorType], dict[str, TensorType]]:
        """The inputs and outputs the engine's graph must have, each fixed size labelled with the
        key it comes from, for graph_io.disagreement to hold the graph against."""
        kv = self.kv_cache
        shape = kv.pool_shape(graph_io.NUM_BLOCKS)
        pool_keys = (None, None, "kv_cache.num_kv_heads", "kv_cache.block_size and head_dim") if len(shape) == 4 else \
            kv_layout.pool_shape(kv.layout, None, "kv_cache.block_size", "kv_cache.num_kv_heads", "kv_cache.head_dim")
        pool = TensorType(kv.numpy_dtype.name, shape, (None, *pool_keys[1:]))
        inputs = {name: TensorType(dtype, graph_io.STEP_SHAPES[name]) for name, dtype in graph_io.STEP_INPUTS.items()}
        logits = TensorType("float32", (graph_io.NUM_LOGITS, self.logits_width),
                            (None, "model_spec.vocab_size" if self.lm_head_tokens is None else "lm_head_tokens"))
        outputs = {graph_io.LOGITS: logits}
        for cache_in, cache_out in self.io.caches():
            inputs[cache_in] = outputs[cache_out] = pool
        if self.states:
            inputs[graph_io.STATE_SLOTS] = TensorType(graph_io.STATE_SLOTS_TYPE, graph_io.STATE_SLOTS_SHAPE)
        for i, ((state_in, state_out), state) in enumerate(zip(self.io.states(), self.states)):
            inputs[state_in] = outputs[state_out] = TensorType(
                "float32", (graph_io.NUM_SLOTS, *state.shape), (None, *[f"states[{i}].shape"] * len(state.shape)))
        if self.io.greedy_tokens:
            outputs[graph_io.GREEDY_TOKENS] = TensorType("int64", (graph_io.NUM_LOGITS,))
        return inputs, outputs

    def to_json(self) -> dict[str, Any]:
        return to_json(self)

    @classmethod
    def from_json(cls, data: Any) -> "Manifest":
        """A manifest from parsed JSON; ContractError names the first problem. An older or newer
        schema_version is reported as such (SchemaError) before any other key is read."""
        version = data.get("schema_version") if isinstance(data, dict) else None
        if not isinstance(version, int) or isinstance(version, bool):
            raise ContractError("schema_version missing or not an integer")
        if version != SCHEMA_VERSION:
            raise SchemaError(version)
        return from_json(cls, data, "manifest")


class SchemaError(ContractError):
    def __init__(self, version: int):
        super().__init__(f"schema {version}")
        self.version = version

    @property
    def newer(self) -> bool:
        return self.version > SCHEMA_VERSION
