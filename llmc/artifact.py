"""The engine directory: the one contract between the compiler (writer) and the runtime (reader).

An engine is a directory holding `manifest.json`, the backend payload (e.g. `model.onnx` and
`model.onnx.data`), `tokenizer/`, `generation_config.json`, `build_report.md` and
`build_report.json`. The manifest is a JSON object with:

  schema_version  int, SCHEMA_VERSION when written            (added by EngineWriter.commit)
  llmc_version    str, the llmc that built it                 (added by EngineWriter.commit)
  created_at      str, ISO 8601 UTC                           (added by EngineWriter.commit)
  files           {relative posix path: {"sha256", "bytes"}}  (added by EngineWriter.commit)
  backend         str (e.g. "onnx") or dict with "name"       (required, from the compiler)
  model_spec      dict, `ModelSpec.to_dict()`                 (required, from the compiler)
  io              dict with "inputs" and "outputs"            (required, from the compiler)
  source, target, build_options, kv_cache, passes             (optional, shown by `llmc inspect`)

The runtime imports this module, so it uses the standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import textwrap
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any, Callable

from llmc.errors import EngineError

# 2: kv_cache.layout names the pools' layout (llmc/kv_layout.py); the runtime allocates by it.
SCHEMA_VERSION = 2
MANIFEST = "manifest.json"
REQUIRED_KEYS = ("schema_version", "files", "backend", "model_spec", "io")
_COMPILER_KEYS = ("backend", "model_spec", "io")  # the rest are filled in by EngineWriter.commit

_CHUNK = 1 << 20  # 1 MiB: bounded memory while hashing multi-GiB weight files


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _build_hint(target: Path | str) -> str:
    return f"build one with `llmc build MODEL -o {target}`"


def _hidden_sibling(target: Path, tag: str) -> Path:
    """An unused hidden path beside `target`, e.g. `.engine.partial-1a2b3c4d`."""
    for _ in range(100):
        path = target.parent / f".{target.name}.{tag}-{os.urandom(4).hex()}"
        if not (path.exists() or path.is_symlink()):
            return path
    raise EngineError(f"cannot pick a temporary name in {target.parent}; remove stale .{target.name}.{tag}-* folders")


def _check_target(target: Path, overwrite: bool) -> None:
    if not (target.exists() or target.is_symlink()):
        return
    if not target.is_dir() or target.is_symlink():
        raise EngineError(f"{target} already exists and is not an engine directory; choose another -o")
    if not (target / MANIFEST).is_file():
        # Never delete a folder we did not create, even with --overwrite.
        raise EngineError(
            f"{target} already exists and is not an llmc engine (no {MANIFEST}); "
            "refusing to replace it, choose another -o"
        )
    if not overwrite:
        raise EngineError(f"engine {target} already exists; pass --overwrite or choose another -o")


class EngineWriter:
    """Builds an engine in a hidden temp dir beside `target` and moves it into place on commit.

    Until `commit` succeeds nothing exists at `target`; leaving the `with` block without
    committing (an exception, Ctrl-C) deletes the temp dir, so an interrupted build leaves
    no trace. With `overwrite`, an existing engine is swapped out only once the new one is
    complete.
    """

    def __init__(self, target: str | Path, overwrite: bool = False) -> None:
        self.target = Path(target).absolute()
        self.overwrite = overwrite
        self.path: Path | None = None
        self._committed = False

    def __enter__(self) -> "EngineWriter":
        _check_target(self.target, self.overwrite)
        self.target.parent.mkdir(parents=True, exist_ok=True)
        # Same parent as the target so the final os.replace is a rename on one filesystem.
        # os.mkdir rather than tempfile.mkdtemp: the finished engine should get the user's
        # umask permissions, not mkdtemp's owner-only 0o700.
        path = _hidden_sibling(self.target, "partial")
        os.mkdir(path)
        self.path = path
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.path is not None and not self._committed:
            shutil.rmtree(self.path, ignore_errors=True)

    def commit(self, manifest: dict[str, Any]) -> Path:
        """Hash the payload, write manifest.json and move the engine to the target path."""
        if self.path is None or self._committed:
            raise RuntimeError("EngineWriter.commit must be called once, inside the `with` block")
        missing = [k for k in _COMPILER_KEYS if k not in manifest]
        if missing:
            # A compiler bug, not a user error: refuse to write an engine the runtime would reject.
            raise ValueError(f"engine manifest is missing required keys: {', '.join(missing)}")

        from llmc import __version__

        files: dict[str, dict[str, Any]] = {}
        for p in sorted(self.path.rglob("*")):
            rel = p.relative_to(self.path).as_posix()
            if rel == MANIFEST or not p.is_file():
                continue
            files[rel] = {"sha256": _sha256(p), "bytes": p.stat().st_size}

        full = dict(manifest)
        full.update(
            schema_version=SCHEMA_VERSION,
            llmc_version=__version__,
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            files=files,
        )
        with open(self.path / MANIFEST, "w", encoding="utf-8") as f:
            json.dump(full, f, indent=2)
            f.write("\n")

        # The target may have changed since __enter__ (another build); check again.
        _check_target(self.target, self.overwrite)
        if not self.target.exists():
            os.replace(self.path, self.target)
            self._committed = True
            return self.target
        # os.replace cannot move a directory onto a non-empty one: move the old engine aside,
        # move the new one in, and put the old one back if that fails.
        aside = _hidden_sibling(self.target, "old")
        os.replace(self.target, aside)
        try:
            os.replace(self.path, self.target)
        except BaseException:
            os.replace(aside, self.target)
            raise
        self._committed = True
        shutil.rmtree(aside, ignore_errors=True)
        return self.target


def engine_file(engine_dir: str | Path, manifest: dict[str, Any], rel: str) -> Path:
    """The absolute path of `rel` (a file, or a folder such as "tokenizer") listed in the manifest.

    Refuses paths that are not listed or that would resolve outside the engine directory, so a
    tampered manifest cannot make the runtime read arbitrary files.
    """
    root = Path(engine_dir).absolute()
    pure = PurePosixPath(rel)
    if not rel or "\\" in rel or pure.is_absolute() or ".." in pure.parts:
        raise EngineError(f"engine {root}: manifest lists unsafe path {rel!r} (outside the engine); rebuild it")
    path = root.joinpath(*pure.parts)
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        raise EngineError(
            f"engine {root}: {rel!r} resolves outside the engine (symlink?); rebuild it with `llmc build`"
        ) from None
    files = manifest.get("files") or {}
    prefix = pure.as_posix() + "/"
    if rel not in files and not any(name.startswith(prefix) for name in files):
        raise EngineError(f"engine {root}: {rel!r} is not listed in {MANIFEST}; rebuild it with `llmc build`")
    return path


def read_json_object(path: Path, corrupt: Callable[[str], Exception],
                     unreadable: Callable[[str], Exception]) -> dict[str, Any]:
    """Parse the JSON object in `path`; raise corrupt(why) or unreadable(why), why being one line."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise corrupt(f"{e.msg} at line {e.lineno}") from None
    except UnicodeDecodeError:
        raise corrupt("not UTF-8 text") from None
    except OSError as e:
        raise unreadable(str(e.strerror)) from None
    if not isinstance(data, dict):
        raise corrupt(f"expected a JSON object, got {type(data).__name__}")
    return data


