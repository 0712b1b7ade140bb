"""Built-in models: small random-weight HF models built locally, and models trained here.

Trained models (code-small, code-draft: models/train_code.py) are committed HF folders under
models/<name>/ and used as they are. The rest of this module is about random-weight recipes.

A recipe is models/<name>.json: {"description", "seed", "init_std", "config": <HF config dict>}.
materialize(name) turns it into an ordinary HF model folder (config, safetensors weights,
generation config, the project tokenizer) so the rest of llmc treats it like any local model.

Weights are deterministic: a recipe gives the same bytes on every machine (for a given torch
version), so tests and benchmarks can compare engines against HF across runs. The cache key
covers the recipe file and tokenizer, so editing either (e.g. bumping "seed") gives a new
folder. torch/transformers load lazily.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

from llmc.errors import ModelError

DEFAULT_RECIPE = "code-small"

# Files a finished model folder must hold; a folder missing any is rebuilt.
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Builds in one process run one at a time: transformers' lazy imports are not thread-safe.
# Across processes, the atomic rename in materialize() is what keeps the cache consistent.
_BUILD_LOCK = threading.Lock()


def _find_recipes_dir() -> Path:
    # Installed: models/ ships as the package llmc.models. From a source checkout that is not
    # installed, llmc.models does not exist, so use the models/ folder beside the package.
    try:
        path = Path(str(importlib.resources.files("llmc.models")))
        if path.is_dir() and any(path.glob("*.json")):
            return path
    except (ModuleNotFoundError, TypeError):
        pass
    return Path(__file__).resolve().parents[2] / "models"


RECIPES_DIR = _find_recipes_dir()
_TOKENIZER_DIR = RECIPES_DIR / "tokenizer"


def random_recipes() -> list[str]:
    """Recipes with random weights, built on first use (models/<name>.json)."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.json"))


def trained_models() -> list[str]:
    """Models trained here and committed as HF folders (models/<name>/, models/train_code.py)."""
    return sorted(p.parent.name for p in RECIPES_DIR.glob("*/model.safetensors"))


def list_recipes() -> list[str]:
    return sorted(random_recipes() + trained_models())


def is_recipe(name: str) -> bool:
    return name in list_recipes()


def _recipe_path(name: str) -> Path:
    if not is_recipe(name):
        raise ModelError(
            f"unknown recipe {name!r}; built-in recipes are: {', '.join(list_recipes())}"
        )
    return RECIPES_DIR / f"{name}.json"


def load_recipe(name: str) -> dict:
    return json.loads(_recipe_path(name).read_text())


def cache_root(cache_dir: Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("LLMC_CACHE"):
        return Path(os.environ["LLMC_CACHE"]).expanduser()
    return Path.home() / ".cache" / "llmc"


def _cache_key(name: str) -> str:
    # The tokenizer is part of the model folder, so a new tokenizer must mean a new folder.
    h = hashlib.sha256(_recipe_path(name).read_bytes())
    h.update((_TOKENIZER_DIR / "tokenizer.json").read_bytes())
    return h.hexdigest()[:12]


def _is_complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in _REQUIRED_FILES)


def materialize(name: str, cache_dir: Path | None = None) -> Path:
    """Return the HF model folder for recipe `name`, building it on first use (a trained model's
    folder is already one)."""
    if name in trained_models():
        return RECIPES_DIR / name
    key = _cache_key(name)
    final = cache_root(cache_dir) / "recipes" / f"{name}-{key}"
    if _is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename at the end, so nobody ever sees a half-written folder.
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        with _BUILD_LOCK:
            _build(load_recipe(name), tmp)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache may be shared
        if final.exists() and not _is_complete(final):
            # Left behind by something other than us (a user deleting files); replace it.
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process won the race and its folder is already in place.
            if not _is_complete(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _build(recipe: dict, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    cfg = dict(recipe["config"])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    # from_config draws its own (discarded) init from the global RNG; fork_rng keeps the
    # caller's RNG state as it was.
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # A private generator, not the global one, so concurrent builds in one process (threads)
    # cannot interleave draws and change each other's weights.
    _reinit(model, recipe["init_std"], torch.Generator().manual_seed(recipe["seed"]))
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    # A one-shard progress bar is noise in CLI output.
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()

    for f in _TOKENIZER_FILES:
        shutil.copyfile(_TOKENIZER_DIR / f, out / f)
    # The tokenizer is shared; its length limit should be this model's context.
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["model_max_length"] = config.max_position_embeddings
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")


def _reinit(model, init_std: float, gen) -> None:
    """Deterministic init, independent of how transformers initializes a given architecture.

    Norm weights are 1 + noise rather than 1 so every norm is distinct: an engine that feeds
    a tensor through the wrong norm then gives visibly different logits.
    """
    import torch

    done: set[int] = set()  # tied weights (embedding == lm_head) are initialized once
    with torch.no_grad():
        for module in model.modules():
            is_norm = isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith(
                ("RMSNorm", "LayerNorm", "RMSNormGated")  # Cohere's LayerNorm is its own class
            )
            for pname, p in module.named_parameters(recurse=False):
                if id(p) in done:
                    continue
                done.add(id(p))
                if pname == "bias":
                    p.normal_(0.0, 0.02, generator=gen)
                elif pname == "sinks":  # a logit per head in each softmax (gpt-oss): big enough to matter
                    p.normal_(0.0, 1.0, generator=gen)
                elif pname == "A_log":  # a DeltaNet head's decay rate: about 1
                    p.copy_(0.5 * torch.randn(p.shape, generator=gen))
                elif pname == "dt_bias":  # softplus(a + dt_bias) small: decays slow enough to carry a state
                    p.copy_(-3.0 + 0.5 * torch.randn(p.shape, generator=gen))
                elif is_norm:
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                elif isinstance(module, (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d)) or hasattr(
                        module, "top_k") or hasattr(module, "gate_up_proj"):  # a MoE router; an experts module's stacks
                    p.normal_(0.0, init_std, generator=gen)
                else:
                    raise RuntimeError(
                        f"recipe init does not know how to initialize "
                        f"{type(module).__name__}.{pname}; extend llmc.compiler.recipes._reinit"
                    )
