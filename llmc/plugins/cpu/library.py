"""Where llmc's CPU kernel library is, and the one loaded copy of it that ctypes calls go through.

Below both the package (whose `register` hands the library to ONNX Runtime) and host.py (which
sets this host's measured tiles in it), so neither imports the other's module to find it.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

# Points at another build of the library; set to "" to build and run without it.
LIBRARY_ENV = "LLMC_CPU_KERNELS"
MISSING_HINT = "reinstall llmc where a C compiler is available: pip install -e ."


def library_path() -> Path | None:
    override = os.environ.get(LIBRARY_ENV)
    if override is not None:
        return Path(override) if override and Path(override).is_file() else None
    found = sorted(Path(__file__).parent.glob("_cpu_ops*.so"))
    return found[-1] if found else None


@functools.cache
def native(path: Path):
    """The library at `path` loaded for ctypes calls (the build's quantizer, the host's tile probes):
    the same loaded object ORT's sessions use."""
    import ctypes

    return ctypes.CDLL(str(path))
