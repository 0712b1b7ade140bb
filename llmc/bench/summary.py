"""Summaries of many requests' latencies: percentiles, throughput, SLO violations and goodput,
over llmc.runtime.metrics.RequestTimes (where each request's TTFT, TPOT, ITL and E2E are defined).
What `llmc bench`, `llmc tune` and the benchmarks report; the runtime itself never needs them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from llmc.runtime.metrics import RequestTimes

__all__ = ["SLO_METRICS", "good_requests", "goodput", "meets_slo", "percentiles", "slo_violations",
           "summarize_requests", "summarize_run", "throughput"]

DEFAULT_PERCENTILES: tuple[float, ...] = (50, 90, 95, 99)
SLO_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2e")  # what an SLO may bound, in seconds


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
