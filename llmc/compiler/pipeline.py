"""The build driver: model ref -> frontend -> export -> passes -> artifact, in labelled stages.

Each stage reports to a `progress` callback and is timed; the build report records stage
times, per-pass counts and peak memory. Everything is written into a temp dir beside the
target and renamed at the end (llmc.artifact.EngineWriter), so a failed or interrupted build
leaves nothing at the target path.
"""

from __future__ import annotations

import hashlib
import json
import resource
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from llmc import __version__
from llmc import kernels, kv_layout
from llmc.artifact import EngineWriter
from llmc.errors import LlmcError, first_line
from llmc.spec import ModelSpec

MODEL_FILE = "model.onnx"
WEIGHTS_FILE = "model.onnx.data"
TOKENIZER_DIR = "tokenizer"
DEFAULT_MAX_CONTEXT = 4096


@dataclass
class BuildOptions:
    block_size: int = 16
    max_context: int | None = None  # default: the model's max positions, capped at 4096
    disable_passes: tuple[str, ...] = ()
    verify: bool = False  # run each pass's numeric verification (slow for big models)
    dump_ir: Path | None = None
    overwrite: bool = False
    last_token_logits: bool = True
    lossless_weights: bool = False

    def validate(self) -> None:
        from llmc.passes import ALL_PASSES, REQUIRED_PASSES

        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise LlmcError(f"--block-size must be a power of two >= 1 (got {self.block_size})")
        if self.max_context is not None and self.max_context < 2:
            raise LlmcError(f"--max-context must be >= 2 (got {self.max_context})")
        for name in self.disable_passes:
            if name not in ALL_PASSES:
                raise LlmcError(f"unknown pass {name!r}; passes are: {', '.join(ALL_PASSES)}")
            if name in REQUIRED_PASSES:
                raise LlmcError(f"pass {name!r} cannot be disabled: the runtime contract needs it")


@dataclass
class StageRecord:
    name: str
    seconds: float
    detail: str = ""


@dataclass
class BuildResult:
    engine_dir: Path
    stages: list[StageRecord] = field(default_factory=list)
    peak_rss_mb: float = 0.0
    misses: list[tuple[str, str]] = field(default_factory=list)  # (pass, why a rule did not fire)


Progress = Callable[[str, str, bool], None]  # (stage, message, finished)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def build(model_ref: str, output: str | Path, options: BuildOptions | None = None,
          progress: Progress | None = None) -> BuildResult:
    from llmc.compiler.export import export_onnx
    from llmc.compiler.frontend import load_hf_model, model_spec_from_config, read_config, resolve_model
    from llmc.passes import ALL_PASSES, BuildContext, PassManager, make_passes
    from llmc.passes.verify import verifier

    options = options or BuildOptions()
    options.validate()
    say = progress or (lambda stage, msg, finished=False: None)
    stages: list[StageRecord] = []
    output = Path(output)

    def stage(name: str, start: float, detail: str = "") -> None:
        stages.append(StageRecord(name, time.perf_counter() - start, detail))
        say(name, f"{detail} ({stages[-1].seconds:.1f}s)" if detail else f"done ({stages[-1].seconds:.1f}s)", True)

    with EngineWriter(output, overwrite=options.overwrite) as writer:
        t = time.perf_counter()
        say("resolve", f"resolving {model_ref}", False)
        folder = resolve_model(model_ref)
        config = read_config(folder)
        spec = model_spec_from_config(config)
        max_context = options.max_context or min(spec.max_position_embeddings, DEFAULT_MAX_CONTEXT)
        if max_context > spec.max_position_embeddings:
            raise LlmcError(f"--max-context {max_context} exceeds the model's max positions "
                            f"({spec.max_position_embeddings}); use a smaller value")
        stage("resolve", t, f"{spec.architecture}, {spec.num_layers} layers, hidden {spec.hidden_size}")

        t = time.perf_counter()
        say("load", "loading weights", False)
        hf_model = load_hf_model(folder)
        num_params = sum(p.numel() for p in hf_model.parameters())
        stage("load", t, f"{num_params / 1e6:.1f}M parameters")

        t = time.perf_counter()
        say("export", "torch.export -> ONNX opset 23", False)
        model = export_onnx(hf_model, spec)
        del hf_model
        stage("export", t, f"{sum(1 for _ in model.graph)} nodes")

        t = time.perf_counter()
        names = [n for n in ALL_PASSES if n not in options.disable_passes]
        ctx = BuildContext(spec, block_size=options.block_size, max_context=max_context,
                           last_token_logits=options.last_token_logits, lossless_weights=options.lossless_weights)
        manager = PassManager(
            make_passes(names),
            verifier=verifier if options.verify else None,
            dump_dir=options.dump_ir,
            on_pass=lambda r: say("passes", f"{r.name}: {_counts_text(r.counts)}", True),
        )
        records = manager.run(model, ctx)
        stage("passes", t, f"{len(records)} passes, {sum(1 for _ in model.graph)} nodes")

        t = time.perf_counter()
        say("save", f"writing {output}", False)
        import onnx_ir as ir

        ir.save(model, writer.path / MODEL_FILE, external_data=WEIGHTS_FILE)
        _save_tokenizer(folder, writer.path / TOKENIZER_DIR)
        _save_generation_config(folder, spec, writer.path / "generation_config.json")
        io = _io_names(model, spec)
        stage("save", t)

        report = {
            "model": model_ref,
            "llmc_version": __version__,
            "stages": [asdict(s) for s in stages],
            "passes": [r.to_dict() for r in records],
            "peak_rss_mb": round(peak_rss_mb(), 1),
            "parameters": num_params,
        }
        (writer.path / "build_report.json").write_text(json.dumps(report, indent=2))
        (writer.path / "build_report.md").write_text(render_report_md(report, spec))
        layout = kv_layout.of_model(model)
        writer.commit({
            "source": {"model": model_ref, "folder": str(folder),
                       "config_sha256": hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()},
            "backend": {"name": "onnxruntime", "target": "cpu",
                        "custom_ops": [kernels.DOMAIN] if kernels.uses_kernels(model.opset_imports) else []},
            "model_spec": spec.to_dict(),
            "build_options": {"block_size": options.block_size, "max_context": max_context,
                              "disabled_passes": list(options.disable_passes),
                              "verified": options.verify,
                              "last_token_logits": options.last_token_logits,
                              "lossless_weights": options.lossless_weights},
            "passes": [r.to_dict() for r in records],
            "quantization": None,
            "kv_cache": {
                "layout": layout,
                "pool_shape": "[" + ", ".join(map(str, kv_layout.pool_shape(
                    layout, "num_blocks", "block_size", "num_kv_heads", "head_dim"))) + "]",
                "dtype": "float32",
                "block_size": options.block_size,
                "num_layers": spec.num_layers,
                "num_kv_heads": spec.num_kv_heads,
                "head_dim": spec.head_dim,
                "scratch_block": 0,
            },
            "io": io,
            "max_context": max_context,
            "payload": {"model": MODEL_FILE, "weights": WEIGHTS_FILE},
            "tokenizer": f"{TOKENIZER_DIR}/tokenizer.json",
        })
    return BuildResult(output, stages, peak_rss_mb(), [(r.name, m) for r in records for m in r.misses])


