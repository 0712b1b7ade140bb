"""llmc's CPU attention kernel over fp32, fp16, bf16 and int8 KV pools, interleaved in one process.

    python benchmarks/kv_cache_dtypes.py [--threads 2] [--reps 9] [--layers 30] [--baseline LIB]

One llmc.cpu::PagedAttention node of smollm2-135m's shape (9 query heads, 3 KV heads, head dim 64,
block 16) per step shape: decode at batch 1 and 8 with 256 and 1024 tokens of context, and a
128-token prefill. As in a model step (benchmarks/attention_kernel.py), each timed pass runs
`--layers` nodes, each over its own pool with the blocks scattered, so a pool is cold when its
turn comes. The dtypes take turns within each repetition (the order rotating), and each ratio is
the median over repetitions of that repetition's time over fp32's, so machine noise that moves
all dtypes alike cancels. `--baseline LIB` adds a fp32 run through another build of the kernel
library (e.g. one built from an earlier commit) to check that fp32 did not move.
Each dtype's output is checked against the numpy reference with the same rounding.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SHAPES = [("decode b1 ctx256", 1, 256, 1), ("decode b1 ctx1024", 1, 1024, 1), ("decode b8 ctx256", 8, 256, 1),
          ("decode b8 ctx1024", 8, 1024, 1), ("prefill 128", 1, 0, 128)]


def session(dtype: str, threads: int, library: str | None = None) -> ort.InferenceSession:
    from llmc.contract import kv_layout
    from llmc.plugins import cpu as kernels

    names = ["qkv", "", "", "pool", "past", "qlen", "tables"]
    types = {"past": TensorProto.INT32, "qlen": TensorProto.INT32, "tables": TensorProto.INT32,
             "pool": kv_layout.ELEMENT_TYPES[dtype], "pool_out": kv_layout.ELEMENT_TYPES[dtype]}
    node = helper.make_node("PagedAttention", names, ["out", "pool_out"], domain=kernels.DOMAIN, num_heads=HEADS,
                            num_kv_heads=KV_HEADS, scale=HEAD_DIM ** -0.5)
    graph = helper.make_graph([node], "attention", [helper.make_tensor_value_info(n, types.get(n, TensorProto.FLOAT),
                                                                                  None) for n in names if n],
                              [helper.make_tensor_value_info(n, types.get(n, TensorProto.FLOAT), None)
                               for n in ("out", "pool_out")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid(kernels.DOMAIN, kernels.VERSION)])
    model.ir_version = 10
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    if library is None:
        kernels.register(opts)
    else:
        opts.register_custom_ops_library(library)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def one_pass(sess: ort.InferenceSession, bindings: list) -> float:
    """Seconds per node of one pass over every layer's pool."""
    start = time.perf_counter()
    for binding in bindings:
        sess.run_with_iobinding(binding)
    return (time.perf_counter() - start) / len(bindings)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9, help="repetitions (each: every dtype once)")
    ap.add_argument("--layers", type=int, default=30, help="pools cycled per timed pass")
    ap.add_argument("--baseline", help="another build of the kernel library, for a fp32 run through it")
    ap.add_argument("--shapes", default=None, help="comma-separated indices into the step shapes (default all)")
    args = ap.parse_args()

    from llmc.contract import kv_layout
    from llmc.plugins import paged_attention as pa

    variants = [(t, t, None) for t in kv_layout.KV_DTYPES]
    if args.baseline:
        variants.append(("fp32@baseline", "fp32", args.baseline))
    shapes = SHAPES if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]
    sessions = {name: session(dtype, args.threads, lib) for name, dtype, lib in variants}
    print(f"PagedAttention, {HEADS} heads / {KV_HEADS} KV heads / head_dim {HEAD_DIM} / block {BLOCK}, "
          f"{args.threads} threads, {args.layers} pools cycled, median of {args.reps} interleaved repetitions; "
          f"ms per node (ratio to fp32)")
    print(f"{'step':<20}" + "".join(f"{name:>22}" for name, _, _ in variants) + "   max |diff| vs reference")
    for label, rows, past, seq in shapes:
        rng = np.random.default_rng(0)
        width = (past + seq) // BLOCK + 1
        num_blocks = rows * width + 1
        tables = rng.permutation(np.arange(1, num_blocks))[:rows * width].reshape(rows, width).astype(np.int32)
        qkv = rng.standard_normal((rows, seq, (HEADS + 2 * KV_HEADS) * HEAD_DIM), dtype=np.float32)
        meta = {"past": np.full(rows, past, np.int32), "qlen": np.full(rows, seq, np.int32), "tables": tables}
        token_major = rng.standard_normal((2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM), dtype=np.float32)
        bindings, pools, errors = {}, {}, []
        for name, dtype, _ in variants:
            pool = kv_layout.from_token_major(token_major, kv_layout.HEAD_MAJOR, dtype)
            pools[name] = [pool.copy() for _ in range(args.layers)]
            bindings[name] = []
            for layer_pool in pools[name]:
                binding = sessions[name].io_binding()
                binding.bind_output("out")
                value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(*kv_layout.ort_value_args(layer_pool, dtype))
                binding.bind_ortvalue_input("pool", value)
                binding.bind_ortvalue_output("pool_out", value)
                for n, array in {"qkv": qkv, **meta}.items():
                    binding.bind_cpu_input(n, array)
                bindings[name].append(binding)
            sessions[name].run_with_iobinding(bindings[name][0])
            out = bindings[name][0].get_outputs()[0].numpy()
            if name == dtype:  # check against the reference, over what this dtype stores
                q, k, v = (qkv[..., a:b].reshape(rows, seq, -1, HEAD_DIM).transpose(0, 2, 1, 3) for a, b in
                           ((0, HEADS * HEAD_DIM), (HEADS * HEAD_DIM, (HEADS + KV_HEADS) * HEAD_DIM),
                            ((HEADS + KV_HEADS) * HEAD_DIM, None)))
                start = kv_layout.to_token_major(kv_layout.from_token_major(token_major, kv_layout.HEAD_MAJOR, dtype),
                                                 kv_layout.HEAD_MAJOR, dtype, head_dim=HEAD_DIM)
                ref, _ = pa.reference(q, k, v, start, meta["past"], meta["qlen"], tables, num_heads=HEADS,
                                      num_kv_heads=KV_HEADS, scale=HEAD_DIM ** -0.5, kv_dtype=dtype)
                errors.append(f"{dtype} {np.abs(out - ref.transpose(0, 2, 1, 3).reshape(out.shape)).max():.0e}")

        for name, _, _ in variants:  # warm-up
            one_pass(sessions[name], bindings[name])
        times = {name: [] for name, _, _ in variants}
        for rep in range(args.reps):
            order = variants[rep % len(variants):] + variants[:rep % len(variants)]
            for name, _, _ in order:
                times[name].append(one_pass(sessions[name], bindings[name]))
        fp32 = np.array(times["fp32"])
        cells = []
        for name, _, _ in variants:
            t = np.array(times[name])
            cells.append(f"{np.median(t) * 1e3:.3f} ({np.median(t / fp32):.3f}x)")
        print(f"{label:<20}" + "".join(f"{c:>22}" for c in cells) + "   " + ", ".join(errors), flush=True)
        del bindings, pools


if __name__ == "__main__":
    main()
