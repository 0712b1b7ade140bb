"""AsyncLLM: an asyncio front for servers.

The engine loop runs in a worker thread (a step is numpy + ONNX Runtime, which release the GIL),
so the event loop stays free to accept requests. Each request gets an async iterator of
RequestOutput snapshots (cumulative tokens and text, plus the `delta` text since the previous
snapshot); `abort` frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from pathlib import Path
from typing import AsyncIterator, Sequence

from llmc.errors import first_line
from llmc.runtime.llm import LLM
from llmc.runtime.request import RequestOutput
from llmc.runtime.sampling import SamplingParams


class AsyncLLM:
    def __init__(self, engine_dir: str | Path, **options):
        self.llm = LLM(engine_dir, **options)
        self._lock = threading.Lock()  # the scheduler is touched by the worker thread and the loop
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop_task: asyncio.Task | None = None

    async def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                          request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request (validation errors raise here) and return its stream of outputs."""
        with self._lock:
            rid = self.llm.add_request(prompt, params, request_id)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        return self._outputs(rid, queue)

    def abort(self, request_id: str) -> bool:
        with self._lock:
            output = self.llm.output(request_id)
            aborted = self.llm.abort(request_id)
        queue = self._queues.pop(request_id, None)
        if aborted and queue is not None:
            queue.put_nowait(copy.copy(output))  # the final, aborted snapshot ends the stream
        return aborted

    def _fail_all(self, message: str) -> None:
        for rid in list(self._queues):
            with self._lock:
                output = self.llm.output(rid)
                self.llm.abort(rid)
            if output is not None:
                output.finish_reason, output.error = "error", message
                self._queues.pop(rid).put_nowait(copy.copy(output))

    async def _outputs(self, rid: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        while True:
            out = await queue.get()
            yield out
            if out.finished:
                return

    def _step(self):
        with self._lock:
            return [(r.request_id, self._snapshot(r)) for r in self.llm.step()]

    @staticmethod
    def _snapshot(request) -> RequestOutput:
        out = copy.copy(request.out)
        out.token_ids = list(out.token_ids)
        out.delta = request.delta()
        return out

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self.llm.has_unfinished():
            try:
                results = await loop.run_in_executor(None, self._step)
            except Exception as exc:  # end every open stream rather than leave its consumer waiting
                self._fail_all(f"engine loop failed: {first_line(exc)}")
                return
            for rid, out in results:
                queue = self._queues.get(rid)
                if queue is not None:
                    queue.put_nowait(out)
                    if out.finished:
                        del self._queues[rid]
