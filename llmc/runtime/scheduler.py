"""In-flight batching scheduler: two queues, a token budget, chunked prefill, recompute preemption.

Each step: running requests first, decodes before prefill chunks (so a long prompt never stalls
everyone's next token), each taking at most `chunk_size` tokens of the step's
`max_num_batched_tokens` budget; then waiting requests are admitted FCFS while the budget,
`max_num_seqs` and free KV blocks allow. When a running request needs a block and none is free,
the newest running request is preempted: its blocks are freed and it goes back to the front of
the waiting queue, to be recomputed later (its cached prefix usually survives in the LRU pool).
A decoding request with speculative proposals computes them too, as far as the budget and the
free blocks reach.
"""

from __future__ import annotations

from collections import deque

from llmc.contract.options import RuntimeOptions
from llmc.runtime.kv_cache import BlockManager
from llmc.runtime.request import Request, Status


class Scheduler:
    def __init__(self, config: RuntimeOptions, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Request, int]]:
        """Pick (request, number of tokens to compute) pairs for this step; blocks are allocated."""
        budget = self.config.max_num_batched_tokens
        step: dict[Request, int] = {}
        for req in sorted(self.running, key=lambda r: (r.num_pending_tokens > 1, r.order)):
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this step
            n = min(req.num_pending_tokens, self.config.chunk_size, budget)
            if n <= 0:
                continue
            if not self._make_room(req, req.num_computed_tokens + n, step):
                continue
            n += self._room_for_proposal(req, n, budget - n)
            self.blocks.append(req, req.num_computed_tokens + n)
            step[req] = n
            budget = self.config.max_num_batched_tokens - sum(step.values())

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            cached = self.blocks.allocate_prefix(req)
            n = min(req.num_pending_tokens, self.config.chunk_size, budget)
            if not self.blocks.can_append(req, req.num_computed_tokens + n):
                self.blocks.free(req)  # give the cached blocks back; try again next step
                break
            self.waiting.popleft()
            self.blocks.record_lookup(len(req.token_ids), cached)
            req.status = Status.RUNNING
            req.admitted(cached)
            self.running.append(req)
            self.blocks.append(req, req.num_computed_tokens + n)
            step[req] = n
            budget -= n
        return list(step.items())

    def _room_for_proposal(self, req: Request, n: int, budget: int) -> int:
        """How many of a decoding request's speculative tokens this step verifies: as many as the
        budget and the free blocks allow (speculation never preempts anyone); the rest are dropped."""
        if not req.proposal or req.num_pending_tokens != n:
            req.proposal = []
            return 0
        k = min(len(req.proposal), budget)
        while k and not self.blocks.can_append(req, req.num_computed_tokens + n + k):
            k -= 1
        del req.proposal[k:]
        return k

    def _make_room(self, req: Request, num_tokens: int, step: dict[Request, int]) -> bool:
        """Preempt the newest running requests until `req` can grow; False if `req` itself went."""
        while not self.blocks.can_append(req, num_tokens):
            victim = max(self.running, key=lambda r: r.order)
            self.preempt(victim)
            step.pop(victim, None)
            if victim is req:
                return False
        return True

    def preempt(self, req: Request) -> None:
        self.recompute(req)
        req.out.preemptions += 1
        self.num_preemptions += 1

    def recompute(self, req: Request) -> None:
        """Drop a running request's cache; it is computed again from its first token next."""
        self.blocks.free(req)
        self.running.remove(req)
        req.proposal = []
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """Retire a request (finished or aborted) and free its blocks."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        self.blocks.free(req)
        req.status = Status.FINISHED
