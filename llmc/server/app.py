"""`llmc serve`: an OpenAI-compatible HTTP server over one AsyncLLM, shared by every connection.

The engine loads in a worker thread after the server starts (`/health` answers 503 until it is
ready). A request is one `AsyncLLM` stream per choice (`n` of each prompt); a client that
disconnects closes its streams, which aborts the requests and frees their blocks at once. The
waiting queue is bounded (429 with Retry-After past it), and every refused request gets OpenAI's
error body naming the field, without touching the others.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmc.contract.options import ServerOptions
from llmc.errors import RequestError, first_line
from llmc.runtime.async_llm import AsyncLLM, tokenizing
from llmc.runtime.chat import ChatTemplate
from llmc.runtime.prompts import Prompt
from llmc.runtime.request import RequestOutput
from llmc.server.prometheus import ServerMetrics
from llmc.server.protocol import UNION_MEMBERS, ChatCompletionRequest, CompletionRequest, _Sampling, error_body

class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.headers, self.kind = status, param, headers, kind


def _refused(exc: RequestError, which: str, max_tokens_field: str, default_field: str) -> HttpError:
    """A runtime refusal as a 400 whose `param` is the field it says it is about (the request's own
    name for max_tokens: chat's max_completion_tokens), `which` of several prompts before it."""
    field = exc.field or default_field
    message = str(exc)
    if field == "max_tokens" and max_tokens_field != field:  # the fix the message names, in the request's words
        message = message.replace(field, max_tokens_field)
        field = max_tokens_field
    return HttpError(400, which + message, field)


class _Server:
    def __init__(self, engine_dir: Path, model: str, options: dict, chat_template: Path | None, max_waiting: int):
        self.engine_dir, self.model, self.options = engine_dir, model, options
        self.chat_template_file, self.max_waiting = chat_template, max_waiting
        self.engine: AsyncLLM | None = None
        self.metrics: ServerMetrics | None = None
        self.load_error: str | None = None
        self.template = None
        self.admitting = 0  # requests past the queue check whose streams are not all queued yet

    def load(self) -> None:
        """Runs in a worker thread while the server already answers /health with 503."""
        try:
            engine = AsyncLLM(self.engine_dir, **self.options)
            self.template = ChatTemplate.of(engine.llm, self.chat_template_file)
            self.metrics = ServerMetrics(engine, self.model)
            engine.on_finish = self.metrics.finished  # every request, read to its end or left
            self.engine = engine
        except Exception as exc:
            self.load_error = first_line(exc)

    def ready(self) -> AsyncLLM:
        if self.engine is None:
            message = f"the engine failed to load: {self.load_error}" if self.load_error else "the engine is loading"
            raise HttpError(503, message, kind="service_unavailable", headers={"Retry-After": "1"})
        return self.engine

    # -- a request: n streams a prompt ---------------------------------------------------------

    async def start(self, body: _Sampling, prompts: list[str | list[int] | Prompt],
                    default_max_tokens: int) -> tuple[str, list]:
        """The streams of every prompt's n choices: choice i of prompt p is stream p * n + i, with
        the sampling (and seed) that choice i of the prompt alone would have."""
        engine = self.ready()
        # Requests admitted but still tokenizing count as waiting: a long prompt is tokenized in a
        # worker, and requests that came meanwhile all passed the check and then all queued.
        # A request larger than the bound is taken when nothing waits: it would never fit otherwise.
        waiting, total = engine.num_waiting + self.admitting, len(prompts) * body.n
        if waiting >= self.max_waiting or (waiting and waiting + total > self.max_waiting):
            raise HttpError(429, f"the server's queue is full ({waiting} requests waiting, at most "
                                 f"{self.max_waiting}); retry later", kind="rate_limit_exceeded",
                            headers={"Retry-After": "1"})
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = []
        self.admitting += total
        try:
            for p, prompt in enumerate(prompts):
                which = f"prompt {p}: " if len(prompts) > 1 else ""  # which of several a refusal is about
                prompt = await engine.tokenize(prompt)  # once for all n choices
                for i in range(body.n):
                    params = body.sampling(i, default_max_tokens)
                    streams.append(await engine.add_request(prompt, params, request_id=f"{rid}-{len(streams)}"))
        except RequestError as exc:
            for stream in streams:
                await stream.aclose()
            raise _refused(exc, which, body.token_limit_field, "prompt") from None
        finally:
            self.admitting -= total
        return rid, streams

    async def choices(self, streams: list) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """(choice index, snapshot) pairs from all of a request's streams as they come, each time
        all that is ready (a consumer that fell behind sends them on in one write); closing this
        iterator closes every stream (aborting what is unfinished)."""
        if len(streams) == 1:  # the common case, without the fan-in's task hops per token
            stream = streams[0]
            try:
                async for out in stream:
                    yield [(0, out), *((0, more) for more in stream.ready())]
            finally:
                await stream.aclose()
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream) -> None:
            try:
                async for out in stream:
                    await queue.put((index, out))
            finally:
                await stream.aclose()
                await queue.put((index, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            open_streams = len(tasks)
            while open_streams:
                got = [await queue.get()]
                while not queue.empty():
                    got.append(queue.get_nowait())
                open_streams -= sum(out is None for _, out in got)
                ready = [(index, out) for index, out in got if out is not None]
                if ready:
                    yield ready
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def create_app(engine_dir: str | Path, *, model: str | None = None, options: dict | None = None,
               chat_template: str | Path | None = None, max_waiting: int = ServerOptions.max_waiting,
               load_before_serving: bool = False) -> FastAPI:
    """`load_before_serving`: the app starts only once the engine is loaded (a replica behind a
    router, which must not be sent requests it would answer 503); otherwise it answers at once and
    `/health` says when the engine is ready."""
    engine_dir = Path(engine_dir)
    server = _Server(engine_dir, model or engine_dir.name, options or {},
                     Path(chat_template) if chat_template else None, max_waiting)
    app = FastAPI(title="llmc", lifespan=_lifespan(server, load_before_serving))
    app.state.server = server
    _add_error_handlers(app)
    _add_status_routes(app, server)
    _add_completion_routes(app, server)
    return app


def _lifespan(server: _Server, load_before_serving: bool):
    """Loads the engine in a worker thread as the app starts (waiting for it when
    `load_before_serving`), and waits for that thread as the app stops."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = asyncio.get_running_loop().run_in_executor(None, server.load)
        if load_before_serving:
            await loading
            if server.load_error:
                raise RuntimeError(f"the engine failed to load: {server.load_error}")
        yield
        await loading

    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    """Every refusal as OpenAI's error body: ours (HttpError), pydantic's, and Starlette's (404, 405)."""
    @app.exception_handler(HttpError)
    async def http_error(request: Request, exc: HttpError):
        return JSONResponse(error_body(str(exc), exc.param, exc.kind), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc.errors()[0])
        return JSONResponse(error_body(message, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def other_http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), None, "invalid_request_error"), status_code=exc.status_code)


def _validation_message(first: dict) -> tuple[str, str | None]:
    """(message, param) of pydantic's first complaint about a request body."""
    # The field's path, without the body and without the union member pydantic tried ("list[str]").
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and p not in UNION_MEMBERS]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON ({first.get('msg')}); send a JSON object", None
    param = ".".join(loc) or None
    shown = "input" in first and loc and first.get("type") != "missing"  # a missing field's input is the body
    why = first.get("msg", "").removeprefix("Value error, ")  # pydantic's prefix for our own checks
    return f"{param or 'body'}: {why}" + (f" (got {first['input']!r:.80})" if shown else ""), param


