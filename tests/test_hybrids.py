"""Hybrid models (recurrent layers beside attention) against transformers on the same weights:
LFM2's short convolutions and Qwen3.5's Gated DeltaNet, each layer's state carried in a slot of
the engine's state pools from step to step, chunk to chunk, and across preemption."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import BLOCK_SIZE, needs_kernels
from llmc.contract import open_engine
from llmc.errors import LlmcError
from llmc.runtime.engine import Engine
from llmc.runtime.llm import LLM
from llmc.runtime.sampling import SamplingParams

HYBRIDS = ("tiny-lfm2", "tiny-qwen3.5")
ATOL = 1e-4
PROMPT_LENS = (23, 9, 40, 100)

pytestmark = needs_kernels


def _engine(engines, recipe):
    return engines(recipe, verify=False)  # --verify does not cover a recurrent state yet (build refuses it)


def _greedy_refs(hf, prompts, max_new_tokens):
    refs = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
        refs.append(out[0, len(prompt):].tolist())
    return refs


@pytest.mark.parametrize("recipe", HYBRIDS)
def test_the_manifest_describes_each_state(recipe, engines):
    manifest = open_engine(_engine(engines, recipe)).manifest
    spec = manifest.model_spec
    assert manifest.kv_cache.num_layers == len(spec.attention_layers) < spec.num_layers
    kinds = {"tiny-lfm2": ["conv"], "tiny-qwen3.5": ["conv", "delta"]}[recipe]
    assert [s.kind for s in manifest.states] == kinds * len(spec.recurrent_layers)
    assert sorted({s.layer for s in manifest.states}) == list(spec.recurrent_layers)
    assert manifest.io.num_states == len(manifest.states)


@pytest.mark.parametrize("recipe", HYBRIDS)
def test_prefill_and_decode_logits_match_hf(recipe, engines, hf_models):
    """A ragged prefill of three rows, then decode steps: every row's state lives in its own slot."""
    hf, _ = hf_models(recipe)
    engine = Engine(_engine(engines, recipe))
    rng = np.random.default_rng(1)
    lens = (23, 9, 40)
    prompts = [rng.integers(3, engine.spec.vocab_size, n).tolist() for n in lens]
    width = -(-(max(lens) + 8) // BLOCK_SIZE)
    tables = np.arange(1, 1 + len(lens) * width, dtype=np.int32).reshape(len(lens), width)
    slots = np.array([3, 1, 2], np.int32)
    ids = np.zeros((len(lens), max(lens)), np.int64)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    logits = engine.forward(ids, pos, np.zeros(3, np.int32), np.array(lens, np.int32), tables,
                            state_slots=slots).copy()
    seqs = [list(p) for p in prompts]
    for step in range(8):
        for i, s in enumerate(seqs):
            with torch.no_grad():
                ref = hf(torch.tensor([s])).logits[0, -1].numpy()
            np.testing.assert_allclose(logits[i], ref, atol=ATOL, rtol=0, err_msg=f"row {i}, step {step}")
            s.append(int(np.argmax(logits[i])))
        past = np.array([len(s) - 1 for s in seqs], np.int32)
        logits = engine.forward(np.array([[s[-1]] for s in seqs]), past[:, None].astype(np.int64), past,
                                np.ones(3, np.int32), tables, state_slots=slots).copy()


@pytest.mark.parametrize("recipe", HYBRIDS)
def test_greedy_tokens_match_hf_alone_batched_and_in_chunks(recipe, engines, hf_models):
    hf, _ = hf_models(recipe)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 1024, n).tolist() for n in PROMPT_LENS]
    refs = _greedy_refs(hf, prompts, 32)
    params = SamplingParams(max_tokens=32)
    # Every prompt in one call, and in 16-token chunks (the 100-token prompt in seven, its state
    # carried from chunk to chunk through its slot).
    for options in ({}, {"chunk_size": 16, "max_num_batched_tokens": 32}):
        llm = LLM(_engine(engines, recipe), **options)
        assert [o.token_ids for o in llm.generate(prompts, params)] == refs, options
        assert [llm.generate(p, params).token_ids for p in prompts] == refs, options
        assert llm.blocks.num_free == llm.blocks.capacity
        assert sorted(llm.blocks._slots) == list(range(1, llm.engine.num_slots))


@pytest.mark.parametrize("recipe", HYBRIDS)
def test_preempted_requests_recompute_their_state(recipe, engines, hf_models):
    hf, _ = hf_models(recipe)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 1024, n).tolist() for n in (41, 47, 39)]
    refs = _greedy_refs(hf, prompts, 24)
    small = LLM(_engine(engines, recipe), kv_cache_blocks=30, max_num_batched_tokens=24, chunk_size=16)
    assert [o.token_ids for o in small.generate(prompts, SamplingParams(max_tokens=24))] == refs
    assert small.scheduler.num_preemptions > 0
    assert small.blocks.num_free == small.blocks.capacity


def test_prefix_caching_is_off_for_a_hybrid(engines, hf_models):
    """A block's KV is not the state at its end, so a hybrid shares no blocks: the same prompt twice
    computes twice and gives transformers' tokens both times."""
    hf, _ = hf_models("tiny-qwen3.5")
    prompt = np.random.default_rng(5).integers(3, 1024, 30).tolist()
    ref = _greedy_refs(hf, [prompt], 16)[0]
    llm = LLM(_engine(engines, "tiny-qwen3.5"), enable_prefix_caching=True)
    outputs = [llm.generate(prompt, SamplingParams(max_tokens=16)) for _ in range(2)]
    assert [o.token_ids for o in outputs] == [ref, ref]
    assert not llm.blocks.enable_prefix_caching and outputs[1].prefix_hit_tokens == 0


def test_speculation_is_refused_in_one_line(engines):
    with pytest.raises(LlmcError, match="recurrent layers' state cannot be rolled back"):
        LLM(_engine(engines, "tiny-lfm2"), speculative="ngram")


def test_the_state_pools_hold_a_slot_per_running_request(engines):
    engine = Engine(_engine(engines, "tiny-qwen3.5"))
    manifest = engine.manifest
    per_slot = sum(s.slot_bytes for s in manifest.states)
    assert engine.num_slots == 16 + 1  # max_num_seqs and the scratch slot
    assert engine.state_bytes == engine.num_slots * per_slot
