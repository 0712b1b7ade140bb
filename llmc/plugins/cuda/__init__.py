"""llmc.plugins.cuda: llmc's CUDA paged-attention kernels and their TensorRT plugin, as sources.

attention.cu implements `llmc::PagedAttention` (paged_attention.py is its definition) behind the C
API of llmc_attention.h; plugin.cpp wraps it as a TensorRT IPluginV3; CMakeLists.txt builds both
libraries on a machine with the CUDA toolkit (and TensorRT for the plugin). This module compiles
the kernels with nvcc alone, which needs no GPU: from PATH or from the `nvidia-cuda-nvcc` wheel
that `pip install 'llmc[cuda-build]'` brings. It imports neither torch nor CuPy; callers that run
the library bring their own device buffers and pass raw pointers (see PagedAttentionArgs).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

from llmc.errors import LlmcError

SOURCE_DIR = Path(__file__).resolve().parent
ATTENTION_SOURCE = SOURCE_DIR / "attention.cu"
PLUGIN_SOURCE = SOURCE_DIR / "plugin.cpp"
HEADER = SOURCE_DIR / "llmc_attention.h"
LIBRARY_NAME = "libllmc_cuda_attention.so"
NVCC_ENV = "LLMC_NVCC"  # an nvcc to use instead of the search below
INSTALL_HINT = "pip install 'llmc[cuda-build]'"
SHARED_ARCHS = ("80", "90")  # machine code for these; PTX for the last, for newer GPUs to JIT
ABI_VERSION = 3  # LLMC_ATTENTION_ABI_VERSION
DTYPES = {"fp16": 0, "bf16": 1}
STATUS = {0: "LLMC_OK", 1: "LLMC_ERR_NULL_POINTER", 2: "LLMC_ERR_BAD_SHAPE", 3: "LLMC_ERR_HEAD_DIM",
          4: "LLMC_ERR_DTYPE", 5: "LLMC_ERR_HEADS", 6: "LLMC_ERR_ALIGNMENT", 7: "LLMC_ERR_ATTRIBUTE",
          8: "LLMC_ERR_CUDA", 9: "LLMC_ERR_ROTARY"}


def _wheel_nvcc() -> Path | None:
    """nvcc from the NVIDIA wheels: nvidia/cu13/bin (CUDA 13) or nvidia/cuda_nvcc/bin (CUDA 12)."""
    for entry in sys.path:
        base = Path(entry or ".") / "nvidia"
        if not base.is_dir():
            continue
        for candidate in sorted(base.glob("*/bin/nvcc"), reverse=True):
            if os.access(candidate, os.X_OK):
                return candidate
    return None


def find_nvcc() -> Path | None:
    """$LLMC_NVCC, else the pip-installed nvcc (the version llmc[cuda-build] pins), else nvcc on
    PATH, else $CUDA_HOME/bin/nvcc or /usr/local/cuda/bin/nvcc."""
    override = os.environ.get(NVCC_ENV)
    if override:
        return Path(override) if Path(override).is_file() else None
    found = _wheel_nvcc() or shutil.which("nvcc")
    if found:
        return Path(found)
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return Path(root) / "bin" / "nvcc"
    return None


def _require_nvcc() -> Path:
    nvcc = find_nvcc()
    if nvcc is None:
        raise LlmcError(f"nvcc not found, which compiling llmc's CUDA kernels needs: {INSTALL_HINT}")
    return nvcc


def _arch_number(arch: str) -> str:
    digits = arch.lower().removeprefix("sm_").removeprefix("compute_")
    if not digits[:2].isdigit() or int(digits[:2]) < 80:
        raise LlmcError(f"unsupported CUDA arch {arch!r}: llmc's kernels need sm_80 or newer (e.g. sm_80, sm_90)")
    return digits


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        first = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "no output")
        raise LlmcError(f"{what} failed (nvcc exit {proc.returncode}): {first.strip()}")


def nvcc_command(*args: str) -> list[str]:
    return [str(_require_nvcc()), "-std=c++17", "-O3", *args]


def compile_cubin(arch: str, out_dir) -> Path:
    """attention.cu -> out_dir/attention_sm_XX.cubin for one arch ("sm_90", "90", "sm_90a")."""
    number = _arch_number(arch)
    out = Path(out_dir) / f"attention_sm_{number}.cubin"
    out.parent.mkdir(parents=True, exist_ok=True)
    _run(nvcc_command("-cubin", f"-arch=sm_{number}", "-o", str(out), str(ATTENTION_SOURCE)),
         f"compiling {ATTENTION_SOURCE.name} for sm_{number}")
    return out


def build_shared_library(out_dir) -> Path:
    """attention.cu -> out_dir/libllmc_cuda_attention.so (sm_80 and sm_90 code, sm_90 PTX), with the
    CUDA runtime linked statically so the library loads next to any torch or CuPy."""
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in SHARED_ARCHS]
    gencode.append(f"-gencode=arch=compute_{SHARED_ARCHS[-1]},code=compute_{SHARED_ARCHS[-1]}")
    out = Path(out_dir) / LIBRARY_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    _run(nvcc_command("-shared", "-Xcompiler", "-fPIC", "-cudart", "static", *gencode, "-o", str(out),
                      str(ATTENTION_SOURCE)), f"building {LIBRARY_NAME}")
    return out


class PagedAttentionArgs(ctypes.Structure):
    """LlmcPagedAttentionArgs of llmc_attention.h, field for field (tests compare the two)."""

    _fields_ = [
        ("query", ctypes.c_void_p), ("key", ctypes.c_void_p), ("value", ctypes.c_void_p),
        ("cache", ctypes.c_void_p), ("output", ctypes.c_void_p),
        ("past_lens", ctypes.c_void_p), ("query_lens", ctypes.c_void_p), ("block_tables", ctypes.c_void_p),
        ("batch", ctypes.c_int32), ("seq", ctypes.c_int32), ("num_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32), ("num_blocks", ctypes.c_int32),
        ("block_size", ctypes.c_int32), ("max_blocks", ctypes.c_int32), ("max_query_len", ctypes.c_int32),
        ("dtype", ctypes.c_int32), ("scale", ctypes.c_float), ("softcap", ctypes.c_float),
        ("sliding_window", ctypes.c_int32), ("rope_cos", ctypes.c_void_p), ("rope_sin", ctypes.c_void_p),
        ("rotary_dim", ctypes.c_int32), ("rotary_interleaved", ctypes.c_int32),
        ("workspace", ctypes.c_void_p), ("workspace_size", ctypes.c_size_t),
    ]


def apply_rotary(x, cos, sin, interleaved: bool = False):
    """Numpy oracle of the kernels' RoPE (ONNX RotaryEmbedding): x [B, H, S, D], cos and sin
    [B, S, R/2] -> x with its first R dims of every head rotated, in float32. Pairs are (i, i + R/2)
    (interleaved=False) or (2i, 2i + 1); out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin. The
    caller rounds to the storage dtype, once, as the kernels do."""
    import numpy as np

    x = np.asarray(x, np.float32)
    cos = np.asarray(cos, np.float32)[:, None]
    sin = np.asarray(sin, np.float32)[:, None]
    half = cos.shape[-1]
    first, second = (slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if interleaved else (
        slice(0, half), slice(half, 2 * half))
    x1, x2 = x[..., first], x[..., second]
    out = x.copy()
    out[..., first] = x1 * cos - x2 * sin
    out[..., second] = x2 * cos + x1 * sin
    return out


def status_message(lib: ctypes.CDLL, status: int) -> str:
    """A failed call's status as one line; a CUDA failure says which CUDA error it was."""
    message = lib.llmc_error_string(status).decode()
    if STATUS.get(status) == "LLMC_ERR_CUDA":
        message += f": {lib.llmc_last_cuda_error().decode()}"
    return message