def load_manifest(engine_dir: str | Path, verify_checksums: bool = True) -> dict[str, Any]:
    """Read and validate an engine's manifest; raise EngineError naming the first problem."""
    root = Path(engine_dir).absolute()
    rebuild = "rebuild it with `llmc build`"
    if not root.exists():
        raise EngineError(f"no engine at {root}; {_build_hint(root)}")
    if not root.is_dir():
        raise EngineError(f"{root} is a file, not an engine directory; pass the folder `llmc build -o` created")
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise EngineError(f"{root} is not an llmc engine (no {MANIFEST}); {_build_hint(root)}")

    manifest = read_json_object(
        mpath, corrupt=lambda why: EngineError(f"engine {root}: corrupt manifest ({why}); {rebuild}"),
        unreadable=lambda why: EngineError(f"engine {root}: cannot read {MANIFEST} ({why}); check its permissions"))

    version = manifest.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise EngineError(f"engine {root}: corrupt manifest (schema_version missing or not an integer); {rebuild}")
    if version > SCHEMA_VERSION:
        raise EngineError(
            f"engine {root} was built by a newer llmc (schema {version}, this llmc reads {SCHEMA_VERSION}); "
            f"upgrade llmc or {rebuild}"
        )
    if version != SCHEMA_VERSION:
        raise EngineError(
            f"engine {root} uses unsupported schema {version} (this llmc reads {SCHEMA_VERSION}); {rebuild}"
        )

    missing = [k for k in REQUIRED_KEYS if k not in manifest]
    if missing:
        raise EngineError(f"engine {root}: manifest is missing required keys: {', '.join(missing)}; {rebuild}")

    files = manifest["files"]
    if not isinstance(files, dict):
        raise EngineError(f"engine {root}: corrupt manifest (files is not an object); {rebuild}")
    for rel, entry in files.items():
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("sha256"), str)
            or not isinstance(entry.get("bytes"), int)
        ):
            raise EngineError(f"engine {root}: corrupt manifest (bad entry for {rel!r} in files); {rebuild}")
        path = engine_file(root, manifest, rel)
        if not path.is_file():
            raise EngineError(f"engine {root}: missing file {rel} (listed in {MANIFEST}); {rebuild}")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise EngineError(
                f"engine {root}: size mismatch for {rel} (expected {entry['bytes']} bytes, found {size}; "
                f"file truncated or changed); {rebuild}"
            )
        if verify_checksums and _sha256(path) != entry["sha256"]:
            raise EngineError(f"engine {root}: checksum mismatch for {rel} (file changed or corrupt); {rebuild}")
    return manifest


