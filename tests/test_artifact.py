"""The engine directory contract: atomic writes, validation errors, and `llmc inspect` text."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from llmc import artifact
from llmc.artifact import MANIFEST, SCHEMA_VERSION, EngineWriter, engine_file, format_manifest, load_manifest
from llmc.errors import EngineError

PAYLOAD = {
    "model.onnx": b"onnx-graph",
    "model.onnx.data": os.urandom(3000),
    "tokenizer/tokenizer.json": b'{"model": {}}',
    "tokenizer/tokenizer_config.json": b"{}",
    "generation_config.json": b'{"eos_token_id": 2}',
    "build_report.md": b"# report\n",
    "build_report.json": b"{}",
}


def base_manifest() -> dict[str, Any]:
    return {
        "source": "org/tiny-llama",
        "backend": "onnx",
        "target": "cpu",
        "model_spec": {"family": "llama", "num_layers": 2, "hidden_size": 64, "eos_token_ids": [2]},
        "io": {"inputs": ["input_ids", "position_ids"], "outputs": ["logits", "present.0.key"]},
        "kv_cache": {"layout": "paged", "block_size": 16},
        "build_options": {"dtype": "float32", "opset": 18},
        "passes": [
            {"name": "fuse_rmsnorm", "counts": {"rmsnorm_fused": 5}, "seconds": 0.12, "changed": True},
            {"name": "fold_constants", "counts": {"folded": 0}, "seconds": 0.01, "changed": False},
        ],
    }


def write_payload(root: Path, payload: dict[str, bytes] = PAYLOAD) -> None:
    for rel, data in payload.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def build(target: Path, overwrite: bool = False, payload: dict[str, bytes] = PAYLOAD) -> Path:
    with EngineWriter(target, overwrite=overwrite) as w:
        write_payload(w.path, payload)
        return w.commit(base_manifest())


def edit_manifest(engine: Path, **changes: Any) -> None:
    data = json.loads((engine / MANIFEST).read_text())
    for key, value in changes.items():
        if value is _DELETE:
            data.pop(key)
        else:
            data[key] = value
    (engine / MANIFEST).write_text(json.dumps(data))


_DELETE = object()


def engine_error(engine: Path, **kw: Any) -> str:
    with pytest.raises(EngineError) as info:
        load_manifest(engine, **kw)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


# --- writing --------------------------------------------------------------------------------


def test_round_trip(tmp_path: Path) -> None:
    target = tmp_path / "engine"
    assert build(target) == target
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]  # no temp dir left behind

    manifest = load_manifest(target)
    assert manifest == json.loads((target / MANIFEST).read_text())
    assert manifest["schema_version"] == SCHEMA_VERSION
    assert manifest["llmc_version"]
    assert manifest["created_at"].endswith("+00:00")
    assert manifest["io"] == base_manifest()["io"]
    assert set(manifest["files"]) == set(PAYLOAD)  # manifest.json does not list itself
    for rel, data in PAYLOAD.items():
        assert manifest["files"][rel] == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


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


def test_commit_requires_compiler_keys(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model_spec"):
        with EngineWriter(tmp_path / "engine") as w:
            manifest = base_manifest()
            del manifest["model_spec"]
            w.commit(manifest)
    assert list(tmp_path.iterdir()) == []


def test_existing_engine_needs_overwrite(tmp_path: Path) -> None:
    target = build(tmp_path / "engine")
    with pytest.raises(EngineError, match="--overwrite") as info:
        EngineWriter(target).__enter__()
    assert "\n" not in str(info.value)
    load_manifest(target)


def test_overwrite_replaces_engine(tmp_path: Path) -> None:
    target = build(tmp_path / "engine")
    new_payload = {"model.onnx": b"v2", "build_report.md": b"v2"}
    build(target, overwrite=True, payload=new_payload)
    manifest = load_manifest(target)
    assert set(manifest["files"]) == set(new_payload)
    assert not (target / "model.onnx.data").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]


def test_overwrite_failed_swap_restores_old(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = build(tmp_path / "engine")
    before = (target / MANIFEST).read_text()
    real_replace = os.replace

    def flaky_replace(src: Any, dst: Any) -> None:
        if ".partial-" in str(src):
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(artifact.os, "replace", flaky_replace)
    with pytest.raises(OSError, match="disk full"):
        build(target, overwrite=True, payload={"model.onnx": b"v2"})
    monkeypatch.undo()
    assert (target / MANIFEST).read_text() == before
    load_manifest(target)
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
    target = build(tmp_path / "out" / "engines" / "tiny")
    load_manifest(target)


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


@pytest.mark.parametrize("value", [_DELETE, "1", 1.0, True, None])
def test_bad_schema_version(engine: Path, value: Any) -> None:
    edit_manifest(engine, schema_version=value)
    assert "schema_version" in engine_error(engine)


def test_newer_schema(engine: Path) -> None:
    edit_manifest(engine, schema_version=SCHEMA_VERSION + 1)
    msg = engine_error(engine)
    assert "newer llmc" in msg and f"schema {SCHEMA_VERSION + 1}" in msg and "upgrade llmc" in msg


def test_older_schema(engine: Path) -> None:
    edit_manifest(engine, schema_version=0)
    msg = engine_error(engine)
    assert "schema 0" in msg and "rebuild" in msg


@pytest.mark.parametrize("key", ["files", "backend", "model_spec", "io"])
def test_missing_required_key(engine: Path, key: str) -> None:
    edit_manifest(engine, **{key: _DELETE})
    msg = engine_error(engine)
    assert "missing required keys" in msg and key in msg


def test_listed_file_missing(engine: Path) -> None:
    (engine / "tokenizer" / "tokenizer.json").unlink()
    msg = engine_error(engine)
    assert "missing file tokenizer/tokenizer.json" in msg


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
    load_manifest(engine, verify_checksums=False)


def test_bad_files_entry(engine: Path) -> None:
    edit_manifest(engine, files={"model.onnx": "abc"})
    assert "bad entry for 'model.onnx'" in engine_error(engine)


@pytest.mark.parametrize("rel", ["../secret", "/etc/passwd", "tokenizer/../../secret", "a\\..\\b"])
def test_path_traversal_refused(engine: Path, rel: str) -> None:
    (engine.parent / "secret").write_bytes(b"s")
    data = json.loads((engine / MANIFEST).read_text())
    data["files"][rel] = {"sha256": hashlib.sha256(b"s").hexdigest(), "bytes": 1}
    (engine / MANIFEST).write_text(json.dumps(data))
    assert "unsafe path" in engine_error(engine)


def test_symlink_escape_refused(engine: Path) -> None:
    (engine.parent / "secret").write_bytes(b"s")
    (engine / "link").symlink_to(engine.parent / "secret")
    data = json.loads((engine / MANIFEST).read_text())
    data["files"]["link"] = {"sha256": hashlib.sha256(b"s").hexdigest(), "bytes": 1}
    (engine / MANIFEST).write_text(json.dumps(data))
    assert "outside the engine" in engine_error(engine)


def test_engine_file(engine: Path) -> None:
    manifest = load_manifest(engine)
    assert engine_file(engine, manifest, "model.onnx") == engine / "model.onnx"
    assert engine_file(engine, manifest, "tokenizer") == engine / "tokenizer"  # folder of listed files
    with pytest.raises(EngineError, match="not listed"):
        engine_file(engine, manifest, "other.onnx")
    with pytest.raises(EngineError, match="unsafe path"):
        engine_file(engine, manifest, "../engine/model.onnx")


# --- inspect --------------------------------------------------------------------------------


def test_format_manifest(engine: Path) -> None:
    text = format_manifest(load_manifest(engine), engine)
    for needle in [
        "org/tiny-llama",
        "onnx (target cpu)",
        "num_layers",
        "block_size",
        "input_ids, position_ids",
        "present.0.key",
        "opset",
        "fuse_rmsnorm",
        "rmsnorm_fused=5",
        "fold_constants",
        "folded=0",
        "model.onnx.data",
        "2.9 KiB",
    ]:
        assert needle in text, needle


def test_format_manifest_minimal() -> None:
    text = format_manifest({"backend": {"name": "onnx"}, "model_spec": {}, "io": {}, "files": {}}, "/x")
    assert "onnx" in text and "I/O" in text
    assert "Passes" not in text