def load_library(path) -> ctypes.CDLL:
    """Load a built libllmc_cuda_attention.so with its signatures set; refuses, before touching
    any other symbol, a library built from other sources (another ABI version or struct size)."""
    lib = ctypes.CDLL(str(path))
    lib.llmc_attention_abi_version.restype = ctypes.c_int
    lib.llmc_attention_args_size.restype = ctypes.c_size_t
    version, size = lib.llmc_attention_abi_version(), lib.llmc_attention_args_size()
    if version != ABI_VERSION or size != ctypes.sizeof(PagedAttentionArgs):
        raise LlmcError(f"{path} has attention ABI {version} ({size}-byte args), llmc expects {ABI_VERSION} "
                        f"({ctypes.sizeof(PagedAttentionArgs)} bytes): rebuild it from this llmc's sources")
    args_p = ctypes.POINTER(PagedAttentionArgs)
    lib.llmc_paged_attention.argtypes = [args_p, ctypes.c_void_p]
    lib.llmc_paged_attention.restype = ctypes.c_int
    lib.llmc_paged_attention_workspace.argtypes = [args_p]
    lib.llmc_paged_attention_workspace.restype = ctypes.c_size_t
    lib.llmc_error_string.argtypes = [ctypes.c_int]
    lib.llmc_error_string.restype = ctypes.c_char_p
    lib.llmc_last_cuda_error.restype = ctypes.c_char_p
    return lib
