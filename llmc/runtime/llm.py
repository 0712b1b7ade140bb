"""LLM: the in-process front end over the engine core (runtime/engine_core.py): it opens an engine
directory, checks and queues requests, and steps the core until they finish, whole or streamed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator, Sequence

from llmc.contract.engine_dir import open_engine, read_eos_token_ids
from llmc.contract.options import RuntimeOptions
from llmc.contract.tuning import read_tuning
from llmc.errors import EngineError, RequestError
from llmc.runtime import prompts as prompts_
from llmc.runtime.engine import load_engine
from llmc.runtime.engine_core import EngineCore
from llmc.runtime.prompts import Prompt
from llmc.runtime.request import Request, RequestOutput
from llmc.runtime.sampling import SamplingParams

__all__ = ["LLM", "Prompt", "RequestOutput", "Stream"]


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
        self.core = EngineCore(self.engine, options, files.tokenizer)
        self.blocks, self.scheduler = self.core.blocks, self.core.scheduler
        self.tokenizer = Tokenizer.from_file(str(files.tokenizer))
        self.eos_ids = frozenset(self.engine.spec.eos_token_ids) | frozenset(read_eos_token_ids(files.generation_config))
        self._requests: dict[str, Request] = {}  # unfinished, by id
        self._next_order = 0

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return prompts_.encode(self.tokenizer, text, add_special_tokens)

    def tokenize(self, prompt: str | Sequence[int]) -> Prompt:
        """The prompt checked and tokenized, for add_request/generate/stream to take as it is (so a
        server can tokenize off its event loop). Thread-safe: it reads nothing that steps change."""
        return prompts_.tokenize(self.tokenizer, prompt)

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Check and queue a request; it joins the running batch at the next step. `arrival_time`
        (a `time.perf_counter()` value, default now) is when it reached the server: a driver that
        adds requests only between steps passes it so TTFT includes the wait for the running step."""
        request = self.make_request(prompt, params or SamplingParams(), request_id, arrival_time)
        self.enqueue(request)
        return request.request_id

    def make_request(self, prompt, params: SamplingParams, request_id: str | None = None,
                     arrival_time: float | None = None) -> Request:
        """A checked request, not yet queued (`enqueue` queues it). Reads nothing a step changes but
        the set of live ids, so another thread may call it while a step runs."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt = prompt if isinstance(prompt, Prompt) else self.tokenize(prompt)
        prompts_.check_fits(prompt, params, tokenizer=self.tokenizer, vocab_size=self.engine.spec.vocab_size,
                           max_context=self.max_context, block_size=self.engine.block_size,
                           pool_blocks=self.blocks.capacity)
        if request_id is None:
            request_id = f"req-{self._next_order}"
            while request_id in self._requests:  # a caller may have picked this name
                request_id += "+"
        elif request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use; pass a unique id")
        self._next_order += 1
        return Request(str(request_id), self._next_order, prompt.text, prompt.ids, params, self.tokenizer,
                       self.eos_ids, arrival_time)

    def enqueue(self, request: Request) -> None:
        """Queue a request from `make_request`; it joins the running batch at the next step."""
        self._requests[request.request_id] = request
        self.core.add(request)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; False if it is unknown or already done."""
        request = self._requests.pop(request_id, None)
        if request is None or request.finished:
            return False
        self.core.retire(request)
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
        updated = self.core.step()
        for r in updated:
            if r.out.finished:
                self._requests.pop(r.request_id, None)
        return updated

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None):
        """Run prompts in flight together; one prompt returns a RequestOutput, many a list."""
        batch, single = prompts_.as_batch(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(batch)
        elif len(params) != len(batch):
            raise RequestError(f"got {len(params)} SamplingParams for {len(batch)} prompts; pass one or one per prompt")
        requests = [self.make_request(p, sp) for p, sp in zip(batch, params)]  # check all first
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

    def _deltas(self, request: Request) -> Iterator[str]:
        try:
            while not request.finished:
                self.step()
                yield from request.deltas()
            yield from request.deltas()
        finally:
            if not request.finished:
                self.abort(request.request_id)
