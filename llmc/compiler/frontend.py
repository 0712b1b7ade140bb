"""Frontend: turn a model reference into an HF model folder, a ModelSpec and a torch module.

A model ref is a built-in recipe name, a local HF folder, or a hub id. All three end up as a
folder with config.json + weights + tokenizer, so one loader serves recipes and users' models.
"""

from __future__ import annotations

import json
import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from llmc.compiler.unsupported import MISSING_FEATURES
from llmc.errors import ModelError, first_line
from llmc.contract.model_spec import ModelSpec

@dataclass(frozen=True)
class Family:
    """One transformers architecture llmc builds: what the frontend must know of it beyond what its
    exported graph says. The families share one structure (decoder, RMSNorm, RoPE, gated MLP, GQA)
    and one pipeline; what differs is in the exported graph, as ops the passes fuse by pattern or
    leave as they are: Qwen3's and Gemma 3's QK-norm (fused into the attention kernel), OLMo 2's
    norms after the attention and the MLP and over the whole Q and K projections, SmolLM3's layers
    without RoPE, Granite's multipliers (its logits scaling: passes/lm_head_scale.py), Gemma's
    (1 + w) norms around each block, embedding scale, GeGLU, softcaps (compiler/attention.py; the
    final one: passes.graph.logits_tail) and per-layer RoPE bases (docs/families.md)."""

    name: str  # ModelSpec.family
    architecture: str  # the transformers class
    model_type: str  # config.json's
    # How the family's transformers code reads sliding_window: not at all ("none"), on every layer
    # ("every_layer": Mistral, Phi-3, StarCoder2, even where config.json lists layer_types), or on
    # the layers layer_types names, which its config class derives when config.json has none.
    windows: Literal["none", "every_layer", "layer_types"] = "none"
    gated_mlp: bool = True  # down(act(gate(x)) * up(x)); False: fc2(act(fc1(x))) (StarCoder2)
    # quantization_config methods of checkpoints the family is released in, which llmc reads as
    # they are (gpt-oss's MXFP4 experts); any other quantized checkpoint is refused.
    released_quantization: tuple[str, ...] = ()
    # The layer_types kind of the family's recurrent layers (a hybrid: LFM2's "conv", Qwen3.5's
    # "linear_attention"), whose state the recurrent-state pass threads through the graph.
    recurrent: str | None = None


