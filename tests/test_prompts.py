"""What a prompt may be: a non-empty str or a non-empty list of int token ids. Anything else is a
one-line RequestError on every entry point, never a TypeError from deep inside, nor silently
read as something else (bytes as token ids, "1" as token 1)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from llmc.errors import RequestError
from llmc.runtime.async_llm import AsyncLLM
from llmc.runtime.llm import LLM
from llmc.runtime.sampling import SamplingParams

FORMS = "a prompt may be a non-empty str, or a non-empty list of int token ids"
PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)

# (prompt, error it gets, whether generate() reads it as one prompt rather than a batch)
BAD = [
    pytest.param("a\ud800b", "unpaired surrogate '\\\\ud800' at index 1", True, id="lone-surrogate"),
    pytest.param(b"hello", "prompt is bytes; decode it to a str first", True, id="bytes"),
    pytest.param(None, "prompt is None", True, id="none"),
    pytest.param(3.5, "prompt is of type float", True, id="float"),
    pytest.param([1.5, 2.5], r"prompt token 0 is 1\.5 \(float\)", True, id="float-ids"),
    pytest.param([True, False], r"prompt token 0 is True \(bool\)", True, id="bool-ids"),
    pytest.param(["1", "2"], r"prompt token 0 is '1' \(str\)", False, id="str-ids"),
    pytest.param([5, None], r"prompt token 1 is None \(NoneType\)", True, id="none-id"),
    pytest.param([[1, 2]], r"prompt token 0 is \[1, 2\] \(list\)", False, id="nested-ids"),
    pytest.param(np.array([1.0, 2.0]), "prompt is a 1-D numpy array of float64", True, id="numpy-floats"),
    pytest.param(np.array([[1, 2]]), "prompt is a 2-D numpy array of int64", False, id="numpy-2d"),
    pytest.param({1, 2}, "prompt is of type set", True, id="set"),
]


@pytest.fixture(scope="module")
def llm(llama_engine):
    return LLM(llama_engine)


@pytest.fixture(scope="module")
def async_llm(llama_engine):
    return AsyncLLM(llama_engine)


def _assert_rejected(call, match):
    with pytest.raises(RequestError, match=match) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and (FORMS in message or "prompt is empty" in message)


@pytest.mark.parametrize("prompt,match,one_in_generate", BAD)
def test_bad_prompt_is_a_one_line_error_everywhere(llm, async_llm, prompt, match, one_in_generate):
    _assert_rejected(lambda: llm.add_request(prompt, PARAMS), match)
    _assert_rejected(lambda: llm.stream(prompt, PARAMS), match)
    if one_in_generate:
        _assert_rejected(lambda: llm.generate(prompt, PARAMS), match)
    _assert_rejected(lambda: llm.generate(["a good one", prompt], PARAMS), match)
    assert not llm.has_unfinished()  # nothing of a rejected batch was queued
    _assert_rejected(lambda: asyncio.run(async_llm.add_request(prompt, PARAMS)), match)
    assert not async_llm.llm.has_unfinished()


@pytest.mark.parametrize("prompt", [[], np.array([], np.int64), ""])
def test_empty_prompt(llm, prompt):
    _assert_rejected(lambda: llm.add_request(prompt, PARAMS), "prompt is empty")


def test_token_id_forms_that_keep_working(llm):
    ids = [5, 17, 42]
    expected = llm.generate(ids, PARAMS).token_ids
    for same in (np.array(ids), np.array(ids, np.int32), tuple(ids), [np.int64(t) for t in ids]):
        out = llm.generate(same, PARAMS)
        assert out.prompt_token_ids == ids and out.token_ids == expected
    batches = ([ids, ids[:2]], np.array([ids, ids]), [np.array(ids), "some text"], (ids, ids))
    for batch in batches:
        outs = llm.generate(batch, PARAMS)
        assert len(outs) == 2 and outs[0].token_ids == expected
    assert [o.prompt for o in llm.generate(["1", "2"], PARAMS)] == ["1", "2"]  # a batch of texts, not ids
