"""llmc's packed GEMM per weight format (fp32, bf16, int8, int4, mxfp4) on smollm2-135m's shapes
(and gpt-oss-20b's expert shapes, oss_gate_up and oss_down, on request).

    python benchmarks/quant_gemm.py [--rows 1 8 128] [--shapes qkv o gate_up down lm_head]
                                    [--formats fp32 bf16 int8 int4 mxfp4 ort-int4 | FORMAT@TILE ...]
                                    [--threads 2] [--rounds 15] [--cache-mb 64] [--no-ort]

Each (shape, rows, format) is one ORT session (2 intra-op threads) of independent PackedMatMul
nodes over distinct weights, as many as make --cache-mb of weight bytes (2x this VM's L3), so the
weights stream from memory as in a model step, where the other layers evict them. The formats
run interleaved, round after round, in one process; the table gives the median ms per call (a
node), the weight bytes streamed per second, and the time as a ratio to fp32's. A format takes the
tile this host measured faster (plugins/cpu/host.py); `FORMAT@TILE` in --formats (`int8@vnni`,
`int8@avx2`, `bf16@avx512`, `bf16@avx2`) forces one, to time the alternatives side by side. `ort-int4` is
ONNX Runtime's own MatMulNBits (int4, block 32, accuracy_level 4: int8 activations, as ORT
GenAI's CPU int4 models use) for comparison. Last, a plain read rate of this machine (ORT
ReduceSum over 256 MB, the same threads) to compare the M = 1 weight streams with.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
          "lm_head": (576, 49152)}
DEFAULT_SHAPES = list(SHAPES)
SHAPES |= {"oss_gate_up": (2880, 5760), "oss_down": (2880, 2880)}  # one gpt-oss-20b expert's
FORMATS = ("fp32", "bf16", "int8", "int4")
BLOCK = 32


def _weight(fmt: str, k: int, n: int, rng) -> tuple[np.ndarray, dict, int]:
    """(the weight as the op takes it, the node's attributes, bytes)."""
    from llmc.plugins.cpu import pack_weight, quant

    w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
    if fmt == "fp32":
        packed, attrs = pack_weight(w), {}
    elif fmt == "mxfp4":  # a checkpoint's codes and scale bytes: random (the time does not depend on them)
        blocks = rng.integers(0, 256, (n, k // BLOCK, 16), dtype=np.uint8)
        scales = rng.integers(118, 126, (n, k // BLOCK), dtype=np.uint8)
        packed = quant.pack_mxfp4(blocks, scales)
        attrs = {"weight_format": quant.WEIGHT_FORMATS[fmt], "block_size": BLOCK, "zero_points": 0}
    elif fmt in ("bf16", "fp16"):
        packed, attrs = quant.pack_16bit(w, fmt), {"weight_format": quant.WEIGHT_FORMATS[fmt]}
    else:
        bits = int(fmt[3:])
        top = 7 if bits == 4 else 127
        scale = (np.abs(w).reshape(k // BLOCK, BLOCK, n).max(1) / top).astype(np.float16).astype(np.float32)
        q = np.clip(np.rint(w / np.repeat(scale, BLOCK, 0)), -top - 1, top).astype(np.int8)
        packed = quant.pack_quantized(q, scale, None, bits, BLOCK)
        attrs = {"weight_format": quant.WEIGHT_FORMATS[fmt], "block_size": BLOCK, "zero_points": 0}
    return packed, attrs, packed.nbytes


def _ort_int4(k: int, n: int, rng) -> tuple[list[np.ndarray], dict, int]:
    """MatMulNBits' inputs: B [N, K / 32, 16] uint8 (two k per byte, low nibble first), scales [N, K / 32]."""
    q = rng.integers(0, 16, (n, k)).astype(np.uint8)
    b = (q[:, 0::2] | q[:, 1::2] << 4).reshape(n, k // BLOCK, BLOCK // 2)
    scales = (rng.uniform(0.5, 1.5, (n, k // BLOCK)) * 0.003).astype(np.float32)
    return [b, scales], {"K": k, "N": n, "bits": 4, "block_size": BLOCK, "accuracy_level": 4}, b.nbytes + scales.nbytes


def session(fmt: str, k: int, n: int, copies: int, threads: int, rng) -> tuple[ort.InferenceSession, int]:
    """A session of `copies` independent products of x [rows, k] with distinct weights; returns it
    and the weight bytes of one product."""
    from llmc.plugins import cpu

    nodes, inits, outputs = [], [], []
    for i in range(copies):
        if fmt == "ort-int4":
            arrays, attrs, nbytes = _ort_int4(k, n, rng)
            names = [f"b{i}", f"s{i}"]
            nodes.append(helper.make_node("MatMulNBits", ["x", *names], [f"y{i}"], domain="com.microsoft", **attrs))
        else:
            packed, attrs, nbytes = _weight(fmt, k, n, rng)
            arrays, names = [packed], [f"w{i}"]
            nodes.append(helper.make_node("PackedMatMul", ["x", *names], [f"y{i}"], domain=cpu.DOMAIN, n=n, **attrs))
        inits += [numpy_helper.from_array(a, name) for a, name in zip(arrays, names)]
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "gemms", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(cpu.DOMAIN, 1),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # idle sessions must not spin against the timed one
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    cpu.register(opts)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]), nbytes


def use_tile(fmt: str) -> None:
    """`int8@vnni`, `bf16@avx512`...: that tile (plugins/cpu/host.py's TILES) for the format's next
    calls; a plain format: the tile this host measured faster."""
    from llmc.plugins.cpu import host
    from llmc.plugins.cpu.library import library_path, native

    lib = native(library_path())
    measured = host.use_measured_kernels(library_path())
    base, _, tile = fmt.partition("@")
    host.apply(lib, {**measured, base: {"tile": tile}} if tile else measured)


def read_rate(threads: int, mb: int = 256, rounds: int = 7) -> float:
    """GB/s of a plain parallel read: ORT ReduceSum of [threads * 64, ...] float32 rows, axis 1."""
    rows = 64 * threads
    x = np.ones((rows, mb * 2 ** 20 // 4 // rows), np.float32)
    node = helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)
    graph = helper.make_graph([node], "read", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(np.array([1], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        sess.run(None, {"x": x})
        times.append(time.perf_counter() - start)
    return x.nbytes / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 128])
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, choices=list(SHAPES))
    parser.add_argument("--formats", nargs="+", default=[*FORMATS, "ort-int4"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--cache-mb", type=float, default=64.0)
    parser.add_argument("--no-ort", action="store_true", help="leave out ORT's MatMulNBits")
    args = parser.parse_args()
    formats = [f for f in args.formats if not (args.no_ort and f == "ort-int4")]
    rng = np.random.default_rng(0)
    print(f"ORT {ort.__version__}, {args.threads} threads, weights >= {args.cache_mb:g} MB per session, "
          f"median of {args.rounds} interleaved rounds")
    print(f"{'shape':>8} {'K x N':>11} {'M':>4} " + " ".join(f"{f:>23}" for f in formats))
    print(f"{'':>8} {'':>11} {'':>4} " + " ".join(f"{'ms  GB/s  x fp32':>23}" for _ in formats))
    m1_rates = {f: [] for f in formats}
    for name in args.shapes:
        k, n = SHAPES[name]
        built = {}
        for fmt in formats:
            base = fmt.split("@")[0]
            one = _weight(base, k, n, rng)[2] if base != "ort-int4" else _ort_int4(k, n, rng)[2]
            copies = max(1, int(np.ceil(args.cache_mb * 2 ** 20 / one)))
            built[fmt] = (*session(base, k, n, copies, args.threads, rng), copies)
        for m in args.rows:
            x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
            times = {f: [] for f in formats}
            for f in formats:  # warm-up
                use_tile(f)
                built[f][0].run(None, {"x": x})
            for _ in range(args.rounds):
                for f in formats:
                    sess, _, copies = built[f]
                    use_tile(f)
                    start = time.perf_counter()
                    sess.run(None, {"x": x})
                    times[f].append((time.perf_counter() - start) / copies)
            med = {f: statistics.median(t) for f, t in times.items()}
            cells = []
            for f in formats:
                rate = built[f][1] / med[f] / 1e9
                if m == 1:
                    m1_rates[f].append(rate)
                cells.append(f"{med[f] * 1e3:8.4f} {rate:6.1f} {med[f] / med['fp32']:6.2f}x"
                             if "fp32" in med else f"{med[f] * 1e3:8.4f} {rate:6.1f}")
            print(f"{name:>8} {f'{k}x{n}':>11} {m:>4} " + " ".join(f"{c:>23}" for c in cells), flush=True)
        del built
    read = read_rate(args.threads)
    print(f"\nplain read rate (ORT ReduceSum, 256 MB, {args.threads} threads): {read:.1f} GB/s")
    for f, rates in m1_rates.items():
        if rates:
            print(f"M = 1 {f:>8}: weight stream {min(rates):.1f}-{max(rates):.1f} GB/s, "
                  f"{min(rates) / read:.0%}-{max(rates) / read:.0%} of the read rate")


if __name__ == "__main__":
    main()
