#!/bin/bash
# Every GPU check of llmc's CUDA kernels in one run, for a machine lent for minutes:
#   bash benchmarks/cuda_all.sh [OUT_DIR]      (from the repo root; OUT_DIR defaults to ./cuda-results)
# Builds the library once, then runs the GPU tests and the 32k correctness sweep side by side
# (CPU-bound numpy oracles), then the decode-bandwidth table alone on the GPU, then the build
# variants (only when the tests pass). Each writes its own file in OUT_DIR; docs/tensorrt.md
# records what they gave.
set -u
out=${1:-cuda-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD PYTHONDONTWRITEBYTECODE=1
lib_dir=$(mktemp -d)
lib=$lib_dir/libllmc_cuda_attention.so
start=$(date +%s)
elapsed() { echo "$1 at $(( $(date +%s) - start )) s" | tee -a "$out/log.txt"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__)"
  python3 -c "from llmc.plugins import cuda; print('nvcc', cuda.find_nvcc())"; } 2>&1 | tee "$out/log.txt"
timeout 300 python3 -c "from llmc.plugins import cuda; cuda.build_shared_library('$lib_dir')" || exit 1
elapsed built
timeout 400 python3 -m pytest -q -p no:cacheprovider --noconftest tests/test_cuda_kernels.py -rfE --tb=short \
    > "$out/pytest.log" 2>&1 &
tests=$!
timeout 400 python3 benchmarks/cuda_attention.py --check-only --library "$lib" > "$out/check.md" 2>&1
elapsed "check rc $?, $(grep -c FAIL "$out/check.md") FAIL rows"
wait $tests
tests_rc=$?
elapsed "pytest rc $tests_rc: $(tail -1 "$out/pytest.log")"
timeout 300 python3 benchmarks/cuda_attention.py --no-check --rope --library "$lib" > "$out/bench.md" 2>&1
elapsed "bench rc $?"
# Timing variants of a kernel that fails its tests would measure nothing worth keeping.
[ $tests_rc -eq 0 ] || exit 1
timeout 300 python3 benchmarks/cuda_attention_variants.py > "$out/variants.md" 2>&1
elapsed "variants rc $?"
