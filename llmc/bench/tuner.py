"""The tuner's search: coordinate descent over knobs against an objective, under a time budget.

The search never measures anything itself: it calls `cost(config)`, which returns one run summary
(a `summarize_run` dict) per repeat, and reads the objective from those. So the real measurement
(llmc.bench.measure) and a deterministic fake in a test are interchangeable.

Coordinate descent: start from the default configuration; for each knob in turn try every value
with the other knobs held at the incumbent, keep the best; sweep the knobs again until a whole
sweep changes nothing or the budget cannot fit another trial. Then the default and the best are
measured once more back to back, so drift of the machine between the first and a late trial does
not pass for a margin. Finished trials are written to a state file after each one; a re-run with
the same setup reuses them (the search is deterministic given its trials, so it replays to where
it stopped and carries on).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmc.errors import LlmcError, first_line

STATE_SCHEMA_VERSION = 1
FINAL_CHECK_TRIALS = 2  # the default and the best, measured again back to back at the end

Config = dict[str, Any]
Cost = Callable[[Config], list[dict[str, Any]]]  # config -> one run summary per repeat


@dataclass(frozen=True)
class Objective:
    name: str
    description: str
    direction: str  # "min" or "max"
    unit: str  # "s" (shown in ms), "tok/s" or "req/s"
    path: tuple[str, ...]  # where the value sits in a run summary
    needs_slo: bool = False

    def value(self, summary: dict[str, Any]) -> float:
        node: Any = summary
        for key in self.path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            raise LlmcError(f"the runs give no {'.'.join(self.path)} for objective {self.name} "
                            "(e.g. no request produced 2+ tokens); raise --output-len")
        return float(node)

    def better(self, a: float, b: float) -> bool:
        return a < b if self.direction == "min" else a > b

    def margin(self, value: float, reference: float) -> float:
        """Relative improvement of `value` over `reference` (positive = better)."""
        return (reference - value) / reference if self.direction == "min" else value / reference - 1

    @property
    def better_word(self) -> str:
        return "lower" if self.direction == "min" else "higher"

    @property
    def shown_unit(self) -> tuple[float, str]:
        """(factor, unit) values are shown in: seconds as ms."""
        return (1e3, "ms") if self.unit == "s" else (1.0, self.unit)

    def format(self, value: float) -> str:
        factor, unit = self.shown_unit
        return f"{value * factor:.2f} {unit}"


OBJECTIVES = {o.name: o for o in (
    Objective("min-tpot-p99", "P99 time per output token", "min", "s", ("tpot", "p99")),
    Objective("max-throughput", "output tokens per second", "max", "tok/s", ("throughput",)),
    Objective("max-goodput", "completed requests per second meeting every SLO", "max", "req/s", ("goodput",),
              needs_slo=True),
)}


def get_objective(name: str, slo: dict[str, float]) -> Objective:
    objective = OBJECTIVES.get(name)
    if objective is None:
        raise LlmcError(f"unknown objective {name!r}; objectives are: {', '.join(OBJECTIVES)}")
    if objective.needs_slo and not slo:
        raise LlmcError(f"objective {name} needs SLOs; pass e.g. --slo ttft=500ms,tpot=50ms")
    return objective


@dataclass(frozen=True)
class Knob:
    name: str
    values: tuple[Any, ...]
    kind: str = "runtime"  # "runtime" (tuning.json can apply it) or "build" (needs a rebuild)


@dataclass
class SearchSpace:
    knobs: list[Knob]
    default: Config

    def __post_init__(self):
        for knob in self.knobs:
            if self.default.get(knob.name) not in knob.values:
                raise ValueError(f"knob {knob.name}: default {self.default.get(knob.name)!r} is not among its values")

    def valid(self, config: Config) -> bool:
        """The scheduler's own constraints; configurations breaking them are skipped, not run."""
        mbt = config.get("max_num_batched_tokens")
        if mbt is None:
            return True
        return config.get("chunk_size", 0) <= mbt and config.get("max_num_seqs", 0) <= mbt

    def kind(self, name: str) -> str:
        return next(k.kind for k in self.knobs if k.name == name)


