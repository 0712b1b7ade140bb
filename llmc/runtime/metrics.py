"""Per-request latency timestamps and the one place latency metrics are defined.

Reports and benchmarks reuse these definitions so every number called "TTFT" or "TPOT" in the
project means the same thing (their summaries over many requests: llmc.bench.summary). All times
are `time.perf_counter()` seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RequestTimes"]


@dataclass
class RequestTimes:
    """Timestamps of one request: arrival, first scheduling, and each output token."""

    arrival: float
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)
    decode_steps: int = 0  # steps that gave tokens after the first (each may give several when speculating)
    proposed_tokens: int = 0  # speculative proposals verified
    accepted_tokens: int = 0  # of which the target kept

    def verified(self, proposed: int, accepted: int) -> None:
        """A decode step that verified `proposed` tokens and kept `accepted`."""
        self.decode_steps += 1
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted

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
