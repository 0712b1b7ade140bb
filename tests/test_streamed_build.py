"""The streamed build: weights read from the checkpoint a slice at a time, never the whole model.

- Streaming changes memory, not results: an engine written in slices of a few KB equals one
  written a tensor at a time.
- A checkpoint much larger than the build's own footprint builds without its size in memory.
- A damaged checkpoint is refused in one line, with nothing left where the engine would be.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file, save_file

from llmc.cli import main
from llmc.compiler.recipes import materialize
from conftest import needs_kernels

SMALL = ["--block-size", "4", "--max-context", "64"]


def _build_args(folder: Path, out: Path, *flags: str) -> list[str]:
    return ["build", str(folder), "-o", str(out), *SMALL, *flags]


@needs_kernels
def test_an_engine_written_in_small_slices_equals_one_written_whole(tmp_path, monkeypatch):
    """Every lazy weight computed and written a panel (32 columns) or a few rows at a time gives
    the bytes the same build gives a tensor at a time: quantization and packing are per column."""
    from llmc.compiler.build import build
    from llmc.contract.options import BuildOptions
    from llmc.passes import lazy

    options = BuildOptions(block_size=4, max_context=64, quant="int4")
    build("tiny-llama", tmp_path / "whole", options)
    monkeypatch.setattr(lazy, "CHUNK_BYTES", 512)
    monkeypatch.setattr(lazy, "CACHE_BYTES", 0)
    build("tiny-llama", tmp_path / "sliced", options)
    assert (tmp_path / "whole" / "model.onnx.data").read_bytes() == (tmp_path / "sliced" / "model.onnx.data").read_bytes()
    # (The second build's graph is the session's cached export, deserialized, whose values are named
    # by another counter: the nodes' kinds and attributes compare.)
    graphs = [onnx.load(tmp_path / e / "model.onnx", load_external_data=False).graph for e in ("whole", "sliced")]
    assert [(n.op_type, str(n.attribute)) for n in graphs[0].node] == [(n.op_type, str(n.attribute)) for n in graphs[1].node]
    a, b = (json.loads((tmp_path / e / "manifest.json").read_text())["quantization"]["tensors"]
            for e in ("whole", "sliced"))
    assert {k: v["relative_error"] for k, v in a.items()} == pytest.approx(
        {k: v["relative_error"] for k, v in b.items()}, rel=1e-5)
    assert all(v["relative_error"] > 0 for v in a.values())


def _random_checkpoint(folder: Path, hidden: int, layers: int, intermediate: int, vocab: int) -> int:
    """A Llama checkpoint of bf16 random weights, one safetensors shard per layer; its bytes."""
    folder.mkdir()
    src = materialize("tiny-llama")
    config = json.loads((src / "config.json").read_text())
    config.update(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate, vocab_size=vocab,
                  num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256, head_dim=64,
                  tie_word_embeddings=False)
    (folder / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copyfile(src / f, folder / f)
    rng, kv = np.random.default_rng(0), config["num_key_value_heads"] * 64
    shapes = {"q_proj": (hidden, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, hidden),
              "gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden), "down_proj": (hidden, intermediate)}
    shards: list[dict[str, np.ndarray]] = [{"model.embed_tokens.weight": (vocab, hidden),
                                            "lm_head.weight": (vocab, hidden), "model.norm.weight": (hidden,)}]
    for i in range(layers):
        layer = {f"model.layers.{i}.{'self_attn' if 'proj' in k and k[0] in 'qkvo' else 'mlp'}.{k}.weight": s
                 for k, s in shapes.items()}
        layer.update({f"model.layers.{i}.input_layernorm.weight": (hidden,),
                      f"model.layers.{i}.post_attention_layernorm.weight": (hidden,)})
        shards.append(layer)
    weight_map, total = {}, 0
    for n, shard in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        arrays = {k: (rng.standard_normal(s, np.float32) * (0.02 if len(s) == 2 else 0.1) + (len(s) == 1))
                  .astype(ml_dtypes.bfloat16) for k, s in shard.items()}
        save_file(arrays, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(arrays, name))
        total += sum(a.nbytes for a in arrays.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                      "weight_map": weight_map}))
    return total


def _peak_rss_mb(folder: Path, out: Path, *flags: str) -> float:
    """The build's own peak RSS (its report's), run as users run it: a fresh `llmc build` process."""
    done = subprocess.run([sys.executable, "-m", "llmc.cli", *_build_args(folder, out, *flags)], capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((out / "build_report.json").read_text())["peak_rss_mb"]


@needs_kernels
def test_a_checkpoint_larger_than_the_build_footprint_never_sits_in_memory(tmp_path):
    """~330 MB of bf16 weights (~660 MB as the fp32 the graph computes in) build with int8 weights
    at a peak RSS within 40% of the checkpoint's size above what a 0.2M-parameter model's build
    takes: holding the model once in fp32 would cost twice the checkpoint."""
    stored = _random_checkpoint(tmp_path / "ckpt", hidden=1024, layers=6, intermediate=4096, vocab=32000)
    tiny = tmp_path / "tiny"
    shutil.copytree(materialize("tiny-llama"), tiny)
    base = _peak_rss_mb(tiny, tmp_path / "e-tiny", "--quant", "int8", "--quant-method", "rtn")
    peak = _peak_rss_mb(tmp_path / "ckpt", tmp_path / "e-big", "--quant", "int8", "--quant-method", "rtn")
    assert stored > 300e6
    assert peak - base < 0.4 * stored / 2**20, (peak, base, stored / 2**20)


# -- damaged checkpoints: one line, exit 2, no engine -----------------------------------------


def _copy(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(materialize("tiny-llama"), folder)
    return folder


def _edit_weights(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _nan(folder):
    def edit(t):
        t["model.layers.1.mlp.up_proj.weight"][3, 5] = np.nan
    _edit_weights(folder, edit)


def _missing(folder):
    _edit_weights(folder, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))


def _unexpected(folder):
    _edit_weights(folder, lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": np.zeros((4, 4), np.float32)}))


def _wrong_shape(folder):
    def edit(t):
        w = t["model.layers.0.self_attn.o_proj.weight"]
        t["model.layers.0.self_attn.o_proj.weight"] = np.ascontiguousarray(w[:, :-8])
    _edit_weights(folder, edit)


def _truncated(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])


def _absurd_config(folder):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1_000_000}))


def _bad_json(folder):
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')


def _bad_index(folder):
    (folder / "model.safetensors.index.json").write_text('{"weight_map": ')


def _shard_missing(folder):
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))


DAMAGE = {
    "nan": (_nan, "model.layers.1.mlp.up_proj.weight (layer 1) holds NaN or Inf"),
    "missing": (_missing, "has no tensor model.layers.1.self_attn.k_proj.weight (layer 1)"),
    "unexpected": (_unexpected, "holds model.layers.0.mlp.extra_proj.weight (layer 0)"),
    "wrong-shape": (_wrong_shape, "tensor model.layers.0.self_attn.o_proj.weight is [64, 56] in the checkpoint"),
    "truncated": (_truncated, "the file is truncated"),
    "absurd-config": (_absurd_config, "config.json describes a model of"),
    "bad-json": (_bad_json, "cannot read"),
    "bad-index": (_bad_index, "cannot read"),
    "shard-missing": (_shard_missing, "names model-00001-of-00002.safetensors, which is not in"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_refused_in_one_line_and_leaves_no_engine(tmp_path, damage):
    make, says = DAMAGE[damage]
    folder = _copy(tmp_path)
    make(folder)
    out = tmp_path / "engine"
    result = CliRunner().invoke(main, _build_args(folder, out, "--quant", "int4"))
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error: ") and says in last, last
    assert "Traceback" not in result.output
    assert not out.exists() and not any(p.name.startswith(".engine") for p in tmp_path.iterdir())


def test_verify_is_refused_before_any_work_where_the_model_would_not_fit(tmp_path, monkeypatch):
    """--verify compares whole graphs in ONNX Runtime; a model whose copies would not fit in the
    memory available is refused in one line before the export, and leaves no engine."""
    import types

    import psutil

    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(total=real.total, available=1 << 20))
    out = tmp_path / "engine"
    result = CliRunner().invoke(main, _build_args(_copy(tmp_path), out, "--verify"))
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error: --verify runs each pass's graph whole") and "build without --verify" in last, last
    assert "export" not in result.output and not out.exists()
