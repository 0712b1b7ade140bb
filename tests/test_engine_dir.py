"""The engine directory contract: atomic writes, a typed manifest validated key by key, every file
the runtime opens kept inside the engine, and the `llmc inspect` text."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import pytest

from llmc.contract import engine_dir
from llmc.contract.codec import ADDED, ContractError, from_json, to_json
from llmc.contract.engine_dir import MANIFEST, EngineWriter, open_engine
from llmc.contract.graph_io import GraphIO
from llmc.contract.manifest import (SCHEMA_VERSION, Backend, FileEntry, KVCache, Manifest, PassRecord, Payload,
                                    Quantization, QuantizedTensor, Source, Tokenizer)
from llmc.contract.model_spec import ModelSpec
from llmc.contract.options import BuildOptions
from llmc.contract.tuning import TUNING_FILE, write_tuning
from llmc.describe import describe
from llmc.errors import EngineError, LlmcError

PAYLOAD = {
    "model.onnx": b"onnx-graph",
    "model.onnx.data": os.urandom(3000),
    "tokenizer/tokenizer.json": b'{"model": {}}',
    "tokenizer/tokenizer_config.json": b"{}",
    "tokenizer/chat_template.jinja": b"{{ messages }}",
    "generation_config.json": b'{"eos_token_id": 2}',
    "build_report.md": b"# report\n",
}


def sample_manifest() -> Manifest:
    spec = ModelSpec(family="llama", architecture="LlamaForCausalLM", num_layers=2, hidden_size=64, num_heads=4,
                     num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=100, max_position_embeddings=256,
                     rope_theta=1e4, norm_eps=1e-6, activation="silu", tie_word_embeddings=True, eos_token_ids=(2,))
    return Manifest(
        source=Source("org/tiny-llama", "/models/tiny", "0" * 64),
        backend=Backend("onnxruntime", "cpu", ()),
        model_spec=spec,
        build_options=BuildOptions(block_size=16, max_context=256),
        kv_cache=KVCache("token-major", "fp32", 16, 2, 2, 16),
        io=GraphIO.paged(2),
        payload=Payload("model.onnx", "model.onnx.data"),
        tokenizer=Tokenizer("tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json",
                            "tokenizer/chat_template.jinja", "<s>", "</s>", "<pad>", None),
        generation_config="generation_config.json",
        passes=(PassRecord("merge-matmuls", True, {"qkv_merge": 2}, 0.12, 100, 96, 1e-6, ()),
                PassRecord("cleanup", False, {"folded": 0}, 0.01, 96, 96, None, ("a rule that did not fire",))),
        quantization=Quantization("search", 32, True, "float16", None,
                                  {"w.q": QuantizedTensor("body", "int4", (64, 128), 0.09)}),
    )


def write_payload(root: Path, payload: dict[str, bytes] = PAYLOAD) -> None:
    for rel, data in payload.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def build(target: Path, overwrite: bool = False, payload: dict[str, bytes] = PAYLOAD,
          manifest: Manifest | None = None) -> Path:
    with EngineWriter(target, overwrite=overwrite) as w:
        write_payload(w.path, payload)
        return w.commit(manifest or sample_manifest())


def rewrite_manifest(engine: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Tamper with manifest.json as raw JSON (to write what the typed Manifest would refuse)."""
    data = json.loads((engine / MANIFEST).read_text())
    change(data)
    (engine / MANIFEST).write_text(json.dumps(data))


def write_manifest(engine: Path, manifest: Manifest) -> None:
    (engine / MANIFEST).write_text(json.dumps(manifest.to_json()))


def engine_error(engine: Path, **kw: Any) -> str:
    with pytest.raises(EngineError) as info:
        open_engine(engine, **kw)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


# --- writing --------------------------------------------------------------------------------


