"""AsyncLLM: an asyncio front for servers.

The engine steps in a thread of its own (a step is numpy + ONNX Runtime, which release the GIL)
and hands each step's results to the event loop, which stays free to accept requests and streams
one step's tokens while the next step computes. Each request gets an async iterator of
RequestOutput snapshots (cumulative tokens and text, plus the `delta` text since the previous
snapshot: one token's, so a speculative step that keeps several tokens yields several snapshots);
`abort` ends its stream at once.

The loop never waits for a step. New requests are validated on the loop and handed to the engine
thread, which queues them before its next step; an abort while a step runs ends the stream with
what it was sent and frees the blocks before the next step (between steps, at once). Waiting on
the engine's lock instead held the loop, and every stream it serves, for whole steps
(docs/serve.md, "Under load and faults").

Every stream ends with a finished snapshot ("stop", "length", "abort" or "error"). A stream is
closed exactly when its final snapshot is queued, by whichever comes first: the step result that
finishes the request, an abort, or an engine failure. A step's results can reach the loop after
an abort (they are dropped); an abort that comes after the step in flight finished the request
returns False, and that step's result ends the stream. `on_finish` sees each final snapshot, read
or not: what a server counts, since a consumer that leaves early never reads its stream's last.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import functools
import threading
from pathlib import Path
from typing import Callable, Sequence

from llmc.errors import RequestError, first_line
from llmc.runtime.llm import LLM
from llmc.runtime.prompts import LONG_TEXT, Prompt
from llmc.runtime.request import RequestOutput
from llmc.runtime.sampling import SamplingParams


class _Stream:
    def __init__(self, out: RequestOutput):
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.out = out  # the live output, for the last snapshot when no step result will come
        self.last = _copy(out)  # the newest snapshot queued
        self.sent = 0  # characters of text the queued deltas carry


class AsyncLLM:
    def __init__(self, engine_dir: str | Path, **options):
        self.llm = LLM(engine_dir, **options)
        self._lock = threading.Lock()  # held by the engine thread for a step; the loop only tries it
        self._streams: dict[str, _Stream] = {}  # open streams; changed on the loop only
        # ("add", Request, _Stream) and ("abort", request id, live output), from the loop to the
        # engine thread, which takes them before each step (deque appends and pops are atomic).
        self._commands: collections.deque = collections.deque()
        self._wake = threading.Event()  # set when there may be work for the engine thread
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # where step results are delivered
        # Called on the loop with every stream's final snapshot as it is queued, whoever reads it.
        self.on_finish: Callable[[RequestOutput], None] | None = None

    async def add_request(self, prompt: str | Sequence[int] | Prompt, params: SamplingParams | None = None,
                          request_id: str | None = None) -> "RequestStream":
        """Queue a request (validation errors raise here) and return its stream of outputs."""
        prompt = await self.tokenize(prompt)
        if request_id is not None and request_id in self._streams:  # queued, not yet known to the engine
            raise RequestError(f"request id {request_id!r} is already in use; pass a unique id")
        request = self.llm.make_request(prompt, params or SamplingParams(), request_id)
        rid = request.request_id
        stream = self._streams[rid] = _Stream(request.out)
        self._commands.append(("add", request, stream))
        self._loop = asyncio.get_running_loop()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._engine, name="llmc-engine", daemon=True)
            self._thread.start()
        self._wake.set()
        return RequestStream(self, rid, stream)

    async def tokenize(self, prompt: str | Sequence[int] | Prompt) -> Prompt:
        """LLM.tokenize, off the loop when the text is long (see `tokenizing`)."""
        return await tokenizing(functools.partial(self.llm.tokenize, prompt),
                                len(prompt) if isinstance(prompt, str) else 0)

    @property
    def num_waiting(self) -> int:
        """Requests not yet scheduled, those the engine thread has not taken yet included."""
        return len(self.llm.scheduler.waiting) + sum(c[0] == "add" for c in tuple(self._commands))

    def abort(self, request_id: str) -> bool:
        """Stop a request; its stream ends at once with an "abort" snapshot, and its blocks are
        freed now or, while a step runs, before the next one. False if it is unknown or already
        finished (its stream then still gets its final snapshot)."""
        stream = self._streams.get(request_id)
        if stream is None or stream.out.finished:
            return False
        if self._lock.acquire(blocking=False):  # between steps: the live output holds still
            try:
                if stream.out.finished:
                    return False
                self.llm.abort(request_id)  # False when the engine thread has not taken it yet: it drops it
                self._end(request_id)
            finally:
                self._lock.release()
        else:  # the step in flight may still add tokens: the stream ends with those it was sent
            self._commands.append(("abort", request_id, stream.out))
            self._end(request_id, sent_only=True)
            self._wake.set()
        return True

    def _end(self, rid: str, error: str | None = None, sent_only: bool = False) -> None:
        """Queue a stream's last snapshot, from its live output (or the last one it was sent),
        and close the stream."""
        stream = self._streams.pop(rid)
        out = _copy(stream.last if sent_only else stream.out)
        out.delta = out.text[stream.sent:]  # also the text of a step result that will be dropped
        if error is not None and out.finish_reason in (None, "abort"):
            out.finish_reason, out.error = "error", error
        elif out.finish_reason is None:  # aborted before the engine took it, or while a step runs
            out.finish_reason = "abort"
        self._queue_final(stream, out)

    def _queue_final(self, stream: _Stream, out: RequestOutput) -> None:
        stream.queue.put_nowait(out)
        if self.on_finish is not None:
            self.on_finish(out)

    def _fail_all(self, message: str) -> None:
        for rid in list(self._streams):
            try:
                with self._lock:
                    self.llm.abort(rid)
            except Exception:  # the engine is already broken; ending the stream is what matters
                pass
            self._end(rid, error=message)

    def _engine(self) -> None:
        """The engine thread: steps while there is work and hands each step's snapshots to the
        loop, so the next step computes while the loop streams the last one's tokens."""
        while True:
            self._wake.wait()
            self._wake.clear()
            while True:
                try:
                    results = self._step()
                except Exception as exc:  # ends every open stream rather than leave its consumer waiting
                    results = exc
                if results is None:
                    break
                try:
                    self._loop.call_soon_threadsafe(self._deliver, results)
                except RuntimeError:  # the loop is closed: nobody is left to stream to
                    break
                if isinstance(results, Exception):
                    break

    def _step(self) -> list[tuple[RequestOutput, RequestOutput]] | None:
        """One engine step's (live output, snapshot) pairs; None when there is nothing to do."""
        with self._lock:
            self._take_commands()
            if not self.llm.has_unfinished():
                return None
            return [(r.out, snapshot) for r in self.llm.step() for snapshot in self._snapshots(r)]

    def _take_commands(self) -> None:
        """The loop's new requests and aborts, in the order it gave them (an id can be reused)."""
        while self._commands:
            kind, subject, other = self._commands.popleft()
            if kind == "add":
                if self._streams.get(subject.request_id) is other:  # not aborted while queued
                    self.llm.enqueue(subject)
            elif self.llm.output(subject) is other:  # still that request, unfinished
                self.llm.abort(subject)

    @staticmethod
    def _snapshots(request) -> list[RequestOutput]:
        """A step's snapshots of a request: one per token's text (a speculative step gives several),
        the last one carrying how the request ended."""
        pieces = request.deltas() or [""]
        snapshots = []
        for i, piece in enumerate(pieces):
            out = _copy(request.out)
            out.delta = piece
            if i < len(pieces) - 1:
                out.finish_reason = out.error = None
            snapshots.append(out)
        return snapshots

    def _deliver(self, results) -> None:
        """On the loop: queue a step's snapshots to their streams."""
        if isinstance(results, Exception):
            self._fail_all(f"engine loop failed: {first_line(results)}")
            return
        for live, out in results:
            stream = self._streams.get(out.request_id)
            if stream is None or stream.out is not live:  # aborted while the step ran (its id may be reused)
                continue
            stream.sent += len(out.delta)
            stream.last = out
            if out.finished:
                del self._streams[out.request_id]
                self._queue_final(stream, out)
            else:
                stream.queue.put_nowait(out)


