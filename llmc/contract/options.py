"""The options users set: how an engine is built, how the runtime serves it, how the server listens.

Each option is declared once, as a field of `BuildOptions`, `RuntimeOptions` or `ServerOptions`
made by `option()`: its default, help, flag, choices and bounds. The CLI's flags (llmc.cli_options),
Ray Serve's config and docs/options.md are generated from these declarations, and the
validation here reads the same choices and bounds.

`BuildOptions` shape the engine; the manifest records them (with `max_context` resolved), so a
variant of an engine is `dataclasses.replace(manifest.build_options, ...)` built again.
`RuntimeOptions` shape a running `LLM`; `llmc tune` writes the tunable ones to tuning.json and
`LLM` reads them back. `ServerOptions` shape `llmc serve`. Each validates on construction: a bad
value is a one-line LlmcError.
Where the machine is the limit it is the bound: num_threads by its CPUs, kv_cache_bytes by its memory.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmc.contract.codec import ADDED
from llmc.errors import LlmcError

# ONNX Runtime's graph optimization levels, by the short names users give.
GRAPH_OPTIMIZATION_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC",
                             "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}

# Upper bounds that only catch typos: a step's logits grow with its rows and its activations with
# its tokens, and a CPU step of 64 Ki tokens already takes minutes.
MAX_NUM_SEQS = 4096
MAX_STEP_TOKENS = 65536

DEFAULT_MAX_CONTEXT = 4096  # max_context where the build is not given one and the model allows more
DEFAULT_KV_CACHE_BYTES = 512 * 2**20  # the KV pool where neither kv_cache_blocks nor kv_cache_bytes is given

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


OPTION = "llmc.option"  # field metadata: the option's declaration


@dataclass(frozen=True)
class Option:
    """What one option's declaration says: everything the CLI, the server, Ray Serve's config and
    docs/options.md show of it comes from here."""

    name: str
    type: str  # the annotation, as text: "int", "int | None", "tuple[str, ...]"
    default: Any
    help: str
    flag: str  # "--block-size"; a boolean's "--on/--off" pair, or a lone "--flag" for one that defaults off
    choices: tuple | None = None
    low: int | None = None  # an integer's bounds; the machine's where `limit` names it
    high: int | None = None
    limit: str | None = None  # the upper bound in words, where the machine sets it
    default_text: str | None = None  # the default in words, where None stands for something
    metavar: str | None = None
    tunable: bool = False

    @property
    def shown_default(self) -> str:
        """The default as help and docs show it."""
        if self.default_text is not None:
            return self.default_text
        if self.default is None:
            return ""
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        return str(self.default)

    def parse(self, value: Any) -> Any:
        """A value given as text (Ray Serve's `key=value` config, say) as the declared type; a value
        that is not text, or not of the type, is returned as it is, for validation to name."""
        if not isinstance(value, str):
            return value
        base = self.type.split(" | ")[0]
        if "None" in self.type and value.lower() == "none":
            return None
        if base == "bool":
            return {"true": True, "false": False}.get(value.lower(), value)
        try:
            return {"int": int, "float": float}.get(base, str)(value)
        except ValueError:
            return value

    @property
    def values(self) -> str:
        """What it accepts, in words: its choices or its integer bounds."""
        if self.choices is not None:
            return ", ".join(map(str, self.choices))
        if self.low is None:
            return ""
        high = self.limit or (str(self.high) if self.high is not None else None)
        return f"{self.low} to {high}" if high else f">= {self.low}"


def option(default: Any, help: str, *, tunable: bool = False, low: int | None = None, high: int | None = None,
           limit: str | None = None, choices: tuple | None = None, flag: str | None = None,
           default_text: str | None = None, metavar: str | None = None, added: bool = False) -> Any:
    """Declare an option: a dataclass field whose metadata holds its help, flag and bounds.
    `added`: the field came after the manifest's schema (codec.added)."""
    metadata = {OPTION: dict(help=help, tunable=tunable, low=low, high=high, limit=limit, choices=choices,
                             flag=flag, default_text=default_text, metavar=metavar)}
    if added:
        metadata[ADDED] = True
    return field(default=default, metadata=metadata)


@functools.cache
def declarations(cls: type) -> tuple[Option, ...]:
    """The declared options of BuildOptions, RuntimeOptions or ServerOptions, in field order."""
    return tuple(_declaration(f) for f in dataclasses.fields(cls))


def declaration(cls: type, name: str) -> Option:
    return _by_name(cls)[name]


@functools.cache
def _by_name(cls: type) -> dict[str, Option]:
    return {d.name: d for d in declarations(cls)}


def _declaration(f: dataclasses.Field) -> Option:
    meta = dict(f.metadata[OPTION])
    flag = meta.pop("flag") or "--" + f.name.replace("_", "-")
    if f.type == "bool" and "/" not in flag and f.default:  # on by default: the flag that turns it off too
        flag = f"{flag}/--no-{flag[2:]}"
    return Option(name=f.name, type=f.type, default=f.default, flag=flag, **meta)


@dataclass(frozen=True)
class BuildOptions:
    block_size: int = option(16, "KV cache block size in tokens (a power of two).")
    max_context: int | None = option(None, "Longest sequence (prompt + output) the engine serves.",
                                     default_text=f"model max, at most {DEFAULT_MAX_CONTEXT}")
    disable_passes: tuple[str, ...] = option((), "Skip an optional pass (repeatable).", flag="--disable-pass",
                                               default_text="none")
    verify: bool = option(False, "Check every pass numerically against the graph before it.",
                          flag="--verify/--no-verify")
    lossless_weights: bool = option(
        False, "Also store the weights in a lossless format 12.5% smaller that batch-1 to 8 decode reads "
               "(same outputs, faster tokens; the engine holds both copies).")
    quant: str = option("none", "Quantize the projections' weights in blocks (integer GEMMs, activations "
                                "quantized on the fly); none keeps them in --weight-dtype.",
                        choices=("none", *QUANT_BITS))
    quant_block_size: int = option(32, "Weights per quantization block, along K.", choices=QUANT_BLOCK_SIZES)
    quant_symmetric: bool = option(True, "Symmetric blocks (no zero point) or asymmetric ones (a zero point each).",
                                   flag="--symmetric/--asymmetric")
    quant_method: str = option("search", "rtn: round to nearest; search: per-block scale search (data-free); "
                                         "awq: activation-aware, calibrated on --calibrate.", choices=QUANT_METHODS)
    lm_head: str = option("auto", "The LM head's format (auto: int6 in an int4 build, int8 in an int8 one, else "
                                  "--weight-dtype).", choices=("auto", *WEIGHT_FORMATS))
    # ONNX Runtime's Gather reads no 4-bit tensor, so the table is at least 8 bits.
    embedding: str = option("auto", "The embedding table's format (auto: int8 in a quantized build, else "
                                    "--weight-dtype).", choices=("auto", *WEIGHT_FORMATS[:4]))
    weight_dtype: str = option("fp32", "Storage of the weights not quantized (16-bit storage, fp32 arithmetic).",
                               choices=WEIGHT_FORMATS[:3])
    kv_cache_dtype: str = option("auto", "KV cache storage (int8: per token and head scales); the pool holds more "
                                         "tokens per byte (auto: fp16 when weights are quantized or 16-bit, else "
                                         "fp32).", choices=("auto", *KV_CACHE_DTYPES))
    calibrate: str | None = option(None, "Text for --quant-method awq's activation statistics [default: the "
                                         "held-out corpus] and --draft-vocab's token counts [default: the "
                                         "corpus' training split].", metavar="FILE")
    backend: str = option("onnxruntime", "ONNX Runtime with llmc's CPU kernels, or a TensorRT plan with llmc's "
                                         "attention plugin (needs TensorRT and a GPU: pip install 'llmc[trt]').",
                          choices=BACKENDS, added=True)
    precision: str = option("auto", "What a TensorRT engine computes in (auto: fp16); the CPU backend computes in "
                                    "fp32.", choices=PRECISIONS, added=True)
    draft_vocab: int | None = option(
        None, "Build a speculative draft whose LM head scores only the N most frequent tokens (in --calibrate's "
              "text): cheaper proposals, verified by the target as any others. Such an engine only serves as "
              "--speculative.", low=1, metavar="N", default_text="the whole vocabulary", added=True)

    def __post_init__(self):
        for declared in declarations(BuildOptions):
            if declared.choices is not None:
                _one_of(declared.flag, getattr(self, declared.name), declared.choices)
        if self.quant_method == "awq" and self.quant == "none":  # it scales the --quant projections only
            raise LlmcError("--quant-method awq calibrates the projections --quant quantizes, and --quant is none; "
                            "add --quant int4 or int8, or drop --quant-method awq")
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


def _one_of(flag: str, value: Any, choices: tuple) -> None:
    if value not in choices or isinstance(value, bool):  # True == 1: a bool is no block size
        raise LlmcError(f"{flag} must be one of {', '.join(map(str, choices))} (got {value!r})")


@dataclass(frozen=True)
class RuntimeOptions:
    max_num_seqs: int = option(16, "Requests running at once.", tunable=True, low=1, high=MAX_NUM_SEQS)
    max_num_batched_tokens: int = option(512, "Tokens computed per step, all requests together.", tunable=True,
                                         low=1, high=MAX_STEP_TOKENS)
    chunk_size: int = option(256, "Most prompt tokens one request computes in a step.", tunable=True, low=1,
                             high=MAX_STEP_TOKENS)
    enable_prefix_caching: bool = option(True, "Reuse the KV blocks of prompt prefixes computed before.")
    # ORT's intra-op threads spin while they wait for work: threads beyond the logical CPUs only
    # preempt each other, and a million of them never finish starting.
    num_threads: int | None = option(None, "ONNX Runtime intra-op threads.", tunable=True, low=1,
                                     limit="the logical CPUs", flag="--threads", default_text="physical cores")
    # A block's bytes come with the engine, which checks the pool fits in memory.
    kv_cache_blocks: int | None = option(None, "KV cache pool size in blocks.", low=2,
                                         default_text="from kv_cache_bytes")
    kv_cache_bytes: int | None = option(None, "KV cache pool size in bytes.", low=1, limit="the machine's memory",
                                        default_text=f"{DEFAULT_KV_CACHE_BYTES // 2**20} MiB")
    allow_spinning: bool = option(True, "ONNX Runtime's threads spin while they wait for work.", tunable=True)
    graph_optimization_level: str = option("all", "ONNX Runtime's graph optimizations.", tunable=True,
                                           choices=tuple(GRAPH_OPTIMIZATION_LEVELS))
    verify_checksums: bool = option(True, "Hash the engine's files when loading it.")
    speculative: str | None = option(None, "Speculative decoding: ngram (prompt lookup) or a draft engine's "
                                           "directory.", tunable=True, default_text="off")
    num_speculative_tokens: int = option(8, "Most tokens proposed per request and step.", tunable=True, low=1,
                                         high=16)
    prompt_lookup_min: int = option(1, "Shortest n-gram ngram speculation matches.", low=1, high=8)
    prompt_lookup_max: int = option(3, "Longest n-gram ngram speculation matches (tried first).", low=1, high=8)
    speculative_adaptive: bool = option(True, "Per-request speculation lengths, and speculation on or off, from "
                                              "acceptance and step times.")
    draft_prompt_lookup: bool = option(True, "A draft takes prompt lookup's proposal where there is one.",
                                       tunable=True)

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
        declared = declaration(RuntimeOptions, name)
        kind = declared.type
        if value is None and "None" in kind:
            return
        if "int" in kind:
            _check_bounds(name, value, declared)
        if kind == "bool" and not isinstance(value, bool):
            raise LlmcError(f"{name} must be True or False (got {value!r})")
        if name == "speculative" and not (isinstance(value, str) and value):
            raise LlmcError(f"speculative must be 'ngram' or a draft engine's directory (got {value!r})")
        if declared.choices is not None:
            _one_of(name, value, declared.choices)

    @staticmethod
    def names() -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(RuntimeOptions))

    @staticmethod
    def tunable_names() -> tuple[str, ...]:
        return tuple(d.name for d in declarations(RuntimeOptions) if d.tunable)

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


