"""The packed-GEMM ops over quantized (int8/int6/int4 blockwise) and 16-bit (bf16/fp16) weights, in real
ONNX Runtime sessions, against llmc/plugins/cpu/quant.py's numpy reference of the kernel's
arithmetic (activations quantized per row and block, integer sums)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
from conftest import needs_kernels
from onnx import TensorProto
from test_cpu_kernels import _session as kernel_session

from llmc.plugins.cpu import pack_weight, quant
from llmc.plugins.cpu.library import library_path, native

pytestmark = needs_kernels
F32 = TensorProto.FLOAT
WEIGHT_TYPES = {"fp32": F32, "bf16": TensorProto.UINT16, "fp16": TensorProto.UINT16, "int8": TensorProto.UINT8,
                "int6": TensorProto.UINT8, "int4": TensorProto.UINT8, "mxfp4": TensorProto.UINT8}
_SESSIONS: dict = {}


def _session(op_type: str, inputs: list[str], outputs: list[str], weight: str = "fp32",
             **attrs) -> ort.InferenceSession:
    key = (op_type, tuple(inputs), weight, tuple(sorted(attrs.items())))
    if key not in _SESSIONS:
        _SESSIONS[key] = kernel_session(op_type, inputs, outputs, {"w": WEIGHT_TYPES[weight]}, threads=2, **attrs)
    return _SESSIONS[key]


def _quantized(rng, k: int, n: int, bits: int, block: int, asymmetric: bool):
    """Random integers over the whole range (the extremes included) and float16-exact scales."""
    if asymmetric:
        top = 2 ** bits - 1
        q = rng.integers(0, top + 1, (k, n)).astype(np.uint8)
        zp = rng.integers(0, top + 1, (k // block, n)).astype(np.uint8)
        q[0, 0], q[1, 0] = 0, top
    else:
        low, high = -2 ** (bits - 1), 2 ** (bits - 1) - 1
        q = rng.integers(low, high + 1, (k, n)).astype(np.int8)
        q[0, 0], q[1, 0] = low, high
        zp = None
    scale = (rng.uniform(0.5, 2.0, (k // block, n)) * 0.01).astype(np.float16).astype(np.float32)
    return q, scale, zp


def _attrs(fmt: str, block: int, zp) -> dict:
    attrs = {"weight_format": quant.WEIGHT_FORMATS[fmt]}
    if fmt in ("int8", "int6", "int4"):
        attrs |= {"block_size": block, "zero_points": int(zp is not None)}
    return attrs


def _tolerance(x, q, scale, zp, block):
    """Float32 rounding of the accumulation: rtol 1e-4 of sum |x| |w| per output."""
    w = q.astype(np.float64) - (0 if zp is None else np.repeat(zp.astype(np.float64), block, 0))
    w *= np.repeat(scale.astype(np.float64), block, 0)
    return 1e-4 * (np.abs(x.reshape(-1, q.shape[0])) @ np.abs(w)) + 1e-6


@pytest.mark.parametrize("bits", [8, 6, 4])
@pytest.mark.parametrize("asymmetric", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("block", [32, 64, 128])
def test_quantized_matmul_matches_the_reference(bits, asymmetric, block):
    """Every row count of a tile (1 to 8 a pass) and ones split into passes (13 and 16: 8-row
    passes; 24 and a prefill's 128: 4-row passes), and a partial last panel (n = 70)."""
    rng = np.random.default_rng(bits * 1000 + block + asymmetric)
    k, n = 2 * block if block < 128 else 128, 70
    q, scale, zp = _quantized(rng, k, n, bits, block, asymmetric)
    blob = quant.pack_quantized(q, scale, zp, bits, block)
    assert blob.dtype == np.uint8 and blob.size == quant.quantized_bytes(k, n, bits, block, asymmetric)
    fmt = f"int{bits}"
    sess = _session("PackedMatMul", ["x", "w"], ["y"], fmt, n=n, **_attrs(fmt, block, zp))
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 24, 128):
        x = rng.standard_normal((1, rows, k), dtype=np.float32)
        x[0, 0, :block] = 0.0  # a zero block: sx = 0
        x[0, -1, 3] = 40.0     # an outlier
        y, = sess.run(None, {"x": x, "w": blob})
        ref = quant.reference(x, q, scale, zp, bits, block)
        assert y.shape == (1, rows, n)
        err = np.abs(y.reshape(rows, n) - ref.reshape(rows, n))
        assert (err <= _tolerance(x, q, scale, zp, block)).all(), (rows, err.max())


