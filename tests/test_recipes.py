"""Built-in recipes: configs load in transformers, materialize is cached and deterministic."""

import hashlib
import json

import pytest

from llmc.compiler import recipes
from llmc.errors import ModelError

TINY = [n for n in recipes.random_recipes() if n.startswith("tiny-")]


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _build_config(name):
    from transformers import AutoConfig

    cfg = dict(recipes.load_recipe(name)["config"])
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def test_recipe_listing():
    names = recipes.list_recipes()
    assert {"tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-phi3", "smollm2-135m-shape"} <= set(
        names
    )
    assert recipes.DEFAULT_RECIPE in names
    assert recipes.is_recipe("tiny-llama")
    assert not recipes.is_recipe("no-such-recipe")
    assert not recipes.is_recipe("tokenizer")  # the tokenizer folder is not a recipe


@pytest.mark.parametrize("name", recipes.random_recipes())
def test_recipe_is_a_valid_hf_config(name):
    recipe = recipes.load_recipe(name)
    assert set(recipe) == {"description", "seed", "init_std", "config"}
    assert isinstance(recipe["description"], str) and recipe["description"]
    config = _build_config(name)
    assert config.architectures and config.architectures[0].endswith("ForCausalLM")
    # Every token the shared tokenizer can produce must be a valid model id.
    assert config.vocab_size >= 1024
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (0, 1, 2)


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_builds(name):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_build_config(name))
    assert type(model).__name__ == recipes.load_recipe(name)["config"]["architectures"][0]


def test_smollm2_shape_builds_on_meta_device():
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_build_config("smollm2-135m-shape"))
    n_params = sum(p.numel() for p in model.parameters())
    assert 130e6 < n_params < 140e6


def test_unknown_recipe_raises_model_error(tmp_path):
    with pytest.raises(ModelError) as exc:
        recipes.materialize("no-such-recipe", tmp_path)
    msg = str(exc.value)
    assert "\n" not in msg
    assert "no-such-recipe" in msg and "tiny-llama" in msg


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return recipes.materialize("tiny-llama", tmp_path_factory.mktemp("cache"))


def test_materialize_layout(tiny_llama):
    assert tiny_llama.parent.name == "recipes"
    assert tiny_llama.name.startswith("tiny-llama-")
    for f in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json"):
        assert (tiny_llama / f).is_file(), f
    gen = json.loads((tiny_llama / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (0, 1)
    # No temp build folders left behind.
    assert [p.name for p in tiny_llama.parent.iterdir()] == [tiny_llama.name]


def test_materialize_cache_hit(tiny_llama):
    before = {p.name: (p.stat().st_mtime_ns, _sha256(p)) for p in tiny_llama.iterdir()}
    again = recipes.materialize("tiny-llama", tiny_llama.parent.parent)
    assert again == tiny_llama
    after = {p.name: (p.stat().st_mtime_ns, _sha256(p)) for p in again.iterdir()}
    assert after == before  # untouched, not rebuilt


def test_incomplete_cache_folder_is_rebuilt(tmp_path):
    first = recipes.materialize("tiny-llama", tmp_path)
    (first / "model.safetensors").unlink()
    again = recipes.materialize("tiny-llama", tmp_path)
    assert again == first and (again / "model.safetensors").is_file()


def test_env_cache_dir_and_deterministic_weights(tmp_path, monkeypatch, tiny_llama):
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path))
    folder = recipes.materialize("tiny-llama")
    assert folder.parent.parent == tmp_path
    # Deterministic: a separate build gives byte-identical weights.
    assert _sha256(folder / "model.safetensors") == _sha256(tiny_llama / "model.safetensors")


def test_hf_loads_materialized_model(tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert tok.model_max_length == model.config.max_position_embeddings
    ids = tok("Hello, world!", return_tensors="pt").input_ids
    assert ids[0, 0].item() == model.config.bos_token_id
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    # Norm weights are randomized so that mixing two norms up changes the output.
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert len({tuple(p[:4].tolist()) for p in norms}) == len(norms)


@pytest.mark.parametrize("text", ["Hello, world! The quick brown fox.", "naïve café 東京",
                                  "  two leading spaces\n\ttab and newline "])
def test_tokenizer_round_trip(tiny_llama, text):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id == 0
    assert tok.decode(ids, skip_special_tokens=True) == text

    raw = Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    enc = raw.encode(text)
    assert enc.ids == ids
    assert raw.decode(enc.ids) == text


def test_tokenizer_special_tokens():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(recipes.RECIPES_DIR / "tokenizer")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert len(tok) == 1024
    assert (recipes.RECIPES_DIR / "tokenizer" / "tokenizer.json").stat().st_size < 200_000
