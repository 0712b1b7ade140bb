"""The engine directory: written whole by `EngineWriter`, opened only through `open_engine`.

An engine is a directory holding manifest.json, the files it lists (backend payload, tokenizer,
generation config, build report) and, optionally, tuning.json (llmc.contract.tuning). A build
writes into a hidden temp dir beside the target and renames it at the end, so nothing is ever
half-written. `open_engine` validates the manifest, checks that every file it names lies inside
the engine (no `..`, absolute paths or symlinks out: a tampered manifest must not make the runtime
read arbitrary files) and verifies sizes and checksums, all before any backend parses a byte.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from types import TracebackType

from llmc.contract.codec import ContractError
from llmc.contract.json_file import read_json_object
from llmc.contract.manifest import SCHEMA_VERSION, FileEntry, Manifest, SchemaError
from llmc.contract.tuning import TUNING_FILE
from llmc.errors import EngineError
from llmc.version import __version__

MANIFEST = "manifest.json"
_CHUNK = 1 << 20  # bounded memory while hashing multi-GiB weight files
# Writes that fail for want of room, and what frees it.
_NO_ROOM = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some space, raise your disk quota",
            errno.EFBIG: "raise the file-size limit (ulimit -f)"}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _hidden_sibling(target: Path, tag: str) -> Path:
    """An unused hidden path beside `target`, e.g. `.engine.partial-1a2b3c4d`."""
    for _ in range(100):
        path = target.parent / f".{target.name}.{tag}-{os.urandom(4).hex()}"
        if not (path.exists() or path.is_symlink()):
            return path
    raise EngineError(f"cannot pick a temporary name in {target.parent}; remove stale .{target.name}.{tag}-* folders")


def _gib_or_mib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _check_target(target: Path, overwrite: bool) -> None:
    if not (target.exists() or target.is_symlink()):
        return
    if not target.is_dir() or target.is_symlink():
        raise EngineError(f"{target} already exists and is not an engine directory; choose another -o")
    if not (target / MANIFEST).is_file():
        # Never delete a folder we did not create, even with --overwrite.
        raise EngineError(f"{target} already exists and is not an llmc engine (no {MANIFEST}); "
                          "refusing to replace it, choose another -o")
    if not overwrite:
        raise EngineError(f"engine {target} already exists; pass --overwrite or choose another -o")


class EngineWriter:
    """Builds an engine in a hidden temp dir beside `target` and moves it into place on commit.

    Until `commit` succeeds nothing exists at `target`; leaving the `with` block without
    committing (an exception, Ctrl-C) deletes the temp dir. With `overwrite`, an existing engine
    is swapped out only once the new one is complete. A write that fails for want of room (a full
    disk, a quota, a file-size limit) ends as a one-line EngineError naming the room needed.
    """

    def __init__(self, target: str | Path, overwrite: bool = False) -> None:
        self.target = Path(target).absolute()
        self.overwrite = overwrite
        self.path: Path | None = None
        self.expected_bytes = 0  # the engine's size, once the build knows it: for the out-of-space error
        self._committed = False

    def __enter__(self) -> "EngineWriter":
        _check_target(self.target, self.overwrite)
        self.target.parent.mkdir(parents=True, exist_ok=True)
        # Beside the target so the final os.replace is a rename on one filesystem; os.mkdir rather
        # than mkdtemp so the engine gets the user's umask, not owner-only 0o700.
        path = _hidden_sibling(self.target, "partial")
        os.mkdir(path)
        self.path = path
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.path is not None and not self._committed:
            shutil.rmtree(self.path, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in _NO_ROOM:
            raise EngineError(self._no_room(exc)) from None

    def reserve(self, nbytes: int) -> None:
        """The engine will take about `nbytes`: refuse now, before any work, where the disk lacks them."""
        self.expected_bytes = nbytes
        free = shutil.disk_usage(self.target.parent).free
        if free < nbytes:
            raise EngineError(f"cannot write engine {self.target}: it needs about {_gib_or_mib(nbytes)} and "
                              f"{self.target.parent} has {_gib_or_mib(free)} free; free some space or choose another -o")

    def _no_room(self, exc: OSError) -> str:
        free = shutil.disk_usage(self.target.parent).free  # measured after the partial engine is gone
        need = f"about {_gib_or_mib(self.expected_bytes)}" if self.expected_bytes else "more room"
        return (f"cannot write engine {self.target}: {exc.strerror}; it needs {need} and {self.target.parent} "
                f"has {_gib_or_mib(free)} free; {_NO_ROOM[exc.errno]} or choose another -o")

    def commit(self, manifest: Manifest) -> Path:
        """List and hash the payload into the manifest, write it and move the engine to the target."""
        if self.path is None or self._committed:
            raise RuntimeError("EngineWriter.commit must be called once, inside the `with` block")
        files = {p.relative_to(self.path).as_posix(): FileEntry(_sha256(p), p.stat().st_size)
                 for p in sorted(self.path.rglob("*")) if p.is_file() and p.name != MANIFEST}
        missing = [rel for rel in manifest.role_files().values() if rel is not None and rel not in files]
        if missing:  # a compiler bug: never write an engine the runtime would reject
            raise ValueError(f"the manifest names files the engine lacks: {', '.join(missing)}")
        manifest = dataclasses.replace(
            manifest, files=files, schema_version=SCHEMA_VERSION, llmc_version=__version__,
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
        with open(self.path / MANIFEST, "w", encoding="utf-8") as f:
            json.dump(manifest.to_json(), f, indent=2)
            f.write("\n")

        _check_target(self.target, self.overwrite)  # another build may have got there meanwhile
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


@dataclass(frozen=True)
class EngineFiles:
    """An opened engine: its manifest and the checked path of every file the runtime reads."""

    root: Path
    manifest: Manifest
    model: Path
    weights: Path | None
    tokenizer: Path
    tokenizer_config: Path
    chat_template: Path | None
    generation_config: Path
    tuning: Path | None  # tuning.json when the engine has one (not listed: re-tuning keeps checksums)
    # role -> sha256 of the files open_engine left for their reader to hash as it reads them
    # (`hash_later`): the weights, which the runtime reads whole anyway.
    unverified: dict[str, str] = field(default_factory=dict)


def read_eos_token_ids(path: Path) -> tuple[int, ...]:
    """The eos_token_id of an engine's generation_config.json (an id, a list of ids or null)."""
    def corrupt(why: str) -> EngineError:
        return EngineError(f"corrupt {path} ({why}); rebuild the engine with `llmc build`")

    data = read_json_object(path, corrupt, lambda why: EngineError(f"cannot read {path} ({why}); "
                                                                   "check its permissions"))
    value = data.get("eos_token_id")
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(type(i) is int and i >= 0 for i in ids):
        raise corrupt(f"eos_token_id: expected a token id >= 0 or a list of them, got {value!r}")
    return tuple(ids)