def _library():
    return native(library_path())


@pytest.mark.parametrize("vnni", [0, 1], ids=["avx2", "vnni"])
@pytest.mark.parametrize("bits", [8, 4])
def test_either_decode_tile_matches_the_reference(bits, vnni):
    """A decode step's rows (1 and 2) take the tile the host measured faster: each one a host may
    choose gives the reference's sums."""
    from llmc.plugins.cpu import host

    lib, fmt = _library(), f"int{bits}"
    seconds = (ctypes.c_double * 2)()
    if host._probe(lib, "llmc_probe_quant")(quant.WEIGHT_FORMATS[fmt], 1, 64, 32, 1, seconds) or seconds[vnni] < 0:
        pytest.skip("this CPU has no AVX-512 VNNI" if vnni else "this CPU has no AVX2")
    rng = np.random.default_rng(bits + 10 * vnni)
    k, n, block = 128, 70, 32
    q, scale, zp = _quantized(rng, k, n, bits, block, False)
    sess = _session("PackedMatMul", ["x", "w"], ["y"], fmt, n=n, **_attrs(fmt, block, zp))
    try:
        assert lib.llmc_set_decode_tile(quant.WEIGHT_FORMATS[fmt], vnni) == 0
        for rows in (1, 2):
            x = rng.standard_normal((1, rows, k), dtype=np.float32)
            y, = sess.run(None, {"x": x, "w": quant.pack_quantized(q, scale, zp, bits, block)})
            err = np.abs(y.reshape(rows, n) - quant.reference(x, q, scale, zp, bits, block).reshape(rows, n))
            assert (err <= _tolerance(x, q, scale, zp, block)).all(), (rows, err.max())
    finally:
        host.apply(lib, host.use_measured_kernels(library_path()))


def test_the_decode_tiles_are_measured_once_per_host(tmp_path, monkeypatch):
    """The probe times each tile the CPU has; the faster is kept per host and library build and
    read back by the next process instead of measuring again."""
    from llmc.plugins.cpu import host

    monkeypatch.setenv("LLMC_CACHE", str(tmp_path))
    tiles = host.measure(_library())
    assert set(tiles) == {"int4", "int6", "int8", "mxfp4", "bf16", "fp16"}
    for choice in tiles.values():
        assert choice["seconds"]["avx2"] > 0 and choice["tile"] == min(choice["seconds"], key=choice["seconds"].get)
    host.use_measured_kernels.cache_clear()
    kept = host.use_measured_kernels(library_path())
    path = host.choices_path(library_path())
    assert path.is_file() and json.loads(path.read_text())["host"] == host.host()
    monkeypatch.setattr(host, "measure", lambda lib: pytest.fail("measured again"))
    host.use_measured_kernels.cache_clear()
    assert host.use_measured_kernels(library_path()) == kept


def test_the_reference_is_close_to_the_float_product():
    """Sanity of the contract: activation quantization costs ~1% of the float product, not more."""
    rng = np.random.default_rng(0)
    q, scale, zp = _quantized(rng, 256, 64, 4, 32, True)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    w = (q.astype(np.float32) - np.repeat(zp, 32, 0)) * np.repeat(scale, 32, 0)
    exact = x @ w
    assert np.abs(quant.reference(x, q, scale, zp, 4, 32) - exact).max() < 0.02 * np.abs(exact).max()


def test_int4_symmetric_is_4_5_bits_a_weight():
    assert quant.quantized_bytes(576, 960, 4, 32, False) * 8 / (576 * 960) == 4.5
    assert quant.quantized_bytes(576, 960, 6, 32, False) * 8 / (576 * 960) == 6.5


