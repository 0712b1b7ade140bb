"""The `llmc bench` and `llmc tune` flows: check every input first (nothing is measured before a
typo is caught), load, measure with progress on stderr, write the files, print the summary."""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmc.bench.slo import format_slo, parse_slo
from llmc.bench.workloads import LengthDist, Workload, parse_qps, qps_label
from llmc.contract.options import format_options
from llmc.errors import LlmcError


@dataclass
class WorkloadArgs:
    """The workload flags both commands take, as typed on the command line."""

    num_requests: int
    prompt_len: str
    output_len: str
    shared_prefix: int
    num_prefixes: int
    qps: str
    max_concurrency: int | None
    seed: int
    warmup: int
    repeats: int
    slo: str | None

    def parse(self) -> tuple[Workload, list[float], dict[str, float]]:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise LlmcError(f"--max-concurrency must be >= 1 (got {self.max_concurrency})")
        if self.warmup < 0:
            raise LlmcError(f"--warmup must be >= 0 requests (got {self.warmup})")
        if self.repeats < 1:
            raise LlmcError(f"--repeats must be >= 1 (got {self.repeats})")
        workload = Workload(self.num_requests, LengthDist.parse(self.prompt_len, "--prompt-len"),
                            LengthDist.parse(self.output_len, "--output-len"), self.shared_prefix,
                            self.num_prefixes, self.seed)
        return workload, parse_qps(self.qps), parse_slo(self.slo)

    def describe(self, workload: Workload) -> dict[str, Any]:
        return {**workload.to_dict(), "max_concurrency": self.max_concurrency, "warmup": self.warmup,
                "repeats": self.repeats}


def _output_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LlmcError(f"cannot create the output folder {path} ({e.strerror}); choose another -o") from None
    return path


def _console():
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def _engine_info(label: str, path: Path, llm) -> dict[str, Any]:
    return {"label": label, "path": str(path), "source": llm.engine.manifest.source.model,
            "options": llm.options.tunable(), "tuning": llm.tuning}


def _labels(paths: list[Path]) -> list[str]:
    names = [p.resolve().name for p in paths]
    return names if len(set(names)) == len(names) else [f"{n}#{i}" for i, n in enumerate(names, 1)]


def bench(engines: list[Path], args: WorkloadArgs, output: Path | None, plots: bool, runtime: dict[str, Any],
          use_tuning: bool, urls: list[str] = (), model: str | None = None, vocab_size: int | None = None,
          tokenizer: str | None = None) -> Path:
    """Benchmark one or two targets: engines in-process, servers at `urls` over HTTP."""
    from llmc.bench.report import build_report, print_table, render_markdown, write_json
    from llmc.bench.runner import InProcess, benchmark
    from llmc.contract.tuning import tuning_line
    from llmc.runtime.llm import LLM

    if len(engines) + len(urls) > 2:
        raise LlmcError(f"llmc bench compares at most two targets (got {len(engines) + len(urls)})")
    if not engines and not urls:
        raise LlmcError("give an engine to benchmark, or --url URL of a server")
    workload, rates, slo = args.parse()
    if plots:
        from llmc.bench.plots import require_matplotlib

        require_matplotlib()
    console = _console()
    loaded, infos = [], []
    for label, path in zip(_labels(engines), engines):
        with console.status(f"loading {path}"):
            llm = LLM(path, use_tuning=use_tuning, **runtime)
        workload.check_fits(llm.max_context)
        if llm.tuning is not None:
            console.print(f"{label}: {tuning_line(llm.tuning)}")
        loaded.append((label, InProcess(llm)))
        infos.append(_engine_info(label, path, llm))
    for url in urls:
        from llmc.bench.http import HttpTarget

        server = HttpTarget(url, model, vocab_size, tokenizer)
        if server.max_context is not None:
            workload.check_fits(server.max_context)
        taken = [lab for lab, _ in loaded]
        label = server.model if server.model not in taken else f"{server.model} ({server.url})"
        loaded.append((label, server))
        infos.append({**server.info, "label": label})
    labels = [label for label, _ in loaded]
    output = output or Path(f"bench-{'-vs-'.join(labels)}".replace("/", "_"))
    _output_dir(output)  # before measuring: a bad -o must not cost a benchmark's worth of time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = workload.num_requests * len(rates) * args.repeats * len(loaded)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("warming up", total=total)
        runs = benchmark(
            loaded, workload, rates, args.repeats, args.max_concurrency, args.warmup,
            on_run=lambda label, rate, rep: progress.update(
                task, description=f"{label} · qps {qps_label(rate)} · repeat {rep + 1}/{args.repeats}"),
            on_finish=lambda: progress.advance(task))

    report = build_report(infos, args.describe(workload), rates, runs, slo)
    if plots:
        from llmc.bench.plots import bench_plots

        report["plots"] = bench_plots(report, output)
    write_json(output / "report.json", report)
    (output / "report.md").write_text(render_markdown(report), encoding="utf-8")
    from rich.console import Console

    stdout = Console(highlight=False)
    if not stdout.is_terminal:  # a pipe or a file has no width to fit: never squeeze the table
        stdout = Console(highlight=False, width=200)
    print_table(report, stdout)
    written = ["report.json", "report.md", *report["plots"]]
    console.print(f"wrote {output}/: {', '.join(written)}")
    return output


