"""The frontend reads HF configs the way transformers does, and refuses what it cannot honour in
one line: per-layer attention kinds, RoPE types, configs without architectures, custom code,
pickled weights."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import numpy as np
import pytest
import torch

from llmc.compiler.frontend import FAMILIES, load_hf_model, model_spec_from_config, read_config
from llmc.compiler.recipes import materialize
from llmc.errors import ModelError


def _config(recipe: str, **changes) -> dict:
    config = read_config(materialize(recipe))
    config.update(changes)
    return {k: v for k, v in config.items() if v is not None}


def _folder(tmp_path, recipe: str, weights: bool = True, **changes):
    src, folder = materialize(recipe), tmp_path / "model"
    shutil.copytree(src, folder, ignore=None if weights else shutil.ignore_patterns("*.safetensors"))
    (folder / "config.json").write_text(json.dumps(_config(recipe, **changes)))
    return folder


def test_qwen2_layer_kinds_follow_max_window_layers():
    config = _config("tiny-qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1, layer_types=None)
    spec = model_spec_from_config(config)
    assert [spec.window(i) for i in range(spec.num_layers)] == [0, 8]
    spec = model_spec_from_config({**config, "max_window_layers": 0})
    assert spec.layer_types == () and [spec.window(i) for i in range(spec.num_layers)] == [8, 8]
    # Without use_sliding_window transformers ignores the window, whatever layer_types says.
    spec = model_spec_from_config({**config, "use_sliding_window": False})
    assert [spec.window(i) for i in range(spec.num_layers)] == [0, 0]


def test_smollm3_windows_its_layers_without_rope_and_only_with_use_sliding_window():
    config = _config("tiny-smollm3", use_sliding_window=True, sliding_window=8, layer_types=None)
    spec = model_spec_from_config(config)  # layer 1 has no RoPE (no_rope_layers [1, 0])
    assert spec.layer_types == ("full_attention", "sliding_attention")
    assert [spec.window(i) for i in range(spec.num_layers)] == [0, 8]
    spec = model_spec_from_config({**config, "use_sliding_window": False})
    assert [spec.window(i) for i in range(spec.num_layers)] == [0, 0]


@pytest.mark.parametrize("recipe, hub_keys", [
    # Gemma 2 as the hub ships it: no layer_types (alternating), rope_theta at the top.
    ("tiny-gemma2", dict(num_hidden_layers=5, layer_types=None, rope_parameters=None, rope_theta=20000.0)),
    # Gemma 3: sliding_window_pattern, and the global / local bases and scaling as older configs hold them.
    ("tiny-gemma3", dict(num_hidden_layers=7, layer_types=None, rope_parameters=None, sliding_window_pattern=3,
                         rope_theta=500000.0, rope_local_base_freq=5000.0,
                         rope_scaling={"rope_type": "linear", "factor": 4.0})),
])
def test_gemma_configs_read_as_transformers_reads_them(recipe, hub_keys):
    from transformers import AutoConfig

    config = _config(recipe, **hub_keys)
    spec = model_spec_from_config(config)
    hf = AutoConfig.for_model(**config)
    assert spec.layer_types == tuple(hf.layer_types) and "full_attention" in spec.layer_types
    rope = hf.rope_parameters
    if recipe == "tiny-gemma3":
        assert spec.rope_local_theta == rope["sliding_attention"]["rope_theta"] == 5000.0
        assert rope["sliding_attention"]["rope_type"] == "default"
        rope = rope["full_attention"]
        assert spec.rope_scaling["factor"] == rope["factor"] == 4.0
    assert spec.rope_theta == rope["rope_theta"] == hub_keys["rope_theta"]
    assert spec.activation == "gelu_pytorch_tanh"
    with pytest.raises(ModelError, match="use_bidirectional_attention .*builds causal language models"):
        model_spec_from_config({**config, "use_bidirectional_attention": True})


@pytest.mark.parametrize("method", ["gptq", "awq", "bitnet", "fp8"])
def test_a_quantized_checkpoint_is_refused_naming_the_fix(method):
    # Its packed tensors would otherwise be refused one by one as tensors config.json has no place for.
    config = _config("tiny-llama", quantization_config={"quant_method": method, "bits": 4})
    with pytest.raises(ModelError, match=f"quantized checkpoint .*quant_method '{method}'.*pass the unquantized"):
        model_spec_from_config(config)


def test_mistral_windows_every_layer_whatever_layer_types_says():
    spec = model_spec_from_config(_config("tiny-mistral", layer_types=["full_attention", "full_attention"]))
    assert [spec.window(i) for i in range(spec.num_layers)] == [16, 16]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_each_record_reads_windows_as_its_transformers_code_does(family):
    """Family.windows against the family's modeling code: whether it reads sliding_window, and
    whether per layer (layer_types) or on every layer."""
    import importlib
    import inspect

    import transformers

    source = inspect.getsource(importlib.import_module(getattr(transformers, family.architecture).__module__))
    # A hybrid's code reads layer_types for its layers' kinds, not for windows: no sliding_window, no window.
    reads = "none" if "sliding_window" not in source else "layer_types" if "layer_types" in source else "every_layer"
    assert family.windows == reads


def test_a_window_the_family_never_reads_is_not_applied():
    spec = model_spec_from_config(_config("tiny-llama", sliding_window=8))  # LlamaConfig keeps the key; Llama ignores it
    assert spec.sliding_window is None and [spec.window(i) for i in range(spec.num_layers)] == [0, 0]


def test_bad_layer_types_is_one_line():
    config = _config("tiny-qwen2", use_sliding_window=True, sliding_window=8, layer_types=["full_attention"])
    with pytest.raises(ModelError, match="layer_types must list one of full_attention, sliding_attention for each "
                                         "of the 2 layers"):
        model_spec_from_config(config)


def test_unknown_rope_type_is_one_line():
    with pytest.raises(ModelError, match="rope type 'su' is not supported"):
        model_spec_from_config(_config("tiny-llama", rope_parameters={"rope_type": "su", "rope_theta": 1e4}))


def test_old_phi3_longrope_config_keeps_its_boundary():
    scaling = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    spec = model_spec_from_config(_config("tiny-phi3", rope_scaling=scaling, original_max_position_embeddings=4096))
    assert spec.longrope_boundary == 4096


def test_config_without_architectures_is_read_by_model_type():
    config = _config("tiny-qwen2")
    del config["architectures"]
    assert model_spec_from_config(config).architecture == "Qwen2ForCausalLM"


def test_dynamic_rope_builds_and_matches_hf_without_architectures(tmp_path):
    """Dynamic NTK only changes the frequencies beyond max_position_embeddings, which no engine
    reaches; it used to fail inside torch.export."""
    from llmc.compiler.build import build
    from llmc.contract.options import BuildOptions
    from llmc.runtime.llm import LLM
    from llmc.runtime.sampling import SamplingParams

    folder = _folder(tmp_path, "tiny-llama", architectures=None,
                     rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    build(str(folder), tmp_path / "engine", BuildOptions(block_size=4, max_context=128))
    prompt = np.random.default_rng(0).integers(3, 1024, 60).tolist()
    with torch.no_grad():
        ref = load_hf_model(folder).generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)
    assert LLM(tmp_path / "engine").generate(prompt, SamplingParams(max_tokens=30)).token_ids == ref[0, 60:].tolist()


def test_custom_code_folder_is_refused_before_transformers_sees_it(tmp_path, monkeypatch):
    folder = _folder(tmp_path, "tiny-llama", model_type="evil-llama",
                     auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    (folder / "modeling_evil.py").write_text("raise SystemExit('custom code ran')\n")
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("asked the user whether to run custom code"))
    from llmc.compiler.build import build

    with pytest.raises(ModelError, match="model_type 'evil-llama' and its own Python code .auto_map., which llmc "
                                         "never runs"):
        build(str(folder), tmp_path / "engine")
    assert not (tmp_path / "engine").exists()


def test_custom_tokenizer_code_is_not_run(tmp_path, monkeypatch):
    from llmc.compiler.tokenizer import export_tokenizer

    folder = _folder(tmp_path, "tiny-llama")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    config["tokenizer_class"] = "EvilTokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "tokenization_evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    monkeypatch.setattr("builtins.input", lambda *a: "y")  # a user who answers yes, if ever asked
    with pytest.raises(ModelError, match="cannot load a tokenizer from"):
        export_tokenizer(folder, tmp_path / "tok")
    assert not (tmp_path / "ran").exists()


def test_pickled_code_in_bin_weights_is_one_line_and_never_runs(tmp_path):
    folder = _folder(tmp_path, "tiny-llama", weights=False)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"model.embed_tokens.weight": Payload()}, protocol=2))
    with pytest.raises(ModelError, match=r"^the \.bin weights in .* hold more than tensors .*get the checkpoint "
                                         r"as \.safetensors$"):
        load_hf_model(folder)
    assert not marker.exists()


def test_export_failure_is_one_line_without_exporter_dumps(tmp_path, monkeypatch, capfd):
    from llmc.compiler.build import build

    # Dynamic NTK RoPE left as transformers wrote it cannot be traced: a real exporter failure.
    monkeypatch.setattr("llmc.compiler.rope.make_rope_per_row", lambda model: 0)
    folder = _folder(tmp_path, "tiny-llama", rope_parameters={"rope_type": "dynamic", "factor": 4.0,
                                                               "rope_theta": 10000.0})
    with pytest.raises(ModelError, match=r"^torch.export of LlamaForCausalLM failed \(.*data-dependent.*\); "
                                         r"this model's code is not exportable"):
        build(str(folder), tmp_path / "engine")
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    assert not (tmp_path / "engine").exists()


def test_a_config_nested_too_deeply_is_one_line(tmp_path):
    """A RecursionError traceback until 2026-12-07 (issue 63)."""
    (tmp_path / "config.json").write_text('{"a": ' * 100_000 + "1" + "}" * 100_000)
    with pytest.raises(ModelError, match="config.json: nested too deeply to be a model's config$") as info:
        read_config(tmp_path)
    assert "\n" not in str(info.value)
