"""Speculative decoding: proposals for decoding rows, verified by the target in its own step.

Before a step the Speculator gives each decoding request a `proposal` of up to k tokens; the
scheduler computes them with the request's pending token as one (k+1)-token row, and the LLM
keeps the accepted prefix plus one token of the target's (`sampling.verify`) and rolls the rest
back. Two proposers: prompt lookup (the continuation of the latest earlier occurrence of the
sequence's last n tokens) and a draft engine (a smaller llmc engine with the same tokenizer and
its own paged cache, stepping every speculating row as one batch).

Adaptive: each request keeps an estimate of how often its proposals are accepted and proposes
the j-th token only while that chance to the power j is at least `MIN_CHANCE`; a request whose
estimate falls below it pauses and probes again after a backoff. Per step, the expected tokens
are weighed against whole-step times measured on this engine per (batch, proposal length), so
speculation steps aside when verifying costs more than it gains (large batches, misses).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.engine import Engine, Row, pack
from llmc.runtime.kv_cache import BlockManager
from llmc.runtime.request import Request
from llmc.runtime.sampling import distribution, sample_from

MIN_CHANCE = 0.25  # propose the j-th token while acceptance**j is at least this
PRIOR_ACCEPTANCE = 0.75  # a new request's estimate: optimistic, so it tries
EMA = 0.3  # weight of the latest step in a request's acceptance estimate
MAX_BACKOFF = 64  # steps a paused request waits at most before it probes again
MIN_GAIN = 1.1  # speculate only when the expected tokens per second beat plain decoding's by this
SAMPLES = 3  # step times measured per (batch, proposal length) before they are trusted
REMEASURE = 64  # decisions at a batch size between refreshing its oldest step time


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's
    last n tokens (n from `max_n` down to `min_n`), from a per-request index of n-grams."""

    cheap = True  # a lookup costs far less than a step: look, then decide

    def __init__(self, min_n: int, max_n: int):
        self.sizes = range(max_n, min_n - 1, -1)
        self._index: dict[str, tuple[list[dict], list[int]]] = {}

    def propose(self, rows: list[Request], ks: list[int]) -> None:
        for r, k in zip(rows, ks):
            r.proposal, r.proposal_probs = (self._lookup(r, k) if k else []), None

    def _lookup(self, r: Request, k: int) -> list[int]:
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
                return tokens[end:end + k]
        return []

    def release(self, r: Request) -> None:
        self._index.pop(r.request_id, None)

    def take_prefill_seconds(self) -> float:
        return 0.0

    def close(self) -> None:
        self._index.clear()


@dataclass
class _DraftSeq:
    """A request's sequence in the draft engine's cache (the BlockManager's sequence protocol)."""
    token_ids: list[int] = field(default_factory=list)  # what the draft has been fed, in order
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_hashed_blocks: int = 0
    cache_salt: int | None = None


class DraftProposer:
    """A smaller engine proposes by decoding k tokens for every speculating row at once."""

    cheap = False

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
        self.blocks = BlockManager(self.engine.num_blocks, self.engine.block_size, enable_prefix_caching=False)
        self.chunk = options.chunk_size
        self._seqs: dict[str, _DraftSeq] = {}
        self._prefill_seconds = 0.0

    def take_prefill_seconds(self) -> float:
        """Seconds spent computing new prompts into the draft's cache since the last call."""
        seconds, self._prefill_seconds = self._prefill_seconds, 0.0
        return seconds

    def propose(self, rows: list[Request], ks: list[int]) -> None:
        live = []
        for r, k in zip(rows, ks):
            r.proposal, r.proposal_probs = [], None
            k = min(k, self.engine.max_context - len(r.token_ids))
            if k > 0 and self._catch_up(r, k):
                live.append((r, k))
        if not live:
            return
        self._prefill([(r, self._seqs[r.request_id]) for r, _ in live])
        # Each draft call feeds every row's newest token and reads its next one.
        probs: dict[str, list[np.ndarray]] = {r.request_id: [] for r, _ in live}
        for j in range(max(k for _, k in live)):
            step = [(r, k) for r, k in live if k > j]
            seqs = [self._seqs[r.request_id] for r, _ in step]
            feeds = pack([Row(s.token_ids[s.num_computed_tokens:], s.num_computed_tokens, s.block_table)
                          for s in seqs])
            logits = self.engine.forward(*feeds)
            for (r, k), s, row in zip(step, seqs, logits):
                s.num_computed_tokens = len(s.token_ids)
                if r.params.greedy:
                    token = int(np.argmax(row))
                else:
                    q = distribution(row, r.params)
                    token = sample_from(q, r.rng)
                    probs[r.request_id].append(q)
                r.proposal.append(token)
                if j + 1 < k:
                    s.token_ids.append(token)
        for r, _ in live:
            if not r.params.greedy:
                r.proposal_probs = np.stack(probs[r.request_id])

    def _catch_up(self, r: Request, k: int) -> bool:
        """Point the request's draft sequence at the target's tokens: keep the cached prefix the
        two agree on (proposals the target rejected diverge) and make room for k more tokens."""
        s = self._seqs.setdefault(r.request_id, _DraftSeq())
        same = 0
        limit = min(s.num_computed_tokens, len(r.token_ids))
        while same < limit and s.token_ids[same] == r.token_ids[same]:
            same += 1
        s.num_computed_tokens = same
        s.token_ids = list(r.token_ids)
        self.blocks.truncate(s, same)
        need = len(s.token_ids) + k - 1
        if not self.blocks.can_append(s, need):
            self.release(r)  # no room in the draft's pool: no proposal this step
            return False
        self.blocks.append(s, need)
        return True

    def _prefill(self, live: list[tuple[Request, _DraftSeq]]) -> None:
        """Compute all but the last of each row's new tokens in chunks (the last one is fed by
        the first proposal call, which reads its logits)."""
        started = time.perf_counter()
        try:
            self._prefill_chunks(live)
        finally:
            self._prefill_seconds += time.perf_counter() - started

    def _prefill_chunks(self, live: list[tuple[Request, _DraftSeq]]) -> None:
        while True:
            rows = [s for _, s in live if len(s.token_ids) - 1 - s.num_computed_tokens > 0]
            if not rows:
                return
            chunks = [s.token_ids[s.num_computed_tokens:len(s.token_ids) - 1][:self.chunk] for s in rows]
            self.engine.forward(*pack([Row(c, s.num_computed_tokens, s.block_table) for c, s in zip(chunks, rows)]),
                                logits_indices=[])
            for c, s in zip(chunks, rows):
                s.num_computed_tokens += len(c)

    def release(self, r: Request) -> None:
        s = self._seqs.pop(r.request_id, None)
        if s is not None:
            self.blocks.free(s)

    def close(self) -> None:
        for rid in list(self._seqs):
            self.blocks.free(self._seqs.pop(rid))


