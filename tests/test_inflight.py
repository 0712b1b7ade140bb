"""In-flight batching: outputs identical to running alone, prefix caching, preemption, abort."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from conftest import settle_async
from llmc.errors import LlmcError, RequestError
from llmc.runtime.async_llm import AsyncLLM
from llmc.runtime.llm import LLM
from llmc.runtime.sampling import SamplingParams

# Small chunks and budget so prompts are split and steps mix decodes with prefill chunks.
SMALL = dict(max_num_seqs=8, max_num_batched_tokens=24, chunk_size=16)


def _workload(n: int, seed: int, vocab: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, int(rng.integers(3, 70))).tolist() for _ in range(n)]
    params = [SamplingParams(max_tokens=int(rng.integers(4, 30)), ignore_eos=True) for _ in range(n)]
    arrivals = sorted(int(a) for a in rng.integers(0, 40, n))
    return prompts, params, arrivals


def _alone(engine_dir, prompts, params):
    llm = LLM(engine_dir, enable_prefix_caching=False)
    return [llm.generate(p, sp).token_ids for p, sp in zip(prompts, params)]


def _run_arrivals(llm: LLM, prompts, params, arrivals):
    outputs, step = {}, 0
    pending = list(range(len(prompts)))
    while pending or llm.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            outputs[i] = llm.output(llm.add_request(prompts[i], params[i]))
        llm.step()
        step += 1
        llm.blocks.check([r.block_table for r in llm.scheduler.running])
    return outputs


def test_24_requests_in_flight_match_running_alone(llama_engine):
    llm = LLM(llama_engine, **SMALL)
    prompts, params, arrivals = _workload(24, seed=0, vocab=llm.engine.spec.vocab_size)
    assert max(len(p) for p in prompts) > SMALL["chunk_size"]
    outputs = _run_arrivals(llm, prompts, params, arrivals)
    expected = _alone(llama_engine, prompts, params)
    for i in range(len(prompts)):
        assert outputs[i].token_ids == expected[i], i
        assert outputs[i].finish_reason == "length"
        m = outputs[i].metrics
        assert m.queue_time >= 0 and m.ttft >= m.queue_time and len(m.itl) == len(m.token_times) - 1
    assert llm.blocks.num_free == llm.blocks.capacity
    llm.blocks.check([])


def test_shared_system_prompt_hits_the_prefix_cache(llama_engine):
    system = "You are a helpful assistant. Answer briefly and precisely, citing sources where possible. "
    questions = ["What is paging?", "Why batch decodes?", "Explain prefix caching.", "What is a block?"]
    prompts = [system + q for q in questions]
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def run(caching: bool):
        llm = LLM(llama_engine, enable_prefix_caching=caching)
        outs = [llm.generate(p, params) for p in prompts]  # one after another: later ones can hit
        return outs, llm

    cached, llm_on = run(True)
    plain, llm_off = run(False)
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    assert cached[0].prefix_hit_tokens == 0
    assert all(o.prefix_hit_tokens > 0 for o in cached[1:])
    assert llm_on.blocks.stats.hit_tokens == sum(o.prefix_hit_tokens for o in cached)
    assert llm_on.core.computed_tokens < llm_off.core.computed_tokens


def test_small_pool_preempts_and_still_matches(llama_engine):
    llm = LLM(llama_engine, kv_cache_blocks=25, **SMALL)  # 24 usable blocks of 4 tokens
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, llm.engine.spec.vocab_size, int(rng.integers(20, 40))).tolist() for _ in range(8)]
    params = [SamplingParams(max_tokens=int(rng.integers(20, 40)), ignore_eos=True) for _ in prompts]
    outputs = _run_arrivals(llm, prompts, params, [0] * len(prompts))
    assert llm.scheduler.num_preemptions > 0
    assert sum(o.preemptions for o in outputs.values()) == llm.scheduler.num_preemptions
    assert [outputs[i].token_ids for i in range(len(prompts))] == _alone(llama_engine, prompts, params)
    assert llm.blocks.num_free == llm.blocks.capacity


def test_abort_mid_stream_frees_blocks(llama_engine):
    llm = LLM(llama_engine)
    keep = llm.add_request("a request that keeps going", SamplingParams(max_tokens=20, ignore_eos=True))
    gone = llm.add_request("a request that will be aborted", SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(5):
        llm.step()
    held = llm.blocks.num_free
    out = llm.output(gone)
    assert llm.abort(gone)
    assert out.finish_reason == "abort" and llm.blocks.num_free > held
    llm.blocks.check([r.block_table for r in llm.scheduler.running])
    while llm.has_unfinished():
        llm.step()
    assert not llm.abort(keep)  # already finished
    assert llm.blocks.num_free == llm.blocks.capacity


def test_request_that_can_never_fit_is_rejected_and_others_carry_on(llama_engine):
    llm = LLM(llama_engine, kv_cache_blocks=9)  # 8 usable blocks = 32 tokens
    ok = [llm.add_request("short one", SamplingParams(max_tokens=8, ignore_eos=True)),
          llm.add_request("short two", SamplingParams(max_tokens=8, ignore_eos=True))]
    with pytest.raises(RequestError, match="KV blocks"):
        llm.add_request("far too long for this pool", SamplingParams(max_tokens=100))
    outs = [llm.output(r) for r in ok]
    while llm.has_unfinished():
        llm.step()
    assert all(len(o.token_ids) == 8 for o in outs)


@pytest.mark.parametrize("option,value", [
    ("max_num_seqs", 0), ("max_num_batched_tokens", -5), ("chunk_size", 0),
    ("enable_prefix_caching", "yes"), ("kv_cache_blocks", 1),
])
def test_invalid_options_name_the_option(llama_engine, option, value):
    with pytest.raises(LlmcError, match=option):
        LLM(llama_engine, **{option: value})


def test_unknown_option(llama_engine):
    with pytest.raises(LlmcError, match="unknown option 'max_batch'"):
        LLM(llama_engine, max_batch=4)


def test_async_llm_streams_concurrently_and_aborts(llama_engine):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    expected = LLM(llama_engine).generate(["first prompt", "second prompt"], params)

    async def main():
        engine = AsyncLLM(llama_engine)
        streams = [await engine.add_request(p, params) for p in ("first prompt", "second prompt")]
        long = await engine.add_request("to be aborted", SamplingParams(max_tokens=200, ignore_eos=True))

        async def collect(stream, abort_after=None):
            seen, text = [], ""
            async for out in stream:
                seen.append(out)
                text += out.delta
                if abort_after is not None and len(seen) == abort_after:
                    engine.abort(out.request_id)
            return seen, text

        results = await asyncio.gather(*(collect(s) for s in streams), collect(long, abort_after=3))
        await settle_async(engine)  # every block back in the pool
        return engine, results

    engine, results = asyncio.run(main())
    for (seen, text), exp in zip(results[:2], expected):
        assert seen[-1].token_ids == exp.token_ids and seen[-1].finished
        assert text == exp.text
        assert len(seen) == 16  # one snapshot per token
    aborted, _ = results[2]
    assert aborted[-1].finish_reason == "abort" and len(aborted[-1].token_ids) < 200


def test_backend_failure_fails_the_step_not_the_engine(llama_engine, monkeypatch):
    llm = LLM(llama_engine)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    victim = llm.output(llm.add_request("this one hits a broken backend", params))
    real_run = llm.engine._run  # the session call every step goes through

    def broken(*args):
        raise RuntimeError("simulated ORT failure\nwith a second line")

    monkeypatch.setattr(llm.engine, "_run", broken)
    llm.step()
    assert victim.finish_reason == "error" and "simulated ORT failure" in victim.error
    assert "\n" not in victim.error
    assert llm.blocks.num_free == llm.blocks.capacity and not llm.has_unfinished()
    monkeypatch.setattr(llm.engine, "_run", real_run)
    assert len(llm.generate("the engine still serves", params).token_ids) == 6


def test_auto_ids_never_collide_with_chosen_ones(llama_engine):
    llm = LLM(llama_engine)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    chosen = llm.add_request("mine", params, request_id="req-1")
    auto = [llm.add_request("auto", params) for _ in range(3)]
    assert len({chosen, *auto}) == 4
    outs = [llm.output(r) for r in (chosen, *auto)]
    while llm.has_unfinished():
        llm.step()
    assert all(len(o.token_ids) == 2 for o in outs)


def test_async_loop_failure_ends_streams_instead_of_hanging(llama_engine, monkeypatch):
    async def main():
        engine = AsyncLLM(llama_engine)

        def broken():
            raise RuntimeError("scheduler exploded")

        monkeypatch.setattr(engine.llm, "step", broken)
        stream = await engine.add_request("hello", SamplingParams(max_tokens=4))
        return engine, await asyncio.wait_for(_last(stream), timeout=10)

    async def _last(stream):
        out = None
        async for out in stream:
            pass
        return out

    engine, last = asyncio.run(main())
    assert last.finish_reason == "error" and "scheduler exploded" in last.error
    assert engine.llm.blocks.num_free == engine.llm.blocks.capacity and not engine.llm.has_unfinished()
