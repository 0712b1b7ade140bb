"""Speculation as a policy: how many tokens each decoding row proposes this step.

Proposers (runtime/proposers.py) only propose; the policy decides, from two things it measures:
- what a decode step costs against a plain one when its rows are s tokens long (the pending token
  and s - 1 proposals): `StepCosts`, a line T(s) = T(1) * (1 + c * (s - 1)) per kind of step,
  calibrated when the engine loads and then followed from every decode step's own time;
- each request's chance that its j-th proposed token is kept (given the ones before it were), per
  position j, from a hopeful prior and decayed over its steps.
A row's k is the one with the most expected output tokens per unit of step cost; in a batch the
step's cap K is the one with the most for all rows together, and plain decoding wins unless a cap
beats it by MIN_GAIN. So a one-shot request speculates from its first step where that pays,
and when another process slows the verify steps more than the plain ones the live costs show it
and the policy backs off. docs/speculative.md has the numbers.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

from llmc.contract import graph_io as io
from llmc.errors import LlmcError
from llmc.runtime.engine import Engine
from llmc.runtime.kv_cache import blocks_for
from llmc.runtime.proposers import DraftProposer, NgramProposer
from llmc.runtime.request import Request
from llmc.runtime.step import Row

# A new request's chances, hopeful so that it tries: 0.75 for its first proposed token, and for
# each later one given the ones before it were kept 0.9 greedy, 0.6 sampled (measured with k = 8
# on code-small's grounded, open and random prompts: first 0.71-0.80 and later 0.83-1.0 greedy,
# first 0.11-0.45 and the second 0.43-0.74 at temperature 0.8-1; docs/speculative.md).
PRIOR_TRIALS = 2.0
PRIOR_FIRST = 0.75 * PRIOR_TRIALS
PRIOR_LATER = {True: 0.9 * PRIOR_TRIALS, False: 0.6 * PRIOR_TRIALS}  # by whether the row is greedy
DECAY = 0.7  # weight of a request's earlier steps in its chances
POOL_DECAY = 0.95  # the same in the chances pooled over requests, which new requests start from
MAX_BACKOFF = 64  # decode steps a paused request waits at most before it probes again
MAX_EXPLORE_WAIT = 1024  # decode steps at most between verify steps of a kind where none pays
MIN_GAIN = 1.03  # speculate only where the expected tokens per unit of cost beat plain decoding's by this
WINDOW = 9  # a kind's last measurements of each cost, of which the median counts
PLAIN_EVERY = 32  # decode steps of a kind between plain steps that keep its T(1) current
WARM_ALL_BELOW = 0.02  # seconds of a plain step below which calibrate runs every verify shape once

Kind = tuple[bool, int]  # (any row samples, the batch size's power of two)


def kind_of(rows: list[Request]) -> Kind:
    """The steps that share costs. Sampling changes a verify step's own cost (its rows' work is on
    distributions), and the batch size what a longer row costs."""
    return any(not r.params.greedy for r in rows), 1 << (len(rows) - 1).bit_length()


def best_k(chances: list[float], c: float, most: int, found: float = 1.0, asking: float = 0.0) -> int:
    """The k up to `most` with the most expected tokens per unit of step cost, 0 unless it beats
    plain decoding by MIN_GAIN. chances[j] is the chance that proposed token j is kept given the
    ones before it were, so a proposal of k gives 1 + sum over j < k of chances[0] ... chances[j]
    tokens at a step cost of 1 + c k. The proposer finds one with chance `found` (else the step is
    plain) and costs `asking` k whether it finds one or not."""
    best, best_rate, tokens, kept = 0, MIN_GAIN, 1.0, 1.0
    for k in range(1, most + 1):
        kept *= chances[k - 1]
        tokens += kept
        rate = (found * tokens + 1.0 - found) / (1.0 + (found * c + asking) * k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def _seconds(engine: Engine, n: int, table: list[int]) -> float:
    """One batch-1 step of a row of n tokens over the scratch block (which nothing reads), logits at each."""
    start = time.perf_counter()
    engine.forward_rows([Row([0] * n, 0, table)], logits_indices=list(range(n)))
    return time.perf_counter() - start


def _plain_seconds(engine: Engine) -> float:
    """A plain batch-1 step's seconds on this engine now: the best of two after a warm-up."""
    _seconds(engine, 1, [io.SCRATCH_BLOCK])  # the shape's first run binds its buffers
    return min(_seconds(engine, 1, [io.SCRATCH_BLOCK]) for _ in range(2))