def _inside(root: Path, rel: str) -> Path:
    """`root`/`rel`, refused unless it stays inside `root` once resolved (symlinks included)."""
    pure = PurePosixPath(rel)
    if not rel or "\\" in rel or pure.is_absolute() or ".." in pure.parts:
        raise EngineError(f"engine {root}: manifest names unsafe path {rel!r} (outside the engine); rebuild it")
    path = root.joinpath(*pure.parts)
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        raise EngineError(f"engine {root}: {rel!r} resolves outside the engine (a symlink?); "
                          "rebuild it with `llmc build`") from None
    return path


def open_engine(engine_dir: str | Path, *, verify_checksums: bool = True,
                hash_later: tuple[str, ...] = ()) -> EngineFiles:
    """Validate an engine and resolve its files; raise EngineError naming the first problem. The
    files of the roles in `hash_later` are not hashed here: `unverified` gives their checksums to
    the reader that hashes them as it reads them (one pass over a multi-GB file, not two)."""
    root = Path(engine_dir).absolute()
    rebuild = "rebuild it with `llmc build`"
    if not root.exists():
        raise EngineError(f"no engine at {root}; build one with `llmc build MODEL -o {root}`")
    if not root.is_dir():
        raise EngineError(f"{root} is a file, not an engine directory; pass the folder `llmc build -o` created")
    if not (root / MANIFEST).is_file():
        raise EngineError(f"{root} is not an llmc engine (no {MANIFEST}); build one with `llmc build MODEL -o {root}`")
    data = read_json_object(
        _inside(root, MANIFEST),
        corrupt=lambda why: EngineError(f"engine {root}: corrupt manifest ({why}); {rebuild}"),
        unreadable=lambda why: EngineError(f"engine {root}: cannot read {MANIFEST} ({why}); check its permissions"))
    try:
        manifest = Manifest.from_json(data)
    except SchemaError as exc:
        if exc.newer:
            raise EngineError(f"engine {root} was built by a newer llmc (schema {exc.version}, this llmc reads "
                              f"{SCHEMA_VERSION}); upgrade llmc or {rebuild}") from None
        raise EngineError(f"engine {root} uses schema {exc.version}, which this llmc no longer reads (it reads "
                          f"{SCHEMA_VERSION}); {rebuild}") from None
    except ContractError as exc:
        raise EngineError(f"engine {root}: corrupt manifest ({exc}); {rebuild}") from None

    later = {rel: role for role, rel in manifest.role_files().items() if role in hash_later and rel is not None}
    for rel, entry in manifest.files.items():
        path = _inside(root, rel)
        if not path.is_file():
            raise EngineError(f"engine {root}: missing file {rel} (listed in {MANIFEST}); {rebuild}")
        size = path.stat().st_size
        if size != entry.bytes:
            raise EngineError(f"engine {root}: size mismatch for {rel} (expected {entry.bytes} bytes, found {size}; "
                              f"file truncated or changed); {rebuild}")
        if verify_checksums and rel not in later and _sha256(path) != entry.sha256:
            raise EngineError(f"engine {root}: checksum mismatch for {rel} (file changed or corrupt); {rebuild}")
    paths: dict[str, Path | None] = {}
    for role, rel in manifest.role_files().items():
        paths[role] = None if rel is None else _inside(root, rel)
        if rel is not None and rel not in manifest.files:
            raise EngineError(f"engine {root}: its {role} file {rel!r} is not listed in {MANIFEST}; {rebuild}")
    tuning = _inside(root, TUNING_FILE)
    unverified = {role: manifest.files[rel].sha256 for rel, role in later.items()} if verify_checksums else {}
    return EngineFiles(root=root, manifest=manifest, tuning=tuning if tuning.is_file() else None,
                       unverified=unverified, **paths)
