"""The code corpus every machine has offline: the running interpreter's standard library.

Files are the library's `.py` sources without its tests (test packages, `idle_test`, `tests`)
and without site-packages, in sorted order. A file is held out when the SHA-256 of its path
relative to the library, taken as a number, is 0..4 mod 100 (about 5% of files): a property of
the path alone, so the split never moves when files are added or removed. corpus_split.json (here)
records the split the committed models were trained on (Python version, files, bytes, held-out
paths); `check_recorded()` tells whether this interpreter's library is that one.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path
from typing import Literal

Split = Literal["train", "heldout"]
HELDOUT_PERCENT = 5
RECORDED = Path(__file__).with_name("corpus_split.json")
_SKIP_DIRS = {"site-packages", "__pycache__", "idle_test", "tests"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(rel_path: str) -> Split:
    bucket = int(hashlib.sha256(rel_path.encode()).hexdigest(), 16) % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


def files(split: Split | None = None, root: Path | None = None) -> list[str]:
    """Relative paths (POSIX) of the corpus files, sorted; only `split`'s when given."""
    root = root or stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("test"))
        rel = Path(dirpath).relative_to(root)
        found += [(rel / f).as_posix() for f in filenames if f.endswith(".py")]
    found.sort()
    return [f for f in found if split is None or split_of(f) == split]


def read(rel_paths: list[str], root: Path | None = None) -> list[str]:
    """The files' texts (UTF-8; the standard library is)."""
    root = root or stdlib_root()
    return [(root / p).read_text(encoding="utf-8") for p in rel_paths]


def record(root: Path | None = None) -> dict:
    """What corpus_split.json holds, for this interpreter's library."""
    import sys

    root = root or stdlib_root()
    every = files(root=root)
    heldout = [p for p in every if split_of(p) == "heldout"]
    size = lambda paths: sum((root / p).stat().st_size for p in paths)  # noqa: E731
    return {"python": sys.version.split()[0], "files": len(every), "bytes": size(every),
            "heldout_files": len(heldout), "heldout_bytes": size(heldout), "heldout": heldout}


def check_recorded() -> str | None:
    """None when this interpreter's held-out files are the recorded ones, else why not."""
    recorded = json.loads(RECORDED.read_text())
    here = record()
    if here["heldout"] != recorded["heldout"] or here["heldout_bytes"] != recorded["heldout_bytes"]:
        return (f"this interpreter's standard library (Python {here['python']}) is not the one the models "
                f"were trained and measured on (Python {recorded['python']})")
    return None