def calibrate(engine: Engine, s: int, reps: int = 3) -> tuple[float, float]:
    """(a plain batch-1 step's seconds, the slope c of rows of s tokens) on this engine now: rows
    of 1 and s tokens alternating, the best of a few each. Every row length up to s runs once first
    where a step is short: a shape's first run binds its buffers, which cost a small model's step as
    much again, and would land in the live costs' first verify steps."""
    table = [io.SCRATCH_BLOCK] * blocks_for(s, engine.block_size)
    one = min(_seconds(engine, 1, table) for _ in range(2))
    if one < WARM_ALL_BELOW:
        for n in range(2, s):
            _seconds(engine, n, table)
    times: dict[int, list[float]] = {1: [], s: []}
    for _ in range(reps):
        for n in (1, s):
            times[n].append(_seconds(engine, n, table))
    one = min(times[1])
    return one, max(0.0, (min(times[s][1:]) / one - 1.0) / (s - 1))


class StepCosts:
    """Per kind of step: a plain step's seconds and the slope c, each the median of its last WINDOW
    measurements. Medians, not means: a verify shape's first run in a process binds its buffers
    (several plain steps' time on a small model), and a step another process held up says nothing
    about the next one; a real change of cost moves the median within half a window."""

    def __init__(self, slope: float, proposer_slopes: tuple[float, ...] = (0.0,)):
        self.prior = slope  # batch 1's, from calibrate
        # Per proposer, what proposing a row one token deeper costs against T(1), from calibrate
        # (a draft's plain step over the target's) until measured on the proposals made.
        self.proposer_priors = proposer_slopes
        # Each kind's first decode step is plain, and measures T(1): calibrate's own plain call left
        # out the Python of a whole step, which is a small model's step's larger part.
        self.plain: dict[Kind, deque[float]] = {}
        self.slopes: dict[Kind, deque[float]] = {}
        self.since_plain: dict[Kind, int] = {}
        self.proposers: dict[int, dict[Kind, deque[float]]] = {}
        self._median: dict[tuple[str, Kind], float] = {}  # kept as they change, read every step

    def slope(self, kind: Kind) -> float:
        c = self._median.get(("slope", kind))
        if c is None:
            # A batch of b rows grows by b tokens a proposal: compute-bound sooner. The prior counts
            # as two measurements, so one verify step cannot overrule it alone.
            c = self._add("slope", self.slopes, kind, min(1.0, self.prior * kind[1]), 2)
        return c

    def proposer_slope(self, i: int, kind: Kind) -> float:
        c = self._median.get((f"proposer {i}", kind))
        return self.proposer_priors[i] if c is None else c

    def observe_proposer(self, i: int, kind: Kind, depth: int, seconds: float) -> None:
        """Proposer i took `seconds` to propose up to `depth` tokens a row for a step of `kind`."""
        if kind in self.plain and depth:
            samples = self.proposers.setdefault(i, {})
            self._add(f"proposer {i}", samples, kind, seconds / (depth * self._median["plain", kind]))

    def plain_due(self, kind: Kind) -> bool:
        """Whether this step should decode plainly to measure T(1): never measured, or long ago."""
        return kind not in self.plain or self.since_plain.get(kind, 0) >= PLAIN_EVERY

    def observe(self, kind: Kind, s: int, seconds: float) -> None:
        """A decode step of `kind` whose longest row was s tokens took `seconds`, proposing left out."""
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
        # The upper median: sorted() on a few floats is a fifth of statistics.median's cost, every step.
        median = self._median[name, kind] = sorted(window)[len(window) // 2]
        return median


class _RowState:
    """A request's chance that its j-th proposed token is kept given the ones before it were, for
    each j: a proposal stops at its first rejection, so a step with a of p kept tried positions
    0..a (up to p - 1) and kept 0..a - 1. Per position, not one rate: where the target copies, a
    proposal that starts right mostly stays right, and one rate for all positions undercounted
    the later ones and chose short proposals. Hopeful prior, decayed over the steps that tried it."""

    def __init__(self, k: int, greedy: bool = True, decay: float = DECAY, start: "_RowState | None" = None):
        """`start`: the pooled state of earlier requests of its kind, whose chances it begins with
        (at the prior's weight) instead of the prior's."""
        self.priors = [PRIOR_FIRST] + [PRIOR_LATER[greedy]] * (k - 1)
        self.decay = decay
        self.trials = [PRIOR_TRIALS] * k
        self.found = [PRIOR_TRIALS, PRIOR_TRIALS]  # (proposals found, times asked), decayed: hopeful
        if start is None:
            self.hits = list(self.priors)
        else:
            self.hits = [chance * PRIOR_TRIALS for chance in start.chances()]
            self.found = [start.found[0] / start.found[1] * PRIOR_TRIALS, PRIOR_TRIALS]
        self.wait = 0  # steps left before a paused request probes again
        self.backoff = 1
        self.chosen: tuple[float, int] | None = None  # (the slope it was chosen at, its best k)
        # Most tokens the next proposal may hold: after a one-token proposal (a paused row's probe),
        # three if it was kept. Sampled text keeps one now and then, and on the later positions'
        # hopeful prior the row went back to its whole k at once.
        self.ramp = k

    def chances(self) -> list[float]:
        return [h / t for h, t in zip(self.hits, self.trials)]

    def best(self, c: float, asking: float) -> int:
        if self.chosen is None or abs(self.chosen[0] - c) > 0.05 * max(c, 1e-3):
            self.chosen = c, best_k(self.chances(), c, len(self.hits), self.found[0] / self.found[1], asking)
        return self.chosen[1]

    def asked(self, found: bool) -> None:
        """Whether the proposer found a proposal when asked (prompt lookup finds none without a match)."""
        self.found = [self.decay * self.found[0] + found, self.decay * self.found[1] + 1.0]
        self.chosen = None

    def kept(self, proposed: int, accepted: int) -> None:
        """A step proposed `proposed` tokens and kept the first `accepted`. Positions it did not
        try drift back to the prior: a position that measured badly is otherwise never tried again
        (a row once at k = 1 stayed there for good)."""
        self.ramp = 2 * accepted + 1 if proposed == 1 else len(self.hits)
        tried, decay = min(accepted + 1, proposed), self.decay
        for j in range(len(self.hits)):
            if j < tried:
                self.hits[j] = decay * self.hits[j] + (j < accepted)
                self.trials[j] = decay * self.trials[j] + 1.0
            else:
                self.hits[j] = decay * self.hits[j] + (1.0 - decay) * self.priors[j]
                self.trials[j] = decay * self.trials[j] + (1.0 - decay) * PRIOR_TRIALS
        self.chosen = None


class SpeculationPolicy:
    """Chooses each decoding row's k, asks the proposers, and learns from the steps."""

    def __init__(self, proposers: list, max_k: int, costs: StepCosts | None):
        """`proposers`, cheapest first: a row takes the first proposal it gets, and the next
        proposer is asked for the rows left without one. `costs` None: fixed k, every row asks for
        max_k (speculative_adaptive off)."""
        self.proposers = proposers
        # Proposers that cut a proposal to what they trust (prompt lookup, by how long its match
        # is) are asked for all a greedy row may take once it speculates at all: the length they
        # choose by the match beat the policy's by the position (grounded 1.78-1.85x against
        # 1.73-1.80x). Not for sampled rows, whose proposals their rule was not made for.
        self._own_length = [getattr(p, "sets_its_length", False) for p in proposers]
        self.max_k = max_k
        self.costs = costs
        self._rows: dict[tuple[str, int], _RowState] = {}  # per (request, proposer)
        self._pooled: dict[tuple[bool, int], _RowState] = {}  # per (greedy, proposer): all requests' chances
        self._proposed_by: dict[str, int] = {}  # request -> the proposer of its pending proposal
        self._idle: dict[Kind, tuple[int, int]] = {}  # while none pays: (steps since a verify step, steps to wait)
        self._outlooks: dict[tuple[Kind, int], tuple[float, bool, bool]] = {}
        self._proposing = 0.0  # the running step's seconds in the proposers
        self._kind: Kind = (False, 1)  # the running step's

    def propose(self, rows: list[Request], remaining) -> None:
        """Give the decoding rows their proposals; `remaining(r)` is how many more tokens r may
        produce (a proposal longer than that minus one cannot be kept)."""
        self._proposing = 0.0
        kind = self._kind = kind_of(rows)
        if self.costs is not None and self.costs.plain_due(kind):
            return
        paying = False
        for i, proposer in enumerate(self.proposers):
            ks = self._ks(rows, remaining, kind, i)
            paying = paying or ks is not None
            asked = [(r, k) for r, k in zip(rows, ks or ()) if k]
            if asked:
                start = time.perf_counter()
                proposer.propose([r for r, _ in asked], [k for _, k in asked])
                took = time.perf_counter() - start
                self._proposing += took
                if self.costs is not None:
                    self.costs.observe_proposer(i, kind, max(k for _, k in asked), took)
                for r, _ in asked:
                    if r.proposal:
                        self._proposed_by[r.request_id] = i
                    if self.costs is not None:
                        self._state(r, i).asked(bool(r.proposal))
                        self._pool(r, i).asked(bool(r.proposal))
            rows = [r for r in rows if not r.proposal]
            if not rows:
                return
        if not paying:
            self._measure_now_and_then(kind, rows, remaining)

    def _measure_now_and_then(self, kind: Kind, rows: list[Request], remaining) -> None:
        """Where no proposer pays, a verify step after 64, 128, ... up to 1,024 plain ones measures
        the costs again (they move with the machine's load). Its proposals are each row's last
        token, which costs no proposer anything: a draft asked instead caught up on every row's
        tokens since, at batch 16 a sixth of the time every 64 steps, and as much at any spacing."""
        idle, wait = self._idle.get(kind, (0, MAX_BACKOFF))
        if idle + 1 < wait:
            self._idle[kind] = idle + 1, wait
            return
        self._idle[kind] = 0, min(2 * wait, MAX_EXPLORE_WAIT)
        for r in rows:
            if remaining(r) > 1:
                r.proposal = [r.token_ids[-1]]

    def _ks(self, rows: list[Request], remaining, kind: Kind, i: int) -> list[int] | None:
        """Each row's k for proposer i; None where not even a row that keeps everything pays."""
        if self.costs is None:
            return [max(min(self.max_k, remaining(r) - 1), 0) for r in rows]
        c, asking = self.costs.slope(kind), self.costs.proposer_slope(i, kind)
        pays, typical = self._outlook(kind, i, c, asking)
        if not pays:  # not even a row that keeps everything pays
            return None
        self._idle.pop(kind, None)
        wanted, probing = [], []
        for r in rows:
            state = self._state(r, i)
            k = min(state.best(c, asking), state.ramp)
            if k and self._own_length[i] and r.params.greedy:
                k = state.ramp
            # A paused request probes only where a new one would speculate (the costs, not its
            # chances, may be what keeps it from proposing) and asking costs less than verifying:
            # a draft's probe catches up on every token since the last, however long the wait.
            probing.append(k == 0 and typical and asking < c and self._probes(state))
            wanted.append((state, max(min(k, remaining(r) - 1), 0)))
        cap = max(k for _, k in wanted)
        if len(rows) > 1:
            cap = _batch_cap(wanted, cap, c + asking)
        return [1 if probe and remaining(r) > 1 else min(k, cap) for r, probe, (_, k) in zip(rows, probing, wanted)]

    def _state(self, r: Request, i: int) -> _RowState:
        state = self._rows.get((r.request_id, i))
        if state is None:
            state = self._rows[r.request_id, i] = _RowState(self.max_k, r.params.greedy,
                                                           start=self._pooled.get((r.params.greedy, i)))
        return state

    def _pool(self, r: Request, i: int) -> _RowState:
        """What the requests of r's kind (greedy or sampled) found with proposer i, pooled: a new
        request starts from it. On a workload of sampled requests whose proposals miss, each new
        one started hopeful and spent its first steps finding out."""
        pooled = self._pooled.get((r.params.greedy, i))
        if pooled is None:
            pooled = self._pooled[r.params.greedy, i] = _RowState(self.max_k, r.params.greedy, POOL_DECAY)
        return pooled

    def _outlook(self, kind: Kind, i: int, c: float, asking: float) -> tuple[bool, bool]:
        """At these costs: whether a row that keeps everything would speculate, and whether a new
        one would; worked out again only when c moves by 5%."""
        seen = self._outlooks.get((kind, i))
        if seen is None or abs(seen[0] - c) > 0.05 * max(c, 1e-3):
            new = _RowState(self.max_k, not kind[0]).chances()
            seen = self._outlooks[kind, i] = (c, best_k([1.0] * self.max_k, c, self.max_k, 1.0, asking) > 0,
                                              best_k(new, c, self.max_k, 1.0, asking) > 0)
        return seen[1], seen[2]

    @staticmethod
    def _probes(state: _RowState) -> bool:
        """A paused request proposes one token after a wait that doubles each time it probes, and
        halves when a probe is kept: a row whose proposals are kept now and then (sampled text)
        probes rarely, one whose text turns to copying again soon speculates again."""
        state.wait -= 1
        if state.wait > 0:
            return False
        state.wait = state.backoff
        state.backoff = min(2 * state.backoff, MAX_BACKOFF)
        return True

    def verified(self, r: Request, proposed: int, accepted: int) -> None:
        """Learn from a request's step: `accepted` of its `proposed` tokens were kept."""
        i = self._proposed_by.pop(r.request_id, -1)
        state = self._rows.get((r.request_id, i))
        if state is None or not proposed:
            return
        state.kept(proposed, accepted)
        self._pool(r, i).kept(proposed, accepted)
        if accepted:
            state.backoff = max(1, state.backoff // 4)  # undoes this probe's doubling and halves

    def step_done(self, s: int, seconds: float) -> None:
        """The step that decoded the rows last proposed for (its longest row s tokens) took
        `seconds`, proposing included."""
        if self.costs is not None:
            self.costs.observe(self._kind, s, seconds - self._proposing)

    def release(self, r: Request) -> None:
        self._proposed_by.pop(r.request_id, None)
        for i, proposer in enumerate(self.proposers):
            self._rows.pop((r.request_id, i), None)
            proposer.release(r)


def _batch_cap(wanted: list[tuple[_RowState, int]], longest: int, c: float) -> int:
    """The cap K with the most expected tokens per unit of cost for a batch whose rows (state, own
    k) each propose min(k, K): the longest row sets the whole step's cost."""
    chances = [state.chances() for state, _ in wanted]
    tokens = float(len(wanted))  # at K = 0
    kept = [1.0] * len(wanted)
    best, best_rate = 0, tokens * MIN_GAIN
    for cap in range(1, longest + 1):
        for i, (_, k) in enumerate(wanted):
            if k >= cap:
                kept[i] *= chances[i][cap - 1]
                tokens += kept[i]
        if tokens / (1.0 + c * cap) > best_rate:
            best, best_rate = cap, tokens / (1.0 + c * cap)
    return best


def make_policy(options, target: Engine, tokenizer_file: Path) -> SpeculationPolicy | None:
    """The policy `options.speculative` asks for: None, "ngram" or a draft engine's path."""
    method = options.speculative
    if method is None:
        return None
    if target.manifest.states:
        raise LlmcError(f"speculative decoding does not support {target.spec.architecture} yet: its recurrent "
                        "layers' state cannot be rolled back past rejected tokens; run without --speculative")
    if target.spec.longrope_boundary is not None:
        raise LlmcError("speculative decoding does not support longrope models yet (their rotation depends on "
                        "the sequence length); run without --speculative")
    lookup = NgramProposer(options.prompt_lookup_min, options.prompt_lookup_max)
    if method == "ngram":
        proposers = [lookup]
    else:
        path = Path(method)
        if not (path / "manifest.json").is_file():
            raise LlmcError(f"speculative must be 'ngram' or a draft engine directory; {method!r} is neither "
                            "(build one with `llmc build`)")
        # Prompt lookup first: a match costs nothing to find, and where the target copies from its
        # context (code, edits, quoting) it is right more often than a small draft, which copies less.
        draft = DraftProposer(path, target, tokenizer_file, options)
        proposers = [lookup, draft] if options.draft_prompt_lookup else [draft]
    k = options.num_speculative_tokens
    costs = None
    if options.speculative_adaptive:
        plain, slope = calibrate(target, k + 1)
        costs = StepCosts(slope, tuple(_plain_seconds(p.engine) / plain if isinstance(p, DraftProposer) else 0.0
                                       for p in proposers))
    return SpeculationPolicy(proposers, k, costs)