def test_round_trip(tmp_path: Path) -> None:
    target = tmp_path / "engine"
    assert build(target) == target
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]  # no temp dir left behind

    opened = open_engine(target)
    manifest = opened.manifest
    assert manifest.to_json() == json.loads((target / MANIFEST).read_text())
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert dataclasses.replace(manifest, files={}, llmc_version="", created_at="") == sample_manifest()
    assert manifest.schema_version == SCHEMA_VERSION and manifest.llmc_version
    assert manifest.created_at.endswith("+00:00")
    assert set(manifest.files) == set(PAYLOAD)  # manifest.json does not list itself
    for rel, data in PAYLOAD.items():
        assert manifest.files[rel] == FileEntry(hashlib.sha256(data).hexdigest(), len(data))
    assert opened.model == target / "model.onnx" and opened.weights == target / "model.onnx.data"
    assert opened.tokenizer == target / "tokenizer" / "tokenizer.json"
    assert opened.chat_template == target / "tokenizer" / "chat_template.jinja"
    assert opened.generation_config == target / "generation_config.json" and opened.tuning is None
    write_tuning(target, {"max_num_seqs": 4})
    assert open_engine(target).tuning == target / TUNING_FILE


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_interrupted_build_leaves_nothing(tmp_path: Path, exc: type[BaseException]) -> None:
    with pytest.raises(exc):
        with EngineWriter(tmp_path / "engine") as w:
            write_payload(w.path)
            assert w.path.parent == tmp_path and w.path.name.startswith(".engine.partial-")
            raise exc()
    assert list(tmp_path.iterdir()) == []


def test_no_commit_leaves_nothing(tmp_path: Path) -> None:
    with EngineWriter(tmp_path / "engine") as w:
        write_payload(w.path)
    assert list(tmp_path.iterdir()) == []


def test_commit_refuses_a_manifest_naming_missing_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model.onnx.data"):
        build(tmp_path / "engine", payload={k: v for k, v in PAYLOAD.items() if k != "model.onnx.data"})
    assert list(tmp_path.iterdir()) == []


def test_existing_engine_needs_overwrite(tmp_path: Path) -> None:
    target = build(tmp_path / "engine")
    with pytest.raises(EngineError, match="--overwrite") as info:
        EngineWriter(target).__enter__()
    assert "\n" not in str(info.value)
    open_engine(target)


def test_overwrite_replaces_engine(tmp_path: Path) -> None:
    target = build(tmp_path / "engine")
    smaller = {k: v for k, v in PAYLOAD.items() if k != "build_report.md"}
    build(target, overwrite=True, payload=smaller)
    assert set(open_engine(target).manifest.files) == set(smaller)
    assert not (target / "build_report.md").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]


def test_overwrite_failed_swap_restores_old(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = build(tmp_path / "engine")
    before = (target / MANIFEST).read_text()
    real_replace = os.replace

    def flaky_replace(src: Any, dst: Any) -> None:
        if ".partial-" in str(src):
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(engine_dir.os, "replace", flaky_replace)
    with pytest.raises(OSError, match="disk full"):
        build(target, overwrite=True)
    monkeypatch.undo()
    assert (target / MANIFEST).read_text() == before
    open_engine(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]


def test_overwrite_refuses_non_engine_folder(tmp_path: Path) -> None:
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "cat.jpg").write_bytes(b"meow")
    with pytest.raises(EngineError, match="not an llmc engine") as info:
        build(folder, overwrite=True)
    assert "\n" not in str(info.value)
    assert (folder / "cat.jpg").read_bytes() == b"meow"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["photos"]


