"""Building a TensorRT plan from the lowered graph (`llmc build --backend tensorrt`).

The network is strongly typed (the graph's fp16/bf16 types are its precision; TensorRT 11 builds
no other kind), parsed by TensorRT's ONNX parser with llmc's plugin library loaded so the
`llmc::PagedAttention` plugin nodes become layers of llmc's plugin, and built with
the engine's optimization profiles (llmc.contract.profiles). The plan runs only on the GPU
architecture and TensorRT version that built it; the manifest records both.

Nothing here is imported unless a TensorRT build or engine is asked for: the CPU install never
loads TensorRT or CUDA.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from llmc.contract.profiles import Profile
from llmc.errors import LlmcError

PLAN_FILE = "engine.plan"
PLUGIN_FILE = "libllmc_trt_plugin.so"
PLUGIN_ENV = "LLMC_TRT_PLUGIN"  # a prebuilt plugin library (else built with CMake from TENSORRT_ROOT)
INSTALL_HINT = "pip install 'llmc[trt]' on a machine with an NVIDIA GPU"


@dataclass(frozen=True)
class Toolchain:
    """TensorRT and the GPU a plan is built for."""

    trt: object  # the tensorrt module
    version: str
    gpu_arch: str  # "sm_90"


def toolchain() -> Toolchain:
    """TensorRT and a GPU, or a one-line LlmcError naming what is missing and the fix."""
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise LlmcError(f"--backend tensorrt needs TensorRT, which is not installed ({exc}); {INSTALL_HINT}") from None
    arch = _gpu_arch()
    if arch is None:
        raise LlmcError("--backend tensorrt needs an NVIDIA GPU and its driver, and none was found; build on the "
                        "machine (or the GPU architecture) that will serve the engine")
    return Toolchain(trt, trt.__version__, arch)


def check_plan(backend, tools: Toolchain) -> None:
    """Refuse, in one line, a plan built for another GPU architecture or TensorRT version."""
    for what, built, here in (("GPU architecture", backend.gpu_arch, tools.gpu_arch),
                              ("TensorRT version", backend.tensorrt_version, tools.version)):
        if built != here:
            raise LlmcError(f"this engine's plan was built for {what} {built}, and this machine has {here}; a plan "
                            f"runs only where it was built: rebuild it here with llmc build --backend tensorrt")


def _gpu_arch() -> str | None:
    """The first CUDA device's architecture ("sm_90"), read through the driver API (libcuda)."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
        return None
    # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75, _MINOR = 76
    if cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, 0) or cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, 0):
        return None
    return f"sm_{major.value}{minor.value}"


def plugin_library(out_dir: Path) -> Path:
    """llmc's plugin library for this TensorRT: `LLMC_TRT_PLUGIN`, or built into `out_dir` with
    CMake against the TensorRT headers and libraries under `TENSORRT_ROOT`."""
    prebuilt = os.environ.get(PLUGIN_ENV)
    if prebuilt:
        if not Path(prebuilt).is_file():
            raise LlmcError(f"{PLUGIN_ENV}={prebuilt}: no such file; point it at libllmc_trt_plugin.so or unset it")
        return Path(prebuilt)
    root = os.environ.get("TENSORRT_ROOT")
    if not root or not (Path(root) / "include" / "NvInfer.h").is_file():
        raise LlmcError("building llmc's TensorRT plugin needs TensorRT's headers: set TENSORRT_ROOT to the TensorRT "
                        f"SDK folder (with include/NvInfer.h), or {PLUGIN_ENV} to a prebuilt {PLUGIN_FILE}")
    import subprocess

    from llmc.plugins import cuda

    build = out_dir / "plugin-build"
    for args in (["cmake", "-S", str(cuda.SOURCE_DIR), "-B", str(build), f"-DTENSORRT_ROOT={root}",
                  "-DCMAKE_BUILD_TYPE=Release"], ["cmake", "--build", str(build), "--target", "llmc_trt_plugin"]):
        done = subprocess.run(args, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise LlmcError(f"building llmc's TensorRT plugin failed ({' '.join(args[:2])}): {tail[0]}")
    return build / PLUGIN_FILE


def build_plan(tools: Toolchain, onnx_path: Path, plugin: Path, profiles: tuple[Profile, ...], num_layers: int,
               pool_dims: tuple[int, ...]) -> bytes:
    """The serialized plan of the lowered graph at `onnx_path` (its weights beside it)."""
    trt = tools.trt
    logger = trt.Logger(trt.Logger.WARNING)
    registry = trt.get_plugin_registry()
    if registry.load_library(str(plugin)) is None:
        raise LlmcError(f"TensorRT could not load llmc's plugin library {plugin}; rebuild it for TensorRT "
                        f"{tools.version}")
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        first = parser.get_error(0)
        raise LlmcError(f"TensorRT's ONNX parser refused the lowered graph: {first.desc()} (node {first.node()}); "
                        "report it with the model's name")
    config = builder.create_builder_config()
    # The plugin writes the new K/V into the pool in place (its cache_out aliases its cache input);
    # without this TensorRT 10.3+ feature it copies the whole pool to cache_out every step.
    aliased = getattr(trt.PreviewFeature, "ALIASED_PLUGIN_IO_10_03", None)
    if aliased is not None:
        config.set_preview_feature(aliased, True)
    for profile in profiles:
        optimization = builder.create_optimization_profile()
        for name, (low, opt, high) in profile.shapes(num_layers, pool_dims).items():
            optimization.set_shape(name, low, opt, high)
        config.add_optimization_profile(optimization)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise LlmcError("TensorRT could not build the plan (its log above says why); report it with the model's name")
    return bytes(plan)