def test_an_int8_weight_packs_in_the_fewest_bits_that_hold_it():
    """int6 has no ONNX type: the graph holds it as int8, and the lowering packs what fits."""
    q = np.array([[-32, 31], [0, 5]], np.int8)
    assert quant.narrowest_bits(q, None) == 6
    assert quant.narrowest_bits(q // 4, None) == 4
    assert quant.narrowest_bits(np.array([[-33, 0]], np.int8), None) == 8
    assert quant.narrowest_bits(np.array([[0, 63]], np.uint8), np.array([[64]], np.uint8)) == 8
    assert quant.narrowest_bits(np.array([[0, 63]], np.uint8), np.array([[7]], np.uint8)) == 6
    assert quant.quantized_bytes(576, 960, 4, 32, False) <= 0.3 * 576 * 960 * 4


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 13])
def test_16bit_matmul_matches_numpy(fmt, rows):
    rng = np.random.default_rng(rows)
    k, n = 40, 70
    w = rng.standard_normal((k, n), dtype=np.float32)
    x = rng.standard_normal((1, rows, k), dtype=np.float32)
    packed = quant.pack_16bit(w, fmt)
    assert packed.dtype == np.uint16 and packed.shape == (3, k, 32)
    rounded = quant.from_16bit(quant.to_16bit(w, fmt), fmt)
    sess = _session("PackedMatMul", ["x", "w"], ["y"], fmt, n=n, weight_format=quant.WEIGHT_FORMATS[fmt])
    y, = sess.run(None, {"x": x, "w": packed})
    np.testing.assert_allclose(y, x @ rounded, rtol=1e-5, atol=1e-4)
    with pytest.raises(Exception, match="16-bit weight must be uint16"):
        sess.run(None, {"x": x, "w": packed[:2].copy()})


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_the_wide_16bit_tile_gives_the_same_sums(fmt):
    """The AVX-512 tile a host may measure faster adds the same products in the same order as the
    AVX2 one: the same outputs to the bit, at row counts of one pass and two, and a partial panel."""
    from llmc.plugins.cpu import host

    lib, bf16 = _library(), int(fmt == "bf16")
    seconds = (ctypes.c_double * 2)()
    if host._probe(lib, "llmc_probe_16bit")(bf16, 1, 64, 32, 1, seconds) or seconds[1] < 0:
        pytest.skip("this CPU has no AVX-512")
    rng = np.random.default_rng(bf16)
    k, n = 40, 70
    w = rng.standard_normal((k, n), dtype=np.float32)
    sess = _session("PackedMatMul", ["x", "w"], ["y"], fmt, n=n, weight_format=quant.WEIGHT_FORMATS[fmt])
    rounded = quant.from_16bit(quant.to_16bit(w, fmt), fmt)
    try:
        for rows in (1, 2, 3, 5, 8, 13):
            x = rng.standard_normal((1, rows, k), dtype=np.float32)
            outs = []
            for wide in (0, 1):
                assert lib.llmc_set_16bit_tile(bf16, wide) == 0
                outs.append(sess.run(None, {"x": x, "w": quant.pack_16bit(w, fmt)})[0])
            assert np.array_equal(outs[0], outs[1])
            np.testing.assert_allclose(outs[1], x @ rounded, rtol=1e-5, atol=1e-4)
    finally:
        host.apply(lib, host.use_measured_kernels(library_path()))


def test_bf16_rounds_to_nearest_even():
    w = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -8 + 2 ** -20, -2.5, np.inf], np.float32)
    back = quant.from_16bit(quant.to_16bit(w, "bf16"), "bf16")
    np.testing.assert_array_equal(back, [1.0, 1.0, 1.0 + 4 * 2 ** -8, 1.0 + 2 ** -7, -2.5, np.inf])
    assert np.isnan(quant.from_16bit(quant.to_16bit(np.array([np.nan], np.float32), "bf16"), "bf16")).all()


OPS = {  # op -> (its inputs, its outputs, the width of its `x` per K)
    "SkipRMSNormMatMul": (["x", "skip", "gamma", "w"], ["y", "sum"], 1),
    "SwiGLUMatMul": (["x", "w"], ["y"], 2),
}


