"""Drive LLM through its public API like a client would, and time what it sees.

A run sends each request at its arrival time (`add_request(..., arrival_time=...)`, so a request
that arrives while a step is running is charged for the wait), keeps at most `max_concurrency`
requests in flight, and steps the engine until every request has finished. Two engines are
compared by alternating their runs in one process (A B, then B A, ...), so slow drift of the
machine lands on both.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from llmc.bench.workloads import MAX_QPS, BenchRequest, Workload, prompt_vocab
from llmc.runtime.llm import LLM
from llmc.bench.summary import summarize_run
from llmc.runtime.metrics import RequestTimes
from llmc.runtime.request import RequestOutput
from llmc.runtime.sampling import SamplingParams

COMPLETED = ("stop", "length")  # finish reasons of requests that ended normally
BUSY_MACHINE = 0.1  # other processes' share of the CPU above which a measurement is flagged
WARMUP_VARIANT = 1 << 30  # a prompt-token stream no measured run uses


@dataclass
class RequestRecord:
    prompt_tokens: int
    output_len: int  # tokens asked for (outputs run to this length: EOS is ignored)
    output: RequestOutput

    @property
    def completed(self) -> bool:
        return self.output.finish_reason in COMPLETED

    def to_dict(self, origin: float) -> dict[str, Any]:
        """Timestamps as seconds since `origin` (the run's start) plus the derived metrics."""
        m = self.output.metrics
        shifted = RequestTimes(m.arrival - origin,
                               None if m.first_scheduled is None else m.first_scheduled - origin,
                               [t - origin for t in m.token_times])
        return {"prompt_tokens": self.prompt_tokens, "output_len": self.output_len,
                "finish_reason": self.output.finish_reason, "error": self.output.error,
                "prefix_hit_tokens": self.output.prefix_hit_tokens, "preemptions": self.output.preemptions,
                **shifted.to_dict()}


@dataclass
class RunResult:
    engine: str
    qps: float
    repeat: int
    start: float  # perf_counter() when the run began; its requests' timestamps count from here
    wall_time: float  # start to the last token
    records: list[RequestRecord] = field(default_factory=list)
    other_cpu: float | None = None  # share of the machine's CPU other processes used meanwhile

    @property
    def times(self) -> list[RequestTimes]:
        return [r.output.metrics for r in self.records]

    def summary(self, slo: dict[str, float] | None = None) -> dict[str, Any]:
        return summarize_run(self.times, self.wall_time, slo, [r.completed for r in self.records])


def merged_summary(runs: Sequence[RunResult], slo: dict[str, float] | None = None) -> dict[str, Any]:
    """One summary over repeats: percentiles over all their requests, rates over their total wall time."""
    records = [r for run in runs for r in run.records]
    return summarize_run([r.output.metrics for r in records], sum(run.wall_time for run in runs), slo,
                         [r.completed for r in records])


class OtherCpu:
    """Measures the share of the machine's CPU that other processes used during a `with` block.

    Timings cannot tell a slow configuration from a busy machine; this can: the machine's busy
    time (steal included, it is another guest's) minus this process's own, over wall time × cores.
    """

    def __enter__(self) -> "OtherCpu":
        import psutil

        self._proc, self.share = psutil.Process(), None
        self._start = (time.perf_counter(), self._busy(psutil.cpu_times()), self._own())
        return self

    def __exit__(self, *exc) -> None:
        import psutil

        t0, busy0, own0 = self._start
        wall = time.perf_counter() - t0
        others = (self._busy(psutil.cpu_times()) - busy0) - (self._own() - own0)
        self.share = min(1.0, max(0.0, others / (wall * (psutil.cpu_count() or 1)))) if wall > 0 else None

    @staticmethod
    def _busy(t) -> float:
        return t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0) + getattr(t, "steal", 0)

    def _own(self) -> float:
        t = self._proc.cpu_times()
        return t.user + t.system


