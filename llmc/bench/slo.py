"""Parse service-level objectives (`ttft=500ms,tpot=50ms`) and durations (`500ms`, `10m`)."""

from __future__ import annotations

import math
import re

from llmc.errors import LlmcError
from llmc.bench.summary import SLO_METRICS

_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h)")


def parse_duration(text: str, what: str, units: tuple[str, ...] = ("ms", "s", "m", "h")) -> float:
    """'500ms' -> 0.5, '1h30m' -> 5400.0 (seconds); a one-line LlmcError naming `what` otherwise."""
    form = "".join(f"|{u}" for u in units)[1:]
    problem = f"{what} {text!r} is not a duration; write a number with a unit ({form}), e.g. 1{units[-1]}"
    cleaned = text.strip().lower()
    parts = list(_DURATION.finditer(cleaned))
    if not parts or "".join(p.group(0) for p in parts) != cleaned:
        raise LlmcError(problem)
    if any(p.group(2) not in units for p in parts):
        raise LlmcError(problem)
    seconds = sum(float(p.group(1)) * _UNITS[p.group(2)] for p in parts)
    if not math.isfinite(seconds) or seconds <= 0:
        raise LlmcError(f"{what} must be > 0 (got {text!r})")
    return seconds


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=500ms,tpot=50ms' -> {'ttft': 0.5, 'tpot': 0.05} (seconds); {} for None or ''."""
    if not text:
        return {}
    form = (f"expected NAME=VALUE pairs separated by commas, e.g. ttft=500ms,tpot=50ms "
            f"(names: {', '.join(SLO_METRICS)}; units: ms, s)")
    slo: dict[str, float] = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        name = name.strip().lower()
        if not sep or not name or not value.strip():
            raise LlmcError(f"malformed SLO {text!r}: {form}")
        if name not in SLO_METRICS:
            raise LlmcError(f"unknown SLO metric {name!r} in {text!r}: {form}")
        if name in slo:
            raise LlmcError(f"SLO {name} is given twice in {text!r}; give each metric once")
        try:
            slo[name] = parse_duration(value, f"SLO {name}", units=("ms", "s"))
        except LlmcError:
            raise LlmcError(f"malformed SLO value {value.strip()!r} for {name}: {form}") from None
    return slo


def format_slo(slo: dict[str, float]) -> str:
    """{'ttft': 0.5} -> 'ttft=500ms' (the form parse_slo reads)."""
    return ",".join(f"{name}={limit * 1e3:g}ms" for name, limit in slo.items())
