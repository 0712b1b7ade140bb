"""The runtimes benchmarks/peers.py compares, one module each, and what they share.

    shared.py      paths, the peers' setup steps and environment, the driver's handle on a worker
    llama_cpp.py   llama.cpp: its build pins, GGUF conversion and quantization, GGUF byte counts,
                   and its worker backends (the low-level C API; Llama.generate with prompt lookup)
    ort_genai.py   ONNX Runtime GenAI: its pin, builder options and conversion, its worker backend
    llmc_engine.py llmc: building and naming the engines to measure, and its worker backend
    bandwidth.py   the DRAM read-bandwidth worker backend (a small C kernel compiled here)
    roofline.py    the bytes a decode step reads: from the safetensors, an ONNX model, a row's own files
    accuracy.py    the per-token arithmetic of the `accuracy` request (benchmarks/quant_accuracy.py)

benchmarks/peers.py is the driver (setup, the interleaved measurement loop, the report) and
benchmarks/peers_worker.py the worker process (the JSON-lines protocol), which runs under two
interpreters: the repo's venv (llmc, bandwidth) and the peers' venv (llama.cpp, ORT GenAI). So at
module level these modules import only the standard library and numpy, and each backend imports
its own runtime lazily.
"""
