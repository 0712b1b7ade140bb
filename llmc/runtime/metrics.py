"""Per-request latency timestamps and the one place latency metrics are defined.

Reports and benchmarks reuse these definitions so every number called "TTFT" or "TPOT" in the
project means the same thing. All times are `time.perf_counter()` seconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["RequestTimes", "percentiles", "summarize_requests"]

DEFAULT_PERCENTILES: tuple[float, ...] = (50, 90, 95, 99)


@dataclass
class RequestTimes:
    """Timestamps of one request: arrival, first scheduling, and each output token."""

    arrival: float
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)

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
    }
