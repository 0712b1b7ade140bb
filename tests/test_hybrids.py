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
    return engines(recipe)  # built with --verify: every pass checked numerically, the state carried


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


# Qwen3.5 as published: the multimodal wrapper (model_type qwen3_5) around the text model, with a
# vision tower and a multi-token-prediction layer beside it in the checkpoint.
_TINY_VISION = {"depth": 1, "hidden_size": 32, "num_heads": 2, "out_hidden_size": 64, "intermediate_size": 64,
                "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _published_qwen35(folder, hf_models):
    """A tiny Qwen3_5ForConditionalGeneration folder whose text model is tiny-qwen3.5's, weights and all."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from llmc.compiler.recipes import load_recipe

    hf, recipe_folder = hf_models("tiny-qwen3.5")
    text = {k: v for k, v in load_recipe("tiny-qwen3.5")["config"].items() if k != "architectures"}
    config = Qwen3_5Config(text_config=text, vision_config=_TINY_VISION,
                           tie_word_embeddings=text["tie_word_embeddings"])
    model = Qwen3_5ForConditionalGeneration(config)
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in hf.state_dict().items()}
    missing, unexpected = model.load_state_dict(renamed, strict=False)
    assert not unexpected and missing and all(k.startswith("model.visual.") for k in missing)
    model.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    assert any(k.startswith("model.visual.") for k in tensors) and "lm_head.weight" in tensors
    if not any(k.startswith("mtp.") for k in tensors):  # transformers' wrapper has no MTP module to save
        tensors["mtp.fc.weight"] = torch.randn(64, 128)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    for name in _TOKENIZER_FILES:
        if (recipe_folder / name).is_file():
            shutil.copyfile(recipe_folder / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def published(tmp_path_factory, hf_models):
    """(folder, engine, BuildResult, progress lines) of the published-format tiny Qwen3.5."""
    from llmc.compiler.build import build
    from llmc.contract.options import BuildOptions

    root = tmp_path_factory.mktemp("published-qwen3.5")
    folder = _published_qwen35(root / "Qwen3.5-tiny", hf_models)
    lines = []
    result = build(str(folder), root / "engine", BuildOptions(block_size=BLOCK_SIZE, max_context=256, verify=False),
                   progress=lambda stage, message, finished=False: lines.append((stage, message, finished)))
    return folder, root / "engine", result, lines


def test_a_published_qwen35_folder_builds_its_text_model(published):
    import json

    from transformers import Qwen3_5ForCausalLM

    folder, engine, result, lines = published
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen3_5"
    hf = Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    rng = np.random.default_rng(6)
    prompts = [rng.integers(3, 1024, n).tolist() for n in (17, 40)]
    refs = _greedy_refs(hf, prompts, 24)
    outputs = LLM(engine).generate(prompts, SamplingParams(max_tokens=24))
    assert [o.token_ids for o in outputs] == refs
    text = LLM(engine).generate("Hello there", SamplingParams(max_tokens=4))  # its tokenizer, from the folder's top
    assert len(text.token_ids) == 4


def test_the_build_says_in_one_line_what_it_skips(published):
    folder, _, result, lines = published
    notes = [m for stage, m, finished in lines if "skipping" in m]
    assert len(notes) == 1 and result.notes == notes
    # the vision tower's tensors: its one block, the merger, the patch and position embeddings
    vision = sum(1 for name in _stored_names(folder) if name.startswith("model.visual."))
    assert notes[0].startswith(f"skipping the vision tower ({vision} tensors, ")
    assert notes[0].endswith(" and the multi-token-prediction layer (1 tensor, 8,192 parameters): "
                             "llmc builds the text model")


def _stored_names(folder):
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "np") as f:
        return list(f.keys())


def test_the_published_engine_is_the_text_models(published, engines):
    folder, engine, _, _ = published
    manifest, plain = open_engine(engine).manifest, open_engine(_engine(engines, "tiny-qwen3.5")).manifest
    assert manifest.model_spec == plain.model_spec
    assert manifest.source.model == manifest.source.folder == str(folder)
    assert [s.kind for s in manifest.states] == [s.kind for s in plain.states]


def test_a_published_folder_without_its_text_config_is_refused_in_one_line():
    from llmc.compiler.frontend import model_spec_from_config
    from llmc.errors import ModelError

    with pytest.raises(ModelError, match="without a text_config .*add it, or pass a qwen3_5_text folder"):
        model_spec_from_config({"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                                "vision_config": _TINY_VISION})


def test_embeddings_tied_only_at_the_top_level_are_refused_naming_the_fix(published, tmp_path):
    """transformers' text class reads text_config alone: it would leave such a checkpoint's LM head random."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from llmc.compiler.frontend import load_checkpoint, model_spec_from_config
    from llmc.errors import ModelError

    folder = published[0]
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {k: v for k, v in load_file(folder / "model.safetensors").items() if k != "lm_head.weight"}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    shutil.copyfile(folder / "tokenizer.json", tmp_path / "tokenizer.json")
    spec = model_spec_from_config(config)
    assert not spec.tie_word_embeddings  # as transformers' Qwen3_5ForCausalLM reads the folder
    with pytest.raises(ModelError, match="set text_config's tie_word_embeddings to true"):
        load_checkpoint(tmp_path, spec)


def test_a_hybrid_draft_is_refused_in_one_line(engines, llama_engine):
    with pytest.raises(LlmcError, match="is a hybrid .* use a transformer as the draft"):
        LLM(llama_engine, speculative=str(_engine(engines, "tiny-lfm2")))
