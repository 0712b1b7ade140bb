"""Speculative decoding: proposals for decoding rows, verified by the target in its own step.

Before a step the Speculator gives each decoding request a `proposal` of up to k tokens; the
scheduler computes them with the request's pending token as one (k+1)-token row, and the LLM
keeps the accepted prefix plus one token of the target's (`sampling.verify`) and rolls the rest
back. Two proposers: prompt lookup (the continuation of the latest earlier occurrence of the
sequence's last n tokens) and a draft engine (a smaller llmc engine with the same tokenizer and
its own paged cache, stepping every speculating row as one batch).

Adaptive: each request estimates how often a proposed token is accepted (given the ones before
it were) and proposes the j-th token only while that chance to the power j is at least
MIN_CHANCE, pausing with a backoff below it. Per step, the cap on the proposal length (none, one
token or k) is the one with the most output tokens per second of whole steps measured on this
engine at this batch size, greedy or sampled, over epochs of several steps; so speculation steps
aside where verifying costs more than it gains (large batches, misses, a draft that is slow for
what it gets right). docs/speculative.md has the numbers.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.engine import Engine
from llmc.runtime.kv_cache import BlockManager
from llmc.runtime.request import Request
from llmc.runtime.sampling import distribution, sample_from
from llmc.runtime.step import Row

MIN_CHANCE = 0.1  # propose the j-th token while acceptance**j is at least this
PRIOR_HITS, PRIOR_TRIALS = 1.5, 2.0  # a new request's estimate, 0.75: optimistic, so it tries
DECAY = 0.7  # weight of the earlier steps in a request's acceptance estimate
MAX_BACKOFF = 64  # steps a paused request waits at most before it probes again
MIN_GAIN = 1.05  # speculate only when its measured tokens per second beat plain decoding's by this
EPOCH = 16  # decode steps the best cap runs between looks at the choice
PROBE_STEPS = 4  # decode steps of a measurement of another cap: short, since a bad cap costs while measured
EPOCH_DECAY = 0.5  # weight of a cap's earlier epochs against its latest
LOSS_BUDGET = 0.005  # the share of decoding time measuring each cap other than the best may lose (0.01 until 11-27)
PROBE_WAIT = 8  # decoding at the best cap between measurements, in multiples of the last one's time, at least
HELD_UP = 8  # a step this many times its epoch's median was held up by something else; a draft's k = 8 took ~5
# New tokens a draft row's first proposal call feeds itself: after a step that kept every proposal
# there are two (the last proposal, never fed, and the target's token), and one call is cheaper
# than a catch-up call and a proposal call.
CATCH_UP = 2


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's
    last n tokens (n from `max_n` down to `min_n`), from a per-request index of n-grams."""

    def __init__(self, min_n: int, max_n: int):
        self.sizes = range(max_n, min_n - 1, -1)
        self._index: dict[str, tuple[list[dict], list[int]]] = {}

    def propose(self, rows: list[Request], ks: list[int]) -> float:
        """Set each row's proposal of up to k tokens; returns the seconds spent catching up on new
        prompts (none here)."""
        for r, k in zip(rows, ks):
            r.proposal = self.lookup(r, k) if k else []
        return 0.0

    def lookup(self, r: Request, k: int) -> list[int]:
        tokens = r.token_ids
        tables, done = self._index.setdefault(r.request_id, ([{} for _ in self.sizes], [0]))
        for end in range(done[0], len(tokens)):  # n-grams ending before `end`, followed by tokens[end]
            for n, table in zip(self.sizes, tables):
                if end >= n:
                    table[tuple(tokens[end - n:end])] = end
        done[0] = len(tokens)
        for n, table in zip(self.sizes, tables):
            end = table.get(tuple(tokens[-n:])) if len(tokens) >= n else None
            if end is not None:
                # How far the two occurrences agree, back from the match (up to half of k): a
                # continuation is trusted for twice that, since a lone token or pair that recurs
                # says little about what follows it (simulated: docs/speculative.md).
                same = n
                while 2 * same < k and same < end and tokens[end - same - 1] == tokens[-same - 1]:
                    same += 1
                # A match that ends `period` tokens back says the text repeats with that period
                # (a loop); its continuation runs into the sequence's end, so it goes on around.
                period = len(tokens) - end
                return [tokens[end + j % period] for j in range(min(k, 2 * same))]
        return []

    def release(self, r: Request) -> None:
        self._index.pop(r.request_id, None)