def _add_status_routes(app: FastAPI, server: _Server) -> None:
    """/health, /v1/models and /metrics: each 503 until the engine is loaded."""
    @app.get("/health")
    async def health():
        server.ready()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        server.ready()
        return {"object": "list", "data": [{"id": server.model, "object": "model", "created": 0, "owned_by": "llmc",
                                            "max_model_len": server.engine.llm.max_context,
                                            "vocab_size": server.engine.llm.engine.spec.vocab_size}]}

    @app.get("/metrics")
    async def metrics():
        server.ready()
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _add_completion_routes(app: FastAPI, server: _Server) -> None:
    """/v1/completions and /v1/chat/completions."""
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        rid, streams = await server.start(body, body.prompts, 16)
        return await _respond(server, request, body, rid, streams, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        engine = server.ready()
        if server.template is None:
            raise HttpError(400, "this engine has no chat template; start the server with --chat-template FILE",
                            "messages")
        llm = engine.llm
        render = functools.partial(server.template.prompt, llm, [m.model_dump(exclude_none=True)
                                                                 for m in body.messages], body.chat_template_kwargs)
        try:
            prompt = await tokenizing(render, sum(len(m.content or "") for m in body.messages))
        except RequestError as exc:
            raise _refused(exc, "", body.token_limit_field, "messages") from None
        rid, streams = await server.start(body, [prompt], max(1, llm.max_context - len(prompt.ids)))
        return await _respond(server, request, body, rid, streams, chat=True)


async def _respond(server: _Server, request: Request, body: _Sampling, rid: str, streams, chat: bool):
    """The response to a request whose streams started: server-sent events as the tokens come, or
    (not streaming) one body once every choice finished."""
    head = _Head(rid, "chat.completion" if chat else "text_completion", int(time.time()), server.model)
    if body.stream:
        return _EventStream(_events(server, body, head, streams, chat))
    return await _whole_response(server, request, body, head, streams, chat)


@dataclass(frozen=True)
class _Head:
    """What every chunk, or the whole response, of a request starts with."""

    id: str
    object: str
    created: int
    model: str


def _usage(body: _Sampling, outs: dict[int, RequestOutput]) -> dict:
    """OpenAI's usage: each prompt as the engine tokenized it, once (not per choice)."""
    prompt = sum(len(o.prompt_token_ids) for index, o in outs.items() if index % body.n == 0)
    completion = sum(len(o.token_ids) for o in outs.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _events(server: _Server, body: _Sampling, head: _Head, streams, chat: bool) -> AsyncIterator[bytes]:
    """The event stream's chunks: each choice's new text as it comes, then the usage (if asked
    for) and [DONE]; closing it aborts what is unfinished (a client that went away)."""
    tokenizer = server.engine.llm.tokenizer
    # Every event is this prefix and one choice: only the choice is encoded per token.
    prefix = (f'data: {{"id": {json.dumps(head.id)}, "object": "{head.object}{".chunk" if chat else ""}", '
              f'"created": {head.created}, "model": {json.dumps(head.model)}, ').encode()
    choices = server.choices(streams)
    latest: dict[int, RequestOutput] = {}  # each choice's newest snapshot
    try:
        first = [True] * len(streams)
        sent = [0] * len(streams)  # log-probabilities already streamed, per choice
        at = [0] * len(streams)  # characters of token text already streamed, per choice
        async for ready in choices:
            written = []
            for index, out in ready:
                latest[index] = out
                logprobs = None
                if out.logprobs is not None:
                    logprobs = _logprobs(tokenizer, out.logprobs[sent[index]:], chat, at[index])
                    sent[index] = len(out.logprobs)
                    if not chat:
                        at[index] += sum(map(len, logprobs["tokens"]))
                choice = _chunk_choice(index, out, logprobs, chat, first[index])
                first[index] = False
                written.append(b'%s"choices": [%s]}\n\n' % (prefix, json.dumps(choice).encode()))
            yield b"".join(written)  # one write for all that were ready
        if body.include_usage:
            counts = json.dumps(_usage(body, latest)).encode()
            yield b'%s"choices": [], "usage": %s}\n\n' % (prefix, counts)
        yield b"data: [DONE]\n\n"
    finally:
        await choices.aclose()  # a client that went away: abort what is unfinished


def _chunk_choice(index: int, out: RequestOutput, logprobs: dict | None, chat: bool, first: bool) -> dict:
    """One choice of a streamed chunk: chat's delta (with the role in the choice's first) or the text."""
    finish = _finish_reason(out)
    if chat:
        delta = {"role": "assistant", "content": out.delta} if first else {"content": out.delta}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return {"index": index, "text": out.delta, "logprobs": logprobs, "finish_reason": finish}


async def _whole_response(server: _Server, request: Request, body: _Sampling, head: _Head, streams, chat: bool):
    """The body once every choice finished: 499 if the client went away first, 500 if a request failed."""
    finals = await _finished_outputs(server, request, streams)
    if len(finals) < len(streams):
        return Response(status_code=499)  # the client went away; nobody reads this
    errors = [o.error for o in finals.values() if o.finish_reason == "error"]
    if errors:
        raise HttpError(500, errors[0], kind="server_error")
    tokenizer = server.engine.llm.tokenizer
    results = []
    for index in range(len(streams)):
        out = finals[index]
        logprobs = None if out.logprobs is None else _logprobs(tokenizer, out.logprobs, chat)
        if chat:
            results.append({"index": index, "message": {"role": "assistant", "content": out.text},
                            "logprobs": logprobs, "finish_reason": _finish_reason(out)})
        else:
            results.append({"index": index, "text": out.text, "logprobs": logprobs,
                            "finish_reason": _finish_reason(out)})
    return {"id": head.id, "object": head.object, "created": head.created, "model": head.model, "choices": results,
            "usage": _usage(body, finals)}


async def _finished_outputs(server: _Server, request: Request, streams) -> dict[int, RequestOutput]:
    """Each choice's final output, by index, collected until all finish or the client goes away
    (then fewer: the unfinished ones are aborted)."""
    finals: dict[int, RequestOutput] = {}
    choices = server.choices(streams)

    async def collect():
        async for ready in choices:
            finals.update((index, out) for index, out in ready if out.finished)

    # The body is read: what the request receives next is the disconnect, when it comes.
    task, watch = asyncio.create_task(collect()), asyncio.create_task(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    finally:
        await choices.aclose()
    return finals


async def _disconnected(receive) -> None:
    """Returns once the ASGI connection reports that its client went away."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _EventStream(Response):
    """A server-sent event stream, written a chunk at a time. One task waits for the client's
    disconnect and cancels the writer, whose chunks' generator then closes (aborting the request).
    Starlette's StreamingResponse does the same in an anyio task group, which cost the event loop
    more per request (docs/serve_overhead.md, "the server's Python per request")."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes]):
        self.chunks, self.status_code, self.background = chunks, 200, None
        self.init_headers()

    async def __call__(self, scope, receive, send) -> None:
        writer, streaming, gone = asyncio.current_task(), True, False

        async def watch() -> None:
            nonlocal gone
            await _disconnected(receive)
            gone = True
            if streaming:  # the writer waits inside the stream: the cancellation lands there
                writer.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            streaming = False
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            writer.uncancel()
        except OSError:  # ASGI 2.4 servers raise it from send once the client is gone
            pass
        finally:
            streaming = False
            watcher.cancel()
            await self.chunks.aclose()


def _logprobs(tokenizer, entries, chat: bool, at: int = 0) -> dict:
    """OpenAI's logprobs object of these tokens: chat's `content` list, or completions' columns,
    whose `text_offset` counts from `at` (the token text a stream already sent, as vLLM counts).
    A token's text is what it decodes to alone."""
    def text(token: int) -> str:
        return tokenizer.decode([token], skip_special_tokens=False)

    if chat:
        def item(token: int, logprob: float) -> dict:
            t = text(token)
            return {"token": t, "logprob": logprob, "bytes": list(t.encode())}

        return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]}
                            for e in entries]}
    tokens = [text(e.token) for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(i): lp for i, lp in e.top} for e in entries], "text_offset": offsets}


def _finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finish_reason in (None, "stop", "length") else "stop"