FAMILIES = (
    Family("llama", "LlamaForCausalLM", "llama"),
    Family("mistral", "MistralForCausalLM", "mistral", windows="every_layer"),
    Family("qwen2", "Qwen2ForCausalLM", "qwen2", windows="layer_types"),
    Family("qwen3", "Qwen3ForCausalLM", "qwen3", windows="layer_types"),
    Family("phi3", "Phi3ForCausalLM", "phi3", windows="every_layer"),
    Family("olmo2", "Olmo2ForCausalLM", "olmo2"),
    Family("smollm3", "SmolLM3ForCausalLM", "smollm3", windows="layer_types"),
    Family("granite", "GraniteForCausalLM", "granite"),
    Family("gemma2", "Gemma2ForCausalLM", "gemma2", windows="layer_types"),
    Family("gemma3", "Gemma3ForCausalLM", "gemma3_text", windows="layer_types"),
    Family("starcoder2", "Starcoder2ForCausalLM", "starcoder2", gated_mlp=False, windows="every_layer"),
    Family("ernie4_5", "Ernie4_5ForCausalLM", "ernie4_5"),
    # Families that took nothing new: their differences (LayerNorm, partial or interleaved RoPE,
    # QK-norm, norms after each block, squared-ReLU MLPs, layers without RoPE) are ops the pipeline
    # already handles or fuses.
    Family("stablelm", "StableLmForCausalLM", "stablelm"),
    Family("olmo", "OlmoForCausalLM", "olmo"),
    Family("helium", "HeliumForCausalLM", "helium"),
    Family("glm", "GlmForCausalLM", "glm"),
    Family("glm4", "Glm4ForCausalLM", "glm4"),
    Family("nemotron", "NemotronForCausalLM", "nemotron", gated_mlp=False),
    Family("arcee", "ArceeForCausalLM", "arcee", gated_mlp=False),
    Family("hunyuan_v1_dense", "HunYuanDenseV1ForCausalLM", "hunyuan_v1_dense"),
    Family("exaone4", "Exaone4ForCausalLM", "exaone4", windows="layer_types"),
    # Mixture of experts: the router as ops, each layer's experts one llmc.cpu::Experts (compiler/experts.py).
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", windows="every_layer"),
    Family("mixtral", "MixtralForCausalLM", "mixtral", windows="every_layer"),
    Family("olmoe", "OlmoeForCausalLM", "olmoe", windows="every_layer"),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", "qwen2_moe", windows="layer_types"),
    Family("flex_olmo", "FlexOlmoForCausalLM", "flex_olmo"),
    Family("hunyuan_v1_moe", "HunYuanMoEV1ForCausalLM", "hunyuan_v1_moe"),
    Family("granitemoe", "GraniteMoeForCausalLM", "granitemoe"),
    Family("phimoe", "PhimoeForCausalLM", "phimoe", windows="every_layer"),
    Family("gpt_oss", "GptOssForCausalLM", "gpt_oss", windows="layer_types", released_quantization=("mxfp4",)),
    Family("granite_swa", "GraniteSWAForCausalLM", "granite_swa", windows="layer_types"),
    Family("gemma", "GemmaForCausalLM", "gemma"),
    Family("cohere", "CohereForCausalLM", "cohere"),
    Family("cohere2", "Cohere2ForCausalLM", "cohere2", windows="layer_types"),
    Family("olmo3", "Olmo3ForCausalLM", "olmo3", windows="layer_types"),
    Family("ministral", "MinistralForCausalLM", "ministral", windows="layer_types"),
    Family("ministral3", "Ministral3ForCausalLM", "ministral3", windows="every_layer"),
    Family("vaultgemma", "VaultGemmaForCausalLM", "vaultgemma", windows="layer_types"),
    Family("hyperclovax", "HyperCLOVAXForCausalLM", "hyperclovax"),
    Family("nanochat", "NanoChatForCausalLM", "nanochat", gated_mlp=False),
    Family("jais2", "Jais2ForCausalLM", "jais2", gated_mlp=False),
    Family("seed_oss", "SeedOssForCausalLM", "seed_oss"),
    # Hybrids: recurrent layers beside attention (compiler/recurrent.py, passes/recurrent_state.py).
    Family("lfm2", "Lfm2ForCausalLM", "lfm2", recurrent="conv"),
    Family("qwen3_5_text", "Qwen3_5ForCausalLM", "qwen3_5_text", recurrent="linear_attention"),
)
SUPPORTED_ARCHITECTURES = {f.architecture: f for f in FAMILIES}
_FAMILY_OF_TYPE = {f.model_type: f for f in FAMILIES}  # transformers loads a config without architectures by it


@dataclass(frozen=True)
class Wrapper:
    """A multimodal model as published around a text model llmc builds: config.json nests the text
    model's config as text_config and the checkpoint holds its tensors under `text_prefix`, beside
    parts llmc leaves out (a vision tower, a multi-token-prediction layer). transformers' text class
    loads such a folder the same way (its conversion mapping's prefix change, its ignored keys)."""

    model_type: str  # config.json's
    text_model_type: str  # text_config's: a Family's
    text_prefix: str  # the text model's tensors' names start so in the checkpoint ...
    model_prefix: str  # ... and so in the text model
    skipped: tuple[tuple[str, str], ...]  # (a left-out part's tensor prefix, what it is)


WRAPPERS = {w.model_type: w for w in (
    Wrapper("qwen3_5", "qwen3_5_text", "model.language_model.", "model.",
            (("model.visual.", "the vision tower"), ("mtp.", "the multi-token-prediction layer"))),
)}


def resolve_model(ref: str) -> Path:
    """Return a local HF folder for a recipe name, a folder path or a hub id."""
    from llmc.compiler import recipes

    if recipes.is_recipe(ref):
        return recipes.materialize(ref)
    path = Path(ref).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelError(f"{ref} is a file, not a model folder; pass the folder holding config.json")
        if not (path / "config.json").is_file():
            raise ModelError(
                f"{ref} is not a HuggingFace model folder (no config.json); "
                "pass a folder saved with save_pretrained, a hub id, or a recipe "
                f"({', '.join(recipes.list_recipes())})"
            )
        return path
    if _looks_like_path(ref):
        raise ModelError(f"no model folder at {ref}; check the path, or use a recipe ({', '.join(recipes.list_recipes())})")
    return _download_from_hub(ref)


