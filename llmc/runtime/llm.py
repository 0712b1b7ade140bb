"""LLM: the user-facing API over an Engine.

`LLM(engine_dir).generate(prompts, params)` runs prompts as a batch: one padded prefill call,
then decode steps of one token per running row until each row stops (EOS, a stop token or
string, max_tokens, or the context limit). `LLM.stream(prompt, params)` yields text deltas as
tokens decode. (In-flight batching with a scheduler replaces the static batch later; the
request state and stop logic here are what it will reuse.)
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from llmc.errors import RequestError
from llmc.runtime.detokenize import IncrementalDetokenizer, find_stop, stop_holdback
from llmc.runtime.engine import Engine
from llmc.runtime.kv_cache import blocks_for
from llmc.runtime.metrics import RequestTimes
from llmc.runtime.sampling import Sampler, SamplingParams, make_rng


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" (EOS / stop token / stop string) or "length"
    metrics: RequestTimes | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class _Request:
    """One sequence's mutable decoding state."""

    def __init__(self, rid: int, prompt: str | None, ids: list[int], params: SamplingParams,
                 tokenizer, eos_ids: frozenset[int]):
        self.out = RequestOutput(rid, prompt, ids, metrics=RequestTimes(arrival=time.perf_counter()))
        self.params = params
        self.rng = make_rng(params)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids=ids)
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_ids)
        self.table: list[int] = []
        self.emitted = 0  # characters of text already streamed

    @property
    def num_tokens(self) -> int:
        return len(self.out.prompt_token_ids) + len(self.out.token_ids)

    def append(self, token: int, now: float, max_context: int) -> None:
        out = self.out
        out.token_ids.append(token)
        out.metrics.record_token(now)
        if token in self.stop_ids:
            out.text += self.detok.flush()
            out.finish_reason = "stop"
            return
        out.text += self.detok.add(token)
        if self.params.stop:
            cut = find_stop(out.text, self.params.stop, max(0, len(out.text) - 64))
            if cut is not None:
                out.text = out.text[:cut]
                out.finish_reason = "stop"
                return
        if len(out.token_ids) >= self.params.max_tokens or self.num_tokens >= max_context:
            out.text += self.detok.flush()
            out.finish_reason = "length"

    def delta(self) -> str:
        """Text not streamed yet, holding back what could still become a stop string."""
        text = self.out.text
        end = len(text) if self.out.finished else len(text) - stop_holdback(text, self.params.stop)
        piece, self.emitted = text[self.emitted:end], max(self.emitted, end)
        return piece


class Stream:
    """Iterator of text deltas; `.output` holds the RequestOutput (final once exhausted)."""

    def __init__(self, llm: "LLM", request: _Request):
        self.output = request.out
        self._gen = llm._deltas(request)

    def __iter__(self) -> Iterator[str]:
        return self._gen


