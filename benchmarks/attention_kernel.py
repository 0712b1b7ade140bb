"""llmc's CPU attention kernel on a model's shape, 30 layers in one graph, as an engine step runs them.

    python benchmarks/attention_kernel.py [--rows 16] [--context 400] [--query 1] [--threads 2]
                                          [--kv-dtype fp32|fp16|bf16|int8] [--layout scattered|sequential]

smollm2-135m-shape's attention (9 query heads, 3 KV heads, head dim 64, block 16). The graph holds
one PagedAttention node per layer, each over its own pool, so one run is a step's 30 attentions
with one Python call around them (a single-node session would time the call, ~10 us, as much as
the op). "cold": each layer's pool is out of cache when its turn comes, as between a real step's
weight streams; the 30 pools (10 MB each at 16 rows x 400 tokens) are evicted by reading a 64 MB
buffer before every run. "warm": the same runs back to back. Output is checked against the numpy
reference (which reads the pool's dtype back as the kernel does).
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
META = {"past": TensorProto.INT32, "qlen": TensorProto.INT32, "tables": TensorProto.INT32}


def session(threads: int, kv_dtype: str) -> ort.InferenceSession:
    from llmc.contract import kv_layout
    from llmc.plugins import cpu as kernels

    pool_type = kv_layout.ELEMENT_TYPES[kv_dtype]
    nodes = [helper.make_node("PagedAttention", ["qkv", "", "", f"pool{i}", "past", "qlen", "tables"],
                              [f"out{i}", f"pool_out{i}"], domain=kernels.DOMAIN, num_heads=HEADS,
                              num_kv_heads=KV_HEADS, scale=HEAD_DIM ** -0.5) for i in range(LAYERS)]
    inputs = ([helper.make_tensor_value_info("qkv", TensorProto.FLOAT, None)]
              + [helper.make_tensor_value_info(f"pool{i}", pool_type, None) for i in range(LAYERS)]
              + [helper.make_tensor_value_info(n, t, None) for n, t in META.items()])
    outputs = [helper.make_tensor_value_info(f"{n}{i}", TensorProto.FLOAT if n == "out" else pool_type, None)
               for i in range(LAYERS) for n in ("out", "pool_out")]
    graph = helper.make_graph(nodes, "attention", inputs, outputs)
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
    ap.add_argument("--kv-dtype", choices=("fp32", "fp16", "bf16", "int8"), default="fp32")
    ap.add_argument("--layout", choices=("scattered", "sequential"), default="scattered",
                    help="where each sequence's blocks lie in the pool")
    ap.add_argument("--runs", type=int, default=31, help="timed runs of each kind (medians reported)")
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
    first = rng.standard_normal((2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM), dtype=np.float32)
    pools = [kv_layout.from_token_major(first if i == 0 else
                                        rng.standard_normal(first.shape, dtype=np.float32),
                                        kv_layout.HEAD_MAJOR, args.kv_dtype) for i in range(LAYERS)]
    sess = session(args.threads, args.kv_dtype)
    binding = sess.io_binding()
    for i, pool in enumerate(pools):
        value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(*kv_layout.ort_value_args(pool, args.kv_dtype))
        binding.bind_ortvalue_input(f"pool{i}", value)
        binding.bind_ortvalue_output(f"pool_out{i}", value)
        binding.bind_output(f"out{i}")
    for name, array in {"qkv": qkv, **meta}.items():
        binding.bind_cpu_input(name, array)
    evict = np.ones(64 << 20, np.uint8)

    def per_layer(cold: bool) -> float:
        times = []
        for _ in range(args.runs):
            if cold:
                evict.sum()
            start = time.perf_counter()
            sess.run_with_iobinding(binding)
            times.append((time.perf_counter() - start) / LAYERS)
        return float(np.median(times))

    per_layer(False)  # warm-up: every layer's K/V now written
    cold, warm = per_layer(True), per_layer(False)

    q, k, v = (qkv[..., a:b].reshape(rows, seq, -1, HEAD_DIM).transpose(0, 2, 1, 3) for a, b in
               ((0, HEADS * HEAD_DIM), (HEADS * HEAD_DIM, (HEADS + KV_HEADS) * HEAD_DIM),
                ((HEADS + KV_HEADS) * HEAD_DIM, None)))
    held = kv_layout.to_token_major(kv_layout.from_token_major(first, kv_layout.HEAD_MAJOR, args.kv_dtype),
                                    kv_layout.HEAD_MAJOR, args.kv_dtype, head_dim=HEAD_DIM)
    ref, _ = pa.reference(q, k, v, held, meta["past"], meta["qlen"], tables, num_heads=HEADS,
                          num_kv_heads=KV_HEADS, scale=HEAD_DIM ** -0.5, kv_dtype=args.kv_dtype)
    out = [o for o in binding.copy_outputs_to_cpu() if o.ndim == 3][0]  # layer 0's
    err = np.abs(out - ref.transpose(0, 2, 1, 3).reshape(out.shape)).max()
    kv_bytes = rows * (past + seq) * kv_layout.bytes_per_token(KV_HEADS, HEAD_DIM, args.kv_dtype)
    print(f"rows {rows} · context {past} · query {seq} · {args.kv_dtype} {args.layout} blocks · {args.threads} "
          f"threads · max |diff| vs reference {err:.1e}")
    print(f"per layer: cold pools {cold * 1e6:.1f} us ({kv_bytes / cold / 1e9:.1f} GB/s of KV) · "
          f"warm {warm * 1e6:.1f} us")


if __name__ == "__main__":
    main()