@dataclass
class _DraftSeq:
    """A request's sequence in the draft engine's cache (the BlockManager's sequence protocol)."""
    token_ids: list[int] = field(default_factory=list)  # what the draft has been fed, in order
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_hashed_blocks: int = 0
    cache_salt: int | None = None
    agreed: int = 0  # the target's length when last caught up: token_ids match it that far


class DraftProposer:
    """A smaller engine proposes by decoding k tokens for every speculating row at once."""

    def __init__(self, path: str | Path, target: Engine, tokenizer_file: Path, options):
        from llmc.contract.engine_dir import open_engine

        files = open_engine(path, verify_checksums=options.verify_checksums)
        if files.tokenizer.read_bytes() != tokenizer_file.read_bytes():
            raise LlmcError(f"draft engine {path} has another tokenizer than the target's; a draft must share "
                            "the target's tokenizer (build both from models trained with one)")
        if files.manifest.model_spec.vocab_size != target.spec.vocab_size:
            raise LlmcError(f"draft engine {path} has a vocabulary of {files.manifest.model_spec.vocab_size} "
                            f"tokens, the target {target.spec.vocab_size}; they must match")
        # One thread that never spins: the draft's and the target's sessions alternate every few
        # hundred microseconds, and two spinning pools on the same cores slow both (docs/speculative.md).
        self.engine = Engine(files, dataclasses.replace(options, num_threads=1, allow_spinning=False))
        # A --draft-vocab head's logits column j is token head[j]; None: column j is token j.
        kept = files.manifest.lm_head_tokens
        self.head = None if kept is None else np.asarray(kept, np.int64)
        self.blocks = BlockManager(self.engine.num_blocks, self.engine.block_size, enable_prefix_caching=False)
        self.chunk = options.chunk_size
        self._seqs: dict[str, _DraftSeq] = {}
        # Prompt lookup first: a match costs nothing to find, and where the target copies from its
        # context (code, edits, quoting) it is right more often than a small draft, which copies less.
        self.lookup = (NgramProposer(options.prompt_lookup_min, options.prompt_lookup_max)
                       if options.draft_prompt_lookup else None)

    def propose(self, rows: list[Request], ks: list[int]) -> float:
        """Set each row's proposal of up to k tokens; returns the seconds the draft spent catching
        up on new prompts before proposing (its share of the catch-up by tokens)."""
        live = []
        for r, k in zip(rows, ks):
            r.proposal = []
            if k and self.lookup is not None and (found := self.lookup.lookup(r, k)):
                r.proposal = found
                continue
            k = min(k, self.engine.max_context - len(r.token_ids))
            if k > 0 and self._catch_up(r, k):
                live.append((r, k))
        if not live:
            return 0.0
        seqs = [self._seqs[r.request_id] for r, _ in live]
        # Only a new prompt's catch-up is set apart, as a cost paid once per request. Catching up on
        # what a row skipped while it paused is what proposing again costs, and set apart too it
        # hid half of a draft's cost where rows paused and resumed (docs/speculative.md).
        new = sum(_behind(s) for s in seqs if s.num_computed_tokens == 0)
        behind = sum(_behind(s) for s in seqs)
        caught_up = self._prefill(seqs) * new / behind if new else 0.0
        # Each draft call feeds every row's newest token and reads its next one.
        for j in range(max(k for _, k in live)):
            step = [(r, k) for r, k in live if k > j]
            seqs = [self._seqs[r.request_id] for r, _ in step]
            logits = self.engine.forward_rows([Row(s.token_ids[s.num_computed_tokens:], s.num_computed_tokens,
                                                   s.block_table) for s in seqs])
            greedy = self.engine.greedy_tokens(logits)  # the graph's argmax, where it has one
            for i, ((r, k), s, row) in enumerate(zip(step, seqs, logits)):
                s.num_computed_tokens = len(s.token_ids)
                if r.params.greedy:
                    token = int(np.argmax(row) if greedy is None else greedy[i])
                else:  # the number the target samples this position with: the two draw alike
                    token = sample_from(distribution(row, r.params), r.draws.at(len(r.token_ids) + j))
                if self.head is not None:  # its columns are ids ascending: the target's order
                    token = int(self.head[token])
                r.proposal.append(token)
                if j + 1 < k:
                    s.token_ids.append(token)
        return caught_up

    def _catch_up(self, r: Request, k: int) -> bool:
        """Point the request's draft sequence at the target's tokens: keep the cached prefix the
        two agree on (proposals the target rejected diverge) and make room for k more tokens."""
        s = self._seqs.setdefault(r.request_id, _DraftSeq())
        limit = min(s.num_computed_tokens, len(r.token_ids))
        same = min(s.agreed, limit)  # the target's tokens only grow: up to `agreed` they still match
        while same < limit and s.token_ids[same] == r.token_ids[same]:
            same += 1
        s.num_computed_tokens = same
        s.token_ids = list(r.token_ids)
        s.agreed = len(r.token_ids)
        self.blocks.truncate(s, same)
        need = len(s.token_ids) + k - 1
        if not self.blocks.can_append(s, need):
            self.release(r)  # no room in the draft's pool: no proposal this step
            return False
        self.blocks.append(s, need)
        return True

    def _prefill(self, seqs: list[_DraftSeq]) -> float:
        """Compute all but the last CATCH_UP of each row's new tokens in chunks (the first proposal
        call feeds those and reads the last one's logits); returns the seconds it took."""
        start = time.perf_counter()
        while True:
            rows = [s for s in seqs if _behind(s) > 0]
            if not rows:
                return time.perf_counter() - start
            chunks = [s.token_ids[s.num_computed_tokens:len(s.token_ids) - CATCH_UP][:self.chunk] for s in rows]
            self.engine.forward_rows([Row(c, s.num_computed_tokens, s.block_table) for c, s in zip(chunks, rows)],
                                     logits_indices=[])
            for c, s in zip(chunks, rows):
                s.num_computed_tokens += len(c)

    def release(self, r: Request) -> None:
        s = self._seqs.pop(r.request_id, None)
        if s is not None:
            self.blocks.free(s)
        if self.lookup is not None:
            self.lookup.release(r)


