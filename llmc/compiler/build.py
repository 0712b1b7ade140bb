"""The build driver: model ref -> frontend -> export -> passes -> engine, in labelled stages.

Each stage reports to a `progress` callback and is timed; the build report records stage times,
per-pass counts and peak memory. Everything is written into a temp dir beside the target and
renamed at the end (llmc.contract.engine_dir.EngineWriter), so a failed or interrupted build leaves
nothing at the target path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from llmc.contract import graph_io, kv_layout
from llmc.contract.codec import to_json
from llmc.contract.engine_dir import EngineWriter
from llmc.contract.manifest import (Backend, KVCache, Manifest, PassRecord, Payload, Quantization, QuantizedTensor,
                                   StateTensor,
                                   Source)
from llmc.contract.model_spec import ModelSpec
from llmc.contract.options import DEFAULT_MAX_CONTEXT, QUANT_BITS, QUANT_BLOCK_SIZES, WEIGHT_ROLES, BuildOptions
from llmc.errors import LlmcError
from llmc.version import __version__

MODEL_FILE = "model.onnx"
WEIGHTS_FILE = "model.onnx.data"
TOKENIZER_DIR = "tokenizer"
GENERATION_CONFIG = "generation_config.json"
# Tensors computed and written at once in the save: one reads and packs while another writes.
SAVE_WORKERS = 2


@dataclass
class StageRecord:
    name: str
    seconds: float
    detail: str = ""


@dataclass
class BuildReport:
    """build_report.json (and .md): what the build did and what it cost."""

    model: str
    llmc_version: str
    stages: list[StageRecord]
    passes: list[PassRecord]
    peak_rss_mb: float
    parameters: int
    quantized: dict[str, QuantizedTensor] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what of the checkpoint the build left out

    def markdown(self, spec: ModelSpec) -> str:
        lines = [
            f"# Build report: {self.model}",
            "",
            f"llmc {self.llmc_version} · {spec.architecture} · {spec.num_layers} layers · hidden {spec.hidden_size} · "
            f"{self.parameters / 1e6:.1f}M parameters · peak RSS {self.peak_rss_mb:.0f} MB",
            "",
            "## Stages",
            "",
            "| stage | seconds | detail |",
            "|---|---:|---|",
        ]
        lines += [f"| {s.name} | {s.seconds:.2f} | {s.detail} |" for s in self.stages]
        if self.notes:
            lines += ["", "## Notes", ""] + [f"- {n}" for n in self.notes]
        lines += ["", "## Passes", "", "| pass | changed | matches | nodes | seconds | max abs diff |",
                  "|---|---|---|---|---:|---:|"]
        for p in self.passes:
            diff = "not verified" if p.max_abs_diff is None else f"{p.max_abs_diff:.2e}"
            lines.append(f"| {p.name} | {'yes' if p.changed else 'no'} | {_counts_text(p.counts)} | "
                         f"{p.nodes_before} → {p.nodes_after} | {p.seconds:.3f} | {diff} |")
        if self.quantized:
            lines += ["", "## Quantized weights", "", "relative error = ||w - stored|| / ||w||", "",
                      "| tensor | role | format | shape | relative error |", "|---|---|---|---|---:|"]
            lines += [f"| {name} | {t.role} | {t.format} | {'x'.join(map(str, t.shape))} | {t.relative_error:.2e} |"
                      for name, t in self.quantized.items()]
        misses = [(p.name, m) for p in self.passes for m in p.misses]
        if misses:
            lines += ["", "## Rules that did not fire", ""] + [f"- {n}: {m}" for n, m in misses]
        return "\n".join(lines) + "\n"


@dataclass
class BuildResult:
    engine_dir: Path
    stages: list[StageRecord] = field(default_factory=list)
    peak_rss_mb: float = 0.0
    misses: list[tuple[str, str]] = field(default_factory=list)  # (pass, why a rule did not fire)
    notes: list[str] = field(default_factory=list)  # what of the checkpoint the build left out


Progress = Callable[[str, str, bool], None]  # (stage, message, finished)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def build(model_ref: str, output: str | Path, options: BuildOptions | None = None, *, overwrite: bool = False,
          dump_ir: Path | None = None, progress: Progress | None = None) -> BuildResult:
    import onnx_ir as ir

    from llmc.compiler.export import export_onnx
    from llmc.compiler.frontend import load_checkpoint, model_spec_from_config, read_config, resolve_model
    from llmc.compiler.tokenizer import export_tokenizer
    from llmc.passes.cpu_kernels import kernel_library_missing
    from llmc.passes.draft_vocab import DraftVocab, kept_tokens
    from llmc.passes.manager import PassManager
    from llmc.passes.pipeline import pipeline
    from llmc.passes.quantize_weights import QuantizeWeights, records_of
    from llmc.passes.recurrent_state import states_of
    from llmc.passes.rotary_tables import RotaryTables
    from llmc.passes.verify import verifier
    from llmc.plugins import cpu

    options = options or BuildOptions()
    chose_kv = options.kv_cache_dtype == "auto"
    if chose_kv:  # recorded as what it resolved to; without the kernel library the cache stays fp32
        options = dataclasses.replace(options, kv_cache_dtype=options.kv_dtype if kernel_library_missing() is None
                                      else "fp32")
    passes = pipeline(options)  # refuses a bad --disable-pass before any work
    tools = None
    if options.backend == "tensorrt":  # TensorRT and a GPU, or one line naming the fix, before any work
        from llmc.trt import plan as trt_plan

        tools = trt_plan.toolchain()
    say = progress or (lambda stage, msg, finished=False: None)
    stages: list[StageRecord] = []
    output = Path(output)

    def stage(name: str, start: float, detail: str = "") -> None:
        stages.append(StageRecord(name, time.perf_counter() - start, detail))
        say(name, f"{detail} ({stages[-1].seconds:.1f}s)" if detail else f"done ({stages[-1].seconds:.1f}s)", True)

    with EngineWriter(output, overwrite=overwrite) as writer:
        t = time.perf_counter()
        say("resolve", f"resolving {model_ref}", False)
        folder = resolve_model(model_ref)
        spec = model_spec_from_config(read_config(folder))
        max_context = options.max_context or min(spec.max_position_embeddings, DEFAULT_MAX_CONTEXT)
        if max_context > spec.max_position_embeddings:
            raise LlmcError(f"--max-context {max_context} exceeds the model's max positions "
                            f"({spec.max_position_embeddings}); use a smaller value")
        options = dataclasses.replace(options, max_context=max_context)
        for p in passes:
            if isinstance(p, RotaryTables):
                p.max_context = max_context
        _check_quantization(options, spec, passes)
        _check_recurrent(options, spec)
        if options.verify:
            _check_verify_fits(spec)
        stage("resolve", t, f"{spec.architecture}, {spec.num_layers} layers, hidden {spec.hidden_size}")

        t = time.perf_counter()
        say("load", "reading the checkpoint's headers", False)
        hf_model, weights = load_checkpoint(folder, spec)
        notes = [n for n in [weights.note()] if n]
        for note in notes:  # a line that stays: the engine is not all of what the folder holds
            say("load", note, True)
        num_params = sum(p.numel() for p in hf_model.parameters())
        writer.reserve(engine_bytes(spec, options, weights.mxfp4_parameters()))  # or refuse before the export
        stage("load", t, f"{num_params / 1e6:.1f}M parameters")

        t = time.perf_counter()
        say("export", "torch.export -> ONNX opset 23", False)
        model = export_onnx(hf_model, spec, weights)
        del hf_model
        stage("export", t, f"{sum(1 for _ in model.graph)} nodes")

        calibration = None
        if options.quant != "none" and options.quant_method == "awq" and \
                any(isinstance(p, QuantizeWeights) for p in passes):
            t = time.perf_counter()
            say("calibrate", "tokenizing calibration text", False)
            calibration, source = calibration_windows(folder, options.calibrate, max_context)
            for p in passes:
                if isinstance(p, QuantizeWeights):
                    p.calibration = calibration
            stage("calibrate", t, f"{calibration.size} tokens of {source}")

        narrowing = [p for p in passes if isinstance(p, DraftVocab)]  # only with --draft-vocab
        if narrowing:
            t = time.perf_counter()
            say("calibrate", "counting tokens for --draft-vocab", False)
            tokens, source = draft_tokens(folder, options.calibrate, options.draft_vocab, spec.vocab_size)
            for p in narrowing:
                p.tokens = tokens
            stage("calibrate", t, f"the {len(tokens)} most frequent tokens of {source}")

        t = time.perf_counter()
        manager = PassManager(passes, verifier=verifier(spec, options.block_size) if options.verify else None,
                              dump_dir=dump_ir,
                              on_pass=lambda r: say("passes", f"{r.name}: {_counts_text(r.counts)}", True))
        with _own_errors():
            records = manager.run(model, spec)
        io = _graph_io(model, spec)
        head_tokens = kept_tokens(model)
        if options.backend == "onnxruntime" and options.kv_cache_dtype != "fp32" and \
                kv_layout.of_model(model) != kv_layout.HEAD_MAJOR:
            raise LlmcError(f"--kv-cache-dtype {options.kv_cache_dtype} needs llmc's CPU attention kernel, which "
                            "this build did not use (cpu-kernels disabled or the kernel library missing); "
                            + ("pass --kv-cache-dtype fp32" if chose_kv else
                               "drop --kv-cache-dtype or reinstall llmc with a C compiler"))
        stage("passes", t, f"{len(records)} passes, {sum(1 for _ in model.graph)} nodes")

        t = time.perf_counter()
        say("save", f"writing {output}", False)
        with _own_errors():  # a weight read while writing may find the checkpoint damaged
            # Lazy weights are computed as they are written: this is most of a build's time.
            ir.save(model, writer.path / MODEL_FILE, external_data=WEIGHTS_FILE,
                    callback=_save_progress(say, writer.expected_bytes), max_workers=SAVE_WORKERS)
        # Lazily quantized weights were computed as they were written: their errors are known now.
        quantized = {name: QuantizedTensor(r["role"], r["format"], tuple(r["shape"]), round(r["relative_error"], 6))
                     for name, r in records_of(model).items()}
        backend = Backend("onnxruntime", "cpu", (cpu.DOMAIN,) if cpu.DOMAIN in model.opset_imports else ())
        payload, kv_dtype = Payload(MODEL_FILE, WEIGHTS_FILE), options.kv_cache_dtype
        if tools is not None:
            backend, payload = _tensorrt_plan(tools, writer.path, spec, options)
            kv_dtype = options.compute_dtype
        tokenizer = export_tokenizer(folder, writer.path / TOKENIZER_DIR)
        _save_generation_config(folder, spec, writer.path / GENERATION_CONFIG)
        stage("save", t)

        report = BuildReport(model_ref, __version__, stages, records, round(peak_rss_mb(), 1), num_params, quantized,
                             notes)
        (writer.path / "build_report.json").write_text(json.dumps(to_json(report), indent=2))
        (writer.path / "build_report.md").write_text(report.markdown(spec))
        writer.commit(Manifest(
            source=Source(model_ref, str(folder), hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()),
            backend=backend,
            model_spec=spec,
            build_options=options,
            kv_cache=KVCache(kv_layout.of_model(model), kv_dtype, options.block_size, len(spec.attention_layers),
                             spec.num_kv_heads, spec.head_dim),
            io=io,
            payload=payload,
            tokenizer=tokenizer.manifest_entry(TOKENIZER_DIR),
            generation_config=GENERATION_CONFIG,
            passes=tuple(records),
            quantization=_quantization(options, quantized, calibration is not None),
            lm_head_tokens=head_tokens,
            states=tuple(StateTensor(s["layer"], s["kind"], tuple(s["shape"])) for s in states_of(model)),
        ))
    return BuildResult(output, stages, peak_rss_mb(), manager.misses, notes)


# Bytes a stored weight takes per parameter: its value and its block's float16 scale (blocks of 32);
# MXFP4's, a 4-bit code and its block's one-byte scale.
BYTES_PER_PARAMETER = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1 + 2 / 32, "int6": 0.75 + 2 / 32,
                       "int4": 0.5 + 2 / 32, "mxfp4": 0.5 + 1 / 32}


def engine_bytes(spec: ModelSpec, options: BuildOptions, mxfp4_parameters: int = 0) -> int:
    """The engine's size on disk, from the config, the options and the expert stacks the checkpoint
    holds in MXFP4 (kept so whatever the options), before any work."""
    table = spec.vocab_size * spec.hidden_size
    body = spec.parameter_count() - table * (1 if spec.tie_word_embeddings else 2) - mxfp4_parameters
    return int(body * BYTES_PER_PARAMETER[options.format_of("body")]
               + mxfp4_parameters * BYTES_PER_PARAMETER["mxfp4"]
               + table * BYTES_PER_PARAMETER[options.format_of("embedding")]
               + table * BYTES_PER_PARAMETER[options.format_of("lm_head")])


# --verify holds the model whole several times: the pass's input cloned, and each of the two graphs
# compared as a proto, its serialized bytes and ONNX Runtime's copy; float32, 4 bytes a parameter.
VERIFY_BYTES_PER_PARAMETER = 6 * 4


def _check_verify_fits(spec: ModelSpec) -> None:
    """--verify compares whole graphs in ONNX Runtime: refuse it, before any work, for a model
    that would not fit in the memory this machine has free."""
    import psutil

    need, free = spec.parameter_count() * VERIFY_BYTES_PER_PARAMETER, psutil.virtual_memory().available
    if need > free:
        raise LlmcError(f"--verify runs each pass's graph whole in ONNX Runtime, about {need / 2**30:.1f} GiB for "
                        f"this model's {spec.parameter_count() / 1e9:.2f} B parameters, and this machine has "
                        f"{free / 2**30:.1f} GiB available; build without --verify (the passes are verified on "
                        "small models by the test suite)")


def _save_progress(say: Progress, expected_bytes: int):
    """onnx_ir's per-tensor callback as a progress line: tensor i of N, bytes, elapsed, ETA."""
    started = time.perf_counter()

    def written(tensor, info) -> None:
        elapsed, done = time.perf_counter() - started, info.offset
        eta = f", ETA {elapsed * (expected_bytes / done - 1):.0f}s" if done and expected_bytes > done else ""
        say("save", f"weights: tensor {info.index + 1} of {info.total} ({done / 2**30:.2f} of ~"
                    f"{expected_bytes / 2**30:.2f} GiB), {elapsed:.0f}s{eta}", False)

    return written


