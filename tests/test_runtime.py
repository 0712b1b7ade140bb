"""Runtime behaviour: streaming, stop conditions, metrics, sampling seeds, KV pool integrity."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from llmc.runtime.llm import LLM
from llmc.runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def llm(llama_engine):
    return LLM(llama_engine)


def test_stream_deltas_concatenate_to_generate_text(llm):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    stream = llm.stream("Once upon a time", params)
    pieces = list(stream)
    full = llm.generate("Once upon a time", params)
    assert "".join(pieces) == full.text == stream.output.text
    assert stream.output.token_ids == full.token_ids
    assert len(pieces) > 1  # it streamed, not one blob at the end


def test_max_tokens_and_metrics(llm):
    out = llm.generate("Hello world", SamplingParams(max_tokens=7, ignore_eos=True))
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    m = out.metrics
    assert len(m.token_times) == 7 and len(m.itl) == 6
    assert 0 < m.ttft <= m.e2e
    assert m.tpot == pytest.approx((m.e2e - m.ttft) / 6)
    assert m.queue_time is not None and m.queue_time >= 0


def test_stop_token_and_eos(llm):
    free_run = llm.generate("Hello world", SamplingParams(max_tokens=12, ignore_eos=True))
    stop_at = free_run.token_ids[4]
    first = free_run.token_ids.index(stop_at)
    out = llm.generate("Hello world", SamplingParams(max_tokens=12, stop_token_ids=(stop_at,)))
    assert out.token_ids == free_run.token_ids[: first + 1] and out.finish_reason == "stop"


def test_stop_string_truncates_and_streams_nothing_past_it(llm):
    free_run = llm.generate("The weather today", SamplingParams(max_tokens=24, ignore_eos=True))
    text = free_run.text
    start = next(i for i in range(len(text) // 2, len(text) - 3)
                 if text[i:i + 3].strip() and "\ufffd" not in text[i:i + 3])
    stop = text[start:start + 3]
    params = SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,))
    out = llm.generate("The weather today", params)
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert "".join(llm.stream("The weather today", params)) == out.text


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate("Sample me", params).token_ids
    again = llm.generate("Sample me", params).token_ids
    other = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    batched = llm.generate(["Something else entirely", "Sample me"], [other, params])[1].token_ids
    assert alone == again == batched
    different = llm.generate("Sample me", SamplingParams(max_tokens=16, temperature=0.8, seed=99, ignore_eos=True))
    assert different.token_ids != alone


def test_pool_is_whole_after_runs_and_abandoned_streams(llm):
    blocks = llm.blocks
    llm.generate(["a", "bb bb", "ccc ccc ccc"], SamplingParams(max_tokens=9, ignore_eos=True))
    assert blocks.num_free == blocks.capacity
    stream = iter(llm.stream("abandon me", SamplingParams(max_tokens=40, ignore_eos=True)))
    next(stream)
    assert blocks.num_free < blocks.capacity  # it holds blocks while running
    stream.close()
    assert blocks.num_free == blocks.capacity


def test_cache_writes_land_in_place(llm):
    """The pool the session writes is the numpy array the runtime owns (IOBinding aliasing)."""
    engine = llm.engine
    pool = engine.pool(0)
    pool[:, 1:] = 0.0
    llm.generate("write me", SamplingParams(max_tokens=3, ignore_eos=True))
    assert np.abs(pool[:, 1:]).sum() > 0


def test_runtime_imports_stay_lean():
    code = ("import sys, llmc; from llmc.runtime.llm import LLM; "
            "bad = [m for m in ('torch', 'transformers', 'llmc.compiler', 'llmc.passes', 'onnx', 'llmc.bench', "
            "'matplotlib') if m in sys.modules]; "
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""