@dataclass
class _RowState:
    acceptance: float = PRIOR_ACCEPTANCE
    wait: int = 0  # steps left before a paused request probes again
    backoff: int = 1


class Speculator:
    """Proposes for decoding requests before each step and learns from what was accepted."""

    def __init__(self, proposer, max_tokens: int, adaptive: bool = True):
        self.proposer = proposer
        self.max_tokens = max_tokens
        self.adaptive = adaptive
        self._rows: dict[str, _RowState] = {}
        self._step_times: dict[tuple[int, int], deque[float]] = {}  # (batch bucket, longest proposal): seconds
        self._decisions: dict[int, int] = {}  # per batch bucket
        self._started: float | None = None

    def propose(self, decoding: list[Request], remaining: list[int]) -> None:
        """Set each decoding request's proposal; `remaining` is how many more tokens each may
        still produce (a proposal longer than that minus one cannot be kept)."""
        self._started = time.perf_counter()
        states = [self._rows.setdefault(r.request_id, _RowState()) for r in decoding]
        ks = [max(min(self._wanted(s), left - 1), 0) for s, left in zip(states, remaining)]
        if not self.adaptive:
            self.proposer.propose(decoding, ks)
            return
        if self.proposer.cheap:  # look first, then weigh what was found
            self.proposer.propose(decoding, ks)
            cap = self._best_cap([len(r.proposal) for r in decoding], states)
            for r in decoding:
                del r.proposal[cap:]
        else:  # weigh what is wanted, then pay for only that
            cap = self._best_cap(ks, states)
            self.proposer.propose(decoding, [min(k, cap) for k in ks])

    def _wanted(self, s: _RowState) -> int:
        if not self.adaptive:
            return self.max_tokens
        k = 0
        while k < self.max_tokens and s.acceptance ** (k + 1) >= MIN_CHANCE:
            k += 1
        if k == 0:  # paused: probe with one token now and then
            s.wait -= 1
            if s.wait <= 0:
                s.wait = s.backoff
                s.backoff = min(2 * s.backoff, MAX_BACKOFF)
                return 1
        return k

    def _best_cap(self, ks: list[int], states: list[_RowState]) -> int:
        """The step's longest proposal with the best measured tokens per second (0: none); a
        length not yet measured at this batch size is tried once."""
        batch, longest = len(ks), max(ks, default=0)
        if longest == 0:
            return 0

        def expected(cap: int) -> float:  # output tokens the step is expected to give
            return sum(sum(s.acceptance ** j for j in range(min(k, cap) + 1)) for k, s in zip(ks, states))

        bucket = _bucket(batch)
        caps = sorted({0, max(1, longest // 2), longest})
        times = [self._step_times.get((bucket, cap), ()) for cap in caps]
        for cap, samples in zip(caps, times):
            if len(samples) < SAMPLES:
                return cap  # measure it
        decisions = self._decisions[bucket] = self._decisions.get(bucket, 0) + 1
        if decisions % REMEASURE == 0:  # costs drift (context grows, neighbours come and go)
            return caps[decisions // REMEASURE % len(caps)]
        rates = [expected(cap) / statistics.median(samples) for cap, samples in zip(caps, times)]
        best = max(range(1, len(caps)), key=rates.__getitem__, default=0)
        return caps[best] if rates[best] > MIN_GAIN * rates[0] else 0

    def verified(self, r: Request, proposed: int, accepted: int) -> None:
        """Learn from a request's step: `accepted` of its `proposed` tokens were kept."""
        s = self._rows.get(r.request_id)
        if s is None or not proposed:
            return
        s.acceptance += EMA * (accepted / proposed - s.acceptance)
        if accepted:
            s.backoff, s.wait = 1, 0

    def step_done(self, batch: int, longest: int) -> None:
        """Record the whole step's time (proposing, verifying, accepting) for its shape; only
        steps that decode and nothing else count."""
        if self._started is None:
            return
        # A draft's one-off catch-up over a new prompt is not what a step of this shape costs.
        seconds = time.perf_counter() - self._started - self.proposer.take_prefill_seconds()
        self._step_times.setdefault((_bucket(batch), longest), deque(maxlen=5)).append(seconds)
        self._started = None

    def cancel_timing(self) -> None:
        self._started = None

    def release(self, r: Request) -> None:
        self._rows.pop(r.request_id, None)
        self.proposer.release(r)

    def close(self) -> None:
        self.proposer.close()


def _bucket(batch: int) -> int:
    """Batch sizes share step times by the power of two at or above them."""
    return 1 << (batch - 1).bit_length()


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