def _fused_rows(op: str, feeds: dict, k: int) -> np.ndarray:
    """What the fused op feeds its product: the normed residual sum, or silu(gate) * up."""
    if op == "SkipRMSNormMatMul":
        total = feeds["x"] + feeds["skip"]
        rms = np.sqrt((total.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5)
        return (total / rms * feeds["gamma"]).astype(np.float32)
    gate, up = feeds["x"][..., :k].astype(np.float64), feeds["x"][..., k:]
    return (gate / (1 + np.exp(-gate)) * up).astype(np.float32)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("fmt", ["int4", "int6", "int8", "bf16"])
@pytest.mark.parametrize("rows", [1, 13])
def test_fused_ops_take_every_format(op, fmt, rows):
    rng = np.random.default_rng(rows)
    k, n, block = 64, 70, 32
    names, outputs, width = OPS[op]
    feeds = {"x": rng.standard_normal((1, rows, width * k), dtype=np.float32),
             "skip": rng.standard_normal((1, rows, k), dtype=np.float32),
             "gamma": rng.standard_normal(k, dtype=np.float32)}
    h = _fused_rows(op, feeds, k)
    if fmt == "bf16":
        w = rng.standard_normal((k, n), dtype=np.float32)
        feeds["w"], ref, tol = quant.pack_16bit(w, fmt), h @ quant.from_16bit(quant.to_16bit(w, fmt), fmt), 1e-4
        attrs = _attrs(fmt, block, None)
    else:
        bits = int(fmt[3:])
        q, scale, zp = _quantized(rng, k, n, bits, block, asymmetric=rows > 1)
        feeds["w"], ref = quant.pack_quantized(q, scale, zp, bits, block), quant.reference(h, q, scale, zp, bits, block)
        # the fused rows differ from numpy's in the last bits, which may move an activation's rounding
        w = (q.astype(np.float32) - (0 if zp is None else np.repeat(zp, block, 0))) * np.repeat(scale, block, 0)
        tol = 2 * np.abs(h).max() / 127 * np.abs(w).max() + 1e-4 * (np.abs(h) @ np.abs(w)).max()
        attrs = _attrs(fmt, block, zp)
    attrs |= {"n": n} | ({"epsilon": 1e-5} if op == "SkipRMSNormMatMul" else {})
    y = _session(op, names, outputs, fmt, **attrs).run(None, {i: feeds[i] for i in names})[0]
    np.testing.assert_allclose(y, ref, rtol=0, atol=tol)


def test_a_wrong_weight_gives_a_one_line_error():
    rng = np.random.default_rng(0)
    q, scale, _ = _quantized(rng, 64, 70, 4, 32, False)
    blob = quant.pack_quantized(q, scale, None, 4, 32)
    sess = _session("PackedMatMul", ["x", "w"], ["y"], "int4", n=70, weight_format=4, block_size=32, zero_points=0)
    x = rng.standard_normal((1, 2, 64), dtype=np.float32)
    for bad_x, bad_w in ((x, blob[:-1].copy()), (x[..., :32].copy(), blob)):
        with pytest.raises(Exception, match=r"int4 weight must be a 1-D uint8 blob of \d+ bytes for K = ") as err:
            sess.run(None, {"x": bad_x, "w": bad_w})
        assert "\n" not in str(err.value).strip()
    with pytest.raises(Exception, match="not a multiple of the weight's block_size"):
        sess.run(None, {"x": x[..., :40].copy(), "w": blob})
    # an fp32 weight where the node says int4: the type is checked too
    fp32 = _session("PackedMatMul", ["x", "w"], ["y"], "fp32", n=70, weight_format=4, block_size=32, zero_points=0)
    with pytest.raises(Exception, match="int4 weight must be"):
        fp32.run(None, {"x": x, "w": pack_weight(q.astype(np.float32))})
    with pytest.raises(Exception, match="block_size 32, 64 or 128"):
        _session("PackedMatMul", ["x", "w"], ["y"], "int4", n=70, weight_format=4, block_size=48, zero_points=0)
    with pytest.raises(Exception, match="weight_format must be"):
        _session("PackedMatMul", ["x", "w"], ["y"], "int4", n=70, weight_format=7)


def test_the_fp32_path_is_unchanged_by_the_attribute():
    """weight_format 0 (explicit) is the fp32 panels, bit for bit the default."""
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((1, 5, 48), dtype=np.float32), rng.standard_normal((48, 70), dtype=np.float32)
    y0, = _session("PackedMatMul", ["x", "w"], ["y"], n=70).run(None, {"x": x, "w": pack_weight(w)})
    y1, = _session("PackedMatMul", ["x", "w"], ["y"], n=70, weight_format=0).run(None, {"x": x, "w": pack_weight(w)})
    assert np.array_equal(y0, y1)
    np.testing.assert_allclose(y0, x @ w, rtol=1e-5, atol=1e-5)


PLAIN = """
import numpy as np, onnxruntime as ort
from onnx import TensorProto, helper
from llmc.plugins import cpu
from llmc.plugins.cpu import quant
rng = np.random.default_rng(1)
worst = 0.0
for fmt, bits, zp_on, block in (("int4", 4, False, 32), ("int4", 4, True, 64), ("int8", 8, False, 128),
                                ("int8", 8, True, 32), ("int6", 6, False, 64), ("int6", 6, True, 32)):
    k, n = 128, 40
    if zp_on:
        q = rng.integers(0, 2 ** bits, (k, n)).astype(np.uint8)
        zp = rng.integers(0, 2 ** bits, (k // block, n)).astype(np.uint8)
    else:
        q, zp = rng.integers(-2 ** (bits - 1), 2 ** (bits - 1), (k, n)).astype(np.int8), None
    scale = (rng.uniform(0.5, 2, (k // block, n)) * 0.01).astype(np.float16).astype(np.float32)
    node = helper.make_node("PackedMatMul", ["x", "w"], ["y"], domain=cpu.DOMAIN, n=n,
                            weight_format=quant.WEIGHT_FORMATS[fmt], block_size=block, zero_points=int(zp_on))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None),
                                            helper.make_tensor_value_info("w", TensorProto.UINT8, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(cpu.DOMAIN, 1)])
    model.ir_version = 10
    opts = ort.SessionOptions()
    cpu.register(opts)
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    x = rng.standard_normal((3, k)).astype(np.float32)
    y, = sess.run(None, {"x": x, "w": quant.pack_quantized(q, scale, zp, bits, block)})
    ref = quant.reference(x, q, scale, zp, bits, block)
    worst = max(worst, float(np.abs(y - ref).max() / np.abs(ref).max()))
for fmt in ("bf16", "fp16"):
    w = rng.standard_normal((24, 40)).astype(np.float32)
    node = helper.make_node("PackedMatMul", ["x", "w"], ["y"], domain=cpu.DOMAIN, n=40,
                            weight_format=quant.WEIGHT_FORMATS[fmt])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None),
                                            helper.make_tensor_value_info("w", TensorProto.UINT16, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(cpu.DOMAIN, 1)])
    model.ir_version = 10
    opts = ort.SessionOptions()
    cpu.register(opts)
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    x = rng.standard_normal((2, 24)).astype(np.float32)
    y, = sess.run(None, {"x": x, "w": quant.pack_16bit(w, fmt)})
    ref = x @ quant.from_16bit(quant.to_16bit(w, fmt), fmt)
    worst = max(worst, float(np.abs(y - ref).max() / np.abs(ref).max()))
print(worst)
"""


@pytest.mark.parametrize("switch", ["LLMC_CPU_PLAIN", "LLMC_CPU_NO_VNNI"])
def test_the_other_paths_match_the_reference(switch):
    """LLMC_CPU_PLAIN=1 makes the library take its plain C path (for CPUs without AVX2),
    LLMC_CPU_NO_VNNI=1 its AVX2 tile where the CPU has AVX-512 VNNI."""
    env = dict(os.environ, **{switch: "1"})
    out = subprocess.run([sys.executable, "-c", PLAIN], env=env, capture_output=True, text=True, check=True)
    assert float(out.stdout.strip()) < 1e-5