def _looks_like_path(ref: str) -> bool:
    return ref.startswith((".", "/", "~")) or ref.count("/") != 1 or ref.endswith("/")


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"],
        )
    except Exception as exc:  # network, auth, 404: all end up as one line for the user
        raise ModelError(
            f"could not fetch {repo_id!r} from the HuggingFace hub ({first_line(exc)}); "
            "pass a local folder or a recipe instead"
        ) from None
    return Path(folder)


def read_config(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot read {folder / 'config.json'}: {exc}; is the model folder complete?") from None
    except RecursionError:  # the parser recurses per level
        raise ModelError(f"cannot read {folder / 'config.json'}: nested too deeply to be a model's config") from None


# RoPE types whose frequencies are fixed at build time, or made per row at export (longrope,
# dynamic: see llmc.compiler.rope).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
LAYER_TYPES = ("full_attention", "sliding_attention")


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config of the model llmc builds: a multimodal wrapper's text_config (as transformers
    builds its text class from the folder: text_config alone, nothing inherited from the top level
    but a quantization_config), else config.json's own."""
    wrapper = WRAPPERS.get(config.get("model_type"))
    if wrapper is None:
        return config
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ModelError(f"config.json is a multimodal {wrapper.model_type} config without a text_config (an object); "
                         f"llmc builds its text model from text_config: add it, or pass a {wrapper.text_model_type} "
                         "folder")
    text = {**text, "model_type": text.get("model_type", wrapper.text_model_type)}
    if text["model_type"] != wrapper.text_model_type:
        raise ModelError(f"config.json's text_config names model_type {text['model_type']!r}; a {wrapper.model_type} "
                         f"model's text model is {wrapper.text_model_type}: fix config.json")
    text.pop("architectures", None)  # the family is the text model type's
    if config.get("quantization_config") is not None:
        text["quantization_config"] = config["quantization_config"]
    return text