@contextlib.contextmanager
def _own_errors():
    """llmc's own one-line errors raised from inside a library's call (onnx_ir's serializer wraps
    what a lazy weight raised) come out as they were raised."""
    try:
        yield
    except LlmcError:
        raise
    except Exception as exc:
        cause = exc
        while cause is not None and not isinstance(cause, LlmcError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        raise cause from None


def _tensorrt_plan(tools, root: Path, spec: ModelSpec, options: BuildOptions) -> tuple[Backend, Payload]:
    """Build the plan from the lowered graph just saved in `root`; the plugin library goes beside it."""
    import shutil
    import tempfile

    from llmc.contract.profiles import profiles
    from llmc.trt import plan as trt_plan

    plugin = root / trt_plan.PLUGIN_FILE
    with tempfile.TemporaryDirectory() as scratch:
        shutil.copyfile(trt_plan.plugin_library(Path(scratch)), plugin)
    shapes = profiles(block_size=options.block_size, max_context=options.max_context)
    plan = trt_plan.build_plan(tools, root / MODEL_FILE, plugin, shapes, spec.num_layers,
                               (options.block_size, spec.num_kv_heads, spec.head_dim))
    (root / trt_plan.PLAN_FILE).write_bytes(plan)
    backend = Backend("tensorrt", "cuda", (), tools.gpu_arch, tools.version, trt_plan.PLUGIN_FILE, shapes)
    return backend, Payload(trt_plan.PLAN_FILE, None)


def _check_recurrent(options: BuildOptions, spec: ModelSpec) -> None:
    """A hybrid's recurrent layers run on llmc's CPU kernels only: one line where they cannot."""
    if not spec.recurrent_layers:
        return
    from llmc.passes.cpu_kernels import kernel_library_missing

    kinds = sorted({spec.layer_types[i] for i in spec.recurrent_layers})
    if options.backend == "tensorrt":
        raise LlmcError(f"{spec.architecture}'s {' and '.join(kinds)} layers have no TensorRT kernel in llmc; "
                        "build it with --backend onnxruntime")
    if (missing := kernel_library_missing()) is not None:
        raise LlmcError(f"{spec.architecture}'s {' and '.join(kinds)} layers run on llmc's CPU kernels: {missing}")


def _check_quantization(options: BuildOptions, spec: ModelSpec, passes) -> None:
    """Options the model or this install cannot honour, before the minutes of export."""
    block = options.quant_block_size
    if any(options.format_of(role) in QUANT_BITS for role in WEIGHT_ROLES):
        sizes = {"hidden size": spec.hidden_size, "intermediate size": spec.intermediate_size}
        if spec.num_experts:
            sizes["expert intermediate size"] = spec.expert_intermediate_size
        for what, size in sizes.items():
            if size % block:
                fits = [str(b) for b in QUANT_BLOCK_SIZES if all(s % b == 0 for s in sizes.values())]
                raise LlmcError(f"--quant-block-size {block} does not divide the model's {what} ({size}); "
                                f"use {' or '.join(fits) if fits else 'no integer quantization for this model'}")
    if options.calibrate is not None and not Path(options.calibrate).is_file():
        raise LlmcError(f"--calibrate {options.calibrate}: no such file; give a text file (UTF-8)")
    if options.draft_vocab is not None:
        if options.draft_vocab >= spec.vocab_size:
            raise LlmcError(f"--draft-vocab {options.draft_vocab} keeps the whole vocabulary ({spec.vocab_size} "
                            "tokens); give fewer, or drop --draft-vocab")
        if options.backend != "onnxruntime":
            raise LlmcError("--draft-vocab builds a draft for llmc's CPU runtime; drop --draft-vocab or "
                            f"--backend {options.backend}")
    if options.kv_cache_dtype != "fp32" and not any(p.name == "cpu-kernels" for p in passes):
        raise LlmcError(f"--kv-cache-dtype {options.kv_cache_dtype} needs the cpu-kernels pass; "
                        "do not disable it, or drop --kv-cache-dtype")


def _calibration_text(folder: Path, text_file: str | None, split: str):
    """(texts, what they are, the model's tokenizer): a file, or the corpus' `split`."""
    from transformers import AutoTokenizer

    if text_file is not None:
        path = Path(text_file)
        texts, source = [path.read_text(encoding="utf-8", errors="replace")], str(path)
    else:
        from llmc.bench import corpus

        texts = corpus.read(corpus.files(split))
        source = "the held-out corpus" if split == "heldout" else f"the corpus' {split} split"
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    tokenizer.model_max_length = 2**62  # the text is counted or cut into windows: no warning about its length
    return texts, source, tokenizer


def calibration_windows(folder: Path, text_file: str | None, max_context: int, tokens: int = 4096):
    """Token windows [W, S] of calibration text: a file, or the held-out corpus; and what it was."""
    import numpy as np

    texts, source, tokenizer = _calibration_text(folder, text_file, "heldout")
    ids = tokenizer("\n".join(texts)[:tokens * 16], add_special_tokens=False)["input_ids"][:tokens]
    width = min(256, max_context)
    if len(ids) < width:
        raise LlmcError(f"--calibrate {source}: {len(ids)} tokens, fewer than one window of {width}; give more text")
    count = len(ids) // width
    return np.asarray(ids[:count * width], np.int64).reshape(count, width), source


def draft_tokens(folder: Path, text_file: str | None, count: int, vocab_size: int):
    """The `count` token ids most frequent in a file's text, or the corpus' training split (not the
    held-out one the benchmarks prompt from), ascending; and what the text was."""
    import numpy as np

    from llmc.passes.draft_vocab import most_frequent

    texts, source, tokenizer = _calibration_text(folder, text_file, "train")
    counts = np.zeros(vocab_size, np.int64)
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids = np.asarray(ids, np.int64)
        counts += np.bincount(ids[ids < vocab_size], minlength=vocab_size)
    return most_frequent(counts, count), source


def _quantization(options: BuildOptions, tensors: dict[str, QuantizedTensor], calibrated: bool) -> Quantization:
    integer = any(t.format in QUANT_BITS for t in tensors.values())
    return Quantization(
        method=options.quant_method if integer else "none",
        block_size=options.quant_block_size if integer else None,
        symmetric=options.quant_symmetric if integer else None,
        scale_dtype="float16" if integer else None,
        calibration=(options.calibrate or "held-out corpus") if calibrated else None,
        tensors=tensors)


def _counts_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in counts.items() if v) or "no change"


