"""llmc: compile HuggingFace decoder-only models to engine artifacts and serve them.

`import llmc` stays cheap: heavy modules (torch, transformers, onnxruntime) load inside
the commands and classes that need them.
"""

from llmc.version import __version__

# The backends that ship with llmc, each registering with the runtime (llmc.runtime.backends) as it
# is imported; here, so that they are registered before any part of llmc loads an engine. ONNX
# Runtime's is the runtime's own (llmc.runtime.engine).
from llmc import trt  # noqa: F401  (TensorRT's; it imports TensorRT itself only for a plan)

__all__ = ["LLM", "SamplingParams", "LlmcError", "__version__"]


def __getattr__(name):
    if name == "LLM":
        from llmc.runtime.llm import LLM

        return LLM
    if name == "SamplingParams":
        from llmc.runtime.sampling import SamplingParams

        return SamplingParams
    if name == "LlmcError":
        from llmc.errors import LlmcError

        return LlmcError
    raise AttributeError(f"module 'llmc' has no attribute {name!r}")
