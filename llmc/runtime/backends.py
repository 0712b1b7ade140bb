"""The runtime's backends, by the name an engine's manifest gives its backend (backend.name).

A backend registers a loader: (EngineFiles, RuntimeOptions | None) -> an engine with the interface
of ONNX Runtime's `Engine` (forward, forward_rows, spec, block_size, num_blocks, ...), which
`LLM`, the scheduler and `llmc bench` run unchanged. The runtime loads every engine through here,
so it imports no backend: the CPU install never loads TensorRT, CUDA or torch.

Who registers: ONNX Runtime's `Engine`, in llmc.runtime.engine beside `load_engine`; TensorRT's,
in llmc.trt, which llmc/__init__.py imports so that it is registered before anything of llmc runs.
A new backend registers in its own package and is imported there too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from llmc.errors import EngineError

if TYPE_CHECKING:  # types only: `import llmc` imports this module, and must stay cheap
    from llmc.contract.engine_dir import EngineFiles
    from llmc.contract.options import RuntimeOptions

    Loader = Callable[[EngineFiles, RuntimeOptions | None], Any]

_LOADERS: dict[str, Loader] = {}


def register(name: str, loader: Loader) -> None:
    """Load the engines whose manifest names backend `name` with `loader`."""
    _LOADERS[name] = loader


def load(files: EngineFiles, options: RuntimeOptions | None = None):
    """The engine of `files`, loaded by the backend its manifest names."""
    name = files.manifest.backend.name
    loader = _LOADERS.get(name)
    if loader is None:
        raise EngineError(f"engine {files.root} runs on {name}, for which this llmc has no backend; "
                          f"rebuild it for one of {', '.join(sorted(_LOADERS))}")
    return loader(files, options)
