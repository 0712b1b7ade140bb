"""The two sets of options users set: how an engine is built and how the runtime serves it.

`BuildOptions` shape the engine; the manifest records them (with `max_context` resolved), so a
variant of an engine is `dataclasses.replace(manifest.build_options, ...)` built again.
`RuntimeOptions` shape a running `LLM`; `llmc tune` writes the tunable ones to tuning.json and
`LLM` reads them back. Both validate on construction: a bad value is a one-line LlmcError.
Where the machine is the limit it is the bound: num_threads by its CPUs, kv_cache_bytes by its memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmc.contract.codec import added
from llmc.errors import LlmcError

# ONNX Runtime's graph optimization levels, by the short names users give.
GRAPH_OPTIMIZATION_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC",
                             "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}

# Upper bounds that only catch typos: a step's logits grow with its rows and its activations with
# its tokens, and a CPU step of 64 Ki tokens already takes minutes.
MAX_NUM_SEQS = 4096
MAX_STEP_TOKENS = 65536

# What a weight can be stored as. "fp32"/"bf16"/"fp16" compute in fp32; "int8"/"int6"/"int4" are
# blockwise quantized (ONNX DequantizeLinear with block_size, lowered to llmc's integer GEMMs; int6
# is int8 in the graph, which has no 6-bit type, and 6.5 bits a weight in llmc's kernels).
WEIGHT_FORMATS = ("fp32", "bf16", "fp16", "int8", "int6", "int4")
QUANT_BITS = {"int8": 8, "int6": 6, "int4": 4}
QUANT_METHODS = ("rtn", "search", "awq")  # round to nearest; data-free scale search; activation-aware
QUANT_BLOCK_SIZES = (32, 64, 128)
KV_CACHE_DTYPES = ("fp32", "fp16", "bf16", "int8")
BACKENDS = ("onnxruntime", "tensorrt")
PRECISIONS = ("auto", "fp32", "fp16", "bf16")  # what the graph computes in (TensorRT: its types)
WEIGHT_ROLES = ("body", "lm_head", "embedding")  # the projections, the LM head, the embedding table


@dataclass(frozen=True)
class BuildOptions:
    block_size: int = 16  # tokens per KV block
    max_context: int | None = None  # longest sequence served; None: the model's, at most 4096
    disable_passes: tuple[str, ...] = ()
    verify: bool = False  # check every pass numerically against the graph before it
    lossless_weights: bool = False  # also store the packed weights in the lossless format
    quant: str = "none"  # the projections' weights: "none" (weight_dtype), "int8" or "int4"
    quant_block_size: int = 32  # weights per quantization block, along K
    quant_symmetric: bool = True  # symmetric blocks (no zero point) or asymmetric (a zero point each)
    quant_method: str = "search"  # QUANT_METHODS
    lm_head: str = "auto"  # the LM head's format: WEIGHT_FORMATS, or "auto" (int6 when quant is int4, else quant)
    embedding: str = "auto"  # the embedding table's: fp32, bf16, fp16, int8, or "auto" (int8 when quantized)
    weight_dtype: str = "fp32"  # storage of the weights left unquantized: fp32, bf16, fp16
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES, or "auto" (kv_dtype says what it becomes)
    calibrate: str | None = None  # text file for --quant-method awq (None: the held-out corpus) and --draft-vocab
    backend: str = added("onnxruntime")  # BACKENDS: ONNX Runtime on CPU, or TensorRT with llmc's plugin
    precision: str = added("auto")  # PRECISIONS; auto: fp32 for onnxruntime, fp16 for tensorrt
    # A speculative draft's LM head over only this many tokens, the most frequent in the --calibrate
    # text (default: the corpus' training split); None: the whole vocabulary.
    draft_vocab: int | None = added(None)

    def __post_init__(self):
        _one_of("--quant", self.quant, ("none", *QUANT_BITS))
        _one_of("--quant-method", self.quant_method, QUANT_METHODS)
        _one_of("--lm-head", self.lm_head, ("auto", *WEIGHT_FORMATS))
        # ONNX Runtime's Gather reads no 4-bit tensor, so the table is at least 8 bits.
        _one_of("--embedding", self.embedding, ("auto", *WEIGHT_FORMATS[:4]))
        _one_of("--weight-dtype", self.weight_dtype, WEIGHT_FORMATS[:3])
        _one_of("--kv-cache-dtype", self.kv_cache_dtype, ("auto", *KV_CACHE_DTYPES))
        if self.quant_block_size not in QUANT_BLOCK_SIZES or isinstance(self.quant_block_size, bool):
            raise LlmcError(f"--quant-block-size must be one of {', '.join(map(str, QUANT_BLOCK_SIZES))} "
                            f"(got {self.quant_block_size!r})")
        if self.calibrate is not None and self.quant_method != "awq" and self.draft_vocab is None:
            raise LlmcError("--calibrate is read by --quant-method awq and --draft-vocab only; add one or drop "
                            "--calibrate")
        if self.draft_vocab is not None and (isinstance(self.draft_vocab, bool) or not isinstance(self.draft_vocab, int)
                                             or self.draft_vocab < 1):
            raise LlmcError(f"--draft-vocab must be a token count >= 1 (got {self.draft_vocab!r})")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) \
                or self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise LlmcError(f"--block-size must be a power of two >= 1 (got {self.block_size})")
        if self.max_context is not None and self.max_context < 2:
            raise LlmcError(f"--max-context must be >= 2 (got {self.max_context})")
        object.__setattr__(self, "disable_passes", tuple(self.disable_passes))
        _one_of("--backend", self.backend, BACKENDS)
        _one_of("--precision", self.precision, PRECISIONS)
        if self.backend == "onnxruntime" and self.precision not in ("auto", "fp32"):
            raise LlmcError(f"--precision {self.precision} is for --backend tensorrt; the CPU backend computes in "
                            "fp32 (store weights in 16 bits with --weight-dtype, the KV cache with --kv-cache-dtype)")
        if self.backend == "tensorrt":
            if self.precision == "fp32":
                raise LlmcError("--backend tensorrt computes in fp16 or bf16 (llmc's attention plugin); "
                                "use --precision fp16 or bf16")
            if self.kv_cache_dtype not in ("auto", "fp32", self.compute_dtype):
                raise LlmcError(f"--kv-cache-dtype {self.kv_cache_dtype}: a TensorRT engine's KV cache is in its "
                                f"--precision ({self.compute_dtype}); drop --kv-cache-dtype")

    @property
    def compute_dtype(self) -> str:
        """What the graph computes in: fp32 on the CPU backend, fp16 or bf16 on TensorRT."""
        if self.precision != "auto":
            return self.precision
        return "fp16" if self.backend == "tensorrt" else "fp32"


    @property
    def kv_dtype(self) -> str:
        """The KV cache's storage. "auto" is fp16 where any weight is stored in fewer than 32 bits
        and llmc's attention kernel runs (llama.cpp's default cache; its error is a small fraction
        of the weights' own, and it halves the bytes attention reads per token), else fp32. The
        build records what it resolved to."""
        if self.kv_cache_dtype != "auto":
            return self.kv_cache_dtype
        kernel = self.backend == "onnxruntime" and "cpu-kernels" not in self.disable_passes
        return "fp16" if kernel and self.reduces_weights else "fp32"

    @property
    def reduces_weights(self) -> bool:
        """Whether any weight is stored in fewer than 32 bits (the quantize phase runs)."""
        return any(self.format_of(role) != "fp32" for role in WEIGHT_ROLES)

    def format_of(self, role: str) -> str:
        """What a weight of `role` (WEIGHT_ROLES) is stored as."""
        body = self.quant if self.quant != "none" else self.weight_dtype
        if role == "body":
            return body
        choice = getattr(self, role)
        if choice != "auto":
            return choice
        if self.quant == "none":
            return body
        # The LM head keeps more bits than int4 (llama.cpp's Q4_0/Q4_K_M keep it at Q6_K, or Q8_0
        # where a row is not a multiple of 256): int6, docs/quantization.md has its cost.
        return "int6" if role == "lm_head" and self.quant == "int4" else "int8"


def _one_of(flag: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise LlmcError(f"{flag} must be one of {', '.join(choices)} (got {value!r})")


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
    speculative: str | None = _tunable(None)  # "ngram" (prompt lookup) or a draft engine's directory
    num_speculative_tokens: int = _tunable(8)  # most tokens proposed per request and step
    prompt_lookup_min: int = 1  # shortest n-gram "ngram" matches
    prompt_lookup_max: int = 3  # longest n-gram "ngram" matches (tried first)
    speculative_adaptive: bool = True  # per-request lengths and on/off from acceptance and step times
    draft_prompt_lookup: bool = _tunable(True)  # a draft takes prompt lookup's proposal where there is one

    def __post_init__(self):
        for name in self.names():
            self.check_value(name, getattr(self, name))
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise LlmcError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                            f"({self.max_num_seqs}) so every running request can decode each step")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise LlmcError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                            f"({self.prompt_lookup_max})")
        if self.chunk_size > self.max_num_batched_tokens:
            raise LlmcError(f"chunk_size ({self.chunk_size}) must be <= max_num_batched_tokens "
                            f"({self.max_num_batched_tokens})")

    @classmethod
    def check_value(cls, name: str, value: Any) -> None:
        """One option's value on its own (the relations between options are checked on construction)."""
        kind = _TYPES[name]
        if value is None and "None" in kind:
            return
        if "int" in kind:
            low, high, what = _int_range(name)
            in_range = isinstance(value, int) and value >= low and (high is None or value <= high)
            if isinstance(value, bool) or not in_range:
                limit = f" and <= {high}{what}" if high is not None else ""
                raise LlmcError(f"{name} must be an integer >= {low}{limit} (got {value!r})")
        if kind == "bool" and not isinstance(value, bool):
            raise LlmcError(f"{name} must be True or False (got {value!r})")
        if name == "speculative" and not (isinstance(value, str) and value):
            raise LlmcError(f"speculative must be 'ngram' or a draft engine's directory (got {value!r})")
        if name == "graph_optimization_level" and not (isinstance(value, str) and value in GRAPH_OPTIMIZATION_LEVELS):
            raise LlmcError(f"graph_optimization_level must be one of {', '.join(GRAPH_OPTIMIZATION_LEVELS)} "
                            f"(got {value!r})")

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
        """The options a caller set (None means not set), names and values checked: a bad one is
        reported before anything (tuning.json, the engine) is read."""
        unknown = sorted(set(options) - set(cls.names()))
        if unknown:
            raise LlmcError(f"unknown option {unknown[0]!r}; options are: {', '.join(cls.names())}")
        given = {k: v for k, v in options.items() if v is not None}
        for name, value in given.items():
            cls.check_value(name, value)
        return given

    @classmethod
    def merge(cls, given: Mapping[str, Any], tuned: Mapping[str, Any] | None) -> tuple["RuntimeOptions",
                                                                                     dict[str, Any]]:
        """(options to run with, tuned values that took effect): a given option wins over its tuned
        value, a tuned value over the default."""
        given = cls.given(given)
        applied = {k: v for k, v in (tuned or {}).items() if k not in given}
        return cls(**{**applied, **given}), applied


