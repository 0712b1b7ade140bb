"""Seeded benchmark workloads: request lengths, prompt tokens, shared prefixes, arrival times.

Everything is a pure function of the seed, so a run is reproducible and two engines compared
side by side get the identical requests. Within one benchmark the lengths of request i are the
same at every arrival rate (so a QPS sweep changes only the load), while the prompt tokens differ
per run: repeating a prompt would turn later runs into prefix-cache hits.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np

from llmc.errors import LlmcError

MAX_QPS = math.inf  # "--qps max": every request arrives at time 0

_FIXED = re.compile(r"\d+")
_UNIFORM = re.compile(r"(\d+)-(\d+)")
_NORMAL = re.compile(r"normal:(\d+(?:\.\d*)?):(\d+(?:\.\d*)?)")


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: `128` (fixed), `64-256` (uniform, inclusive) or
    `normal:192:32` (mean:std, rounded and clipped to [1, mean + 3 std])."""

    kind: str
    low: int
    high: int
    mean: float = 0.0
    std: float = 0.0

    @classmethod
    def parse(cls, text: str, option: str) -> "LengthDist":
        text = str(text).strip()
        form = f"{option} takes N, LO-HI or normal:MEAN:STD (e.g. 128, 64-256, normal:192:32), got {text!r}"
        if _FIXED.fullmatch(text):
            n = int(text)
            dist = cls("fixed", n, n)
        elif m := _UNIFORM.fullmatch(text):
            dist = cls("uniform", int(m[1]), int(m[2]))
            if dist.low > dist.high:
                raise LlmcError(f"{option} {text!r}: LO must be <= HI")
        elif m := _NORMAL.fullmatch(text):
            mean, std = float(m[1]), float(m[2])
            dist = cls("normal", 1, max(1, round(mean + 3 * std)), mean, std)
        else:
            raise LlmcError(form)
        if dist.low < 1:
            raise LlmcError(f"{option} {text!r}: lengths must be >= 1 token")
        return dist

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "fixed":
            return [self.low] * n
        if self.kind == "uniform":
            return [int(x) for x in rng.integers(self.low, self.high + 1, n)]
        return [int(x) for x in np.clip(np.rint(rng.normal(self.mean, self.std, n)), self.low, self.high)]

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(self.low)
        return f"{self.low}-{self.high}" if self.kind == "uniform" else f"normal:{self.mean:g}:{self.std:g}"


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    output_len: int
    arrival: float  # seconds after the run starts when the client sends it


@dataclass(frozen=True)
class Workload:
    """`num_requests` requests; with `shared_prefix` > 0 every prompt starts with one of
    `num_prefixes` fixed prefixes of that many tokens (a system prompt), and `prompt_len` is the
    whole prompt: prefix + its own tail of at least one token."""

    num_requests: int
    prompt_len: LengthDist
    output_len: LengthDist
    shared_prefix: int = 0
    num_prefixes: int = 1
    seed: int = 0

    def __post_init__(self):
        if self.num_requests < 1:
            raise LlmcError(f"--num-requests must be >= 1 (got {self.num_requests})")
        if self.shared_prefix < 0:
            raise LlmcError(f"--shared-prefix must be >= 0 tokens (got {self.shared_prefix})")
        if self.num_prefixes < 1:
            raise LlmcError(f"--num-prefixes must be >= 1 (got {self.num_prefixes})")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prompt_len"], d["output_len"] = str(self.prompt_len), str(self.output_len)
        return d

    def lengths(self, repeat: int) -> tuple[list[int], list[int]]:
        """(prompt lengths, output lengths) of repeat `repeat`; the same at every arrival rate."""
        rng = np.random.default_rng([self.seed, 0, repeat])
        prompts = self.prompt_len.sample(rng, self.num_requests)
        outputs = self.output_len.sample(rng, self.num_requests)
        return [max(p, self.shared_prefix + 1) if self.shared_prefix else p for p in prompts], outputs

    def check_fits(self, max_context: int) -> None:
        """Fail up front if some request could not fit the engine's context."""
        longest_prompt = max(self.prompt_len.high, self.shared_prefix + 1 if self.shared_prefix else 0)
        if longest_prompt + self.output_len.high > max_context:
            raise LlmcError(f"the workload asks for prompts up to {longest_prompt} tokens plus outputs up to "
                            f"{self.output_len.high}, more than the engine's max context {max_context}; "
                            "lower --prompt-len/--output-len/--shared-prefix")

    def requests(self, vocab_ids: np.ndarray, rate: float, repeat: int, variant: int) -> list[BenchRequest]:
        """The requests of one run. `vocab_ids` are the token ids prompts are drawn from; `variant`
        (e.g. the index of the arrival rate) picks fresh prompt tokens for the same lengths."""
        prompt_lens, output_lens = self.lengths(repeat)
        tokens_rng = np.random.default_rng([self.seed, 1, repeat, variant])
        prefixes = [vocab_ids[np.random.default_rng([self.seed, 2, k]).integers(0, len(vocab_ids), self.shared_prefix)]
                    for k in range(self.num_prefixes)] if self.shared_prefix else []
        arrivals = arrival_times(self.num_requests, rate, np.random.default_rng([self.seed, 3, repeat]))
        out = []
        for i, (n_prompt, n_output) in enumerate(zip(prompt_lens, output_lens)):
            head = prefixes[i % self.num_prefixes].tolist() if prefixes else []
            tail = vocab_ids[tokens_rng.integers(0, len(vocab_ids), n_prompt - len(head))].tolist()
            out.append(BenchRequest(head + tail, n_output, arrivals[i]))
        return out


def arrival_times(n: int, rate: float, rng: np.random.Generator) -> list[float]:
    """Poisson arrivals at `rate` requests/s starting at 0 (the first request at time 0); all at 0
    for MAX_QPS. The gaps are unit-rate exponentials scaled by 1/rate, so the same generator state
    gives the same arrival pattern stretched or squeezed at every rate."""
    if rate == MAX_QPS:
        return [0.0] * n
    gaps = rng.exponential(1.0, n - 1) / rate
    return [0.0, *np.cumsum(gaps).tolist()]


def parse_qps(text: str) -> list[float]:
    """'1,4,max' -> [1.0, 4.0, inf]; rates must be > 0."""
    rates = []
    for item in str(text).split(","):
        item = item.strip().lower()
        if item in ("max", "inf"):
            rates.append(MAX_QPS)
            continue
        try:
            rate = float(item)
        except ValueError:
            raise LlmcError(f"--qps takes rates in requests/s or 'max', separated by commas (e.g. 1,4,max), "
                            f"got {text!r}") from None
        if not rate > 0 or not math.isfinite(rate):
            raise LlmcError(f"--qps must be > 0 requests/s (got {item}); use 'max' to send every request at once")
        rates.append(rate)
    if len(set(rates)) != len(rates):
        raise LlmcError(f"--qps {text!r} lists a rate twice; give each rate once")
    return rates


def qps_label(rate: float | str) -> str:
    """A rate as shown and as a report stores it: 'max', '4', '0.5'."""
    return "max" if rate in (MAX_QPS, "max") else f"{rate:g}"


def prompt_vocab(vocab_size: int, exclude: Iterable[int]) -> np.ndarray:
    """Token ids prompts are drawn from: the whole vocabulary except `exclude` (EOS and the like)."""
    return np.setdiff1d(np.arange(vocab_size), np.fromiter(exclude, dtype=np.int64))
