"""AsyncLLM streams always end (finished, aborted or failed), whatever consumers and aborts do,
and leave no request or KV block behind.

Each test runs under asyncio.wait_for, so a stream that never ends fails it instead of hanging CI.
"""

from __future__ import annotations

import asyncio
import threading
import random

import pytest

from conftest import settle_async as _settle
from llmc.errors import RequestError
from llmc.runtime.async_llm import AsyncLLM
from llmc.runtime.prompts import LONG_TEXT
from llmc.runtime.sampling import SamplingParams

TIMEOUT = 30  # seconds; each workload takes about one


def _run(main):
    async def guarded():
        try:
            return await asyncio.wait_for(main(), TIMEOUT)
        except asyncio.TimeoutError:
            pytest.fail(f"a stream did not end within {TIMEOUT}s")
    return asyncio.run(guarded())


class Boom(Exception):
    pass


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_stream_ends_under_random_aborts_and_failing_consumers(llama_engine, seed):
    rng = random.Random(seed)
    shared = "A shared system prompt that spans several KV blocks."
    jobs = []
    for i in range(150):
        prompt = rng.choice([f"{shared} question {i}", f"prompt {i}", [rng.randrange(1, 200) for _ in range(5)]])
        behaviour = rng.choice(["read", "read", "abort_at_end", "abort_early", "raise", "close"])
        jobs.append((f"s{i}", prompt, rng.randint(1, 24), behaviour, rng.randint(1, 3)))
    aborted: set[str] = set()  # ids whose abort() returned True
    finals: dict[str, tuple] = {}  # id -> (last snapshot, joined deltas, max_tokens) of streams read to the end
    live: set[str] = set()  # streams their consumer did not close (one that raised leaves its stream open)
    closed: dict[str, tuple] = {}  # id -> (live output, its token count at the close, max_tokens)

    async def main():
        engine = AsyncLLM(llama_engine)

        def abort(rid):
            if engine.abort(rid):
                aborted.add(rid)

        async def abort_soon(rid):
            # lands while the step that finishes the request is running, or just after it
            await asyncio.sleep(rng.random() * 0.003)
            abort(rid)

        async def consume(rid, prompt, max_tokens, behaviour, k):
            stream = await engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), rid)
            live.add(rid)
            seen, text, out = 0, "", None
            if behaviour == "abort_at_end" and max_tokens == 1:
                await abort_soon(rid)
            async for out in stream:
                seen, text = seen + 1, text + out.delta
                if behaviour == "abort_at_end" and len(out.token_ids) == max_tokens - 1:
                    await abort_soon(rid)
                elif behaviour == "abort_early" and seen == k:
                    abort(rid)
                elif behaviour == "raise" and seen == k and not out.finished:
                    raise Boom  # the stream is left unclosed; its finalizer aborts the request
                elif behaviour == "close" and seen == k and not out.finished:
                    if rid in engine._streams:  # not already ended (aborted, or its final snapshot queued)
                        request = engine._streams[rid].out
                        closed[rid] = (request, len(request.token_ids), max_tokens)
                    await stream.aclose()
                    live.discard(rid)
                    return
            live.discard(rid)
            finals[rid] = (out, text, max_tokens)

        async def consumer(*job):
            try:
                await consume(*job)
            except Boom:
                pass

        async def outside_aborter():
            while True:
                await asyncio.sleep(rng.random() * 0.003)
                if live:
                    abort(rng.choice(sorted(live)))
                engine.abort("no such request")

        aborter = asyncio.create_task(outside_aborter())
        await asyncio.gather(*(consumer(*job) for job in jobs))
        aborter.cancel()
        await _settle(engine)

    _run(main)
    for rid, (request, at_close, max_tokens) in closed.items():  # at most the step in flight ran on
        assert request.finish_reason == "abort" or len(request.token_ids) == max_tokens, rid
        assert len(request.token_ids) <= at_close + 1, rid
    for rid, (out, text, max_tokens) in finals.items():
        assert out.finished and text == out.text, rid
        if rid in aborted:
            assert out.finish_reason == "abort" and len(out.token_ids) < max_tokens, rid
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == max_tokens, rid
    assert aborted and closed and len(finals) > len(jobs) // 2  # the workload did what it says


@pytest.mark.parametrize("abort_at,expect", [(3, "length"), (2, "abort")])
def test_abort_racing_the_step_in_flight(llama_engine, abort_at, expect):
    """abort() runs on the loop after a step produced `abort_at` tokens but before its results
    arrive: when that step finished the request, the stream still gets its final snapshot; when
    not, the abort snapshot carries the dropped result's text."""
    async def main():
        engine = AsyncLLM(llama_engine)
        loop = asyncio.get_running_loop()
        real_step, answers = engine._step, []

        def step():
            results = real_step()
            for _, out in results or ():  # queued on the loop ahead of the step's results
                if len(out.token_ids) == abort_at:
                    aborted = threading.Event()

                    def abort(rid=out.request_id):
                        answers.append(engine.abort(rid))
                        aborted.set()

                    loop.call_soon_threadsafe(abort)
                    aborted.wait(10)  # the engine thread steps again only after the abort landed
            return results

        engine._step = step
        stream = await engine.add_request("hello there", SamplingParams(max_tokens=3, ignore_eos=True))
        outs = [out async for out in stream]
        await _settle(engine)
        return answers, outs

    answers, outs = _run(main)
    last = outs[-1]
    assert answers == [expect == "abort"]
    assert last.finish_reason == expect and len(last.token_ids) == abort_at
    assert "".join(o.delta for o in outs) == last.text