def _graph_io(model, spec: ModelSpec) -> graph_io.GraphIO:
    """The compiled graph's interface, which must be the engine contract's."""
    from llmc.passes.recurrent_state import states_of

    have = {v.name for v in [*model.graph.inputs, *model.graph.outputs]}
    io = graph_io.GraphIO.paged(len(spec.attention_layers), graph_io.GREEDY_TOKENS in have, len(states_of(model)))
    missing = [name for name in (*io.inputs, *io.outputs) if name not in have]
    extra = sorted(have - {*io.inputs, *io.outputs})
    if missing or extra:
        detail = f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(extra[:3])}"
        # The paged rewrite adds every step input but logits_indices, which the LM head's rewrite adds.
        what = "LM head" if missing == [graph_io.LOGITS_INDICES] else "attention"
        raise LlmcError(f"the compiled graph lacks the engine interface ({detail}); this model's {what} "
                        f"was not recognized")
    return io


def _save_generation_config(folder: Path, spec: ModelSpec, dest: Path) -> None:
    src = folder / GENERATION_CONFIG
    config = json.loads(src.read_text()) if src.is_file() else {}
    config.setdefault("bos_token_id", spec.bos_token_id)
    config.setdefault("eos_token_id", list(spec.eos_token_ids))
    dest.write_text(json.dumps(config, indent=2))
