"""Decode attention over the paged cache: ONNX Runtime CPU realizations, timed on one layer.

    python benchmarks/attention_variants.py [T]      # T = context tokens per row (default 512)

smollm2-135m-shape's attention shape (9 query heads, 3 KV heads, head dim 64), 16 rows decoding
one token each, block size 16, each row's valid length random in [T/4, T). Variants, each one
ORT session with 2 threads, median of 30 runs; outputs are checked against variant A:
  A  token-major pool [2, NB, bs, Hkv, D]: GatherND of the row's blocks, 3-D ONNX Attention with a
     boolean mask (what the lowering emits)
  B  head-major pool [2, Hkv, NB, bs, D]: GatherND straight into [B, Hkv, T, D], 4-D Attention
     (no transposes anywhere)
  C  B with Attention-24's nonpad_kv_seqlen instead of a mask
  D  A's gather + com.microsoft GroupQueryAttention taking the gathered prefix as its past
  K  llmc's CPU kernel (llmc.cpu::PagedAttention) reading its head-major pool in place, no gather
The gather alone is timed too: it is what every variant pays. Results: docs/attention_cpu.md.
"""
import time, sys
import numpy as np, onnxruntime as ort
from onnx import helper as h, TensorProto as TP
B, Hq, Hkv, D, bs = 16, 9, 3, 64, 16
T = int(sys.argv[1]) if len(sys.argv) > 1 else 512
M = T // bs; NB = B * M + 1
rng = np.random.default_rng(0)
bt = (1 + rng.permutation(B * M)).astype(np.int64).reshape(B, M)
lens = rng.integers(T // 4, T, B)  # valid kv per row
def sess(nodes, inputs, outputs, opset=23):
    g = h.make_graph(nodes, "g", inputs, outputs)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", opset)]); m.ir_version = 10
    o = ort.SessionOptions(); o.intra_op_num_threads = 2; o.log_severity_level = 3
    return ort.InferenceSession(m.SerializeToString(), o, providers=["CPUExecutionProvider"])
def vi(n, t, s): return h.make_tensor_value_info(n, t, s)
def timeit(s, feeds, n=30):
    for _ in range(3): s.run(None, feeds)
    ts = []
    for _ in range(n):
        t = time.perf_counter(); out = s.run(None, feeds); ts.append(time.perf_counter() - t)
    return np.median(ts) * 1e3, out[0]
q4 = rng.standard_normal((B, Hq, 1, D)).astype(np.float32)
mask = (np.arange(T)[None, :] < lens[:, None]).reshape(B, 1, 1, T)
# A: token-major pool, GatherND (kv, block), 3D attention
poolA = rng.standard_normal((2, NB, bs, Hkv, D)).astype(np.float32)
idxA = np.stack([np.stack([np.full_like(bt, w), bt], -1) for w in (0, 1)])
nodes = [h.make_node("Constant", [], ["shp"], value=h.make_tensor("s", TP.INT64, [3], [0, -1, Hkv * D])),
         h.make_node("Constant", [], ["qs"], value=h.make_tensor("s2", TP.INT64, [3], [0, 0, -1]))]
for w, n in ((0, "k"), (1, "v")):
    nodes += [h.make_node("GatherND", ["pool", f"i{w}"], [n + "g"]), h.make_node("Reshape", [n + "g", "shp"], [n])]
nodes += [h.make_node("Transpose", ["q"], ["qt"], perm=[0, 2, 1, 3]), h.make_node("Reshape", ["qt", "qs"], ["q3"]),
          h.make_node("Attention", ["q3", "k", "v", "mask"], ["y"], q_num_heads=Hq, kv_num_heads=Hkv)]
sA = sess(nodes, [vi("pool", TP.FLOAT, poolA.shape), vi("i0", TP.INT64, idxA[0].shape), vi("i1", TP.INT64, idxA[1].shape),
                  vi("q", TP.FLOAT, q4.shape), vi("mask", TP.BOOL, mask.shape)], [vi("y", TP.FLOAT, None)])
tA, yA = timeit(sA, {"pool": poolA, "i0": idxA[0], "i1": idxA[1], "q": q4, "mask": mask})
# B: head-major pool [2, Hkv, NB, bs, D], GatherND (kv, h, block) -> [B, Hkv, M, bs, D] -> [B,Hkv,T,D], 4D attention
poolB = np.ascontiguousarray(poolA.transpose(0, 3, 1, 2, 4))
hh = np.arange(Hkv)[None, :, None]
idxB = [np.stack(np.broadcast_arrays(np.full((B, Hkv, M), w), hh, bt[:, None, :]), -1).astype(np.int64) for w in (0, 1)]
nodes = [h.make_node("Constant", [], ["shp"], value=h.make_tensor("s", TP.INT64, [4], [0, 0, -1, D]))]
for w, n in ((0, "k"), (1, "v")):
    nodes += [h.make_node("GatherND", ["pool", f"i{w}"], [n + "g"]), h.make_node("Reshape", [n + "g", "shp"], [n])]
mk = [h.make_node("Attention", ["q", "k", "v", "mask"], ["y"])]
ins = [vi("pool", TP.FLOAT, poolB.shape), vi("i0", TP.INT64, idxB[0].shape), vi("i1", TP.INT64, idxB[1].shape), vi("q", TP.FLOAT, q4.shape)]
sB = sess(nodes + mk, ins + [vi("mask", TP.BOOL, mask.shape)], [vi("y", TP.FLOAT, None)])
tB, yB = timeit(sB, {"pool": poolB, "i0": idxB[0], "i1": idxB[1], "q": q4, "mask": mask})
yAr = yA.reshape(B, 1, Hq, D).transpose(0, 2, 1, 3)
print(f"T={T}: A token-major+3D {tA:.3f} ms | B head-major+4D {tB:.3f} ms  maxdiff {np.abs(yAr - yB).max():.2e}")
# C: B with nonpad_kv_seqlen (opset 24)
try:
    mk = [h.make_node("Attention", ["q", "k", "v", "", "", "", "nkv"], ["y"])]
    sC = sess(nodes + mk, ins + [vi("nkv", TP.INT64, [B])], [vi("y", TP.FLOAT, None)], opset=24)
    tC, yC = timeit(sC, {"pool": poolB, "i0": idxB[0], "i1": idxB[1], "q": q4, "nkv": lens.astype(np.int64)})
    print(f"   C head-major+nonpad_kv_seqlen {tC:.3f} ms maxdiff {np.abs(yC - yB).max():.2e}")
except Exception as e: print("C failed", str(e)[:300])
# gather-only costs
sG = sess(nodes, ins[:3], [vi("k", TP.FLOAT, None), vi("v", TP.FLOAT, None)])
tG, _ = timeit(sG, {"pool": poolB, "i0": idxB[0], "i1": idxB[1]})
print(f"   gather only (head-major) {tG:.3f} ms; bytes {2*B*T*Hkv*D*4/1e6:.1f} MB")
# D: gather (token-major, as A) + com.microsoft GroupQueryAttention with the gathered prefix as past (BSNH->BNSH needs a transpose)
try:
    k_new = rng.standard_normal((B, 1, Hkv * D)).astype(np.float32)
    nodes = [h.make_node("Constant", [], ["shp"], value=h.make_tensor("s", TP.INT64, [4], [0, -1, Hkv, D]))]
    for w, n in ((0, "k"), (1, "v")):
        nodes += [h.make_node("GatherND", ["pool", f"i{w}"], [n + "g"]), h.make_node("Reshape", [n + "g", "shp"], [n + "r"]),
                  h.make_node("Transpose", [n + "r"], [n], perm=[0, 2, 1, 3])]
    nodes += [h.make_node("Transpose", ["q"], ["qt"], perm=[0, 2, 1, 3]),
              h.make_node("Constant", [], ["qs"], value=h.make_tensor("s2", TP.INT64, [3], [0, 0, -1])),
              h.make_node("Reshape", ["qt", "qs"], ["q3"]),
              h.make_node("GroupQueryAttention", ["q3", "kn", "vn", "k", "v", "seqlens", "total"], ["y", "pk", "pv"],
                          domain="com.microsoft", num_heads=Hq, kv_num_heads=Hkv)]
    g = h.make_graph(nodes, "g", [vi("pool", TP.FLOAT, poolA.shape), vi("i0", TP.INT64, idxA[0].shape), vi("i1", TP.INT64, idxA[1].shape),
                     vi("q", TP.FLOAT, q4.shape), vi("kn", TP.FLOAT, k_new.shape), vi("vn", TP.FLOAT, k_new.shape),
                     vi("seqlens", TP.INT32, [B]), vi("total", TP.INT32, [])], [vi("y", TP.FLOAT, None)])
    mdl = h.make_model(g, opset_imports=[h.make_opsetid("", 23), h.make_opsetid("com.microsoft", 1)]); mdl.ir_version = 10
    o = ort.SessionOptions(); o.intra_op_num_threads = 2; o.log_severity_level = 3
    sD = ort.InferenceSession(mdl.SerializeToString(), o, providers=["CPUExecutionProvider"])
    # each row: past = lens-1 valid tokens of the gathered prefix, plus the new token
    feeds = {"pool": poolA, "i0": idxA[0], "i1": idxA[1], "q": q4, "kn": k_new, "vn": k_new,
             "seqlens": (lens).astype(np.int32), "total": np.array(T + 1, np.int32)}
    tD, _ = timeit(sD, feeds)
    print(f"   D gather + GroupQueryAttention(past=gathered) {tD:.3f} ms")
except Exception as e: print("D failed", str(e)[:400])
# K: llmc's CPU kernel (llmc.cpu::PagedAttention, the cpu-kernels pass), reading A's pool's contents
# in place, in the kernel's own (head-major) layout.
# Its step also writes the new token; feeding the K/V already at position lens-1 makes that write
# a no-op, so it attends to exactly what A does.
try:
    from llmc.contract import kv_layout
    from llmc.plugins import cpu as kernels
    pos = lens - 1
    blk, off = bt[np.arange(B), pos // bs], pos % bs
    k_cur, v_cur = (poolA[w, blk, off].reshape(B, 1, Hkv * D) for w in (0, 1))
    node = h.make_node("PagedAttention", ["q", "k", "v", "pool", "past", "qlen", "tables"], ["y", "pool_out"],
                       domain=kernels.DOMAIN, num_heads=Hq, num_kv_heads=Hkv, scale=1 / np.sqrt(D))
    g = h.make_graph([node], "g", [vi("q", TP.FLOAT, None), vi("k", TP.FLOAT, None), vi("v", TP.FLOAT, None),
                                   vi("pool", TP.FLOAT, None), vi("past", TP.INT32, None), vi("qlen", TP.INT32, None),
                                   vi("tables", TP.INT32, None)], [vi("y", TP.FLOAT, None), vi("pool_out", TP.FLOAT, None)])
    mdl = h.make_model(g, opset_imports=[h.make_opsetid("", 23), h.make_opsetid(kernels.DOMAIN, kernels.VERSION)])
    mdl.ir_version = 10
    o = ort.SessionOptions(); o.intra_op_num_threads = 2; o.log_severity_level = 3
    kernels.register(o)
    sK = ort.InferenceSession(mdl.SerializeToString(), o, providers=["CPUExecutionProvider"])
    bind = sK.io_binding()  # the pool in and out bound to one buffer, as the runtime does
    pool_value = ort.OrtValue.ortvalue_from_numpy(kv_layout.from_token_major(poolA, kv_layout.HEAD_MAJOR))
    bind.bind_ortvalue_input("pool", pool_value); bind.bind_ortvalue_output("pool_out", pool_value)
    for name, arr in (("q", q4.reshape(B, 1, Hq * D)), ("k", k_cur), ("v", v_cur), ("past", pos.astype(np.int32)),
                      ("qlen", np.ones(B, np.int32)), ("tables", bt.astype(np.int32))):
        bind.bind_cpu_input(name, np.ascontiguousarray(arr))
    bind.bind_output("y")
    for _ in range(3): sK.run_with_iobinding(bind)
    ts = []
    for _ in range(30):
        t = time.perf_counter(); sK.run_with_iobinding(bind); ts.append(time.perf_counter() - t)
    yK = bind.copy_outputs_to_cpu()[-1]  # outputs come in binding order: the pool, then y
    print(f"   K llmc.cpu::PagedAttention in place {np.median(ts) * 1e3:.3f} ms maxdiff {np.abs(yK.reshape(yA.shape) - yA).max():.2e}")
except Exception as e: print("K failed", str(e)[:400])
