"""Bad input gets a one-line error and a non-zero exit, never a traceback; nothing half-written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmc.cli import main
from llmc.compiler.frontend import FAMILIES, MISSING_FEATURES, WRAPPERS
from llmc.errors import EngineError, RequestError
from llmc.runtime.llm import LLM
from llmc.runtime.sampling import SamplingParams


def _cli(*args: str):
    result = CliRunner().invoke(main, list(args))
    return result, result.output  # click >= 8.2 mixes stderr into output


def _assert_one_line_error(args, expected: str):
    result, text = _cli(*args)
    assert result.exit_code != 0, text
    assert "Traceback" not in text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, text
    assert expected in errors[0], errors[0]
    assert result.exception is None or isinstance(result.exception, SystemExit)  # no escaped error


@pytest.fixture
def engine_copy(llama_engine, tmp_path) -> Path:
    dst = tmp_path / "engine"
    shutil.copytree(llama_engine, dst)
    return dst


def test_missing_model_path(tmp_path):
    _assert_one_line_error(["build", str(tmp_path / "nope" / "model"), "-o", str(tmp_path / "e")],
                           "no model folder")
    assert not (tmp_path / "e").exists()


def test_folder_that_is_not_a_model(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hi")
    _assert_one_line_error(["build", str(tmp_path / "notes"), "-o", str(tmp_path / "e")], "no config.json")


def test_unsupported_architecture(tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    _assert_one_line_error(["build", str(folder), "-o", str(tmp_path / "e")], "unsupported architecture GPT2LMHeadModel")
    result, text = _cli("build", str(folder), "-o", str(tmp_path / "e"))
    assert "LlamaForCausalLM" in text  # the message lists what is supported


@pytest.mark.parametrize("model_type", list(MISSING_FEATURES))
@pytest.mark.parametrize("named_by", ["architectures", "model_type"])
def test_a_known_architecture_is_refused_naming_what_llmc_lacks(tmp_path, model_type, named_by):
    architecture, lacks = MISSING_FEATURES[model_type]
    config = {"model_type": model_type} | ({"architectures": [architecture]} if named_by == "architectures" else {})
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    _assert_one_line_error(["build", str(folder), "-o", str(tmp_path / "e")], f"(llmc lacks {lacks})")


def test_every_causal_lm_transformers_knows_is_built_or_refused_naming_what_llmc_lacks():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    built = {f.model_type for f in FAMILIES} | {f.architecture for f in FAMILIES}
    unnamed = [t for t, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()
               if t not in built and cls not in built and t not in MISSING_FEATURES]
    assert not unnamed  # add each to llmc/compiler/unsupported.py with what it lacks, or build it
    assert not {f.model_type for f in FAMILIES} & set(MISSING_FEATURES)
    # A multimodal wrapper builds its text model, which must be a family, and is not refused.
    assert {w.text_model_type for w in WRAPPERS.values()} <= {f.model_type for f in FAMILIES}
    assert not set(WRAPPERS) & set(MISSING_FEATURES)


def test_unknown_pass_and_required_pass(tmp_path):
    _assert_one_line_error(["build", "tiny-llama", "-o", str(tmp_path / "e"), "--disable-pass", "nope"], "unknown pass")
    _assert_one_line_error(["build", "tiny-llama", "-o", str(tmp_path / "e"), "--disable-pass", "paged-kv-cache"],
                           "cannot be disabled")


def test_engine_missing_manifest(engine_copy):
    (engine_copy / "manifest.json").unlink()
    _assert_one_line_error(["run", str(engine_copy), "hi"], "no manifest.json")
    _assert_one_line_error(["inspect", str(engine_copy)], "no manifest.json")


def test_engine_corrupt_manifest(engine_copy):
    (engine_copy / "manifest.json").write_text("{not json")
    _assert_one_line_error(["run", str(engine_copy), "hi"], "corrupt manifest")


def test_engine_checksum_mismatch(engine_copy):
    weights = engine_copy / "model.onnx.data"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0xFF
    weights.write_bytes(bytes(data))
    _assert_one_line_error(["run", str(engine_copy), "hi"], "checksum mismatch for model.onnx.data")


def test_engine_unknown_schema_version(engine_copy):
    manifest = json.loads((engine_copy / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (engine_copy / "manifest.json").write_text(json.dumps(manifest))
    _assert_one_line_error(["run", str(engine_copy), "hi"], "newer llmc")


def test_engine_unknown_kv_cache_layout(engine_copy):
    manifest = json.loads((engine_copy / "manifest.json").read_text())
    manifest["kv_cache"]["layout"] = "diagonal"
    (engine_copy / "manifest.json").write_text(json.dumps(manifest))
    _assert_one_line_error(["run", str(engine_copy), "hi"], "kv_cache.layout: expected one of")


def test_engine_of_an_older_schema_says_rebuild(engine_copy):
    manifest = json.loads((engine_copy / "manifest.json").read_text())
    manifest["schema_version"] = 2  # untyped manifests, before the contract package
    (engine_copy / "manifest.json").write_text(json.dumps(manifest))
    _assert_one_line_error(["run", str(engine_copy), "hi"], "uses schema 2, which this llmc no longer reads")
    _assert_one_line_error(["inspect", str(engine_copy)], "rebuild it with `llmc build`")


def test_no_engine_at_path(tmp_path):
    _assert_one_line_error(["run", str(tmp_path / "missing"), "hi"], "no engine at")


def test_prompt_longer_than_max_context(llama_engine):
    llm = LLM(llama_engine)
    long_prompt = " ".join(["word"] * 2000)
    _assert_one_line_error(["run", str(llama_engine), long_prompt], "max context")
    with pytest.raises(RequestError, match="max context"):
        llm.generate(long_prompt)
    with pytest.raises(RequestError, match="lower max_tokens"):
        llm.generate("hello", SamplingParams(max_tokens=llm.max_context))


@pytest.mark.parametrize("flag,value,field", [
    ("--temperature", "-1", "temperature"),
    ("--top-p", "0", "top_p"),
    ("--top-p", "1.5", "top_p"),
    ("--top-k", "-1", "top_k"),
    ("--max-tokens", "0", "max_tokens"),
])
def test_invalid_sampling_values(llama_engine, flag, value, field):
    _assert_one_line_error(["run", str(llama_engine), "hi", flag, value], field)


def test_empty_prompt(llama_engine):
    _assert_one_line_error(["run", str(llama_engine), ""], "prompt is empty")
    llm = LLM(llama_engine)
    with pytest.raises(RequestError, match="prompt is empty"):
        llm.generate("")
    with pytest.raises(RequestError, match="no prompts given"):
        llm.generate([])


def test_out_of_kv_memory_is_a_clear_error(llama_engine):
    llm = LLM(llama_engine, kv_cache_blocks=4)  # 3 usable blocks of 4 tokens
    with pytest.raises(RequestError, match="KV blocks"):
        llm.generate("a prompt that needs more than twelve tokens of cache, easily", SamplingParams(max_tokens=8))
    assert llm.blocks.num_free == llm.blocks.capacity


def test_interrupted_build_leaves_nothing(tmp_path):
    from llmc.compiler.build import build

    target = tmp_path / "engine"

    def interrupt(stage, message, finished):
        if stage == "passes":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build("tiny-llama", target, progress=interrupt)
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def test_engine_error_is_one_line(tmp_path):
    with pytest.raises(EngineError) as err:
        LLM(tmp_path / "missing")
    assert "\n" not in str(err.value)


def test_unreachable_hub_id_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never touch the network in tests
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    _assert_one_line_error(["build", "some-org/some-model", "-o", str(tmp_path / "e")], "could not fetch")
    assert not (tmp_path / "e").exists()