def test_overwrite_refuses_file(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("keep me")
    with pytest.raises(EngineError, match="not an engine directory"):
        build(path, overwrite=True)
    assert path.read_text() == "keep me"


def test_creates_missing_parent(tmp_path: Path) -> None:
    open_engine(build(tmp_path / "out" / "engines" / "tiny"))


# --- the typed manifest ---------------------------------------------------------------------


def test_every_key_is_typed() -> None:
    data = sample_manifest().to_json()
    data["model_spec"]["num_layers"] = "2"
    with pytest.raises(ContractError, match=r"manifest.model_spec.num_layers: expected int, got str"):
        Manifest.from_json(data)
    data = sample_manifest().to_json()
    data["kv_cache"]["layout"] = "diagonal"
    with pytest.raises(ContractError, match="kv_cache.layout: expected one of 'token-major', 'head-major'"):
        Manifest.from_json(data)
    data = sample_manifest().to_json()
    data["build_options"]["flash"] = True
    with pytest.raises(ContractError, match="build_options: unknown key 'flash'"):
        Manifest.from_json(data)
    data = sample_manifest().to_json()
    data["io"]["inputs"] = data["io"]["inputs"][:-1]  # a layer's pool missing
    with pytest.raises(ContractError, match="not the paged-attention interface of an engine of 2 attention layers"):
        Manifest.from_json(data)
    assert from_json(BuildOptions, to_json(BuildOptions(block_size=8))) == BuildOptions(block_size=8)


# --- loading --------------------------------------------------------------------------------


@pytest.fixture
def engine(tmp_path: Path) -> Path:
    return build(tmp_path / "engine")


def test_missing_path(tmp_path: Path) -> None:
    msg = engine_error(tmp_path / "nope")
    assert "no engine at" in msg and "llmc build" in msg


def test_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    assert "not an engine directory" in engine_error(tmp_path / "f")


def test_no_manifest(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    assert "not an llmc engine (no manifest.json)" in engine_error(tmp_path / "d")


def test_manifest_not_json(engine: Path) -> None:
    (engine / MANIFEST).write_text("{not json")
    assert "corrupt manifest" in engine_error(engine)


def test_manifest_not_object(engine: Path) -> None:
    (engine / MANIFEST).write_text("[1, 2]")
    msg = engine_error(engine)
    assert "corrupt manifest" in msg and "list" in msg


@pytest.mark.parametrize("value", [None, "1", 1.0, True])
def test_bad_schema_version(engine: Path, value: Any) -> None:
    rewrite_manifest(engine, lambda d: d.update(schema_version=value))
    assert "schema_version" in engine_error(engine)


def test_newer_schema(engine: Path) -> None:
    rewrite_manifest(engine, lambda d: d.update(schema_version=SCHEMA_VERSION + 1))
    msg = engine_error(engine)
    assert "newer llmc" in msg and f"schema {SCHEMA_VERSION + 1}" in msg and "upgrade llmc" in msg


def test_older_schema_says_rebuild(engine: Path) -> None:
    rewrite_manifest(engine, lambda d: d.update(schema_version=SCHEMA_VERSION - 1))
    msg = engine_error(engine)
    assert f"schema {SCHEMA_VERSION - 1}" in msg and "rebuild it with `llmc build`" in msg


@pytest.mark.parametrize("key", [f.name for f in dataclasses.fields(Manifest) if ADDED not in f.metadata])
def test_missing_key(engine: Path, key: str) -> None:
    rewrite_manifest(engine, lambda d: d.pop(key))
    msg = engine_error(engine)
    assert "corrupt manifest" in msg and key in msg


def test_a_key_added_to_the_schema_may_be_missing(engine: Path) -> None:
    rewrite_manifest(engine, lambda d: d.pop("lm_head_tokens"))
    assert open_engine(engine).manifest.lm_head_tokens is None


@pytest.mark.parametrize("tokens", [[], [5, 3], [2, 2], [-1, 4], [0, 10**6]])
def test_draft_head_tokens_must_be_ascending_ids_in_the_vocabulary(engine: Path, tokens) -> None:
    rewrite_manifest(engine, lambda d: d.update(lm_head_tokens=tokens))
    assert "lm_head_tokens: expected ascending token ids below model_spec.vocab_size" in engine_error(engine)


def test_listed_file_missing(engine: Path) -> None:
    (engine / "tokenizer" / "tokenizer.json").unlink()
    assert "missing file tokenizer/tokenizer.json" in engine_error(engine)


def test_size_mismatch(engine: Path) -> None:
    with open(engine / "model.onnx.data", "ab") as f:
        f.write(b"extra")
    msg = engine_error(engine, verify_checksums=False)  # sizes are checked even without hashing
    assert "size mismatch for model.onnx.data" in msg


def test_checksum_mismatch(engine: Path) -> None:
    data = bytearray((engine / "model.onnx.data").read_bytes())
    data[100] ^= 0xFF
    (engine / "model.onnx.data").write_bytes(bytes(data))
    assert "checksum mismatch for model.onnx.data" in engine_error(engine)
    open_engine(engine, verify_checksums=False)


def test_bad_files_entry(engine: Path) -> None:
    rewrite_manifest(engine, lambda d: d["files"].update({"model.onnx": "abc"}))
    assert "files.model.onnx: expected an object" in engine_error(engine)


# Every file the runtime opens, and how a manifest names it.
ROLES: dict[str, Callable[[Manifest, str], Manifest]] = {
    "model": lambda m, rel: dataclasses.replace(m, payload=dataclasses.replace(m.payload, model=rel)),
    "weights": lambda m, rel: dataclasses.replace(m, payload=dataclasses.replace(m.payload, weights=rel)),
    "tokenizer": lambda m, rel: dataclasses.replace(m, tokenizer=dataclasses.replace(m.tokenizer, file=rel)),
    "tokenizer_config": lambda m, rel: dataclasses.replace(m, tokenizer=dataclasses.replace(m.tokenizer, config=rel)),
    "chat_template": lambda m, rel: dataclasses.replace(m, tokenizer=dataclasses.replace(m.tokenizer,
                                                                                        chat_template=rel)),
    "generation_config": lambda m, rel: dataclasses.replace(m, generation_config=rel),
}


def test_roles_cover_every_file_the_manifest_names() -> None:
    assert set(sample_manifest().role_files()) == set(ROLES)


def _point(engine: Path, role: str, rel: str) -> None:
    """The manifest names `rel` for `role`, listed with the right checksum: its place is the only fault."""
    secret = engine.parent / "secret"
    secret.write_bytes(b"s")
    manifest = ROLES[role](open_engine(engine).manifest, rel)
    files = {**manifest.files, rel: FileEntry(hashlib.sha256(b"s").hexdigest(), 1)}
    write_manifest(engine, dataclasses.replace(manifest, files=files))


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("rel", ["../secret", "/etc/passwd", "tokenizer/../../secret", "a\\..\\b"])
def test_a_file_named_outside_the_engine_is_refused(engine: Path, role: str, rel: str) -> None:
    _point(engine, role, rel)
    assert "unsafe path" in engine_error(engine)


@pytest.mark.parametrize("role", ROLES)
def test_a_symlink_out_of_the_engine_is_refused(engine: Path, role: str) -> None:
    (engine / "link").symlink_to(engine.parent / "secret")
    _point(engine, role, "link")
    assert "resolves outside the engine" in engine_error(engine)


@pytest.mark.parametrize("name", [TUNING_FILE, MANIFEST])
def test_unlisted_files_the_runtime_reads_may_not_link_out(engine: Path, name: str) -> None:
    outside = engine.parent / "outside.json"
    outside.write_text((engine / MANIFEST).read_text() if name == MANIFEST else '{"schema_version": 1, "options": {}}')
    (engine / name).unlink(missing_ok=True)
    (engine / name).symlink_to(outside)
    assert "resolves outside the engine" in engine_error(engine)


@pytest.mark.parametrize("role", ROLES)
def test_a_file_the_manifest_does_not_list_is_refused(engine: Path, role: str) -> None:
    (engine / "other").write_bytes(b"x")
    write_manifest(engine, ROLES[role](open_engine(engine).manifest, "other"))
    assert "is not listed in manifest.json" in engine_error(engine)


# --- inspect --------------------------------------------------------------------------------


def test_describe(engine: Path) -> None:
    text = describe(open_engine(engine).manifest, engine)
    for needle in ["org/tiny-llama", "onnxruntime (target cpu)", "num_layers", "block_size",
                   "[2, num_blocks, 16, 2, 16]", "input_ids, position_ids", "kv_cache_out.1", "merge-matmuls",
                   "qkv_merge=2", "folded=0", "chat_template.jinja", "model.onnx.data", "2.9 KiB"]:
        assert needle in text, needle


def test_a_tensorrt_engine_is_described_and_refused_by_the_cpu_runtime_in_one_line(engine: Path) -> None:
    """What `llmc inspect` shows of a plan's manifest (the GPU and TensorRT it runs on, its
    profiles), and the ONNX Runtime engine's one-line refusal to run one."""
    import dataclasses

    from llmc.contract.manifest import Backend
    from llmc.contract.profiles import profiles
    from llmc.runtime.engine import Engine

    manifest = open_engine(engine).manifest
    backend = Backend("tensorrt", "cuda", (), "sm_90", "10.9.0", "libllmc_trt_plugin.so",
                      profiles(block_size=16, max_context=manifest.max_context))
    write_manifest(engine, dataclasses.replace(manifest, backend=backend))
    text = describe(open_engine(engine).manifest, engine)
    for needle in ["tensorrt (target cuda)", "gpu architecture  sm_90", "TensorRT          10.9.0",
                   "profile decode   rows 1-16, tokens 1-1", "profile prefill  rows 1-16, tokens 2-"]:
        assert needle in text, needle
    with pytest.raises(EngineError, match=r"is a TensorRT plan \(sm_90, TensorRT 10.9.0\), which ONNX Runtime "
                                          r"cannot run.*--backend onnxruntime"):
        Engine(engine)
    try:
        import tensorrt  # noqa: F401
    except ImportError:  # LLM loads its backend, TensorRT's, which is not here: one line naming the fix
        from llmc.runtime.llm import LLM

        with pytest.raises(LlmcError, match=r"^--backend tensorrt needs TensorRT, which is not installed .*"
                                            r"pip install 'llmc\[trt\]'"):
            LLM(engine)
