"""What the benchmark scripts share: the engine under test."""

from __future__ import annotations

import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def engine_for(model: str, engine: Path | None, *build_args: str) -> tuple[Path, float | None, float | None]:
    """`engine` if given, else a fresh build of `model` in a temp dir. Returns (engine dir, build
    seconds, build peak RSS MB); the build runs in a child process so its time and memory are its own."""
    if engine is not None:
        return engine, None, None
    out = Path(tempfile.mkdtemp(prefix="llmc-bench-")) / "engine"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "llmc.cli", "build", model, "-o", str(out), *build_args],
                   check=True, stdout=subprocess.DEVNULL)
    return out, time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0
