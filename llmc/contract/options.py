"""The two sets of options users set: how an engine is built and how the runtime serves it.

`BuildOptions` shape the engine; the manifest records them (with `max_context` resolved), so a
variant of an engine is `dataclasses.replace(manifest.build_options, ...)` built again.
`RuntimeOptions` shape a running `LLM`; `llmc tune` writes the tunable ones to tuning.json and
`LLM` reads them back. Both validate on construction: a bad value is a one-line LlmcError.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmc.errors import LlmcError

# ONNX Runtime's graph optimization levels, by the short names users give.
GRAPH_OPTIMIZATION_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC",
                             "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}


@dataclass(frozen=True)
class BuildOptions:
    block_size: int = 16  # tokens per KV block
    max_context: int | None = None  # longest sequence served; None: the model's, at most 4096
    disable_passes: tuple[str, ...] = ()
    verify: bool = False  # check every pass numerically against the graph before it
    last_token_logits: bool = True  # False: logits for every position
    lossless_weights: bool = False  # also store the packed weights in the lossless format

    def __post_init__(self):
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) \
                or self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise LlmcError(f"--block-size must be a power of two >= 1 (got {self.block_size})")
        if self.max_context is not None and self.max_context < 2:
            raise LlmcError(f"--max-context must be >= 2 (got {self.max_context})")
        object.__setattr__(self, "disable_passes", tuple(self.disable_passes))


def _tunable(default: Any) -> Any:
    return field(default=default, metadata={"tunable": True})


@dataclass(frozen=True)
class RuntimeOptions:
    max_num_seqs: int = _tunable(16)  # requests running at once
    max_num_batched_tokens: int = _tunable(512)  # tokens computed per step, all requests together
    chunk_size: int = _tunable(256)  # most prompt tokens one request computes in a step
    enable_prefix_caching: bool = True
    num_threads: int | None = _tunable(None)  # ONNX Runtime intra-op threads; None: physical cores
    kv_cache_blocks: int | None = None  # pool size in blocks; None: from kv_cache_bytes
    kv_cache_bytes: int | None = None  # pool size in bytes; None: 512 MiB
    allow_spinning: bool = _tunable(True)
    graph_optimization_level: str = _tunable("all")
    verify_checksums: bool = True  # hash the engine's files when loading it

    def __post_init__(self):
        for name in self.names():
            self.check_value(name, getattr(self, name))
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise LlmcError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                            f"({self.max_num_seqs}) so every running request can decode each step")
        if self.chunk_size > self.max_num_batched_tokens:
            raise LlmcError(f"chunk_size ({self.chunk_size}) must be <= max_num_batched_tokens "
                            f"({self.max_num_batched_tokens})")

    @classmethod
    def check_value(cls, name: str, value: Any) -> None:
        """One option's value on its own (the relations between options are checked on construction)."""
        kind = _TYPES[name]
        if value is None and "None" in kind:
            return
        if "int" in kind and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise LlmcError(f"{name} must be an integer >= 1 (got {value!r})")
        if kind == "bool" and not isinstance(value, bool):
            raise LlmcError(f"{name} must be True or False (got {value!r})")
        if name == "graph_optimization_level" and value not in GRAPH_OPTIMIZATION_LEVELS:
            raise LlmcError(f"graph_optimization_level must be one of {', '.join(GRAPH_OPTIMIZATION_LEVELS)} "
                            f"(got {value!r})")
        if name == "kv_cache_blocks" and value < 2:
            raise LlmcError(f"kv_cache_blocks must be >= 2 (got {value})")

    @staticmethod
    def names() -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(RuntimeOptions))

    @staticmethod
    def tunable_names() -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(RuntimeOptions) if f.metadata.get("tunable"))

    def tunable(self) -> dict[str, Any]:
        """The values tuning.json can hold."""
        return {name: getattr(self, name) for name in self.tunable_names()}

    @classmethod
    def tunable_of(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """The entries of `config` (a tuner configuration, say) that tuning.json can hold."""
        tunable = cls.tunable_names()
        return {k: v for k, v in config.items() if k in tunable}

    @classmethod
    def given(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        """The options a caller set (None means not set), names checked."""
        unknown = sorted(set(options) - set(cls.names()))
        if unknown:
            raise LlmcError(f"unknown option {unknown[0]!r}; options are: {', '.join(cls.names())}")
        return {k: v for k, v in options.items() if v is not None}

    @classmethod
    def merge(cls, given: Mapping[str, Any], tuned: Mapping[str, Any] | None) -> tuple["RuntimeOptions",
                                                                                     dict[str, Any]]:
        """(options to run with, tuned values that took effect): a given option wins over its tuned
        value, a tuned value over the default."""
        given = cls.given(given)
        applied = {k: v for k, v in (tuned or {}).items() if k not in given}
        return cls(**{**applied, **given}), applied


_TYPES = {f.name: f.type for f in dataclasses.fields(RuntimeOptions)}  # annotations, as text


def format_options(options: Mapping[str, Any]) -> str:
    """`max_num_seqs=8, allow_spinning=false`: options as the CLI prints them."""
    return ", ".join(f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in options.items())