@dataclass
class Trial:
    config: Config
    values: list[float] = field(default_factory=list)  # the objective per repeat
    seconds: float = 0.0
    error: str | None = None
    summaries: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def score(self) -> float:
        return statistics.median(self.values)

    @property
    def rel_spread(self) -> float:
        """(max - min) / median over repeats: how far apart repeats of the same trial landed."""
        return (max(self.values) - min(self.values)) / abs(self.score) if self.score else 0.0

    def to_state(self) -> dict[str, Any]:
        return {"config": self.config, "seconds": self.seconds, "error": self.error, "summaries": self.summaries}


@dataclass
class TuneResult:
    trials: list[Trial]
    default: Trial | None
    best: Trial | None  # best successful trial of any kind
    winner: Trial | None  # what tuning.json gets: best runtime-only trial, if it beats the default beyond noise
    objective: Objective
    measured: int  # trials measured in this session (the rest came from the state file)
    seconds: float
    budget: float
    out_of_budget: bool
    confirmed: bool = False  # default and best were measured again back to back at the end

    @property
    def margin(self) -> float:
        return self.objective.margin(self.best.score, self.default.score)

    @property
    def noise(self) -> float:
        return max(self.best.rel_spread, self.default.rel_spread)

    @property
    def verdict(self) -> str:
        if self.best is self.default:
            if self.confirmed:  # the check only runs when a trial had beaten the default
                return ("Measured again back to back at the end, the default came out ahead of the search's "
                        "best: the machine changed during the search, and the default stays.")
            return "No trial beat the default configuration."
        if self.margin <= self.noise:
            return (f"The margin ({self.margin:+.1%}) is within the repeats' spread ({self.noise:.1%}): "
                    "not a measurable difference, so tuning.json keeps the default values.")
        ratio = f"{self.margin / self.noise:.2f}× the larger spread" if self.noise else "repeats agreed exactly"
        return f"The margin is beyond the repeats' spread ({self.noise:.1%}; {ratio})."


def _key(config: Config) -> str:
    return json.dumps(config, sort_keys=True)


