"""Only the native part of the build; everything else is in pyproject.toml.

llmc's CPU kernels (llmc/kernels/) compile into a shared library that ONNX Runtime loads as a
custom-op library. The extension is optional: where no C compiler is found the install still
succeeds and engines are built from standard ONNX ops instead.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "llmc.kernels._cpu_ops",
    sources=["llmc/kernels/cpu_ops.c", "llmc/kernels/attention.c", "llmc/kernels/linear.c"],
    depends=["llmc/kernels/kernels.h", "llmc/kernels/simd.h", "llmc/kernels/ort_abi.h"],
    # -fopenmp-simd honours the `omp simd` loops without linking an OpenMP runtime (ORT owns the
    # threads); -ffp-contract=fast because -std=c11 otherwise forbids fusing `a += x * w` into
    # one FMA (separate multiply and add halved the GEMM's compute rate: decode at 16 rows was
    # 19% slower); no -ffast-math: the kernels must match the reference to 1e-5.
    extra_compile_args=["-O3", "-std=c11", "-fopenmp-simd", "-ffp-contract=fast", "-fno-math-errno",
                        "-fno-trapping-math", "-fvisibility=hidden"],
    optional=True,
)])