def test_the_loop_adds_and_aborts_while_a_step_runs(llama_engine):
    """A step can take a long time (a long prefill); requests that arrive meanwhile are accepted and
    aborts answered without waiting for it, and both take effect before the next step."""
    async def main():
        engine = AsyncLLM(llama_engine)
        backend = engine.llm.engine
        real_forward, in_step, release = backend.forward_rows, threading.Event(), threading.Event()

        def held_forward(*args):  # the first step's graph run, held until the test lets it go
            in_step.set()
            release.wait(TIMEOUT)
            return real_forward(*args)

        backend.forward_rows = held_forward
        first = await engine.add_request("the first", SamplingParams(max_tokens=4, ignore_eos=True))
        while not in_step.is_set():
            await asyncio.sleep(0.001)
        backend.forward_rows = real_forward  # the held run is the only one
        later = [await engine.add_request(f"later {i}", SamplingParams(max_tokens=4, ignore_eos=True), f"l{i}")
                 for i in range(3)]
        assert engine.num_waiting == 3
        assert engine.abort("l1") and not engine.abort("l1")
        gone = [out async for out in later[1]]
        assert [o.finish_reason for o in gone] == ["abort"] and not gone[0].token_ids
        release.set()
        outs = [[out async for out in s] for s in (first, later[0], later[2])]
        await _settle(engine)
        assert engine.llm.output("l1") is None and engine.num_waiting == 0
        return outs

    outs = _run(main)
    assert all(o[-1].finish_reason == "length" and len(o[-1].token_ids) == 4 for o in outs)


def test_closing_a_stream_early_aborts_its_request(llama_engine):
    async def main():
        engine = AsyncLLM(llama_engine)
        stream = await engine.add_request("a long answer", SamplingParams(max_tokens=200, ignore_eos=True))
        async for out in stream:
            break
        request = engine._streams[out.request_id].out
        at_close = len(request.token_ids)  # the engine thread may have stepped on since `out`
        await stream.aclose()
        await _settle(engine)  # the engine thread took the abort before its next step
        assert request.finish_reason == "abort" and len(request.token_ids) <= at_close + 1  # the step in flight

    _run(main)


def test_a_consumer_that_fell_behind_takes_every_queued_snapshot_at_once(llama_engine):
    """`ready()` hands over what is queued without waiting (a server writes it in one send): in
    order, up to and including the final snapshot, and nothing after it."""
    async def main():
        engine = AsyncLLM(llama_engine)
        stream = await engine.add_request("a long answer", SamplingParams(max_tokens=12, ignore_eos=True))
        while stream.request_id in engine._streams:  # open until its final snapshot is queued
            await asyncio.sleep(0.01)
        outs = [await anext(stream), *stream.ready()]
        await _settle(engine)
        return outs, stream.ready()

    outs, after = _run(main)
    assert [len(o.token_ids) for o in outs] == list(range(1, 13)) and outs[-1].finish_reason == "length"
    assert "".join(o.delta for o in outs) == outs[-1].text and after == []


def test_closing_or_dropping_an_unread_stream_aborts_its_request(llama_engine):
    """A server can close a request's streams before reading any (a client gone at once, a later
    choice rejected): that aborts them too, as does dropping one unclosed."""
    async def main():
        engine = AsyncLLM(llama_engine)
        finals = []
        engine.on_finish = finals.append
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        closed = await engine.add_request("closed unread", params, "closed")
        await closed.aclose()
        dropped = await engine.add_request("dropped unread", params, "dropped")
        del dropped
        await _settle(engine)
        return finals

    finals = _run(main)
    assert sorted((o.request_id, o.finish_reason) for o in finals) == [("closed", "abort"), ("dropped", "abort")]
    assert all(len(o.token_ids) < 200 for o in finals)


def test_engine_failure_ends_streams_including_ones_finished_in_the_failed_step(llama_engine):
    async def main():
        engine = AsyncLLM(llama_engine)
        real_step = engine.llm.step

        def step_then_fail():
            real_step()  # finishes the one-token request; its result is lost with the step
            raise RuntimeError("scheduler exploded")

        engine.llm.step = step_then_fail
        streams = [await engine.add_request(f"prompt {n}", SamplingParams(max_tokens=n, ignore_eos=True))
                   for n in (1, 50)]
        outs = [[out async for out in s] for s in streams]
        await _settle(engine)
        return [o[-1] for o in outs]

    short, long = _run(main)
    assert short.finish_reason == "length" and len(short.token_ids) == 1
    assert long.finish_reason == "error" and "scheduler exploded" in long.error


def test_a_long_prompt_tokenizes_off_the_loop_and_outside_the_engine_lock(llama_engine):
    """Tokenizing megabytes takes seconds: the event loop (other streams' deliveries) and the engine
    thread (which needs the lock to step) must not wait for it. Short prompts stay inline."""
    engine = AsyncLLM(llama_engine)
    seen = []
    tokenize = engine.llm.tokenize

    def spy(prompt):
        seen.append((len(prompt), threading.current_thread() is threading.main_thread(), engine._lock.locked()))
        return tokenize(prompt)

    engine.llm.tokenize = spy
    long_text = "a b " * (LONG_TEXT // 4 + 1)

    async def main():
        with pytest.raises(RequestError, match="max context"):
            await engine.add_request(long_text, SamplingParams(max_tokens=2))
        stream = await engine.add_request("short", SamplingParams(max_tokens=2, ignore_eos=True))
        assert len([out async for out in stream]) == 2
        await _settle(engine)

    _run(main)
    assert seen == [(len(long_text), False, False), (5, True, False)]
    # the long path (encode_batch, which releases the GIL) gives the ids the short one does
    assert engine.llm.encode(long_text) == engine.llm.tokenizer.encode(long_text).ids