def tune(engine: Path, args: WorkloadArgs, output: Path | None, plots: bool, objective_name: str, budget: str,
         build_knobs: bool, fresh: bool) -> Path:
    """`llmc tune`: search the knobs for the objective within the budget, write the winner to
    tuning.json and the trials to tuning_report.md (and a plot)."""
    from llmc.bench.measure import make_space
    from llmc.bench.report import config_changes
    from llmc.bench.tuner import get_objective, parse_budget

    workload, rates, slo = args.parse()
    objective = get_objective(objective_name, slo)
    budget_s = parse_budget(budget)
    if len(rates) != 1:
        raise LlmcError(f"llmc tune measures one arrival rate; pass a single --qps (got {args.qps!r})")
    rate = rates[0]
    if plots:
        from llmc.bench.plots import require_matplotlib

        require_matplotlib()
    console = _console()
    defaults, manifest = _untuned(console, engine, workload)
    max_in_flight = min(workload.num_requests, args.max_concurrency or workload.num_requests)
    space = make_space(defaults, manifest.build_options if build_knobs else None, max_in_flight)
    output = _output_dir(output or Path(f"tune-{engine.resolve().name}"))
    if fresh:
        _forget_trials(output)
    described = {**args.describe(workload), "qps": qps_label(rate)}
    result = _run_trials(console, engine, manifest, args, workload, rate, slo, output, space, objective, budget_s,
                         fingerprint=_fingerprint(engine, described, slo, build_knobs))
    if result.default is None or result.default.failed:
        raise LlmcError(f"the default configuration failed on this workload ({result.default.error}); "
                        "check the engine with `llmc run`")
    winner_options, path = _write_winner(engine, result, objective, described, slo)
    recommendation = _rebuild_recommendation(engine, manifest, space, result)
    plot = _write_tuning_report(output, engine, result, objective, described, recommendation, plots)
    console.print(f"best: {config_changes(result.best.config, space.default) or 'the default'} "
                  f"· {result.margin:+.1%} {objective.name} vs default · {result.verdict}")
    if recommendation:
        console.print(recommendation)
    console.print(f"wrote {path} ({format_options(winner_options)}) and {output}/tuning_report.md"
                  + (f", {output}/{plot}" if plot else ""))
    return output


TUNE_STATE = "tune_state.json"  # the trials so far, for resuming


def _untuned(console, engine: Path, workload: Workload):
    """(the engine's untuned RuntimeOptions, its manifest): the untuned defaults are the baseline.
    The LLM is dropped on return, before the trials load their own."""
    from llmc.runtime.llm import LLM

    with console.status(f"loading {engine}"):
        llm = LLM(engine, use_tuning=False)
        workload.check_fits(llm.max_context)
        return llm.options, llm.engine.manifest


def _forget_trials(output: Path) -> None:
    """--fresh: drop an earlier run's trial state and the engine variants it built."""
    (output / TUNE_STATE).unlink(missing_ok=True)
    shutil.rmtree(output / "engines", ignore_errors=True)


