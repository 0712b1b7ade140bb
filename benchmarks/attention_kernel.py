"""llmc's CPU attention kernel on one layer's shape, with the pool cold as in a real step.

    python benchmarks/attention_kernel.py [--rows 16] [--context 400] [--query 1] [--threads 2]
                                          [--layout scattered|sequential]

smollm2-135m-shape's attention (9 query heads, 3 KV heads, head dim 64, block 16). A model step
runs 30 layers, each over its own pool, with the weights streaming through the caches in between,
so a layer's pool is never in cache when its turn comes. `attention_variants.py` times one pool
over and over, which stays in L3 (10 MB at 16 rows x 400 tokens); this script cycles through 30
pools, like the engine, and reports both. Output is checked against the numpy reference.
`--layout sequential` gives each sequence consecutive blocks, as a fresh engine's pool does;
`scattered` (the default) shuffles them, as a pool looks after requests have come and gone.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def session(threads: int) -> ort.InferenceSession:
    from llmc.plugins import cpu as kernels

    names = ["qkv", "", "", "pool", "past", "qlen", "tables"]
    types = {"past": TensorProto.INT32, "qlen": TensorProto.INT32, "tables": TensorProto.INT32}
    node = helper.make_node("PagedAttention", names, ["out", "pool_out"], domain=kernels.DOMAIN, num_heads=HEADS,
                            num_kv_heads=KV_HEADS, scale=HEAD_DIM ** -0.5)
    graph = helper.make_graph([node], "attention", [helper.make_tensor_value_info(n, types.get(n, TensorProto.FLOAT),
                                                                                  None) for n in names if n],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("out", "pool_out")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid(kernels.DOMAIN, kernels.VERSION)])
    model.ir_version = 10
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    kernels.register(opts)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16, help="sequences in the step")
    ap.add_argument("--context", type=int, default=400, help="tokens already cached per sequence")
    ap.add_argument("--query", type=int, default=1, help="new tokens per sequence (1 = decode)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layout", choices=("scattered", "sequential"), default="scattered",
                    help="where each sequence's blocks lie in the pool")
    args = ap.parse_args()

    from llmc.contract import kv_layout
    from llmc.plugins import paged_attention as pa

    rng = np.random.default_rng(0)
    rows, past, seq = args.rows, args.context, args.query
    width = (past + seq) // BLOCK + 1
    num_blocks = rows * width + 1
    order = np.arange(1, num_blocks)
    if args.layout == "scattered":
        order = rng.permutation(order)
    tables = order[:rows * width].reshape(rows, width).astype(np.int32)
    qkv = rng.standard_normal((rows, seq, (HEADS + 2 * KV_HEADS) * HEAD_DIM), dtype=np.float32)
    meta = {"past": np.full(rows, past, np.int32), "qlen": np.full(rows, seq, np.int32), "tables": tables}
    token_major = [rng.standard_normal((2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM), dtype=np.float32)
                   for _ in range(LAYERS)]
    sess = session(args.threads)
    bindings = []
    for pool in token_major:
        binding = sess.io_binding()
        value = ort.OrtValue.ortvalue_from_numpy(kv_layout.from_token_major(pool, kv_layout.HEAD_MAJOR))
        binding.bind_ortvalue_input("pool", value)
        binding.bind_ortvalue_output("pool_out", value)
        for name, array in {"qkv": qkv, **meta}.items():
            binding.bind_cpu_input(name, array)
        binding.bind_output("out")
        bindings.append(binding)

    def per_layer(group) -> float:
        times = []
        for _ in range(7):
            start = time.perf_counter()
            for binding in group:
                sess.run_with_iobinding(binding)
            times.append((time.perf_counter() - start) / len(group))
        return float(np.median(times))

    per_layer(bindings)  # warm-up: every step's K/V now written
    cold, warm = per_layer(bindings), per_layer(bindings[:1] * LAYERS)

    q, k, v = (qkv[..., a:b].reshape(rows, seq, -1, HEAD_DIM).transpose(0, 2, 1, 3) for a, b in
               ((0, HEADS * HEAD_DIM), (HEADS * HEAD_DIM, (HEADS + KV_HEADS) * HEAD_DIM),
                ((HEADS + KV_HEADS) * HEAD_DIM, None)))
    ref, _ = pa.reference(q, k, v, token_major[0], meta["past"], meta["qlen"], tables, num_heads=HEADS,
                          num_kv_heads=KV_HEADS, scale=HEAD_DIM ** -0.5)
    out = [o for o in bindings[0].copy_outputs_to_cpu() if o.ndim == 3][0]
    err = np.abs(out - ref.transpose(0, 2, 1, 3).reshape(out.shape)).max()
    kv_bytes = rows * (past + seq) * 2 * KV_HEADS * HEAD_DIM * 4
    print(f"rows {rows} · context {past} · query {seq} · {args.layout} blocks · {args.threads} threads · "
          f"max |diff| vs reference {err:.1e}")
    print(f"per layer: cold pools {cold * 1e3:.3f} ms ({kv_bytes / cold / 1e9:.1f} GB/s of KV) · "
          f"warm pool {warm * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