def _behind(s: _DraftSeq) -> int:
    """The tokens a draft sequence's catch-up prefills: all it has not computed but the last CATCH_UP."""
    return max(len(s.token_ids) - CATCH_UP - s.num_computed_tokens, 0)


@dataclass
class _RowState:
    """A request's chance that a proposed token is accepted given the ones before it were: a
    proposal stops at its first rejection, so a step of k proposals with a kept counts a hits
    out of a + 1 tries (a out of a when all were kept), decayed over steps."""
    hits: float = PRIOR_HITS
    trials: float = PRIOR_TRIALS
    wait: int = 0  # steps left before a paused request probes again
    backoff: int = 1

    @property
    def acceptance(self) -> float:
        return self.hits / self.trials


@dataclass
class _Mean:
    """A per-step mean pooled over epochs, the older ones decayed by EPOCH_DECAY."""
    total: float = 0.0
    steps: float = 0.0

    def add(self, total: float, steps: int) -> "_Mean":
        return _Mean(total + EPOCH_DECAY * self.total, steps + EPOCH_DECAY * self.steps)

    @property
    def value(self) -> float:
        return self.total / self.steps


class _Bucket:
    """The choice of cap for one bucket of steps (batch size, greedy or sampled), measured in epochs
    of several decode steps (EPOCH at the best cap, PROBE_STEPS measuring another), so the
    step-to-step noise of a shared machine and the mix of requests average out. A cap's rate is its
    output tokens a step over its seconds a step. The seconds come from its own epochs, the tokens
    also from every larger cap's, counted as if those steps had run at it (a row that kept a
    proposals would have kept min(a, cap)): caps are compared on the same text, not each on the
    stretch it happened to be measured on, where a lucky probe of a smaller cap could displace the
    best for a while."""

    def __init__(self, caps: list[int]):
        self.caps = caps
        self.seconds: dict[int, _Mean] = {}  # per cap: seconds a step
        self.tokens: dict[int, _Mean] = {}  # per cap: output tokens a step
        # The first measurements speculate first and decode plainly last: a process's first steps
        # at a batch size, or its first sampled ones, run cold code, and measured first plain
        # decoding looked 1.5x slower than it was, long enough for a cap that lost to run.
        self.first = caps[1:] + caps[:1]
        self.cap = self.first[0]  # the cap of the running epoch
        self.probing = True  # the running epoch measures a cap rather than uses the best
        self.running: int | None = None  # the cap that runs between measurements, once all are measured
        self.epoch_tokens: dict[int, float] = {}  # the running epoch's tokens, per cap up to its own
        self.steps: list[float] = []  # the running epoch's steps' seconds
        self.catch_up = 0.0  # the running epoch's draft catch-up seconds
        # Per cap: seconds of decoding at the best cap before it is measured again. Each cap has its
        # own: with one wait, set by whichever cap was measured last, a long one that plain
        # decoding had bought also kept k from being measured again after one bad measurement.
        self.waits: dict[int, float] = {}
        self.costs: dict[int, float] = {}  # per cap: the seconds its last measurement took
        self.length = PROBE_STEPS  # the running epoch's steps

    @property
    def rates(self) -> dict[int, float]:
        """Tokens per second of each measured cap."""
        return {cap: self.tokens[cap].value / seconds.value for cap, seconds in self.seconds.items()}

    def record(self, tokens: dict[int, float], seconds: float, catch_up: float = 0.0) -> bool:
        """Add a step: its output tokens under each cap up to the running one, its seconds, and
        the seconds a draft spent catching up before it (left out of the rate, but counted in what
        a measurement costs: measuring a draft that is not running makes it catch up on every
        request in flight). True when it ended an epoch (and the next epoch's cap is chosen)."""
        for cap, got in tokens.items():
            self.epoch_tokens[cap] = self.epoch_tokens.get(cap, 0.0) + got
        self.steps.append(seconds)
        self.catch_up += catch_up
        steps = len(self.steps)
        if steps < self.length:
            return False
        # A step over HELD_UP times the epoch's median counts as the median: a page fault or another
        # process held it up, which says nothing about the cap, and counted in full it made a cap far
        # behind the best for the long wait after its measurement (a best cap then never ran again:
        # test_speculative). Every other step counts in full, not as the median: where only some
        # rows propose, a cap's steps are a mix of plain ones and dearer ones, and the median, a
        # plain step, made a draft that cost 1.6x plain decoding look the best for hundreds of steps.
        # statistics', not numpy's: run cold after a step, numpy's took up to 0.15 ms.
        median = statistics.median(self.steps)
        spent = sum(t if t <= HELD_UP * median else median for t in self.steps)
        self.seconds[self.cap] = self.seconds.get(self.cap, _Mean()).add(spent, steps)
        for cap, got in self.epoch_tokens.items():
            self.tokens[cap] = self.tokens.get(cap, _Mean()).add(got, steps)
        if self.probing:  # the cap waits so that measuring it costs at most LOSS_BUDGET of the time
            # The loss is the cap's pooled rate's, not this epoch's own: over 4 steps of text whose
            # matches come in bursts, one epoch without them measured k at half plain decoding's
            # rate where it was 2x ahead, and the wait it bought kept plain decoding on for six
            # requests (docs/speculative.md).
            self.costs[self.cap] = spent + self.catch_up
            if len(self.seconds) == len(self.caps):  # (the first measurements wait for the last one)
                rates = self.rates
                for cap in [self.cap] if self.waits else self.caps:
                    loss = max(0.0, 1.0 - rates[cap] / max(rates.values()))
                    self.waits[cap] = self.costs[cap] * max(PROBE_WAIT, loss / LOSS_BUDGET)
        else:
            self.decoded(spent)
        self.cap, self.probing = self._next()
        self.length = self._length()
        self.epoch_tokens, self.steps, self.catch_up = {}, [], 0.0
        return True

    def _length(self) -> int:
        """The next epoch's steps: a measurement's few, EPOCH at a speculating best, and at plain
        decoding all the steps until the next measurement is due. A plain step costs nothing to
        measure but its timing (`Speculator.plain`), so plain decoding's rate is measured over the
        whole wait, not in an epoch of its own after it, whose steps ran the speculator's
        bookkeeping: where proposals missed, measurements came often, and so did those epochs."""
        if self.probing:
            return PROBE_STEPS
        if self.cap:
            return EPOCH
        return max(EPOCH, math.ceil(self.wait / self.seconds[0].value))

    def best(self) -> int:
        """The measured cap with the most tokens per second; speculating must beat plain
        decoding by MIN_GAIN."""
        rates = self.rates
        best = max(rates, key=rates.get)
        return best if best and rates[best] > MIN_GAIN * rates[0] else 0

    def _next(self) -> tuple[int, bool]:
        """The next epoch's cap, and whether it measures: a cap not yet measured, or one that is
        not the best once its own wait has passed (a cap close to the best is measured again soon,
        one far behind it rarely)."""
        unmeasured = [c for c in self.first if c not in self.seconds]
        if unmeasured:
            return unmeasured[0], True
        best = self.best()
        if self.running is not None and best != self.running:
            # The waits were bought at the old best, against its rate; the others are measured
            # against the new one soon. Carried over, a wait that measuring plain decoding had bought
            # while k was far ahead kept plain decoding on for hundreds of steps after a stretch of
            # text without matches made it the best (docs/speculative.md).
            soon = PROBE_WAIT * PROBE_STEPS * self.seconds[best].value
            self.waits = {cap: min(wait, soon) for cap, wait in self.waits.items()}
        self.running = best
        due = min((c for c in self.caps if c != best), key=lambda c: self.waits.get(c, 0.0))
        return (due, True) if self.waits.get(due, 0.0) <= 0 else (best, False)

    @property
    def wait(self) -> float:
        """Seconds of decoding at the best cap before the next measurement is due."""
        return min(self.waits.get(c, 0.0) for c in self.caps if c != self.running)

    def decoded(self, seconds: float) -> None:
        """Count seconds of decoding at the best cap toward every cap's wait."""
        self.waits = {cap: wait - seconds for cap, wait in self.waits.items()}


