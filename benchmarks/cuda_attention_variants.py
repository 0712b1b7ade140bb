"""Build-time variants of llmc's CUDA decode attention, each checked and timed on the same shapes.

    python benchmarks/cuda_attention_variants.py [--variants 32:3:256,32:2:256,32:3:512]
                                                 [--shapes 32768x64,16384x8,32768x1]

A variant is TILE:STAGES:CTAS, attention.cu's build-time knobs: tokens per K/V tile of the
prefill kernel, which split partitions are whole multiples of (LLMC_KV_TILE), cp.async stages of
each decode warp's ring (LLMC_DECODE_STAGES) and the CTA count the decode kernel's flash-decoding
splits aim for (LLMC_DECODE_TARGET_CTAS). Each builds for sm_90 (all at once), then runs
in a process of its own: every library links its own static CUDA runtime, and a second one
loaded into the same process failed its launches. In each process: a few correctness cases
against paged_attention.reference() (fp16 and bf16, a 16k decode, a ragged prefill, a window,
fused RoPE), then for each CONTEXTxBATCH shape of benchmarks/cuda_attention.py (Llama-3-8B's
attention, fp16, block 16) the best of 3 x 20 calls, as K/V bytes read per second over the
device-to-device copy bandwidth. The first variant runs again last, to show drift.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
import tempfile

import cuda_attention as bench

CHECKS = (dict(group=4, block=16, past=[16383, 5000, 0], qlens=[1, 1, 0], seq=1),
          dict(group=8, block=32, past=[3000, 17], qlens=[70, 1], seq=70),
          dict(group=1, block=16, past=[9000, 40], qlens=[1, 1], seq=1, window=1000),
          dict(group=4, block=16, past=[2047, 0], qlens=[1, 1], seq=1, rotary=(128, False)))


def build(variant: str, out_dir: str) -> str:
    from llmc.plugins import cuda

    tile, stages, ctas = variant.split(":")
    path = os.path.join(out_dir, f"t{tile}s{stages}c{ctas}.so")
    cmd = cuda.nvcc_command("-shared", "-Xcompiler", "-fPIC", "-cudart", "static", "-arch=sm_90",
                            f"-DLLMC_KV_TILE={tile}", f"-DLLMC_DECODE_STAGES={stages}",
                            f"-DLLMC_DECODE_TARGET_CTAS={ctas}", "-o", path, str(cuda.ATTENTION_SOURCE))
    subprocess.run(cmd, check=True)
    return path


def run_one(path: str, shapes: list[tuple[int, int]]) -> None:
    import torch

    from llmc.plugins import cuda

    lib, name = cuda.load_library(path), os.path.basename(path)
    worst = 0.0
    for dtype, tol in bench.TOLERANCE.items():
        for case in CHECKS:
            err, scale = bench.check(lib, dtype, **case)
            worst = max(worst, err / max(scale, 1e-3) / tol)
    print(f"{name}: worst error / tolerance {worst:.2f} ({'ok' if worst <= 1 else 'FAIL'})", flush=True)
    copy_bw = bench.copy_bandwidth(20)
    torch.cuda.empty_cache()
    for context, batch in shapes:
        step = bench.DecodeStep(context, batch)
        call = bench.in_turn(step.calls(lib))
        best = min(bench.timed(call, 20) for _ in range(3))
        print(f"| {name} | {context} | {batch} | {best * 1e6:.0f} | {step.kv_bytes / best / copy_bw:.0%} |", flush=True)
        del step, call
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="32:3:256,32:2:256,32:3:512")
    ap.add_argument("--shapes", default="32768x64,32768x32,16384x8,32768x1,4096x64")
    ap.add_argument("--library", help=argparse.SUPPRESS)  # the per-variant process
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    if args.library:
        run_one(args.library, shapes)
        return
    variants = args.variants.split(",")
    out_dir = tempfile.mkdtemp(prefix="llmc-cuda-variants-")
    with concurrent.futures.ThreadPoolExecutor(len(variants)) as pool:
        paths = list(pool.map(lambda v: build(v, out_dir), variants))
    print("| variant | context | batch | µs | of copy |\n|---|---|---|---|---|", flush=True)
    for path in [*paths, paths[0]]:
        subprocess.run([sys.executable, __file__, "--shapes", args.shapes, "--library", path], check=False)


if __name__ == "__main__":
    main()
