"""A request's state as it moves through the scheduler, and what users get back.

There is no separate "prefill" and "decode" state: a request has `token_ids` (prompt, then
outputs) of which the first `num_computed_tokens` have K/V in the cache. Each step computes
some of the rest (a prefill chunk, or the one newly sampled token when decoding); when all are
computed, the last one's logits give the next token. Preemption frees the blocks and sets
`num_computed_tokens` back to 0: recomputation is then just a longer prefill.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field

from llmc.runtime.detokenize import IncrementalDetokenizer, find_stop, stop_holdback
from llmc.runtime.metrics import RequestTimes
from llmc.runtime.sampling import Draws, SamplingParams, token_logprob


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" (EOS, stop token/string), "length", "abort" or "error"
    error: str | None = None  # with finish_reason "error": what failed
    metrics: RequestTimes | None = None
    prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    preemptions: int = 0
    delta: str = ""  # in streamed snapshots: the text added since the previous snapshot
    logprobs: list | None = None  # TokenLogprob per output token, when the request asked for them

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Request:
    def __init__(self, request_id: str, order: int, prompt: str | None, prompt_ids: list[int],
                 params: SamplingParams, tokenizer, eos_ids: frozenset[int], arrival: float | None = None):
        self.request_id = request_id
        self.order = order  # arrival order: FCFS admission, newest is preempted first
        self.params = params
        self.token_ids = list(prompt_ids)
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_hashed_blocks = 0
        self.state_slot = 0  # a hybrid's slot in the state pools while it runs (kv_cache.BlockManager)
        self.cache_salt: int | None = None  # see llmc.runtime.kv_cache.chain_hash
        self.status = Status.WAITING
        self.draws = Draws.of(params)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids)
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_ids)
        self.out = RequestOutput(request_id, prompt, list(prompt_ids),
                                 metrics=RequestTimes(arrival=time.perf_counter() if arrival is None else arrival),
                                 logprobs=None if params.logprobs is None else [])
        self.proposal: list[int] = []  # speculative tokens to verify after the pending one (not in token_ids)
        self._emitted = 0  # characters of text already streamed
        self._token_ends: deque[int] = deque()  # len(out.text) after each token not yet streamed
        self._admitted = False

    @property
    def num_pending_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def admitted(self, cached_tokens: int) -> None:
        if not self._admitted:
            self._admitted = True
            self.out.prefix_hit_tokens = cached_tokens
            self.out.metrics.mark_scheduled()

    def append(self, token: int, now: float, max_context: int) -> None:
        """Add a sampled token and decide whether the request is done."""
        out = self.out
        self.token_ids.append(token)
        out.token_ids.append(token)
        out.metrics.record_token(now)
        if token in self.stop_ids:
            out.text += self.detok.flush()
            out.finish_reason = "stop"
            return
        out.text += self.detok.add(token)
        self._token_ends.append(len(out.text))
        if self.params.stop:
            cut = find_stop(out.text, self.params.stop, max(0, len(out.text) - 64))
            if cut is not None:
                out.text = out.text[:cut]
                out.finish_reason = "stop"
                return
        if len(out.token_ids) >= self.params.max_tokens or len(self.token_ids) >= max_context:
            out.text += self.detok.flush()
            out.finish_reason = "length"

    def extend(self, tokens: list[int], logits, max_context: int, now: float | None = None) -> int:
        """Append a step's tokens (one sampled, or what verification kept), logits[j] the row
        token j was chosen from (read only for logprobs), up to one that finishes the request;
        returns how many it took. Each token gets its own time unless `now` is given: ITL per token."""
        for j, token in enumerate(tokens):
            if self.out.logprobs is not None:
                self.out.logprobs.append(token_logprob(logits[j], token, self.params.logprobs))
            self.append(token, time.perf_counter() if now is None else now, max_context)
            if self.out.finished:
                return j + 1
        return len(tokens)

    def deltas(self) -> list[str]:
        """Text not streamed yet, one piece per token (a speculative step adds several), holding
        back what could still become a stop string."""
        text = self.out.text
        end = len(text) if self.out.finished else len(text) - stop_holdback(text, self.params.stop)
        pieces = []
        while self._token_ends and self._token_ends[0] <= end:
            cut = self._token_ends.popleft()
            if cut > self._emitted:
                pieces.append(text[self._emitted:cut])
                self._emitted = cut
        if end > self._emitted:  # held-back text released, or the flush at the end
            pieces.append(text[self._emitted:end])
            self._emitted = end
        if self.out.finished:
            self._token_ends.clear()
        return pieces

    def delta(self) -> str:
        return "".join(self.deltas())