def run_requests(llm: LLM, requests: Sequence[BenchRequest], max_concurrency: int | None = None,
                 on_finish: Callable[[], None] | None = None) -> tuple[list[RequestRecord], float, float]:
    """Send `requests` at their arrival times; returns (records, start, wall time).

    With `max_concurrency`, a request due while that many are in flight waits on the client side
    and counts as arriving when a slot frees (as a closed-loop client would send it then).
    """
    cap = max_concurrency or len(requests)
    pending = deque(sorted(range(len(requests)), key=lambda i: requests[i].arrival))
    records: list[RequestRecord] = [None] * len(requests)  # type: ignore[list-item]  # all set by the end
    in_flight: list[RequestOutput] = []
    slot_freed_at = -math.inf  # last time a full client freed a slot
    start = time.perf_counter()
    while pending or in_flight:
        now = time.perf_counter()
        while pending and len(in_flight) < cap and start + requests[pending[0]].arrival <= now:
            i = pending.popleft()
            req = requests[i]
            params = SamplingParams(max_tokens=req.output_len, ignore_eos=True)
            rid = llm.add_request(req.prompt, params, arrival_time=max(start + req.arrival, slot_freed_at))
            out = llm.output(rid)
            records[i] = RequestRecord(len(req.prompt), req.output_len, out)
            in_flight.append(out)
        if in_flight:
            llm.step()
            still = [o for o in in_flight if not o.finished]
            if len(still) < len(in_flight):
                if len(in_flight) >= cap:
                    slot_freed_at = time.perf_counter()
                for _ in range(len(in_flight) - len(still)):
                    if on_finish:
                        on_finish()
                in_flight = still
        elif pending:
            time.sleep(max(0.0, start + requests[pending[0]].arrival - time.perf_counter()))
    end = max((t for r in records for t in r.output.metrics.token_times[-1:]), default=time.perf_counter())
    return records, start, end - start


class InProcess:
    """An LLM in this process as a benchmark target. A target has `max_context` (None: unknown),
    `vocab` (the token ids prompts are drawn from), `run` (send requests, time what comes back) and
    `in_process`; `llmc.bench.http.HttpTarget` is the other kind, a server over HTTP."""

    in_process = True

    def __init__(self, llm: LLM):
        self.llm = llm
        self.max_context = llm.max_context
        self.vocab = engine_vocab(llm)

    def run(self, requests: Sequence[BenchRequest], max_concurrency: int | None = None,
            on_finish: Callable[[], None] | None = None) -> tuple[list[RequestRecord], float, float]:
        return run_requests(self.llm, requests, max_concurrency, on_finish)


def warm_up(target, workload: Workload, count: int) -> None:
    """Run `count` requests of the workload's shape at once, short outputs, unrecorded: the first
    calls of an ORT session allocate and pick kernels for each new shape. Shared prefixes are the
    measured runs' own, so measurement starts with the system prompt cached, as in steady state."""
    if count < 1:
        return
    requests = replace(workload, num_requests=count).requests(target.vocab, MAX_QPS, repeat=0,
                                                              variant=WARMUP_VARIANT)
    target.run([BenchRequest(r.prompt, min(r.output_len, 16), 0.0) for r in requests])


def engine_vocab(llm: LLM):
    """The token ids benchmark prompts are drawn from on this engine (EOS ids left out)."""
    return prompt_vocab(llm.engine.spec.vocab_size, llm.eos_ids)


@dataclass(frozen=True)
class PlannedRun:
    engine: int  # index into the engines being compared
    qps_index: int
    repeat: int


def plan_runs(num_engines: int, num_rates: int, repeats: int) -> list[PlannedRun]:
    """Run order: per rate, per repeat, every engine once, alternating which goes first."""
    plan = []
    for q in range(num_rates):
        for rep in range(repeats):
            order = range(num_engines) if rep % 2 == 0 else reversed(range(num_engines))
            plan += [PlannedRun(e, q, rep) for e in order]
    return plan


def benchmark(targets: Sequence[tuple[str, Any]], workload: Workload, rates: Sequence[float], repeats: int = 1,
              max_concurrency: int | None = None, warmup: int = 4,
              on_run: Callable[[str, float, int], None] | None = None,
              on_finish: Callable[[], None] | None = None) -> list[RunResult]:
    """Warm each target (InProcess, HttpTarget) up, then run every (rate, repeat) on every target
    in plan_runs order. Targets that agree on vocabulary get the very same requests for the same
    (rate, repeat)."""
    for _, target in targets:
        if target.max_context is not None:
            workload.check_fits(target.max_context)
    for _, target in targets:
        warm_up(target, workload, warmup)
    results = []
    for planned in plan_runs(len(targets), len(rates), repeats):
        label, target = targets[planned.engine]
        rate = rates[planned.qps_index]
        if on_run:
            on_run(label, rate, planned.repeat)
        requests = workload.requests(target.vocab, rate, planned.repeat, planned.qps_index)
        with OtherCpu() as other:
            records, start, wall = target.run(requests, max_concurrency, on_finish)
        # A server's own processes are "other" to this one: their share says nothing about noise.
        results.append(RunResult(label, rate, planned.repeat, start, wall, records,
                                 other.share if target.in_process else None))
    return results
