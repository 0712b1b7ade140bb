"""llmc.cpu: llmc's CPU kernels, a custom-op library ONNX Runtime loads.

The C sources (attention.c, linear.c, quant.c, experts.c, recurrent.c: the arithmetic; ort_glue.c:
ORT's custom-op ABI, whose few slots it uses are declared in ort_abi.h because the ORT wheel ships
no headers, and the ops' registration; ops.c, decoder_layer.c, recurrent_ops.c: the ops; threads.c:
DecoderLayer's scheduler) are compiled by setup.py when llmc is installed, as an optional extension: without a C compiler the install
still succeeds, the passes that target these ops stand aside and engines use standard ONNX ops.
The library is a plain shared object for ORT's `register_custom_ops_library`, not a Python
module; the build also calls its quantizer (quantize.c) through ctypes (passes/quantizers.py).
library.py finds and loads it; host.py sets the tiles this host measured faster in it.
The ops and their inputs are documented in kernels.h; recurrent.py holds the recurrent layers'
(CausalConv1d, GatedDeltaRule) numpy references.
"""

from __future__ import annotations

from typing import NamedTuple

DOMAIN = "llmc.cpu"
VERSION = 1
PANEL = 32  # PackedMatMul's column panel width (LLMC_PANEL in kernels.h)
ACT_SILU, ACT_GELU_TANH = 0, 1  # SwiGLU's and SwiGLUMatMul's `activation` (LLMC_ACT_* in kernels.h)
ACT_CLAMPED_SWIGLU = 2  # Experts' only: gpt-oss's, with attributes alpha and limit


class PackedGemm(NamedTuple):
    weight_input: int  # where it takes its packed weight; the optional lossless copy is the input after
    num_outputs: int


# The ops that run the packed GEMM (ops.c).
PACKED_GEMMS = {"PackedMatMul": PackedGemm(1, 1), "SkipRMSNormMatMul": PackedGemm(3, 2),
                "SwiGLUMatMul": PackedGemm(1, 1)}


def register(session_options) -> None:
    """Make `session_options` able to run llmc.cpu nodes. Raises LlmcError when the library is
    missing, so an engine that needs it fails with the fix rather than ORT's unknown-op error."""
    from llmc.errors import LlmcError
    from llmc.plugins.cpu.host import use_measured_kernels
    from llmc.plugins.cpu.library import MISSING_HINT, library_path

    path = library_path()
    if path is None:
        raise LlmcError(f"this engine runs llmc's CPU kernels, which this install lacks; {MISSING_HINT}, "
                        "or rebuild the engine with --disable-pass cpu-kernels")
    session_options.register_custom_ops_library(str(path))
    use_measured_kernels(path)  # this host's choices, set in the library before the session runs


def pack_weight(w):
    """[K, N] -> column panels [ceil(N / PANEL), K, PANEL], the last one zero-padded: the
    weight layout PackedMatMul reads (one panel streams while up to 12 rows accumulate)."""
    import numpy as np

    k, n = w.shape
    panels = -(-n // PANEL)
    out = np.empty((panels, k, PANEL), np.float32)
    full = n // PANEL
    # Each panel is a [K, PANEL] slice; copied panel by panel from the rows of a checkpoint's
    # [N, K] Linear (w is its transposed view), rather than through a transposed copy of all of w.
    np.copyto(out[:full], w[:, :full * PANEL].T.reshape(full, PANEL, k).transpose(0, 2, 1))
    if n > full * PANEL:
        out[full] = 0
        out[full, :, :n - full * PANEL] = w[:, full * PANEL:]
    return out


def pack_experts(w):
    """Stacked expert weights as the checkpoint holds them, [E, N, K] (each a Linear's [out, in]),
    -> each expert packed as pack_weight packs a [K, N] weight: [E, ceil(N / PANEL), K, PANEL],
    what llmc.cpu::Experts reads with packed=1."""
    import numpy as np

    return np.stack([pack_weight(expert.T) for expert in w])