class Speculator:
    """Proposes for decoding requests before each step and learns from what was accepted."""

    def __init__(self, proposer, max_tokens: int, adaptive: bool = True):
        self.proposer = proposer
        self.max_tokens = max_tokens
        self.adaptive = adaptive
        # The caps a batch size chooses between: none, one token, the most allowed.
        self.caps = sorted({0, 1, max_tokens})
        # acceptance**j >= MIN_CHANCE exactly when acceptance >= MIN_CHANCE**(1/j): the j-th bar.
        self._bars = [MIN_CHANCE ** (1 / j) for j in range(1, max_tokens + 1)]
        self._rows: dict[str, _RowState] = {}
        self._buckets: dict[tuple[bool, int], _Bucket] = {}
        self._lost: set[tuple[bool, int]] = set()  # buckets where speculating measured no faster
        self._pending: tuple[bool, int] | None = None  # the running step's bucket, when it is measured
        self._started = 0.0
        self._accepted: list[int] = []  # the running step's kept proposals, per verified row
        self._catch_up = 0.0  # the running step's draft catch-up, in seconds

    def propose(self, decoding: list[Request], remaining) -> None:
        """Set the decoding requests' proposals; `remaining(r)` is how many more tokens r may still
        produce (a proposal longer than that minus one cannot be kept)."""
        self._started = time.perf_counter()
        cap = self.max_tokens
        if self.adaptive:
            bucket = _bucket(decoding)
            if self._outgrown(bucket):
                return
            self._pending = bucket
            measured = self._buckets.get(bucket)
            if measured is None:
                measured = self._buckets[bucket] = _Bucket(self.caps)
            cap = measured.cap
            if cap == 0:
                return
        ks = [max(min(self._wanted(r), cap, remaining(r) - 1), 0) for r in decoding]
        # A draft's catch-up over a new prompt is left out of the step's time: it is paid once per
        # request, at its first speculating step, and landing in one cap's short epoch it made that
        # cap look slow for the long wait that follows a measurement (docs/speculative.md).
        self._catch_up = self.proposer.propose(decoding, ks)
        self._started += self._catch_up

    def plain(self, running: list[Request]) -> bool:
        """True when these rows decode plainly this step, so it needs no proposals: their bucket's
        cap is none (the step is timed for it), or a smaller batch of their kind found speculating
        no faster. The step then runs without the speculator's bookkeeping, which was a measurable
        share of a small model's plain step."""
        if not self.adaptive:
            return False
        bucket = _bucket(running)
        if self._outgrown(bucket):
            return True
        measured = self._buckets.get(bucket)
        if measured is None or measured.cap:
            return False
        self._pending, self._started = bucket, time.perf_counter()
        return True

    def _outgrown(self, bucket: tuple[bool, int]) -> bool:
        """True when a smaller batch of the bucket's kind found speculating no faster: verifying
        costs more the larger the batch, so this one does not try."""
        return any(kind == bucket[0] and size < bucket[1] for kind, size in self._lost)

    def _wanted(self, r: Request) -> int:
        """The request's own proposal length: the j-th token only while acceptance**j is at least
        MIN_CHANCE; none while paused, but a one-token probe now and then."""
        if not self.adaptive:
            return self.max_tokens
        s = self._rows.get(r.request_id)
        if s is None:
            s = self._rows[r.request_id] = _RowState()
        k = bisect.bisect_right(self._bars, s.acceptance)
        if k == 0:
            s.wait -= 1
            if s.wait <= 0:
                s.wait = s.backoff
                s.backoff = min(2 * s.backoff, MAX_BACKOFF)
                return 1
        return k

    def verified(self, r: Request, proposed: int, accepted: int) -> None:
        """Learn from a request's step: `accepted` of its `proposed` tokens were kept."""
        self._accepted.append(accepted)
        s = self._rows.get(r.request_id)
        if s is None or not proposed:
            return
        s.hits = DECAY * s.hits + accepted
        s.trials = DECAY * s.trials + accepted + (accepted < proposed)
        if accepted:
            s.backoff, s.wait = 1, 0

    def step_done(self, tokens: int | None) -> None:
        """Record the step's output tokens and whole time (proposing, verifying, accepting) in its
        batch size's epoch; None: the step also prefilled, so it says nothing about decoding."""
        bucket, self._pending = self._pending, None
        accepted, self._accepted = self._accepted, []
        catch_up, self._catch_up = self._catch_up, 0.0
        if bucket is None or tokens is None:
            return
        seconds = time.perf_counter() - self._started
        measured = self._buckets[bucket]
        # What the step would have output under each smaller cap: a row keeps min(accepted, cap).
        by_cap = {cap: tokens - sum(a - cap for a in accepted if a > cap) for cap in self.caps if cap <= measured.cap}
        if not measured.record(by_cap, seconds, catch_up):
            return
        if 0 in measured.seconds:
            if measured.cap == 0 and not measured.probing:
                self._lost.add(bucket)
            else:
                self._lost.discard(bucket)

    def release(self, r: Request) -> None:
        self._rows.pop(r.request_id, None)
        self.proposer.release(r)


def _bucket(rows: list[Request]) -> tuple[bool, int]:
    """The steps that share measurements: by whether any row samples, and by the power of two at or
    above the batch size. Sampling changes both sides of the trade: a proposal is accepted with
    probability min(1, p/q), not when it is the argmax, and a sampled row's proposing and verifying
    work on distributions; measured together, a switch from greedy to sampled requests ran the
    greedy requests' best cap for dozens of steps at twice a plain step's time (docs/speculative.md)."""
    return any(not r.params.greedy for r in rows), 1 << (len(rows) - 1).bit_length()


def make_speculator(options, target: Engine, tokenizer_file: Path) -> Speculator | None:
    """The Speculator `options.speculative` asks for: None, "ngram" or a draft engine's path."""
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
    return Speculator(proposer, options.num_speculative_tokens, options.speculative_adaptive)
