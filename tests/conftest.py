"""Shared, expensive fixtures: one materialized recipe and one engine per family per session.

Engines are built with block size 4 so every test prompt spans many blocks, and with per-pass
verification on, so each build also checks every pass numerically.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest

from llmc.plugins.cpu.library import library_path

FAMILIES = ("tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-phi3", "tiny-qwen3", "tiny-olmo2", "tiny-smollm3",
            "tiny-granite", "tiny-gemma2", "tiny-gemma3", "tiny-starcoder2",
            "tiny-ernie4_5", "tiny-stablelm", "tiny-olmo", "tiny-helium", "tiny-glm", "tiny-glm4", "tiny-nemotron",
            "tiny-arcee", "tiny-hunyuan", "tiny-exaone4", "tiny-gemma", "tiny-cohere", "tiny-cohere2", "tiny-olmo3",
            "tiny-ministral", "tiny-ministral3", "tiny-vaultgemma", "tiny-hyperclovax", "tiny-nanochat", "tiny-jais2",
            "tiny-seed_oss", "tiny-qwen3-moe", "tiny-mixtral", "tiny-olmoe", "tiny-qwen2-moe", "tiny-flex-olmo",
            "tiny-hunyuan-moe", "tiny-granitemoe", "tiny-phimoe", "tiny-gpt-oss", "tiny-granite-swa")
BLOCK_SIZE = 4
MAX_CONTEXT = 256
# For tests of llmc's CPU kernels: CI's install compiles them, so there they always run.
needs_kernels = pytest.mark.skipif(library_path() is None,
                                   reason="llmc's CPU kernel library is not built (no C compiler at install)")


@pytest.fixture(scope="session", autouse=True)
def _recipe_cache(tmp_path_factory):
    # Recipes materialize into a per-session cache unless the caller provides one.
    if "LLMC_CACHE" not in os.environ:
        os.environ["LLMC_CACHE"] = str(tmp_path_factory.mktemp("llmc-cache"))
    yield


@pytest.fixture(scope="session", autouse=True)
def _export_each_checkpoint_once():
    """torch.export is most of the suite's time (docs/architecture.md, "Tests and CI"), and most
    builds export a checkpoint that an earlier build of the session already did (one engine per
    weight format, KV dtype or pass set). An export is a function of the checkpoint alone, so each
    one is exported once and every later build of the same folder, config and weights gets a copy
    of that graph, deserialized afresh (no tensor is shared with a graph an earlier build's passes
    rewrote)."""
    import onnx
    import onnx_ir as ir

    from llmc.compiler import export
    from llmc.passes import lazy

    real, graphs = export.export_onnx, {}

    def export_onnx(hf_model, spec, weights=None):
        # The graph reads the folder's weights: its files' names, sizes and times stand for them.
        folder = Path(hf_model.config._name_or_path)
        files = ";".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in sorted(folder.iterdir())
                         if f.suffix in (".safetensors", ".bin", ".json")) if folder.is_dir() else ""
        # The attention and experts implementations are not in the config's JSON but change the graph.
        impls = (hf_model.config._attn_implementation, getattr(hf_model.config, "_experts_implementation", None))
        key = (str(folder), files, hf_model.config.to_json_string(), impls, repr(spec), weights is None)
        if key not in graphs:
            model = real(hf_model, spec, weights)
            if any(isinstance(v.const_value, lazy.Mxfp4Stack) for v in model.graph.initializers.values()):
                return model  # a copy would lose what the packing keeps bit for bit: the MXFP4 codes
            try:  # reads every weight: a damaged checkpoint's build must find out in its own time
                graphs[key] = ir.to_proto(model).SerializeToString()
            except Exception:
                pass
            return model
        return ir.from_proto(onnx.ModelProto.FromString(graphs[key]))

    export.export_onnx = export_onnx
    yield
    export.export_onnx = real


class _Engines:
    def __init__(self, root: Path):
        self.root = root
        self._built: dict[str, Path] = {}

    def __call__(self, recipe: str, *disabled_passes: str, **options) -> Path:
        key = (recipe, *disabled_passes, *(f"{k}={v}" for k, v in sorted(options.items())))
        if key not in self._built:
            from llmc.compiler.build import build
            from llmc.contract.options import BuildOptions

            out = self.root / "-".join(key)
            build(recipe, out, BuildOptions(**{"block_size": BLOCK_SIZE, "max_context": MAX_CONTEXT, "verify": True,
                                               "disable_passes": disabled_passes, **options}))
            self._built[key] = out
        return self._built[key]


@pytest.fixture(scope="session")
def engines(tmp_path_factory) -> _Engines:
    """`engines("tiny-llama")` -> engine dir, built once per session (`engines("tiny-llama",
    "cpu-kernels")`: the same with those passes disabled; keywords are other BuildOptions)."""
    return _Engines(tmp_path_factory.mktemp("engines"))


@pytest.fixture(scope="session")
def hf_models():
    """`hf_models("tiny-llama")` -> (HF model in eval mode, with transformers' eager attention,
    folder), loaded once per session."""
    cache: dict = {}

    def get(recipe: str):
        if recipe not in cache:
            import torch
            from transformers import AutoModelForCausalLM

            from llmc.compiler.recipes import materialize

            # transformers' own eager attention: the reference is never llmc's code (the build may
            # trace a family through llmc's attention op, compiler/attention.py).
            folder = materialize(recipe)
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
            cache[recipe] = (hf.eval(), folder)
        return cache[recipe]

    return get


@pytest.fixture(scope="session")
def llama_engine(engines) -> Path:
    return engines("tiny-llama")


async def settle_async(engine) -> None:
    """Wait until an AsyncLLM has no request queued or left, then check that every KV block went
    back to the pool (aborts while a step runs free their blocks before the next one)."""
    while True:
        with engine._lock:  # no step is half done while we look
            if not engine._commands and not engine.llm.has_unfinished():
                blocks = engine.llm.blocks
                assert blocks.num_free == blocks.capacity  # free or cached-evictable, none held
                blocks.check([])
                return
        await asyncio.sleep(0.01)