# --- `llmc inspect` -------------------------------------------------------------------------


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _value(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v, separators=(", ", ": ")) if v else "-"
    return str(v)


def _kv_lines(d: dict[str, Any]) -> list[str]:
    if not d:
        return ["  (none)"]
    width = max(len(str(k)) for k in d)
    return [f"  {str(k):<{width}}  {_value(v)}" for k, v in d.items()]


def _names(items: Any) -> list[str]:
    # io lists may hold plain names or {"name": ..., "shape": ..., "dtype": ...} dicts.
    if isinstance(items, dict):
        return [str(k) for k in items]
    out = []
    for item in items or []:
        out.append(str(item.get("name", item)) if isinstance(item, dict) else str(item))
    return out


def _describe(v: Any, key: str = "name") -> str:
    if isinstance(v, dict):
        return str(v.get(key) or _value(v))
    return _value(v)


def format_manifest(manifest: dict[str, Any], engine_dir: str | Path) -> str:
    """Human-readable summary of an engine for `llmc inspect`; tolerates missing optional sections."""
    lines: list[str] = [f"Engine {Path(engine_dir)}"]
    backend = _describe(manifest.get("backend"))
    target = manifest.get("target")
    if target is None and isinstance(manifest.get("backend"), dict):
        target = manifest["backend"].get("target")
    header = {
        "source": _describe(manifest.get("source"), "model"),
        "llmc version": f"{_value(manifest.get('llmc_version'))} (schema {_value(manifest.get('schema_version'))})",
        "created": _value(manifest.get("created_at")),
        "backend": backend if target is None else f"{backend} (target {_value(target)})",
    }
    lines += _kv_lines(header)

    def section(title: str, body: list[str]) -> None:
        lines.append("")
        lines.append(title)
        lines.extend(body)

    spec = manifest.get("model_spec")
    section("Model spec", _kv_lines(spec) if isinstance(spec, dict) else ["  (none)"])

    kv = manifest.get("kv_cache")
    if isinstance(kv, dict) and kv:
        section("KV cache", _kv_lines(kv))

    io = manifest.get("io") if isinstance(manifest.get("io"), dict) else {}
    io_lines = []
    for kind in ("inputs", "outputs"):
        names = _names(io.get(kind))
        prefix = f"  {f'{kind} ({len(names)})':<14}  "
        # Engines with many layers have hundreds of KV names: wrap rather than one huge line.
        text = ", ".join(names) if names else "-"
        io_lines += textwrap.wrap(text, width=100, initial_indent=prefix, subsequent_indent=" " * len(prefix))
    section("I/O", io_lines)

    options = manifest.get("build_options")
    if isinstance(options, dict) and options:
        section("Build options", _kv_lines(options))

    passes = [p for p in manifest.get("passes") or [] if isinstance(p, dict)]
    if passes:
        rows = []
        for p in passes:
            counts = p.get("counts") or {}
            counts_text = ", ".join(f"{k}={v}" for k, v in counts.items()) if isinstance(counts, dict) else "-"
            seconds = p.get("seconds")
            time_text = f"{seconds:.2f}s" if isinstance(seconds, (int, float)) else "-"
            rows.append((str(p.get("name", "?")), _value(p.get("changed")), time_text, counts_text or "-"))
        width = max(len("pass"), *(len(r[0]) for r in rows))
        body = [f"  {'pass':<{width}}  changed  {'time':>8}  counts"]
        body += [f"  {n:<{width}}  {c:<7}  {t:>8}  {k}" for n, c, t, k in rows]
        section(f"Passes ({len(passes)})", body)

    files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    if files:
        sizes = {rel: e.get("bytes") if isinstance(e, dict) else None for rel, e in files.items()}
        width = max(len(rel) for rel in sizes)
        body = [
            f"  {rel:<{width}}  {_human_bytes(n) if isinstance(n, int) else '?':>10}" for rel, n in sizes.items()
        ]
        total = sum(n for n in sizes.values() if isinstance(n, int))
        body.append(f"  {'total':<{width}}  {_human_bytes(total):>10}")
        section(f"Files ({len(files)})", body)
    return "\n".join(lines)
