"""llmc's CPU kernels: a custom-op library ONNX Runtime loads (domain `llmc.cpu`).

The C sources (attention.c: the arithmetic; cpu_ops.c: ORT's custom-op ABI) are compiled by
setup.py when llmc is installed, as an optional extension: without a C compiler the install
still succeeds, the `cpu-kernels` pass stands aside and engines use standard ONNX ops.
The library is a plain shared object for ORT's `register_custom_ops_library`, not a Python
module: nothing imports it.
"""

from __future__ import annotations

import os
from pathlib import Path

DOMAIN = "llmc.cpu"
VERSION = 1
PANEL = 32  # PackedMatMul's column panel width (LLMC_PANEL in kernels.h)
# Points at another build of the library; set to "" to build and run without it.
LIBRARY_ENV = "LLMC_CPU_KERNELS"
MISSING_HINT = "reinstall llmc where a C compiler is available: pip install -e ."


def library_path() -> Path | None:
    override = os.environ.get(LIBRARY_ENV)
    if override is not None:
        return Path(override) if override and Path(override).is_file() else None
    found = sorted(Path(__file__).parent.glob("_cpu_ops*.so"))
    return found[-1] if found else None


def uses_kernels(opset_domains) -> bool:
    return DOMAIN in opset_domains


def register(session_options) -> None:
    """Make `session_options` able to run llmc.cpu nodes. Raises LlmcError when the library is
    missing, so an engine that needs it fails with the fix rather than ORT's unknown-op error."""
    from llmc.errors import LlmcError

    path = library_path()
    if path is None:
        raise LlmcError(f"this engine runs llmc's CPU kernels, which this install lacks; {MISSING_HINT}, "
                        "or rebuild the engine with --disable-pass cpu-kernels")
    session_options.register_custom_ops_library(str(path))
