"""Only the native part of the build; everything else is in pyproject.toml.

llmc's CPU kernels (llmc/plugins/cpu/) compile into a shared library that ONNX Runtime loads as a
custom-op library. The extension is optional: where no C compiler is found the install still
succeeds and engines are built from standard ONNX ops instead.
"""

from setuptools import Extension, setup

# The sources compile concurrently: attention.c alone takes most of the build (docs/architecture.md,
# "Tests and CI").
try:
    from pybind11.setup_helpers import ParallelCompile

    ParallelCompile("LLMC_BUILD_JOBS").install()
except ImportError:  # `python setup.py build_ext` outside pip's build environment: one at a time
    pass

CPU = "llmc/plugins/cpu/"

setup(ext_modules=[Extension(
    "llmc.plugins.cpu._cpu_ops",
    # The arithmetic (attention.c .. experts.c, kernels.h), then ORT's custom ops: their glue
    # (ort_glue.c), compute (ops.c, decoder_layer.c) and DecoderLayer's scheduler (threads.c);
    # the recurrent layers' arithmetic (recurrent.c) and ops (recurrent_ops.c).
    sources=[CPU + name for name in ("attention.c", "linear.c", "quant.c", "quantize.c", "experts.c", "ort_glue.c",
                                     "ops.c", "decoder_layer.c", "threads.c", "recurrent.c",
                                     "recurrent_ops.c")],
    depends=[CPU + name for name in ("kernels.h", "simd.h", "ort_abi.h", "ort_glue.h", "ops.h", "threads.h")],
    # -fopenmp-simd honours the `omp simd` loops without linking an OpenMP runtime (ORT owns the
    # threads); -ffp-contract=fast because -std=c11 otherwise forbids fusing `a += x * w` into one
    # FMA, which costs the GEMM much of its compute rate (docs/attention_cpu.md); no -ffast-math:
    # the kernels must match the reference to 1e-5.
    extra_compile_args=["-O3", "-std=c11", "-fopenmp-simd", "-ffp-contract=fast", "-fno-math-errno",
                        "-fno-trapping-math", "-fvisibility=hidden"],
    optional=True,
)])