class RequestStream:
    """One request's snapshots, an async iterator. `aclose()` before the final snapshot aborts the
    request, read or not (an unstarted async generator's aclose would run nothing), and so does
    dropping an unfinished stream."""

    def __init__(self, engine: AsyncLLM, request_id: str, stream: _Stream):
        self.request_id = request_id
        self._engine, self._stream, self._done = engine, stream, False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        out = await self._stream.queue.get()
        self._done = out.finished
        return out

    def ready(self) -> list[RequestOutput]:
        """The snapshots already queued, taken without waiting: what a consumer that fell behind
        can hand on together (a server writes them to its socket at once)."""
        queue, outs = self._stream.queue, []
        while not self._done and not queue.empty():
            out = queue.get_nowait()
            self._done = out.finished
            outs.append(out)
        return outs

    async def aclose(self) -> None:
        self._close()

    def _close(self) -> None:
        self._done = True
        if self._engine._streams.get(self.request_id) is self._stream:  # still open: nobody will read the rest
            self._engine.abort(self.request_id)

    def __del__(self):  # may run in any thread: the abort goes to the loop
        loop = self._engine._loop
        if not self._done and loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._close)
            except RuntimeError:  # the loop closed meanwhile
                pass


async def tokenizing(call: Callable[[], Prompt], chars: int) -> Prompt:
    """call(), which tokenizes `chars` characters: in a worker thread from LONG_TEXT up, since
    megabytes take seconds, for which neither the event loop nor the engine thread should wait."""
    return await asyncio.to_thread(call) if chars >= LONG_TEXT else call()


def _copy(out: RequestOutput) -> RequestOutput:
    """A snapshot of a live output: its lists go on growing in the engine thread."""
    snapshot = copy.copy(out)
    snapshot.token_ids = list(out.token_ids)
    if out.logprobs is not None:
        snapshot.logprobs = list(out.logprobs)
    return snapshot
