"""The TensorRT backend: the plan builder (plan.py, for --backend tensorrt) and `TrtEngine`
(engine.py), which runs a plan. Importing the package registers TrtEngine with the runtime
(llmc.runtime.backends) for manifests of backend "tensorrt"; llmc/__init__.py imports it. It
stays cheap: TensorRT, CUDA and torch load only when a plan is built or opened."""

from llmc.runtime import backends


def _load_plan(files, options):
    from llmc.trt.engine import TrtEngine  # here, not above: `import llmc` must not import numpy

    return TrtEngine(files, options)


backends.register("tensorrt", _load_plan)