def _fingerprint(engine: Path, described: dict, slo: dict, build_knobs: bool) -> dict:
    """What the saved trials were measured on: a run resumes them only where this is the same."""
    from llmc.contract import MANIFEST

    return {"engine": hashlib.sha256((engine / MANIFEST).read_bytes()).hexdigest(),
            "workload": described, "slo": slo, "build_knobs": build_knobs}


class _TrialLog:
    """The tuner's progress on the console: the running trial in a spinner, a line per finished one."""

    def __init__(self, console, status, space, objective):
        self.console, self.status, self.space, self.objective = console, status, space, objective
        self.trial_no = 0

    def progress(self, what: str) -> None:
        self.status.update(f"trial {self.trial_no + 1}: {what}")

    def started(self, config) -> None:
        from llmc.bench.report import config_changes

        self.progress(config_changes(config, self.space.default) or "default")

    def finished(self, trial, reused: bool) -> None:
        from llmc.bench.report import config_changes, other_cpu
        from llmc.bench.runner import BUSY_MACHINE

        self.trial_no += 1
        changed = config_changes(trial.config, self.space.default) or "default"
        value = f"failed: {trial.error}" if trial.failed else \
            f"{self.objective.format(trial.score)} (spread {trial.rel_spread:.1%})"
        reuse = " (reused)" if reused else ""
        share = other_cpu(trial)
        busy = f" · other processes took {share:.0%} of the CPU" if share and share > BUSY_MACHINE else ""
        self.console.print(f"  trial {self.trial_no:2d} {changed}: {value} · {trial.seconds:.1f}s{reuse}{busy}")


def _run_trials(console, engine: Path, manifest, args: WorkloadArgs, workload: Workload, rate: float, slo: dict,
                output: Path, space, objective, budget_s: float, fingerprint: dict):
    """The tuner's result: trials of the space within the budget, the default configuration first."""
    from llmc.bench.measure import WorkloadCost
    from llmc.bench.tuner import Tuner

    status = console.status("measuring the default configuration")
    log = _TrialLog(console, status, space, objective)
    status.start()
    cost = WorkloadCost(engine, manifest, workload, rate, args.repeats, args.max_concurrency, args.warmup, slo,
                        output, space, on_progress=log.progress)
    try:
        return Tuner(space, cost, objective, budget_s, output / TUNE_STATE, fingerprint, on_trial=log.finished,
                     on_start=log.started).run()
    finally:
        status.stop()


def _write_winner(engine: Path, result, objective, described: dict, slo: dict) -> tuple[dict[str, Any], Path]:
    """(the winner's tunable options, the tuning.json written with them and what was measured)."""
    from llmc.contract.options import RuntimeOptions
    from llmc.contract.tuning import write_tuning

    winner_options = RuntimeOptions.tunable_of(result.winner.config)
    path = write_tuning(engine, winner_options, objective=objective.name, workload=described,
                        slo=format_slo(slo) or None,
                        measured={"default": result.default.score, "winner": result.winner.score,
                                  "margin": objective.margin(result.winner.score, result.default.score),
                                  "unit": objective.unit, "trials": len(result.trials)})
    return winner_options, path


def _rebuild_recommendation(engine: Path, manifest, space, result) -> str | None:
    """Where the best trial changes build knobs, which tuning.json cannot apply: the rebuild to run."""
    from llmc.bench.measure import build_command

    if not any(result.best.config[k.name] != space.default[k.name] for k in space.knobs if k.kind == "build"):
        return None
    return (f"The best trial changes build knobs, which tuning.json cannot apply: rebuild with "
            f"`{build_command(manifest, engine, result.best.config)}` and run `llmc tune` on the new "
            f"engine. tuning.json holds the best runtime-only configuration for the current build.")


def _write_tuning_report(output: Path, engine: Path, result, objective, described: dict,
                         recommendation: str | None, plots: bool) -> str | None:
    """tuning_report.md, and the plot it shows (its file name) when `plots`."""
    from llmc.bench.report import render_tuning_markdown

    plot = None
    if plots:
        from llmc.bench.plots import tuning_plot

        plot = tuning_plot(result, output)
    (output / "tuning_report.md").write_text(
        render_tuning_markdown(result, objective, described, str(engine), recommendation, plot), encoding="utf-8")
    return plot