def _counts_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in counts.items() if v) or "no change"


def _io_names(model, spec: ModelSpec) -> dict:
    inputs = [v.name for v in model.graph.inputs]
    outputs = [v.name for v in model.graph.outputs]
    caches = [f"kv_cache.{i}" for i in range(spec.num_layers)]
    missing = [c for c in caches if c not in inputs]
    if missing:
        raise LlmcError(f"the graph has no paged KV cache input for {len(missing)} of "
                        f"{spec.num_layers} layers; this model's attention was not recognized")
    return {
        "inputs": inputs,
        "outputs": outputs,
        "cache_inputs": caches,
        "cache_outputs": [f"kv_cache_out.{i}" for i in range(spec.num_layers)],
        # Each cache output is bound to the same buffer as its input: in-place writes.
        "aliases": {f"kv_cache_out.{i}": f"kv_cache.{i}" for i in range(spec.num_layers)},
        "logits": "last" if len(model.graph.outputs[0].shape or ()) == 2 else "all",
    }


def _save_tokenizer(folder: Path, dest: Path) -> None:
    """Normalize to a fast tokenizer's tokenizer.json (what the lean runtime loads)."""
    dest.mkdir(parents=True)
    if (folder / "tokenizer.json").is_file():
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (folder / name).is_file():
                shutil.copy2(folder / name, dest / name)
        return
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(folder, use_fast=True).save_pretrained(dest)
    except Exception as exc:
        raise LlmcError(f"cannot load a tokenizer from {folder} ({first_line(exc)}); "
                        "the model folder needs tokenizer files") from None
    if not (dest / "tokenizer.json").is_file():
        raise LlmcError(f"the tokenizer in {folder} has no fast (tokenizer.json) form; llmc needs one")


def _save_generation_config(folder: Path, spec: ModelSpec, dest: Path) -> None:
    src = folder / "generation_config.json"
    config = json.loads(src.read_text()) if src.is_file() else {}
    config.setdefault("bos_token_id", spec.bos_token_id)
    config.setdefault("eos_token_id", list(spec.eos_token_ids))
    dest.write_text(json.dumps(config, indent=2))


def render_report_md(report: dict, spec: ModelSpec) -> str:
    lines = [
        f"# Build report: {report['model']}",
        "",
        f"llmc {report['llmc_version']} · {spec.architecture} · {spec.num_layers} layers · "
        f"hidden {spec.hidden_size} · {report['parameters'] / 1e6:.1f}M parameters · "
        f"peak RSS {report['peak_rss_mb']:.0f} MB",
        "",
        "## Stages",
        "",
        "| stage | seconds | detail |",
        "|---|---:|---|",
    ]
    lines += [f"| {s['name']} | {s['seconds']:.2f} | {s['detail']} |" for s in report["stages"]]
    lines += ["", "## Passes", "", "| pass | changed | matches | nodes | seconds | max abs diff |",
              "|---|---|---|---|---:|---:|"]
    for p in report["passes"]:
        diff = "not verified" if p["max_abs_diff"] is None else f"{p['max_abs_diff']:.2e}"
        lines.append(f"| {p['name']} | {'yes' if p['changed'] else 'no'} | {_counts_text(p['counts'])} | "
                     f"{p['nodes_before']} → {p['nodes_after']} | {p['seconds']:.3f} | {diff} |")
    misses = [(p["name"], m) for p in report["passes"] for m in p["misses"]]
    if misses:
        lines += ["", "## Rules that did not fire", ""] + [f"- {n}: {m}" for n, m in misses]
    return "\n".join(lines) + "\n"