_TYPES = {f.name: f.type for f in dataclasses.fields(RuntimeOptions)}  # annotations, as text


SPECULATIVE_LIMITS = {"num_speculative_tokens": 16, "prompt_lookup_min": 8, "prompt_lookup_max": 8}


def _int_range(name: str) -> tuple[int, int | None, str]:
    """(lowest, highest or None, what the highest is) of an integer option, on this machine."""
    if name == "num_threads":
        # ORT's intra-op threads spin while they wait for work: threads beyond the logical CPUs only
        # preempt each other, and a million of them never finish starting.
        return 1, os.cpu_count() or 1, ", this machine's logical CPU count"
    if name == "kv_cache_bytes":
        import psutil

        total = psutil.virtual_memory().total
        return 1, total, f", this machine's memory ({total / 2**30:.1f} GiB)"
    if name in SPECULATIVE_LIMITS:
        return 1, SPECULATIVE_LIMITS[name], ""
    if name == "kv_cache_blocks":
        return 2, None, ""  # a block's bytes come with the engine, which checks the pool fits in memory
    return 1, MAX_NUM_SEQS if name == "max_num_seqs" else MAX_STEP_TOKENS, ""


def format_options(options: Mapping[str, Any]) -> str:
    """`max_num_seqs=8, allow_spinning=false`: options as the CLI prints them."""
    return ", ".join(f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in options.items())
