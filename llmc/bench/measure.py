"""The tuner's real cost function and search space: load the engine with a trial's options
(building a variant first when a build knob differs), warm up, run the workload per repeat.

Runtime knobs are what tuning.json can apply. Build knobs (block size, optional passes) change the
engine itself; they are searched only on request, by building variants into the workspace.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from pathlib import Path
from typing import Any

from llmc.bench.runner import InProcess, OtherCpu, RunResult, engine_vocab, run_requests, warm_up
from llmc.bench.tuner import Config, Knob, SearchSpace
from llmc.bench.workloads import Workload
from llmc.contract import MANIFEST
from llmc.contract.manifest import Manifest
from llmc.contract.options import BuildOptions, RuntimeOptions, declaration
from llmc.errors import LlmcError
from llmc.runtime.llm import LLM

NO_PASSES = "none"  # the disable_passes value for "nothing disabled"


def _around(default: int, candidates: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted({default, *candidates}))


def runtime_space(defaults: RuntimeOptions, max_in_flight: int) -> list[Knob]:
    """Runtime knobs, most influential first (the search varies them in this order).

    `max_in_flight` is the most requests the workload can have in flight: a max_num_seqs above it
    behaves exactly like one at it, so measuring it could only let noise pick it."""
    cores = os.cpu_count() or 1
    threads = {1, cores, defaults.num_threads} | {n for n in (2, 4, 8, 16) if n <= cores}
    seqs = [n for n in (4, 8, 16, 32) if n <= max_in_flight] or [max_in_flight]
    knobs = [
        Knob("num_threads", tuple(sorted(threads))),
        Knob("max_num_seqs", _around(defaults.max_num_seqs, tuple(seqs))),
        Knob("max_num_batched_tokens", _around(defaults.max_num_batched_tokens, (256, 512, 1024))),
        Knob("chunk_size", _around(defaults.chunk_size, (64, 128, 256, 512))),
        Knob("allow_spinning", (True, False)),
        Knob("graph_optimization_level", tuple(dict.fromkeys(("basic", "extended", "all",
                                                              defaults.graph_optimization_level)))),
        # Speculation off, prompt lookup, or the draft engine the caller named (never guessed).
        Knob("speculative", tuple(dict.fromkeys((None, "ngram", defaults.speculative)))),
        Knob("num_speculative_tokens", _around(defaults.num_speculative_tokens, (2, 4, 8))),
    ]
    if defaults.speculative not in (None, "ngram"):  # a draft: with prompt lookup's proposals first, or alone
        knobs.append(Knob("draft_prompt_lookup", (True, False)))
    return knobs


# The build options the tuner searches with --build-knobs (disable_passes as one "+"-joined knob value).
BUILD_KNOBS = ("block_size", "disable_passes", "lossless_weights")


def _knob_value(options: BuildOptions, name: str) -> Any:
    value = getattr(options, name)
    return ("+".join(value) or NO_PASSES) if name == "disable_passes" else value


def build_space(options: BuildOptions) -> tuple[list[Knob], Config]:
    """Build knobs and the engine's own values of them (its manifest's build options)."""
    from llmc.passes.pipeline import optional_passes

    default = {name: _knob_value(options, name) for name in BUILD_KNOBS}
    knobs = [Knob("block_size", _around(options.block_size, (8, 16, 32)), "build"),
             Knob("disable_passes", tuple(dict.fromkeys([default["disable_passes"], NO_PASSES, *optional_passes()])),
                  "build"),
             Knob("lossless_weights", (options.lossless_weights, not options.lossless_weights), "build")]
    return knobs, default


def variant_options(options: BuildOptions, config: Config) -> BuildOptions:
    """The engine's build options with a configuration's build knobs."""
    passes = config["disable_passes"]
    return dataclasses.replace(options, block_size=config["block_size"], lossless_weights=config["lossless_weights"],
                               disable_passes=() if passes == NO_PASSES else tuple(passes.split("+")))


def make_space(defaults: RuntimeOptions, build: BuildOptions | None, max_in_flight: int) -> SearchSpace:
    knobs = runtime_space(defaults, max_in_flight)
    default = {k.name: getattr(defaults, k.name) for k in knobs}
    if build is not None:
        build_knobs, build_default = build_space(build)
        knobs += build_knobs
        default.update(build_default)
    return SearchSpace(knobs, default)


def build_command(manifest: Manifest, engine: Path, config: Config) -> str:
    """The `llmc build` line that rebuilds `engine` with a configuration's build knobs."""
    options = variant_options(manifest.build_options, config)

    def flag(name: str) -> str:
        return declaration(BuildOptions, name).flag

    parts = ["llmc build", manifest.source.model, "-o", str(engine), "--overwrite", flag("block_size"),
             str(options.block_size), flag("max_context"), str(options.max_context)]
    parts += [part for name in options.disable_passes for part in (flag("disable_passes"), name)]
    if options.lossless_weights:
        parts.append(flag("lossless_weights"))
    return " ".join(parts)


class WorkloadCost:
    """cost(config) -> one run summary per repeat, measured on the real engine."""

    def __init__(self, engine: Path, manifest: Manifest, workload: Workload, rate: float, repeats: int,
                 max_concurrency: int | None, warmup: int, slo: dict[str, float], workspace: Path,
                 space: SearchSpace, on_progress=None):
        self.engine, self.manifest, self.workload, self.rate = engine, manifest, workload, rate
        self.repeats, self.max_concurrency, self.warmup, self.slo = repeats, max_concurrency, warmup, slo
        self.workspace, self.space, self.on_progress = workspace, space, on_progress

    def _engine_for(self, config: Config) -> Path:
        build = {k.name: config[k.name] for k in self.space.knobs if k.kind == "build"}
        if all(self.space.default[name] == value for name, value in build.items()):
            return self.engine
        from llmc.compiler.build import build as run_build

        variant = self.workspace / "engines" / (f"bs{build['block_size']}-{build['disable_passes']}"
                                                 + ("-lossless" if build["lossless_weights"] else ""))
        if not (variant / MANIFEST).is_file():  # built by an earlier, interrupted session: reuse
            if self.on_progress:
                self.on_progress(f"building {variant.name}")
            run_build(self.manifest.source.model, variant, variant_options(self.manifest.build_options, config),
                      overwrite=True)
        return variant

    def __call__(self, config: Config) -> list[dict[str, Any]]:
        engine = self._engine_for(config)
        runtime = RuntimeOptions.tunable_of(config)
        # Checksums were verified when the tune started (variants are this tuner's own builds):
        # re-hashing the weights for every trial would only add to its time.
        llm = LLM(engine, use_tuning=False, verify_checksums=False, **runtime)
        try:
            warm_up(InProcess(llm), self.workload, self.warmup)
            vocab = engine_vocab(llm)
            summaries = []
            for rep in range(self.repeats):
                if self.on_progress:
                    self.on_progress(f"repeat {rep + 1}/{self.repeats}")
                with OtherCpu() as other:
                    records, start, wall = run_requests(llm, self.workload.requests(vocab, self.rate, rep, 0),
                                                        self.max_concurrency)
                run = RunResult("trial", self.rate, rep, start, wall, records, other.share)
                failed = [r for r in records if not r.completed]
                if failed:
                    why = failed[0].output.error or failed[0].output.finish_reason
                    raise LlmcError(f"{len(failed)} of {len(records)} requests failed ({why})")
                summaries.append({**run.summary(self.slo), "other_cpu": other.share})
            return summaries
        finally:
            del llm
            gc.collect()  # free this trial's KV pool and session before the next one allocates its own