class LLM:
    def __init__(self, engine_dir: str | Path, **engine_options):
        from tokenizers import Tokenizer

        self.engine = Engine(engine_dir, **engine_options)
        manifest = self.engine.manifest
        self.tokenizer = Tokenizer.from_file(str(self.engine.dir / manifest["tokenizer"]))
        eos = set(self.engine.spec.eos_token_ids)
        gen_path = self.engine.dir / "generation_config.json"
        if gen_path.is_file():
            value = json.loads(gen_path.read_text()).get("eos_token_id")
            eos |= set(value if isinstance(value, list) else [value] if value is not None else [])
        self.eos_ids = frozenset(eos)
        self.sampler = Sampler()
        self._next_id = 0

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    # -- public API -------------------------------------------------------------------------

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None):
        """Generate for one prompt (returns a RequestOutput) or many (returns a list)."""
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], (int, np.integer)))
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise RequestError("no prompts given; pass a string or a list of strings")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(batch)
        elif len(params) != len(batch):
            raise RequestError(f"got {len(params)} SamplingParams for {len(batch)} prompts; pass one or one per prompt")
        requests = [self._request(p, sp) for p, sp in zip(batch, params)]
        for group in self._groups(requests):
            for _ in self._run(group):
                pass
        outputs = [r.out for r in requests]
        return outputs[0] if single else outputs

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Stream:
        return Stream(self, self._request(prompt, params or SamplingParams()))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    # -- internals --------------------------------------------------------------------------

    def _request(self, prompt, params: SamplingParams) -> _Request:
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty; pass at least one character of text")
            text, ids = prompt, self.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
            if not ids:
                raise RequestError("prompt is empty; pass at least one token id")
            bad = [t for t in ids if not 0 <= t < self.engine.spec.vocab_size]
            if bad:
                raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.engine.spec.vocab_size - 1})")
        limit = self.max_context
        if len(ids) >= limit:
            raise RequestError(f"prompt is {len(ids)} tokens but the engine's max context is {limit}; "
                               "shorten the prompt or rebuild with a larger --max-context")
        if len(ids) + params.max_tokens > limit:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                               f"engine's max context {limit}; lower max_tokens to {limit - len(ids)} or less")
        worst = blocks_for(len(ids) + params.max_tokens, self.engine.block_size)
        if worst > self.engine.blocks.capacity:
            raise RequestError(f"request needs up to {worst} KV blocks but the pool has {self.engine.blocks.capacity}; "
                               "raise kv_cache_blocks / kv_cache_bytes or lower max_tokens")
        self._next_id += 1
        return _Request(self._next_id, text, ids, params, self.tokenizer, self.eos_ids)

    def _groups(self, requests: list[_Request]) -> Iterator[list[_Request]]:
        """Split a batch into groups whose worst-case KV blocks fit the pool together."""
        group, used = [], 0
        for r in requests:
            need = blocks_for(len(r.out.prompt_token_ids) + r.params.max_tokens, self.engine.block_size)
            if group and used + need > self.engine.blocks.num_free:
                yield group
                group, used = [], 0
            group.append(r)
            used += need
        if group:
            yield group

    def _deltas(self, request: _Request) -> Iterator[str]:
        for _ in self._run([request]):
            piece = request.delta()
            if piece:
                yield piece

    def _run(self, requests: list[_Request]) -> Iterator[None]:
        """Prefill the batch, then decode until every request finished; yields after each step.
        Blocks are always returned to the pool, also when the caller stops iterating early."""
        engine = self.engine
        try:
            active = list(requests)
            step_ids = [r.out.prompt_token_ids for r in active]
            past = [0] * len(active)
            while active:
                for r, ids, p in zip(active, step_ids, past):
                    engine.blocks.ensure(r.table, p + len(ids))
                    if r.out.metrics.first_scheduled is None:
                        r.out.metrics.mark_scheduled()
                feeds = self._pack(active, step_ids, past)
                logits = engine.forward(*feeds)
                if logits.ndim == 3:  # an all-positions engine: keep each row's last valid token
                    logits = logits[np.arange(len(active)), feeds[3] - 1]
                tokens = self.sampler.sample(logits, [r.params for r in active], [r.rng for r in active])
                now = time.perf_counter()
                still = []
                for r, token in zip(active, tokens):
                    r.append(int(token), now, self.max_context)
                    if r.out.finished:
                        engine.blocks.free(r.table)
                    else:
                        still.append(r)
                yield
                active = still
                past = [r.num_tokens - 1 for r in active]
                step_ids = [[r.out.token_ids[-1]] for r in active]
        finally:
            for r in requests:
                engine.blocks.free(r.table)

    def _pack(self, requests, step_ids, past):
        batch, seq = len(requests), max(len(ids) for ids in step_ids)
        input_ids = np.zeros((batch, seq), np.int64)
        query_lens = np.array([len(ids) for ids in step_ids], np.int32)
        past_lens = np.array(past, np.int32)
        for i, ids in enumerate(step_ids):
            input_ids[i, : len(ids)] = ids
        position_ids = past_lens[:, None].astype(np.int64) + np.arange(seq)[None, :]
        width = max(len(r.table) for r in requests)
        tables = np.zeros((batch, width), np.int32)
        for i, r in enumerate(requests):
            tables[i, : len(r.table)] = r.table
        return input_ids, position_ids, past_lens, query_lens, tables
