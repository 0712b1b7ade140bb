"""Per-request latency timestamps and the one place latency metrics are defined.

Reports and benchmarks reuse these definitions so every number called "TTFT" or "TPOT" in the
project means the same thing. All times are `time.perf_counter()` seconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["RequestTimes", "SLO_METRICS", "good_requests", "goodput", "meets_slo", "percentiles", "slo_violations",
           "summarize_requests", "summarize_run", "throughput"]

DEFAULT_PERCENTILES: tuple[float, ...] = (50, 90, 95, 99)
SLO_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2e")  # what an SLO may bound, in seconds


@dataclass
class RequestTimes:
    """Timestamps of one request: arrival, first scheduling, and each output token."""

    arrival: float
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)
    decode_steps: int = 0  # steps that gave tokens after the first (each may give several when speculating)
    proposed_tokens: int = 0  # speculative proposals verified
    accepted_tokens: int = 0  # of which the target kept

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else None

    @property
    def tokens_per_step(self) -> float | None:
        """Output tokens per decode step after the first token: 1 without speculation."""
        return (self.num_tokens - 1) / self.decode_steps if self.decode_steps else None

    @property
    def num_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float | None:
        """Time to first token: first token time - arrival (includes queueing and prefill)."""
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def e2e(self) -> float | None:
        """End-to-end latency: last token time - arrival."""
        return self.token_times[-1] - self.arrival if self.token_times else None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (n - 1); None when n < 2."""
        n = len(self.token_times)
        if n < 2:
            return None
        return (self.e2e - self.ttft) / (n - 1)

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: gaps between consecutive token times."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def queue_time(self) -> float | None:
        """first_scheduled - arrival; None until the request has been scheduled."""
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    def mark_scheduled(self, t: float | None = None) -> None:
        """Record the first time the scheduler picked this request; later calls are ignored."""
        if self.first_scheduled is None:
            self.first_scheduled = time.perf_counter() if t is None else t

    def record_token(self, t: float | None = None) -> None:
        """Record that an output token was produced at t (now by default)."""
        self.token_times.append(time.perf_counter() if t is None else t)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready raw timestamps plus the derived metrics."""
        return {
            "arrival": self.arrival,
            "first_scheduled": self.first_scheduled,
            "token_times": list(self.token_times),
            "num_tokens": self.num_tokens,
            "queue_time": self.queue_time,
            "ttft": self.ttft,
            "tpot": self.tpot,
            "e2e": self.e2e,
            "decode_steps": self.decode_steps,
            "proposed_tokens": self.proposed_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_step": self.tokens_per_step,
        }


def _key(p: float) -> str:
    return f"p{p:g}"  # 50 -> "p50", 99.9 -> "p99.9"


def percentiles(values: Iterable[float], ps: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, float]:
    """{"p50": ..., "p90": ...} with linear interpolation (numpy's default); {} when values is empty."""
    data = np.asarray(list(values), dtype=np.float64)
    if data.size == 0:
        return {}
    qs = np.percentile(data, list(ps))
    return {_key(p): float(q) for p, q in zip(ps, qs)}


def summarize_requests(times: Sequence[RequestTimes]) -> dict[str, Any]:
    """Latency percentiles (seconds) over requests; each metric only counts requests that define it."""
    ttft = [t.ttft for t in times if t.ttft is not None]
    e2e = [t.e2e for t in times if t.e2e is not None]
    tpot = [t.tpot for t in times if t.tpot is not None]
    queue = [t.queue_time for t in times if t.queue_time is not None]
    itl = [gap for t in times for gap in t.itl]
    proposed, accepted = sum(t.proposed_tokens for t in times), sum(t.accepted_tokens for t in times)
    steps = sum(t.decode_steps for t in times)
    return {
        "counts": {
            "requests": len(times),
            "with_tokens": len(ttft),
            "with_tpot": len(tpot),
            "output_tokens": sum(t.num_tokens for t in times),
            "itl_gaps": len(itl),
        },
        "ttft": percentiles(ttft),
        "tpot": percentiles(tpot),
        "e2e": percentiles(e2e),
        "itl": percentiles(itl),
        "queue_time": percentiles(queue),
        "speculation": {
            "proposed_tokens": proposed,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else None,
            "tokens_per_step": sum(max(t.num_tokens - 1, 0) for t in times) / steps if steps else None,
        },
    }


def slo_violations(times: RequestTimes, slo: Mapping[str, float]) -> list[str]:
    """The SLO names (see SLO_METRICS) this request misses; `slo` maps a name to its limit in seconds.

    A request with no output token misses every SLO. A metric the request does not define cannot be
    missed: a one-token output has no TPOT and no gaps, so it is judged on TTFT and E2E only. The
    ITL limit applies to every gap of the request, not to an average.
    """
    unknown = set(slo) - set(SLO_METRICS)
    if unknown:
        raise ValueError(f"unknown SLO metric {sorted(unknown)[0]!r}; SLOs can bound {', '.join(SLO_METRICS)}")
    if not times.token_times:
        return list(slo)
    observed = {"ttft": times.ttft, "tpot": times.tpot, "e2e": times.e2e, "itl": max(times.itl, default=None)}
    return [name for name, limit in slo.items() if observed[name] is not None and observed[name] > limit]


def meets_slo(times: RequestTimes, slo: Mapping[str, float]) -> bool:
    return not slo_violations(times, slo)


def throughput(times: Sequence[RequestTimes], wall_time: float) -> float:
    """Output tokens per second of wall time."""
    return sum(t.num_tokens for t in times) / wall_time


def _completed(times: Sequence[RequestTimes], completed: Sequence[bool] | None) -> list[bool]:
    # Without finish reasons, a request that produced a token is taken as completed.
    return list(completed) if completed is not None else [bool(t.token_times) for t in times]


def good_requests(times: Sequence[RequestTimes], slo: Mapping[str, float],
                  completed: Sequence[bool] | None = None) -> list[bool]:
    """For each request: did it complete and meet every SLO? `completed[i]` says whether request i
    ended normally (not aborted or failed); by default, whether it produced a token."""
    done = _completed(times, completed)
    return [ok and meets_slo(t, slo) for t, ok in zip(times, done, strict=True)]


def goodput(times: Sequence[RequestTimes], slo: Mapping[str, float], wall_time: float,
            completed: Sequence[bool] | None = None) -> float:
    """Completed requests per second of wall time that met every SLO in `slo`."""
    return sum(good_requests(times, slo, completed)) / wall_time


def summarize_run(times: Sequence[RequestTimes], wall_time: float, slo: Mapping[str, float] | None = None,
                  completed: Sequence[bool] | None = None) -> dict[str, Any]:
    """summarize_requests plus the run's rates: throughput (output tokens/s), completed requests/s
    and, with SLOs, goodput (requests/s that completed and met every SLO) and attainment (their
    share of all requests). `wall_time` is the run's length in seconds, start to last token."""
    if wall_time <= 0:
        raise ValueError(f"wall_time must be > 0 seconds (got {wall_time})")
    done = _completed(times, completed)
    summary = summarize_requests(times)
    summary["counts"]["completed"] = sum(done)
    summary["wall_time"] = wall_time
    summary["throughput"] = throughput(times, wall_time)
    summary["request_throughput"] = sum(done) / wall_time
    if slo:
        good = sum(good_requests(times, slo, done))
        summary["slo"] = dict(slo)
        summary["goodput"] = good / wall_time
        summary["slo_attainment"] = good / len(times) if times else None
    return summary
