"""LLM: the user-facing engine loop over an artifact, with in-flight batching.

One step = (propose) -> schedule -> run the backend -> sample or verify -> append/stop/stream.
Requests join and leave between steps. Decoding rows (one pending token, plus any speculative
proposal) run in one call and prefill chunks in another: padding a decode row to a chunk's length
would multiply its cost.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from llmc.contract.engine_dir import open_engine, read_eos_token_ids
from llmc.contract.options import RuntimeOptions
from llmc.contract.tuning import read_tuning
from llmc.errors import EngineError, RequestError, check_unicode, first_line
from llmc.runtime.engine import load_engine
from llmc.runtime.kv_cache import BlockManager, blocks_for
from llmc.runtime.request import Request, RequestOutput
from llmc.runtime.sampling import Sampler, SamplingParams, token_logprob, verify
from llmc.runtime.scheduler import Scheduler
from llmc.runtime.speculative import make_speculator
from llmc.runtime.step import Row

__all__ = ["LLM", "Prompt", "RequestOutput", "Stream"]

# Texts from this many characters up are tokenized with the GIL released (see LLM.encode).
LONG_TEXT = 10_000


class Prompt(NamedTuple):
    """A prompt checked and tokenized (LLM.tokenize): its text (None when given as ids) and ids."""
    text: str | None
    ids: list[int]


class Stream:
    """Iterator of text deltas of one request; `.output` is its RequestOutput (final once
    exhausted). Closing it early aborts the request and frees its blocks."""

    def __init__(self, llm: "LLM", request: Request):
        self.output = request.out
        self._gen = llm._deltas(request)

    def __iter__(self) -> Iterator[str]:
        return self._gen

    def close(self) -> None:
        self._gen.close()


class LLM:
    def __init__(self, engine_dir: str | Path, *, use_tuning: bool = True, **options):
        """`options` are RuntimeOptions fields. One left out (or None) takes the value in the engine's
        tuning.json (unless use_tuning is False), else its default. `self.options` is what runs,
        `self.tuning` the tuned values that took effect (None without tuning)."""
        from tokenizers import Tokenizer

        given = RuntimeOptions.given(options)
        # The weights are hashed as the engine reads them in (load_engine): one pass, not two.
        files = open_engine(engine_dir, verify_checksums=given.get("verify_checksums", True), hash_later=("weights",))
        if (kept := files.manifest.lm_head_tokens) is not None:
            raise EngineError(f"engine {files.root} is a speculative draft: its LM head scores {len(kept)} of the "
                              f"{files.manifest.model_spec.vocab_size} tokens (--draft-vocab), so it cannot decode "
                              f"alone; pass it as --speculative to a target built without --draft-vocab")
        tuned = read_tuning(files.tuning) if use_tuning and files.tuning is not None else None
        options, applied = RuntimeOptions.merge(given, tuned)
        self.tuning = applied if tuned is not None else None
        self.engine = load_engine(files, options)
        self.options = dataclasses.replace(options, num_threads=self.engine.num_threads)
        self.blocks = BlockManager(self.engine.num_blocks, self.engine.block_size, options.enable_prefix_caching)
        self.scheduler = Scheduler(options, self.blocks)
        self.tokenizer = Tokenizer.from_file(str(files.tokenizer))
        self.eos_ids = self._eos_ids(files.generation_config)
        self.sampler = Sampler()
        self.speculator = make_speculator(options, self.engine, files.tokenizer)
        self._requests: dict[str, Request] = {}
        self._next_order = 0
        # Cumulative engine counts, all requests, aborted ones included: tokens run through the
        # model (prefill + decode), prompts whose prefill finished, tokens sampled.
        self.computed_tokens = self.prompt_tokens = self.generated_tokens = 0

    def _eos_ids(self, generation_config: Path) -> frozenset[int]:
        return frozenset(self.engine.spec.eos_token_ids) | frozenset(read_eos_token_ids(generation_config))

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) >= LONG_TEXT:  # encode holds the GIL throughout (seconds for megabytes); encode_batch does not
            return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    # -- request lifecycle ------------------------------------------------------------------

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Validate and queue a request; it joins the running batch at the next step.

        `arrival_time` (a `time.perf_counter()` value, default now) is when the request reached
        the server: a driver that only adds requests between steps passes the real arrival so
        TTFT includes the wait for the running step."""
        request = self.make_request(prompt, params or SamplingParams(), request_id, arrival_time)
        self.enqueue(request)
        return request.request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; False if it is unknown or already done."""
        request = self._requests.pop(request_id, None)
        if request is None or request.finished:
            return False
        self._retire(request)
        request.out.finish_reason = "abort"
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def output(self, request_id: str) -> RequestOutput | None:
        """The live output of an unfinished request (None once it finished or if unknown)."""
        request = self._requests.get(request_id)
        return request.out if request is not None else None

    def step(self) -> list[Request]:
        """Run one engine step; returns the requests that got a token (or finished) in it."""
        spec = self.speculator
        if spec is not None and not spec.plain(self.scheduler.running):
            self._propose()
        scheduled = self.scheduler.schedule()
        updated: list[Request] = []
        decodes = [(r, n) for r, n in scheduled if r.num_pending_tokens == 1]
        prefills = [(r, n) for r, n in scheduled if r.num_pending_tokens > 1]
        before = sum(len(r.out.token_ids) for r, _ in decodes) if spec is not None else 0
        for rows in (decodes, prefills):
            if not rows:
                continue
            try:
                updated += self._run(rows)
            except Exception as exc:  # a backend failure ends the step's requests, not the server
                for r, _ in rows:
                    r.out.finish_reason, r.out.error = "error", f"backend step failed: {first_line(exc)}"
                    if r not in updated:
                        updated.append(r)
        if spec is not None:
            spec.step_done(None if prefills else sum(len(r.out.token_ids) for r, _ in decodes) - before)
        for r in updated:
            if r.out.finished:
                self._retire(r)
                self._requests.pop(r.request_id, None)
            elif self._crosses_longrope_boundary(r):
                self.scheduler.recompute(r)
                r.cache_salt = self._rope_factors(r)
        return updated

    def _propose(self) -> None:
        """Proposals for the requests that decode next step (the scheduler trims what does not fit)."""
        decoding, prefilling = [], bool(self.scheduler.waiting)
        for r in self.scheduler.running:
            if r.proposal:  # one left from a step that did not schedule the request
                r.proposal = []
            pending = r.num_pending_tokens
            if pending == 1:
                if r.out.token_ids:
                    decoding.append(r)
            elif pending > 1:
                prefilling = True
        # Only steps that decode and nothing else speculate: a step with prefill chunks is long
        # already, and its time says nothing about what verifying costs.
        if decoding and (not prefilling or not self.speculator.adaptive):
            self.speculator.propose(decoding, self._remaining)

    def _remaining(self, r: Request) -> int:
        return min(r.params.max_tokens - len(r.out.token_ids), self.max_context - len(r.token_ids))

    def _retire(self, request: Request) -> None:
        self.scheduler.finish(request)
        if self.speculator is not None:
            self.speculator.release(request)

    def _rope_factors(self, request: Request) -> int | None:
        """Which longrope factors rotate the request's cached keys (1: long, 0: short; None
        without longrope): cached blocks are shared only between sequences that agree."""
        boundary = self.engine.spec.longrope_boundary
        return None if boundary is None else int(len(request.token_ids) > boundary)

    def _crosses_longrope_boundary(self, request: Request) -> bool:
        """True when a sequence grows past longrope's boundary with its cache rotated by the short
        factors: like transformers, it is then computed again, all of it with the long factors."""
        boundary = self.engine.spec.longrope_boundary
        return boundary is not None and request.num_computed_tokens == boundary < len(request.token_ids)

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None):
        """Run prompts in flight together; one prompt returns a RequestOutput, many a list."""
        if isinstance(prompts, Prompt):
            single = True
        elif isinstance(prompts, np.ndarray):
            single = prompts.ndim != 2  # a 2-D array is a batch of token-id rows
        elif isinstance(prompts, (list, tuple)):  # a batch, unless it is one prompt of (would-be) token ids
            single = len(prompts) > 0 and isinstance(prompts[0], (int, float, np.number, np.bool_))
        else:
            single = True  # a str, or a bad prompt that make_request explains
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise RequestError("no prompts given; pass a string or a list of strings")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(batch)
        elif len(params) != len(batch):
            raise RequestError(f"got {len(params)} SamplingParams for {len(batch)} prompts; pass one or one per prompt")
        requests = [self.make_request(p, sp) for p, sp in zip(batch, params)]  # validate all first
        for r in requests:
            self.enqueue(r)
        try:
            while any(not r.finished for r in requests):
                self.step()
        finally:
            for r in requests:
                if not r.finished:
                    self.abort(r.request_id)
        outputs = [r.out for r in requests]
        return outputs[0] if single else outputs

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Stream:
        request = self.make_request(prompt, params or SamplingParams())
        self.enqueue(request)
        return Stream(self, request)

    # -- internals --------------------------------------------------------------------------

    def enqueue(self, request: Request) -> None:
        """Queue a request from `make_request`; it joins the running batch at the next step."""
        request.cache_salt = self._rope_factors(request)
        self._requests[request.request_id] = request
        self.scheduler.add(request)

    def make_request(self, prompt, params: SamplingParams, request_id: str | None = None,
                     arrival_time: float | None = None) -> Request:
        """A validated request, not yet queued (`enqueue` queues it). Reads nothing a step changes
        but the set of live ids, so another thread may call it while a step runs."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        text, ids = prompt if isinstance(prompt, Prompt) else self.tokenize(prompt)
        limit = self.max_context
        if len(ids) >= limit:
            raise RequestError(f"prompt is {len(ids)} tokens but the engine's max context is {limit}; "
                               "shorten the prompt or rebuild with a larger --max-context", field="prompt")
        vocab = self.engine.spec.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None and text is not None:  # the tokenizer knows tokens the model has no embedding for
            raise RequestError(f"the prompt encodes to token {self.tokenizer.id_to_token(bad)!r} (id {bad}), "
                               f"outside the model's vocabulary (0..{vocab - 1}); remove it from the prompt", field="prompt")
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", field="prompt")
        if len(ids) + params.max_tokens > limit:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                               f"engine's max context {limit}; lower max_tokens to {limit - len(ids)} or less",
                               field="max_tokens")
        worst = blocks_for(len(ids) + params.max_tokens, self.engine.block_size)
        if worst > self.blocks.capacity:
            raise RequestError(f"request needs up to {worst} KV blocks but the pool has {self.blocks.capacity}; "
                               "raise kv_cache_blocks / kv_cache_bytes or lower max_tokens", field="max_tokens")
        if request_id is None:
            request_id = f"req-{self._next_order}"
            while request_id in self._requests:  # a caller may have picked this name
                request_id += "+"
        elif request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use; pass a unique id")
        self._next_order += 1
        return Request(str(request_id), self._next_order, text, ids, params, self.tokenizer, self.eos_ids,
                       arrival_time)

    def tokenize(self, prompt: str | Sequence[int]) -> Prompt:
        """The prompt checked and tokenized, for add_request/generate/stream to take as it is (so a
        server can tokenize off its event loop); anything else is a RequestError saying what a
        prompt may be. Thread-safe: it reads nothing that steps change."""
        if isinstance(prompt, Prompt):
            return prompt
        forms = "a prompt may be a non-empty str, or a non-empty list of int token ids"
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty; pass at least one character of text", field="prompt")
            check_unicode(prompt, "prompt", RequestError, forms)
            return Prompt(prompt, self.encode(prompt))
        if isinstance(prompt, (bytes, bytearray)):  # a sequence of ints: it would run as one token id per byte
            raise RequestError(f"prompt is {type(prompt).__name__}; decode it to a str first ({forms})", field="prompt")
        if isinstance(prompt, np.ndarray) and prompt.ndim == 1 and prompt.dtype.kind in "iu":
            ids = prompt.tolist()
        elif isinstance(prompt, Sequence):
            for i, t in enumerate(prompt):
                if isinstance(t, bool) or not isinstance(t, (int, np.integer)):  # a bool is an int, never a token
                    raise RequestError(f"prompt token {i} is {t!r:.40} ({type(t).__name__}), not an int token id; "
                                       f"{forms}", field="prompt")
            ids = [int(t) for t in prompt]
        else:
            kind = (f"a {prompt.ndim}-D numpy array of {prompt.dtype}" if isinstance(prompt, np.ndarray)
                    else "None" if prompt is None else f"of type {type(prompt).__name__}")
            raise RequestError(f"prompt is {kind}; {forms}", field="prompt")
        if not ids:
            raise RequestError("prompt is empty; pass at least one token id", field="prompt")
        return Prompt(None, ids)

    def _deltas(self, request: Request) -> Iterator[str]:
        try:
            while not request.finished:
                self.step()
                yield from request.deltas()
            yield from request.deltas()
        finally:
            if not request.finished:
                self.abort(request.request_id)

    def _run(self, rows: list[tuple[Request, int]]) -> list[Request]:
        packed, seq = self._rows(rows)
        if any(r.proposal for r, _ in rows):
            return self._run_speculative(rows, packed, seq)
        logits = self.engine.forward_rows(packed, seq)  # each row's last computed token
        done = []
        for i, (r, n) in enumerate(rows):
            self.computed_tokens += n
            r.num_computed_tokens += n
            self.blocks.commit(r)
            if r.num_pending_tokens == 0:
                done.append(i)
        if not done:
            return []
        picked = logits if len(done) == len(rows) else logits[done]  # decode steps: every row, no copy
        return self._sample([rows[i][0] for i in done], picked)

    def _sample(self, requests: list[Request], logits: np.ndarray) -> list[Request]:
        tokens = self.sampler.sample(logits, [r.params for r in requests], [r.draws for r in requests],
                                     [len(r.token_ids) for r in requests], self.engine.greedy_tokens(logits))
        now = time.perf_counter()
        for i, (r, token) in enumerate(zip(requests, tokens)):
            if r.out.token_ids:
                r.out.metrics.decode_steps += 1
            else:
                self.prompt_tokens += len(r.out.prompt_token_ids)
            if r.out.logprobs is not None:
                r.out.logprobs.append(token_logprob(logits[i], int(token), r.params.logprobs))
            r.append(int(token), now, self.max_context)
        self.generated_tokens += len(requests)
        return requests

    def _run_speculative(self, rows: list[tuple[Request, int]], packed: list[Row], seq: int) -> list[Request]:
        """A decode step where some rows verify proposals: logits at every position of those rows
        (after the pending token and after each proposal), at the last of the others."""
        # Plain Python lists: numpy's per-call cost on these few ints was a tenth of the Python
        # around a verify step, which is itself a fixed cost that every accepted token must repay.
        indices = []
        for b, (r, n) in enumerate(rows):
            indices.extend(range(b * seq, b * seq + n) if r.proposal else (b * seq + n - 1,))
        logits = self.engine.forward_rows(packed, seq, logits_indices=indices)
        greedy = self.engine.greedy_tokens(logits)
        plain, updated = [], []
        start = 0
        for r, n in rows:
            self.computed_tokens += n
            if r.proposal:
                self._keep_verified(r, logits[start:start + n], None if greedy is None else greedy[start:start + n])
                updated.append(r)
                start += n
            else:
                r.num_computed_tokens += n
                self.blocks.commit(r)
                plain.append((r, start))
                start += 1
        if plain:
            updated += self._sample([r for r, _ in plain], logits[[start for _, start in plain]])
        return updated

    def _keep_verified(self, r: Request, logits: np.ndarray, greedy: np.ndarray | None) -> None:
        """Append what the target keeps of a row's proposal and roll its cache back to that."""
        proposed = r.proposal
        tokens = verify(logits, proposed, r.params, r.draws, len(r.token_ids), greedy)
        r.proposal = []
        kept = len(tokens) - 1
        metrics = r.out.metrics
        metrics.decode_steps += 1
        metrics.proposed_tokens += len(proposed)
        metrics.accepted_tokens += kept
        self.speculator.verified(r, len(proposed), kept)
        computed = r.num_computed_tokens + 1 + kept  # the pending token and the kept proposals
        for j, token in enumerate(tokens):
            if r.out.logprobs is not None:  # logits[j] is what came after the j-th verified position
                r.out.logprobs.append(token_logprob(logits[j], token, r.params.logprobs))
            r.append(token, time.perf_counter(), self.max_context)  # each token its own time: ITL per token
            self.generated_tokens += 1
            if r.out.finished:
                break
        r.num_computed_tokens = min(computed, len(r.token_ids))  # a stop inside the run ends it there
        self.blocks.truncate(r, len(r.token_ids))  # blocks holding only rejected proposals go back
        self.blocks.commit(r)

    def _rows(self, rows: list[tuple[Request, int]]) -> tuple[list[Row], int]:
        """The step's rows and the length they are padded to."""
        seq = max(n for _, n in rows)
        # A row's padding slots carry its last known position, from which a length-dependent RoPE
        # reads the row's length; a chunk that fills its row gets a padding slot for it.
        if self.engine.spec.longrope_boundary is not None and any(
                n == seq and len(r.token_ids) > r.num_computed_tokens + n for r, n in rows):
            seq += 1
        return [Row((r.token_ids[r.num_computed_tokens:] + r.proposal)[:n], r.num_computed_tokens, r.block_table,
                    len(r.token_ids) - 1) for r, n in rows], seq
