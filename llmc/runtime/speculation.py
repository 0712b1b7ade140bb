"""Speculation as a policy: how many tokens each decoding row proposes this step.

Proposers (runtime/proposers.py) only propose; the policy decides, from two things it measures:
- what a decode step costs against a plain one when its rows are s tokens long (the pending token
  and s - 1 proposals): `StepCosts`, a line T(s) = T(1) * (1 + c * (s - 1)) per kind of step,
  calibrated when the engine loads and then followed from every decode step's own time;
- each request's chance that a proposed token is kept (given the ones before it were), from a
  hopeful prior and decayed over its steps.
A row of acceptance a that proposes k tokens outputs (1 - a^(k+1)) / (1 - a) on average; the step's
cap K is the one with the most expected tokens per unit of cost, and plain decoding wins unless a
cap beats it by MIN_GAIN. So a one-shot request speculates from its first step where that pays,
and when another process slows the verify steps more than the plain ones the live costs show it
and the policy backs off. docs/speculative.md has the numbers.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from llmc.contract import graph_io as io
from llmc.errors import LlmcError
from llmc.runtime.engine import Engine
from llmc.runtime.kv_cache import blocks_for
from llmc.runtime.proposers import DraftProposer, NgramProposer
from llmc.runtime.request import Request
from llmc.runtime.step import Row

PRIOR_HITS, PRIOR_TRIALS = 1.5, 2.0  # a new request's acceptance, 0.75: hopeful, so it tries
DECAY = 0.7  # weight of a request's earlier steps in its acceptance
MAX_BACKOFF = 64  # decode steps a paused request waits at most before it probes again
MIN_GAIN = 1.03  # speculate only where the expected tokens per unit of cost beat plain decoding's by this
WINDOW = 9  # a kind's last measurements of each cost, of which the median counts
PLAIN_EVERY = 32  # decode steps of a kind between plain steps that keep its T(1) current
WARM_ALL_BELOW = 0.02  # seconds of a plain step below which calibrate runs every verify shape once
GRID = 40  # steps of acceptance in a kind's table of the best k
PRIOR = round(PRIOR_HITS / PRIOR_TRIALS * GRID)  # the prior acceptance's entry

Kind = tuple[bool, int]  # (any row samples, the batch size's power of two)


def kind_of(rows: list[Request]) -> Kind:
    """The steps that share costs. Sampling changes a verify step's own cost (its rows' work is on
    distributions), and the batch size what a longer row costs."""
    return any(not r.params.greedy for r in rows), 1 << (len(rows) - 1).bit_length()


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a row outputs from a proposal of k: the target's own one and each kept proposal."""
    return k + 1.0 if acceptance >= 1.0 else (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def calibrate(engine: Engine, s: int, reps: int = 3) -> float:
    """The slope c of rows of s tokens on this engine now, at batch 1: rows over the scratch block
    (which nothing reads), alternating, the best of a few each. Every row length up to s runs once
    first where a step is short: a shape's first run binds its buffers, which cost a small model's
    step as much again, and would land in the live costs' first verify steps."""
    table = [io.SCRATCH_BLOCK] * blocks_for(s, engine.block_size)

    def seconds(n: int) -> float:
        start = time.perf_counter()
        engine.forward_rows([Row([0] * n, 0, table)], logits_indices=list(range(n)))
        return time.perf_counter() - start

    one = min(seconds(1) for _ in range(2))
    if one < WARM_ALL_BELOW:
        for n in range(2, s):
            seconds(n)
    times: dict[int, list[float]] = {1: [], s: []}
    for _ in range(reps):
        for n in (1, s):
            times[n].append(seconds(n))
    return max(0.0, (min(times[s][1:]) / min(times[1]) - 1.0) / (s - 1))


class StepCosts:
    """Per kind of step: a plain step's seconds and the slope c, each the median of its last WINDOW
    measurements. Medians, not means: a verify shape's first run in a process binds its buffers
    (several plain steps' time on a small model), and a step another process held up says nothing
    about the next one; a real change of cost moves the median within half a window."""

    def __init__(self, slope: float):
        self.prior = slope  # batch 1's, from calibrate
        # Each kind's first decode step is plain, and measures T(1): calibrate's own plain call left
        # out the Python of a whole step, which is a small model's step's larger part.
        self.plain: dict[Kind, deque[float]] = {}
        self.slopes: dict[Kind, deque[float]] = {}
        self.since_plain: dict[Kind, int] = {}
        self._median: dict[tuple[str, Kind], float] = {}  # kept as they change, read every step

    def slope(self, kind: Kind) -> float:
        c = self._median.get(("slope", kind))
        if c is None:
            # A batch of b rows grows by b tokens a proposal: compute-bound sooner. The prior counts
            # as two measurements, so one verify step cannot overrule it alone.
            c = self._add("slope", self.slopes, kind, min(1.0, self.prior * kind[1]), 2)
        return c

    def plain_due(self, kind: Kind) -> bool:
        """Whether this step should decode plainly to measure T(1): never measured, or long ago."""
        return kind not in self.plain or self.since_plain.get(kind, 0) >= PLAIN_EVERY

    def observe(self, kind: Kind, s: int, seconds: float) -> None:
        """A decode step of `kind` whose longest row was s tokens took `seconds`, all of it."""
        if s == 1:
            self.since_plain[kind] = 0
            self._add("plain", self.plain, kind, seconds)
            return
        self.since_plain[kind] = self.since_plain.get(kind, 0) + 1
        if kind in self.plain:
            self.slope(kind)  # the prior first
            self._add("slope", self.slopes, kind, max(0.0, (seconds / self._median["plain", kind] - 1.0) / (s - 1)))

    def _add(self, name: str, samples: dict[Kind, deque[float]], kind: Kind, value: float, times: int = 1) -> float:
        window = samples.setdefault(kind, deque(maxlen=WINDOW))
        window.extend([value] * times)
        median = self._median[name, kind] = statistics.median(window)
        return median


def _plain_seconds(engine: Engine) -> float:
    row = Row([0], 0, [io.SCRATCH_BLOCK])
    times = []
    for _ in range(3):
        start = time.perf_counter()
        engine.forward_rows([row])
        times.append(time.perf_counter() - start)
    return min(times[1:])


@dataclass
class _RowState:
    """A request's chance that a proposed token is kept given the ones before it were: a proposal
    stops at its first rejection, so k proposals with a kept count a hits out of a + 1 tries (a out
    of a when all were kept), decayed over steps."""
    hits: float = PRIOR_HITS
    trials: float = PRIOR_TRIALS
    wait: int = 0  # steps left before a paused request probes again
    backoff: int = 1

    @property
    def acceptance(self) -> float:
        return self.hits / self.trials


class SpeculationPolicy:
    """Chooses each decoding row's k, hands the rows to the proposer, and learns from the steps."""

    def __init__(self, proposer, max_k: int, costs: StepCosts | None):
        """`costs` None: fixed k, every row proposes max_k (speculative_adaptive off)."""
        self.proposer = proposer
        self.max_k = max_k
        self.costs = costs
        self._rows: dict[str, _RowState] = {}
        self._tables: dict[Kind, tuple[float, list[int]]] = {}  # per kind: its slope then, best k per acceptance
        self._idle: dict[Kind, int] = {}  # per kind: steps since a verify step, while none pays

    def propose(self, rows: list[Request], remaining) -> None:
        """Give the decoding rows their proposals; `remaining(r)` is how many more tokens r may
        produce (a proposal longer than that minus one cannot be kept)."""
        ks = self._ks(rows, remaining)
        if any(ks):
            self.proposer.propose(rows, ks)

    def _ks(self, rows: list[Request], remaining) -> list[int]:
        if self.costs is None:
            return [max(min(self.max_k, remaining(r) - 1), 0) for r in rows]
        kind = kind_of(rows)
        if self.costs.plain_due(kind):
            return [0] * len(rows)
        table, c = self._table(kind), self.costs.slope(kind)
        if table[GRID] == 0:  # not even a row that keeps every proposal pays at these costs
            idle = self._idle[kind] = self._idle.get(kind, 0) + 1
            if idle < MAX_BACKOFF:
                return [0] * len(rows)
            self._idle[kind] = 0  # measure a verify step again now and then: the costs move
            return [1 if remaining(r) > 1 else 0 for r in rows]
        wanted, probing = [], []
        for r in rows:
            state = self._rows.get(r.request_id)
            if state is None:
                state = self._rows[r.request_id] = _RowState()
            k = table[int(state.acceptance * GRID + 0.5)]
            # A paused request probes only where a typical one would speculate: the costs, not its
            # acceptance, may be what keeps it from proposing.
            probing.append(k == 0 and table[PRIOR] > 0 and self._probes(state))
            wanted.append((state.acceptance, max(min(k, remaining(r) - 1), 0)))
        cap = max(k for _, k in wanted)
        if len(rows) > 1:
            cap = _batch_cap(wanted, cap, c)
        return [1 if probe and remaining(r) > 1 else min(k, cap) for r, probe, (_, k) in zip(rows, probing, wanted)]

    def _table(self, kind: Kind) -> list[int]:
        """The best k at each of GRID + 1 acceptances for the kind's slope, made again when it moves."""
        c = self.costs.slope(kind)
        made = self._tables.get(kind)
        if made is not None and abs(made[0] - c) <= 0.05 * max(c, 1e-3):
            return made[1]
        table = []
        for i in range(GRID + 1):
            rates = [expected_tokens(i / GRID, k) / (1.0 + c * k) for k in range(self.max_k + 1)]
            best = max(range(self.max_k + 1), key=rates.__getitem__)
            table.append(best if rates[best] > MIN_GAIN else 0)
        self._tables[kind] = (c, table)
        return table

    @staticmethod
    def _probes(state: _RowState) -> bool:
        """A paused request proposes one token after a wait that doubles each time it misses."""
        state.wait -= 1
        if state.wait > 0:
            return False
        state.wait = state.backoff
        state.backoff = min(2 * state.backoff, MAX_BACKOFF)
        return True

    def verified(self, r: Request, proposed: int, accepted: int) -> None:
        """Learn from a request's step: `accepted` of its `proposed` tokens were kept."""
        state = self._rows.get(r.request_id)
        if state is None or not proposed:
            return
        state.hits = DECAY * state.hits + accepted
        state.trials = DECAY * state.trials + accepted + (accepted < proposed)
        if accepted:
            state.backoff, state.wait = 1, 0

    def step_done(self, rows: list[Request], s: int, seconds: float) -> None:
        """A step that only decoded `rows` (its longest row s tokens) took `seconds`, proposing included."""
        if self.costs is not None:
            self.costs.observe(kind_of(rows), s, seconds)

    def release(self, r: Request) -> None:
        self._rows.pop(r.request_id, None)
        self.proposer.release(r)


def _batch_cap(wanted: list[tuple[float, int]], longest: int, c: float) -> int:
    """The cap K with the most expected tokens per unit of cost for a batch whose rows (acceptance,
    own k) each propose min(k, K): the longest row sets the whole step's cost."""
    tokens = float(len(wanted))  # at K = 0
    powers = [1.0] * len(wanted)
    best, best_rate = 0, tokens * MIN_GAIN
    for cap in range(1, longest + 1):
        for i, (a, k) in enumerate(wanted):
            if k >= cap:
                powers[i] *= a
                tokens += powers[i]
        if tokens / (1.0 + c * cap) > best_rate:
            best, best_rate = cap, tokens / (1.0 + c * cap)
    return best if best == 0 or best_rate > MIN_GAIN * len(wanted) else 0


def make_policy(options, target: Engine, tokenizer_file: Path) -> SpeculationPolicy | None:
    """The policy `options.speculative` asks for: None, "ngram" or a draft engine's path."""
    method = options.speculative
    if method is None:
        return None
    if target.spec.longrope_boundary is not None:
        raise LlmcError("speculative decoding does not support longrope models yet (their rotation depends on "
                        "the sequence length); run without --speculative")
    if method == "ngram":
        proposer = NgramProposer(options.prompt_lookup_min, options.prompt_lookup_max)
    else:
        path = Path(method)
        if not (path / "manifest.json").is_file():
            raise LlmcError(f"speculative must be 'ngram' or a draft engine directory; {method!r} is neither "
                            "(build one with `llmc build`)")
        proposer = DraftProposer(path, target, tokenizer_file, options)
    k = options.num_speculative_tokens
    costs = None
    if options.speculative_adaptive:
        slope = calibrate(target, k + 1)
        if isinstance(proposer, DraftProposer):  # each proposed token is one more draft step
            slope += _plain_seconds(proposer.engine) / _plain_seconds(target)
        costs = StepCosts(slope)
    return SpeculationPolicy(proposer, k, costs)