def model_spec_from_config(config: dict[str, Any]) -> ModelSpec:
    config = text_config(config)
    archs = config.get("architectures") or []
    family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if family is None and not archs:
        family = _FAMILY_OF_TYPE.get(config.get("model_type"))
    if family is None:
        got = ", ".join(archs) if archs else f"model_type={config.get('model_type')!r}"
        lacks = next((what for model_type, (cls, what) in MISSING_FEATURES.items()
                      if cls in archs or model_type == config.get("model_type")), None)
        why = f" (llmc lacks {lacks})" if lacks else ""
        raise ModelError(
            f"unsupported architecture {got}{why}; llmc supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    model_type = config.get("model_type")
    if model_type not in _FAMILY_OF_TYPE:
        # transformers would build such a model from the folder's own Python (auto_map), or not at all.
        code = " and its own Python code (auto_map), which llmc never runs" if config.get("auto_map") else ""
        raise ModelError(f"config.json names model_type {model_type!r}{code}; llmc loads the model types "
                         f"{', '.join(_FAMILY_OF_TYPE)} with transformers' built-in code")
    heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    quantized = config.get("quantization_config")
    if isinstance(quantized, dict) and quantized.get("quant_method") not in family.released_quantization:
        method = quantized.get("quant_method", "unnamed")
        raise ModelError(f"config.json holds a quantized checkpoint (quantization_config, quant_method {method!r}); "
                         "llmc builds from fp32/bf16/fp16 weights and quantizes them itself: pass the unquantized "
                         "model and --quant int8 or int4")
    if config.get("use_bidirectional_attention"):
        raise ModelError("config.json sets use_bidirectional_attention (an embedding model, not a decoder); "
                         "llmc builds causal language models")
    kinds = (*LAYER_TYPES, family.recurrent) if family.recurrent else LAYER_TYPES
    _check_layer_types(config.get("layer_types"), config["num_hidden_layers"], kinds)  # transformers' names no layer
    derived = _transformers_config(config)
    rope_theta, rope_scaling, local_theta = _rope(derived)
    window, layer_types = _windows(derived, family, config["num_hidden_layers"])
    if family.recurrent:  # config.json's list, checked above, or the one transformers derives
        layer_types = tuple(derived.layer_types)
    return ModelSpec(
        family=family.name,
        architecture=family.architecture,
        num_layers=config["num_hidden_layers"],
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads,
        intermediate_size=_intermediate_size(derived),
        vocab_size=config["vocab_size"],
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        rope_theta=rope_theta,
        norm_eps=float(config.get("rms_norm_eps", config.get("norm_epsilon", config.get("norm_eps", 1e-6)))),
        gated_mlp=family.gated_mlp,
        activation=config.get("hidden_activation") or config.get("hidden_act", "silu"),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_scaling=rope_scaling,
        sliding_window=window,
        layer_types=layer_types,
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos_ids,
        rope_local_theta=local_theta,
        attn_logit_softcap=float(config.get("attn_logit_softcapping") or 0.0),
        final_logit_softcap=float(config.get("final_logit_softcapping") or 0.0),
        # The hub's Qwen3-MoE configs say num_experts, transformers 5 and Mixtral num_local_experts.
        num_experts=int(config.get("num_experts") or config.get("num_local_experts") or 0),
        experts_per_token=int(config.get("num_experts_per_tok") or config.get("moe_topk") or 0),
        expert_intermediate_size=int(config.get("moe_intermediate_size") or config["intermediate_size"]),
        recurrent_parameters=_recurrent_parameters(derived, family),
    )


def _intermediate_size(derived) -> int:
    """The MLP's width as the family's code sizes it: LFM2 takes 2/3 of config.json's, times a
    multiplier, rounded up to a multiple (block_auto_adjust_ff_dim)."""
    size = derived.intermediate_size
    if getattr(derived, "block_auto_adjust_ff_dim", False):
        size = int(2 * size / 3)
        if derived.block_ffn_dim_multiplier is not None:
            size = int(derived.block_ffn_dim_multiplier * size)
            multiple = derived.block_multiple_of
            size = multiple * -(-size // multiple)
    return size


def _recurrent_parameters(derived, family: Family) -> int:
    """The parameters of one recurrent layer's mixer (in place of attention's), for the size check."""
    hidden = derived.hidden_size
    if family.recurrent == "conv":  # in_proj (B, C, x), the depthwise conv, out_proj
        return 4 * hidden * hidden + hidden * derived.conv_L_cache
    if family.recurrent == "linear_attention":  # q, k, v, z, b, a projections, the conv over q, k, v, out_proj
        keys = derived.linear_num_key_heads * derived.linear_key_head_dim
        values = derived.linear_num_value_heads * derived.linear_value_head_dim
        return hidden * (2 * keys + 2 * values + 2 * derived.linear_num_value_heads) + values * hidden + \
            (2 * keys + values) * derived.linear_conv_kernel_dim
    return 0


def _transformers_config(config: dict[str, Any]):
    """transformers' config object for config.json: what each family derives from its keys (which
    layers attend in a window, RoPE per layer kind, old keys in their transformers 5 form) is then
    read as transformers reads it, not re-derived here."""
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k != "model_type"}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoConfig.for_model(config["model_type"], **fields)
    except Exception as exc:  # transformers' own validation of the values: one line, naming it
        raise ModelError(f"config.json is not a valid {config['model_type']} config ({first_line(exc)}); "
                         "fix config.json") from None


def _rope(derived) -> tuple[float, dict[str, Any] | None, float | None]:
    """(base, scaling, the sliding layers' base where it differs) from transformers 5's
    rope_parameters, nested by layer kind where the kinds rotate differently (Gemma 3, OLMo 3)."""
    params = dict(getattr(derived, "rope_parameters", None) or {})
    local = None
    if params.keys() & set(LAYER_TYPES):
        local = params.get("sliding_attention")
        params = dict(params.get("full_attention") or local)
    for each in (params, local or {}):
        _check_rope_type(each.get("rope_type", "default"))
    theta = float(params.get("rope_theta", 10000.0))
    kind = params.get("rope_type", "default")
    if kind == "longrope":
        boundary = params.get("original_max_position_embeddings")
        if not isinstance(boundary, int) or boundary < 1:
            raise ModelError("a longrope config needs original_max_position_embeddings (a positive integer); "
                             "fix config.json")
    local_theta = float(local["rope_theta"]) if local and float(local.get("rope_theta", theta)) != theta else None
    return theta, (params if kind != "default" else None), local_theta


def _check_rope_type(kind: str) -> None:
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ModelError(f"rope type {kind!r} is not supported; llmc supports {', '.join(SUPPORTED_ROPE_TYPES)}")


def _check_layer_types(types, layers: int, kinds: tuple[str, ...] = LAYER_TYPES) -> None:
    if types is not None and (not isinstance(types, list) or len(types) != layers
                              or any(t not in kinds for t in types)):
        raise ModelError(f"config.json layer_types must list one of {', '.join(kinds)} for each of the "
                         f"{layers} layers (got {types!r}); fix config.json")


def _windows(derived, family: Family, layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(sliding window, which layers attend within it; () when all do) as the family's code reads
    them from transformers' config: Qwen2's use_sliding_window and max_window_layers, Gemma's
    patterns and SmolLM3's NoPE layers are in the layer_types its config class derives."""
    window = getattr(derived, "sliding_window", None)
    if not window or family.windows == "none":
        return None, ()
    types = getattr(derived, "layer_types", None)
    if family.windows == "every_layer" or types is None:
        return int(window), ()
    _check_layer_types(types, layers)
    return int(window), (() if all(t == "sliding_attention" for t in types) else tuple(types))


def load_checkpoint(folder: Path, spec: ModelSpec):
    """(the module to trace, its weights): a skeleton over the safetensors on disk, or for a
    folder of PyTorch .bin files only, the model transformers loads whole and its state dict."""
    from llmc.compiler import weights

    if weights.has_safetensors(folder):
        stored = weights.SafetensorsWeights(folder)
        config = read_config(folder)
        if (wrapper := WRAPPERS.get(config.get("model_type"))) is not None:
            stored = weights.TextModel(stored, wrapper.text_prefix, wrapper.model_prefix, wrapper.skipped)
            _check_tied_head(config, spec, stored, folder)
        if spec.num_experts:
            stored = weights.with_expert_stacks(stored, text_config(config)["model_type"])
        implied, held = spec.parameter_count(), stored.parameter_count()
        if implied > 1.25 * held:  # before building a module of that size
            raise ModelError(f"config.json describes a model of {implied:,} parameters but the checkpoint in {folder} "
                             f"holds {held:,}; config.json is not this checkpoint's (or is damaged): fix it")
        model, layout = _with_llmc_experts(skeleton_model(folder))
        stored = weights.KernelLayout(stored, *layout) if any(layout) else stored
        _check_tensors(model, stored, folder)
        return model, stored
    model, _ = _with_llmc_experts(load_hf_model(folder))
    return model, weights.StateDictWeights(model.state_dict())


def _check_tied_head(config: dict[str, Any], spec: ModelSpec, stored, folder: Path) -> None:
    """transformers builds a wrapper's text model from text_config alone, so a checkpoint saved with
    the embeddings tied at the top level only has no LM head for it (transformers would leave one
    random): refused naming the fix, not read as a missing tensor."""
    if config.get("tie_word_embeddings") and not spec.tie_word_embeddings and not stored.has("lm_head.weight"):
        raise ModelError(f"{folder / 'config.json'} ties the word embeddings (tie_word_embeddings) at its top level "
                         "but not in text_config, from which the text model is built, and the checkpoint has no "
                         "lm_head.weight; set text_config's tie_word_embeddings to true")


def _with_llmc_experts(model) -> tuple[Any, tuple[bool, bool]]:
    """A mixture-of-experts model with its experts run by llmc's op (compiler/experts.py), which
    exports as one node a layer, and how the checkpoint stores their stacks (experts.layout: the
    module's are now in the op's); refused in one line where its experts are of a form the op lacks."""
    if not getattr(model, "_can_set_experts_implementation", lambda: False)():
        return model, (False, False)
    from llmc.compiler import experts
    from llmc.plugins.cpu.library import MISSING_HINT, library_path

    modules = [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]
    if not modules:
        return model, (False, False)
    if (lacks := experts.unsupported(modules[0])) is not None:
        raise ModelError(f"{type(model).__name__}'s experts have {lacks}, which llmc's experts kernel lacks")
    if library_path() is None:
        raise ModelError(f"{type(model).__name__}'s experts run on llmc's CPU kernels, which this install lacks; "
                         f"{MISSING_HINT}")
    layout = experts.layout(modules[0])
    for module in modules:
        experts.convert_module(module)
    experts.register()
    model.set_experts_implementation(experts.NAME)
    return model, layout


def _check_tensors(model, stored, folder: Path) -> None:
    """Every parameter the config implies is in the checkpoint with its shape, and nothing else is
    (a tied parameter under any of its names; what transformers ignores on loading, ignored)."""
    import re

    from llmc.compiler.weights import layer_of

    shapes = {id(p): tuple(p.shape) for p in model.parameters()}
    expected = set()
    for key, group in parameter_names(model).items():
        found = next((n for n in group if stored.has(n)), None)
        if found is None:
            raise ModelError(f"the checkpoint in {folder} has no tensor {group[0]}{layer_of(group[0])}, which "
                             "config.json implies; the download is incomplete or config.json is not this "
                             "checkpoint's")
        if stored.shape(found) != shapes[key]:
            raise ModelError(f"tensor {found} is {list(stored.shape(found))} in the checkpoint but config.json "
                             f"implies {list(shapes[key])}; config.json is not this checkpoint's: fix it")
        expected.update(group)
    ignored = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    extra = [n for n in stored.names() if n not in expected and not n.endswith("rotary_emb.inv_freq")
             and not any(p.search(n) for p in ignored)]
    if extra:
        raise ModelError(f"the checkpoint in {folder} holds {extra[0]}{layer_of(extra[0])}"
                         f"{f' (and {len(extra) - 1} more tensors)' if len(extra) > 1 else ''}, which the model "
                         "config.json describes has no place for; config.json is not this checkpoint's: fix it")


def parameter_names(model) -> dict[int, list[str]]:
    """Each parameter's names (a tied LM head is also the embedding), by the parameter's id."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def skeleton_model(folder: Path):
    """The checkpoint's transformers module with every parameter a fake tensor (shape and dtype,
    no storage) and its buffers real (RoPE's inverse frequencies are computed, not stored): what
    torch.export needs to trace the model, built in seconds and a few MB whatever the model's size.
    The weights stay on disk (llmc.compiler.weights) until a pass or the writer reads them."""
    import torch
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):  # never initialized, never given memory
        if param is not None and not param.is_meta:  # a meta one is already ours (tied weights)
            param = torch.nn.Parameter(param.to("meta"), requires_grad=False)
        register(module, name, param)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
            if config.model_type in WRAPPERS:  # the text model alone, as transformers' text class loads it
                config = config.get_text_config(decoder=True)
                config._name_or_path = str(folder)
            # A released quantization (MXFP4 experts) is read from the checkpoint as it is
            # (weights.KernelLayout); the module is the float model that the values mean.
            config.quantization_config = None
            torch.nn.Module.register_parameter = on_meta
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                     attn_implementation=_attention_for(config))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ModelError(f"transformers cannot build the model of {folder / 'config.json'}: {first_line(exc)}; "
                         "fix config.json") from None
    finally:
        torch.nn.Module.register_parameter = register
    # torch.export traces on the CPU: each meta parameter becomes a fake CPU tensor, tied ones one.
    fake, made = FakeTensorMode(allow_non_fake_inputs=True), {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in made:
                    with fake:
                        made[id(param)] = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype),
                                                             requires_grad=False)
                module._parameters[name] = made[id(param)]
    return model.eval()


def _attention_for(config) -> str:
    """SDPA, which the exporter writes as ONNX Attention, where the family's code takes it; else
    llmc's own (compiler/attention.py: Gemma 2, whose softcap SDPA lacks)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from llmc.compiler import attention

    return attention.implementation_for(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)])


def load_hf_model(folder: Path):
    """Load the checkpoint in fp32 with the SDPA attention the exporter turns into ONNX Attention."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()  # llmc's own progress reports stages
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's unpickler warns about protocols, not about safety
            config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
            model = AutoModelForCausalLM.from_pretrained(
                folder, config=config, dtype=torch.float32, attn_implementation=_attention_for(config),
                trust_remote_code=False
            )
    except pickle.UnpicklingError:
        # transformers reads .bin files with torch.load(weights_only=True), which refuses anything
        # but tensors; the error's own advice (weights_only=False) would run the file's code.
        raise ModelError(f"the .bin weights in {folder} hold more than tensors (pickled objects that would run "
                         "code), so llmc will not load them; get the checkpoint as .safetensors") from None
    except (OSError, ImportError) as exc:  # ImportError: what transformers needs for the checkpoint's format
        raise ModelError(f"cannot load weights from {folder}: {first_line(exc)}") from None
    return model.eval()