@dataclass(frozen=True)
class ServerOptions:
    """How `llmc serve` (and Ray Serve's replicas of it) listens, queues and stops."""

    host: str = option("127.0.0.1", "Address to listen on.")
    port: int = option(8000, "Port to listen on (0: any free port).", low=0, high=65535)
    max_waiting: int = option(256, "Requests that may wait for a slot; beyond it the server answers 429 with "
                                   "Retry-After.", low=0, high=1_000_000)
    grace_period: float = option(30.0, "Seconds SIGTERM waits for running requests to finish before exiting.",
                                 low=0, high=86_400)
    replicas: int | None = option(None, "Serve this many replicas (each with --threads CPUs, default 1) behind "
                                        "Ray Serve's proxy and llmc's load-aware router; needs pip install "
                                        "'llmc[ray]'.", low=1, high=256, default_text="one server, without Ray")

    def __post_init__(self):
        # Checked here, before anything starts: a port past 65535 printed "serving" and then hung.
        for declared in declarations(ServerOptions):
            value = getattr(self, declared.name)
            if declared.low is not None and not (value is None and "None" in declared.type):
                _check_bounds(declared.flag, value, declared)


def _check_bounds(label: str, value: Any, declared: Option) -> None:
    """A number within the declaration's bounds (an int unless it is declared a float), else one line."""
    low, high, what = _int_range(declared)
    number = (int, float) if declared.type.startswith("float") else int
    if isinstance(value, bool) or not isinstance(value, number) or value < low or (high is not None and value > high):
        limit = f" and <= {high}{what}" if high is not None else ""
        raise LlmcError(f"{label} must be {'an integer' if number is int else 'a number'} >= {low}{limit} "
                        f"(got {value!r})")


def _int_range(declared: Option) -> tuple[int, int | None, str]:
    """(lowest, highest or None, what the highest is) of an integer option, on this machine."""
    if declared.name == "num_threads":
        return declared.low, os.cpu_count() or 1, ", this machine's logical CPU count"
    if declared.name == "kv_cache_bytes":
        import psutil

        total = psutil.virtual_memory().total
        return declared.low, total, f", this machine's memory ({total / 2**30:.1f} GiB)"
    return declared.low, declared.high, ""


def format_options(options: Mapping[str, Any]) -> str:
    """`max_num_seqs=8, allow_spinning=false`: options as the CLI prints them."""
    return ", ".join(f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in options.items())
