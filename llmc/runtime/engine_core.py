"""The engine core: one step is schedule -> run -> update, with in-flight batching over a paged cache.

`schedule` asks the speculation policy for proposals, lets the scheduler pick each request's tokens
and packs them into a plan: decoding rows in one backend call and prefill chunks in another
(padding a decode row to a chunk's length would multiply its cost), with the positions whose
logits are needed. `run` executes one call of the plan. `update` samples or verifies, appends,
and hands the step's time to the policy. Requests join and leave between steps. `LLM` and
`AsyncLLM` are front ends over this.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmc.contract.options import RuntimeOptions
from llmc.errors import first_line
from llmc.runtime.engine import Engine
from llmc.runtime.kv_cache import BlockManager
from llmc.runtime.request import Request
from llmc.runtime.sampling import Sampler, verify
from llmc.runtime.scheduler import Scheduler
from llmc.runtime.speculation import make_policy
from llmc.runtime.step import Row


@dataclass
class Call:
    """One backend call of a step: its requests and tokens each computes, their rows padded to
    `seq`, and the flat token positions whose logits it returns (None: each row's last)."""
    rows: list[tuple[Request, int]]
    packed: list[Row]
    seq: int
    logits_indices: list[int] | None


@dataclass
class Plan:
    calls: list[Call]
    started: float  # when the step began, proposing included
    decode_only: bool  # the step decodes and does nothing else: its time measures decoding


class EngineCore:
    def __init__(self, engine: Engine, options: RuntimeOptions, tokenizer_file: Path):
        self.engine = engine
        self.blocks = BlockManager(engine.num_blocks, engine.block_size, options.enable_prefix_caching,
                                   getattr(engine, "num_slots", 0))
        self.scheduler = Scheduler(options, self.blocks)
        self.sampler = Sampler()
        self.speculation = make_policy(options, engine, tokenizer_file)
        self.max_context = engine.max_context
        # Cumulative counts, all requests, aborted ones included: tokens run through the model
        # (prefill + decode), prompts whose prefill finished, tokens sampled.
        self.computed_tokens = self.prompt_tokens = self.generated_tokens = 0

    def step(self) -> list[Request]:
        """Run one step; returns the requests that got a token (or finished) in it."""
        plan = self.schedule()
        updated: list[Request] = []
        for call in plan.calls:
            try:
                logits = self.run(call)
            except Exception as exc:  # a backend failure ends the call's requests, not the server
                for r, _ in call.rows:
                    r.out.finish_reason, r.out.error = "error", f"backend step failed: {first_line(exc)}"
                updated += [r for r, _ in call.rows if r not in updated]
            else:
                updated += self.update(call, logits)
        if plan.decode_only and self.speculation is not None:
            self.speculation.step_done(plan.calls[0].seq, time.perf_counter() - plan.started)
        for r in updated:
            if r.out.finished:
                self.retire(r)
            elif self._crosses_longrope_boundary(r):
                self.scheduler.recompute(r)
                r.cache_salt = self.rope_factors(r)
        return updated

    def schedule(self) -> Plan:
        started = time.perf_counter()
        running, spec = self.scheduler.running, self.speculation
        decoding = [r for r in running if r.num_pending_tokens == 1 and r.out.token_ids]
        only_decoding = len(decoding) == len(running) and not self.scheduler.waiting
        # With costs measured, only steps that decode and nothing else speculate: a step with
        # prefill chunks is long already, and its time says nothing about what verifying costs.
        if spec is not None:
            for r in running:
                r.proposal = []  # one left from a step that did not schedule the request
            if decoding and (only_decoding or spec.costs is None):
                spec.propose(decoding, self._remaining)
        scheduled = self.scheduler.schedule()
        decodes = [(r, n) for r, n in scheduled if r.num_pending_tokens == 1]
        prefills = [(r, n) for r, n in scheduled if r.num_pending_tokens > 1]
        calls = [self._call(rows) for rows in (decodes, prefills) if rows]
        return Plan(calls, started, bool(decodes) and not prefills and only_decoding)

    def _call(self, rows: list[tuple[Request, int]]) -> Call:
        seq = max(n for _, n in rows)
        # A row's padding slots carry its last known position, from which a length-dependent RoPE
        # reads the row's length; a chunk that fills its row gets a padding slot for it.
        if self.engine.spec.longrope_boundary is not None and any(
                n == seq and len(r.token_ids) > r.num_computed_tokens + n for r, n in rows):
            seq += 1
        packed = [Row((r.token_ids[r.num_computed_tokens:] + r.proposal)[:n], r.num_computed_tokens, r.block_table,
                      len(r.token_ids) - 1, r.state_slot) for r, n in rows]
        indices = None
        if any(r.proposal for r, _ in rows):  # verifying rows: logits after each of their tokens
            # Plain lists: numpy's per-call cost on these few ints was a tenth of the Python around a
            # verify step, a fixed cost every accepted token must repay.
            indices = []
            for b, (r, n) in enumerate(rows):
                indices.extend(range(b * seq, b * seq + n) if r.proposal else (b * seq + n - 1,))
        return Call(rows, packed, seq, indices)

    def run(self, call: Call) -> np.ndarray:
        return self.engine.forward_rows(call.packed, call.seq, call.logits_indices)

    def update(self, call: Call, logits: np.ndarray) -> list[Request]:
        """Advance each row by what it computed: verify its proposal, or sample the next token of a
        row whose prompt is done; the rest (prefill chunks) wait for their next chunk."""
        greedy = self.engine.greedy_tokens(logits)
        updated, to_sample, picked = [], [], []
        start = 0
        for r, n in call.rows:
            self.computed_tokens += n
            if r.proposal:
                self._keep_verified(r, logits[start:start + n], None if greedy is None else greedy[start:start + n])
                updated.append(r)
                start += n
                continue
            r.num_computed_tokens += n
            self.blocks.commit(r)
            if r.num_pending_tokens == 0:
                to_sample.append(r)
                picked.append(start)
            start += 1
        if to_sample:
            if len(picked) < len(logits):  # decode steps: every row, no copy
                logits, greedy = logits[picked], None if greedy is None else greedy[picked]
            updated += self._sample(to_sample, logits, greedy)
        return updated

    def _sample(self, requests: list[Request], logits: np.ndarray, greedy: np.ndarray | None) -> list[Request]:
        tokens = self.sampler.sample(logits, [r.params for r in requests], [r.draws for r in requests],
                                     [len(r.token_ids) for r in requests], greedy)
        now = time.perf_counter()
        for i, (r, token) in enumerate(zip(requests, tokens)):
            if r.out.token_ids:
                r.out.metrics.decode_steps += 1
            else:
                self.prompt_tokens += len(r.out.prompt_token_ids)
            r.extend([int(token)], logits[i:i + 1] if r.out.logprobs is not None else None, self.max_context, now)
        self.generated_tokens += len(requests)
        return requests

    def _keep_verified(self, r: Request, logits: np.ndarray, greedy: np.ndarray | None) -> None:
        """Append what the target keeps of a row's proposal and roll its cache back to that."""
        proposed, r.proposal = r.proposal, []
        tokens = verify(logits, proposed, r.params, r.draws, len(r.token_ids), greedy)
        r.out.metrics.verified(len(proposed), len(tokens) - 1)
        self.speculation.verified(r, len(proposed), len(tokens) - 1)
        computed = r.num_computed_tokens + len(tokens)  # the pending token and the kept proposals
        self.generated_tokens += r.extend(tokens, logits, self.max_context)
        r.num_computed_tokens = min(computed, len(r.token_ids))  # a stop inside the run ends it there
        self.blocks.truncate(r, len(r.token_ids))  # blocks holding only rejected proposals go back
        self.blocks.commit(r)

    def _remaining(self, r: Request) -> int:
        return min(r.params.max_tokens - len(r.out.token_ids), self.max_context - len(r.token_ids))

    # -- request lifecycle ------------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.cache_salt = self.rope_factors(request)
        self.scheduler.add(request)

    def retire(self, request: Request) -> None:
        """End a request (finished or aborted) and free its KV blocks."""
        self.scheduler.finish(request)
        if self.speculation is not None:
            self.speculation.release(request)

    def rope_factors(self, request: Request) -> int | None:
        """Which longrope factors rotate the request's cached keys (1: long, 0: short; None
        without longrope): cached blocks are shared only between sequences that agree."""
        boundary = self.engine.spec.longrope_boundary
        return None if boundary is None else int(len(request.token_ids) > boundary)

    def _crosses_longrope_boundary(self, request: Request) -> bool:
        """True when a sequence grows past longrope's boundary with its cache rotated by the short
        factors: like transformers, it is then computed again, all of it with the long factors."""
        boundary = self.engine.spec.longrope_boundary
        return boundary is not None and request.num_computed_tokens == boundary < len(request.token_ids)
