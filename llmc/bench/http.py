"""An OpenAI-compatible server as a benchmark target (`llmc bench --url`): llmc's or another's.

Each request is a streaming `POST /v1/completions` of the workload's token ids (greedy,
`ignore_eos`, `max_tokens` = its output length), sent at its arrival time with at most
`max_concurrency` in flight, and timed as its client sees it: arrival = when it was sent (or
when a client slot freed), a token time per streamed chunk. The same RequestTimes, summaries,
reports and plots as an in-process engine's follow.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence

import httpx

from llmc.bench.runner import RequestRecord
from llmc.bench.workloads import BenchRequest, prompt_vocab
from llmc.errors import LlmcError, first_line
from llmc.runtime.metrics import RequestTimes
from llmc.runtime.request import RequestOutput

LOAD_WAIT_S = 120  # how long a server answering 503 (loading) is waited for


class HttpTarget:
    in_process = False

    def __init__(self, url: str, model: str | None = None, vocab_size: int | None = None,
                 tokenizer: str | None = None):
        """`tokenizer` (an engine folder or a tokenizer.json): send prompts as the text it decodes the
        workload's token ids to, for servers that take no token ids (llama-cpp-python's)."""
        self.decode, tokenizer_size = _decoder(tokenizer) if tokenizer else (None, None)
        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        try:
            deadline = time.monotonic() + LOAD_WAIT_S
            while (response := httpx.get(f"{self.url}/v1/models", timeout=10)).status_code == 503:
                if time.monotonic() > deadline:  # still loading its model
                    break
                time.sleep(0.5)
            listed = response.raise_for_status().json()["data"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise LlmcError(f"cannot list the models of {url} ({first_line(exc)}); is an OpenAI-compatible server "
                            "running there?") from None
        entry = next((m for m in listed if model in (None, m.get("id"))), None)
        if entry is None:
            raise LlmcError(f"{url} serves {', '.join(m.get('id', '?') for m in listed) or 'no model'}, not "
                            f"{model!r}; pass one of them with --model")
        self.model = entry["id"]
        self.max_context = entry.get("max_model_len")
        vocab_size = vocab_size or entry.get("vocab_size") or tokenizer_size
        if tokenizer_size:  # ids the tokenizer has no text for would decode to nothing
            vocab_size = min(vocab_size, tokenizer_size)
        if not vocab_size:
            raise LlmcError(f"{url} does not say its vocabulary size; pass --vocab-size (prompts are random token "
                            "ids below it)")
        self.vocab = prompt_vocab(int(vocab_size), ())
        self.info = {"label": self.model, "path": self.url, "source": f"{self.model} at {self.url}",
                     "options": {}, "tuning": None}

    def run(self, requests: Sequence[BenchRequest], max_concurrency: int | None = None,
            on_finish: Callable[[], None] | None = None) -> tuple[list[RequestRecord], float, float]:
        return asyncio.run(self._run(requests, max_concurrency or len(requests), on_finish))

    async def _run(self, requests, cap: int, on_finish):
        slots = asyncio.Semaphore(cap)
        start = time.perf_counter()
        limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
            async def one(req: BenchRequest) -> RequestRecord:
                await asyncio.sleep(max(0.0, start + req.arrival - time.perf_counter()))
                async with slots:  # a request due while the client is full is sent when a slot frees
                    out = await self._send(client, req, max(start + req.arrival, time.perf_counter()))
                if on_finish:
                    on_finish()
                return RequestRecord(len(req.prompt), req.output_len, out)

            records = await asyncio.gather(*(one(r) for r in requests))
        end = max((t for r in records for t in r.output.metrics.token_times[-1:]), default=time.perf_counter())
        return list(records), start, end - start

    async def _send(self, client, req: BenchRequest, arrival: float) -> RequestOutput:
        out = RequestOutput("", None, list(req.prompt), metrics=RequestTimes(arrival=arrival))
        prompt = self.decode(req.prompt) if self.decode else list(req.prompt)
        body = {"model": self.model, "prompt": prompt, "max_tokens": req.output_len, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        last_chunk, usage = None, None
        try:
            async with client.stream("POST", f"{self.url}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    out.finish_reason, out.error = "error", f"HTTP {response.status_code}: {text[:200]}"
                    return out
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    choices = chunk.get("choices") or []
                    if not choices:
                        continue
                    last_chunk = time.perf_counter()
                    # A chunk is a token, whatever its text (a token may decode to none yet), except
                    # a closing chunk with no text, which some servers send after the last token.
                    finish = choices[0].get("finish_reason")
                    if finish is None or choices[0].get("text"):
                        out.metrics.record_token()
                    out.finish_reason = finish or out.finish_reason
        except (httpx.HTTPError, ValueError) as exc:
            out.finish_reason, out.error = "error", first_line(exc)
        if out.finish_reason is None:
            out.finish_reason, out.error = "error", "the stream ended without a finish reason"
        # The closing chunk carried the last token after all (its text was empty): the server's
        # usage, when it sends one, says so.
        missing = (usage or {}).get("completion_tokens", 0) - out.metrics.num_tokens
        if missing == 1 and last_chunk is not None:
            out.metrics.record_token(last_chunk)
        return out


def _decoder(path: str):
    from pathlib import Path

    from tokenizers import Tokenizer

    file = Path(path)
    if file.is_dir():
        file = next((f for f in (file / "tokenizer" / "tokenizer.json", file / "tokenizer.json") if f.is_file()), file)
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:
        raise LlmcError(f"cannot load a tokenizer from {path} ({first_line(exc)}); pass an engine folder or a "
                        "tokenizer.json") from None
    return (lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False)), tokenizer.get_vocab_size()