class Tuner:
    def __init__(self, space: SearchSpace, cost: Cost, objective: Objective, budget_s: float,
                 state_path: Path | None = None, fingerprint: dict[str, Any] | None = None,
                 on_trial: Callable[[Trial, bool], None] | None = None,
                 on_start: Callable[[Config], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.space, self.cost, self.objective, self.budget = space, cost, objective, budget_s
        self.state_path, self.fingerprint = state_path, fingerprint or {}
        self.on_trial, self.on_start, self.clock = on_trial, on_start, clock
        self._done: dict[str, Trial] = {}
        self._visited: list[Trial] = []
        self._durations: list[float] = []  # of every measurement this session: predicts the next one
        self._measured = 0  # trials measured this session (the others came from the state file)
        if state_path is not None and state_path.is_file():
            self._load_state()

    # -- state ---------------------------------------------------------------------------

    def _load_state(self) -> None:
        fix = "pass --fresh to start over or choose another output folder"
        try:
            state = json.loads(self.state_path.read_text(encoding="utf-8"))
            if state.get("schema_version") != STATE_SCHEMA_VERSION:
                raise ValueError(f"schema_version {state.get('schema_version')!r}")
            fingerprint, trials = state["fingerprint"], state["trials"]
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            raise LlmcError(f"corrupt tuning state {self.state_path} ({first_line(exc)}); {fix}") from None
        if fingerprint != self.fingerprint:
            changed = sorted(k for k in set(fingerprint) | set(self.fingerprint)
                             if fingerprint.get(k) != self.fingerprint.get(k))
            raise LlmcError(f"{self.state_path} holds trials of a different setup ({', '.join(changed)} differ); {fix}")
        for t in trials:
            trial = self._score(Trial(t["config"], seconds=t["seconds"], error=t["error"], summaries=t["summaries"]))
            self._done[_key(trial.config)] = trial

    def _save_state(self) -> None:
        if self.state_path is None:
            return
        state = {"schema_version": STATE_SCHEMA_VERSION, "fingerprint": self.fingerprint,
                 "trials": [t.to_state() for t in self._done.values()]}
        tmp = self.state_path.with_name(f".{self.state_path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(state, indent=1), encoding="utf-8")
        os.replace(tmp, self.state_path)  # an interrupted write leaves the previous state whole

    # -- trials ----------------------------------------------------------------------------

    def _score(self, trial: Trial) -> Trial:
        if not trial.failed:
            try:
                trial.values = [self.objective.value(s) for s in trial.summaries]
            except LlmcError as exc:
                trial.error = str(exc)
        return trial

    def _fits_budget(self, elapsed: float, trials: int = 1) -> bool:
        expected = statistics.median(self._durations) if self._durations else 0.0
        return elapsed + trials * expected <= self.budget

    def _trial(self, config: Config) -> Trial:
        key = _key(config)
        trial = self._done.get(key)
        reused = trial is not None
        if trial is None:
            if self.on_start:
                self.on_start(config)
            t0 = self.clock()
            try:
                trial = Trial(dict(config), summaries=self.cost(dict(config)))
                if not trial.summaries:
                    raise LlmcError("the cost function returned no runs")
            except LlmcError as exc:  # e.g. a build variant that does not build: note it, search on
                trial = Trial(dict(config), error=str(exc))
            trial.seconds = self.clock() - t0
            self._durations.append(trial.seconds)
            self._measured += 1
            self._score(trial)
            self._done[key] = trial
            self._save_state()
        if all(t is not trial for t in self._visited):
            self._visited.append(trial)
            if self.on_trial:
                self.on_trial(trial, reused)
        return trial

    def run(self) -> TuneResult:
        start = self.clock()
        incumbent = dict(self.space.default)
        default = self._trial(incumbent)  # always measured: every margin is against it
        best = None if default.failed else default
        out_of_budget = False
        changed = best is not None
        while changed and not out_of_budget:
            changed = False
            for knob in self.space.knobs:
                for value in knob.values:
                    config = {**incumbent, knob.name: value}
                    if value == incumbent[knob.name] or not self.space.valid(config):
                        continue
                    # Leave room to measure the default and the best again at the end.
                    if _key(config) not in self._done and not self._fits_budget(self.clock() - start,
                                                                                trials=1 + FINAL_CHECK_TRIALS):
                        out_of_budget = True
                        break
                    trial = self._trial(config)
                    if not trial.failed and self.objective.better(trial.score, best.score):
                        best, changed = trial, True
                incumbent = dict(best.config)  # the next knob varies around the best so far
                if out_of_budget:
                    break
        confirmed, finalists = False, None
        if best is not None and best is not default:
            # The default ran first and the best somewhere later: machine drift between them would
            # land in the margin. Measure both again back to back; their values pool both rounds,
            # and the final choice is among these finalists only (a trial measured once must not
            # overtake them just because their second round came out lower).
            finalists = [default, best, self._best(runtime_only=True)]
            finalists = [t for i, t in enumerate(finalists) if all(t is not u for u in finalists[:i])]
            if self._fits_budget(self.clock() - start, trials=len(finalists)):
                confirmed = all([self._remeasure(t) for t in finalists])
        pool = finalists if confirmed else None
        winner = None
        if best is not None:
            best = self._best(pool)
            winner = self._best(pool, runtime_only=True)
            noise = max(winner.rel_spread, default.rel_spread)
            if self.objective.margin(winner.score, default.score) <= noise:
                winner = default
        return TuneResult(self._visited, default, best, winner, self.objective,
                          measured=self._measured, seconds=self.clock() - start, budget=self.budget,
                          out_of_budget=out_of_budget, confirmed=confirmed)

    def _best(self, candidates: list[Trial] | None = None, runtime_only: bool = False) -> Trial:
        """The best successful trial among `candidates` (default: all visited); with runtime_only,
        among those on the engine as built (build knobs at their defaults)."""
        build = [k.name for k in self.space.knobs if k.kind == "build"]
        pool = [t for t in (candidates or self._visited) if not t.failed
                and not (runtime_only and any(t.config[n] != self.space.default[n] for n in build))]
        return min(pool, key=lambda t: t.score if self.objective.direction == "min" else -t.score)

    def _remeasure(self, trial: Trial) -> bool:
        t0 = self.clock()
        try:
            more = self.cost(dict(trial.config))
        except LlmcError:
            return False  # keep what the first measurement found
        self._durations.append(self.clock() - t0)
        trial.summaries = trial.summaries + more
        trial.seconds += self.clock() - t0
        self._score(trial)
        self._save_state()
        return True


def parse_budget(text: str) -> float:
    from llmc.bench.slo import parse_duration

    return parse_duration(text, "--budget", units=("s", "m", "h"))
