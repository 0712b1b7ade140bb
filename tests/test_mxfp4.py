"""mxfp4 weights (OCP Microscaling, as gpt-oss ships its expert weights): the blob holds the
checkpoint's codes and scales bit for bit, every path of the kernel (plain C, AVX2, AVX-512 VNNI)
gives llmc/plugins/cpu/quant.py's reference_mxfp4, that arithmetic is the checkpoint's product but
for the activations' rounding, and llmc.cpu::Experts takes the format."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import needs_kernels
from onnx import TensorProto
from test_cpu_kernels import _gated
from test_cpu_kernels import _session as kernel_session
from test_quant_kernels import _session

from llmc.plugins import cpu
from llmc.plugins.cpu import quant
from llmc.plugins.cpu.library import library_path, native

pytestmark = needs_kernels
MXFP4 = quant.WEIGHT_FORMATS["mxfp4"]
ROWS = (1, 2, 3, 8, 16, 24)  # decode (the measured tile), the few-rows VNNI tile, the 4-row one
SHAPES = ((96, 70), (64, 32), (32, 5))  # (K, N): partial last panels, a single panel


def _checkpoint(rng, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """One expert's weight as gpt-oss stores it: blocks [N, K / 32, 16] of random bytes (every code)
    and scales [N, K / 32] around 2^0."""
    return (rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8),
            rng.integers(118, 130, (n, k // 32), dtype=np.uint8))


def _edge_scales(blocks: np.ndarray, scales: np.ndarray) -> None:
    """Column 0: every scale byte 0 (weights 2^-127 times the values: subnormal floats); column 1:
    one block at 255 (transformers' ldexp overflows to +-inf there); column 2: a 255 block whose
    codes are all zero."""
    scales[0, :] = 0
    scales[1, -1] = 255
    scales[2, 0], blocks[2, 0] = 255, 0


def _assert_matches(y: np.ndarray, x: np.ndarray, blocks: np.ndarray, scales: np.ndarray, what) -> None:
    """The kernel's y against reference_mxfp4: the same non-finite outputs, and the finite ones within
    float32 rounding of the accumulation (1e-4 of sum |x| |w|, relative, so subnormal sums too)."""
    ref = quant.reference_mxfp4(x, blocks, scales).reshape(y.shape)
    w = np.abs(quant.dequantize_mxfp4(blocks, scales).astype(np.float64))
    tol = 1e-4 * (np.abs(x.reshape(-1, w.shape[1])) @ np.where(np.isfinite(w), w, 0).T).reshape(y.shape)
    assert np.array_equal(np.isnan(y), np.isnan(ref)), what
    assert np.array_equal(y[np.isinf(ref)], ref[np.isinf(ref)]), what
    finite = np.isfinite(ref)
    err = np.abs(y[finite] - ref[finite])
    assert (err <= tol[finite]).all(), (what, err.max())


def _check_products() -> None:
    """PackedMatMul over mxfp4 blobs at every row count and shape, normal and edge-case scales,
    through whichever path this process's library takes (the tests below run it under each)."""
    rng = np.random.default_rng(6)
    for k, n in SHAPES:
        sess = _session("PackedMatMul", ["x", "w"], ["y"], "mxfp4", n=n, weight_format=MXFP4, block_size=32,
                        zero_points=0)
        for edge in (False, True):
            blocks, scales = _checkpoint(rng, n, k)
            if edge:
                _edge_scales(blocks, scales)
            blob = quant.pack_mxfp4(blocks, scales)
            for rows in ROWS:
                x = rng.standard_normal((1, rows, k), dtype=np.float32)
                x[0, 0, :32] = 0.0  # a zero block: sx = 0
                x[0, -1, 3] = 40.0  # an outlier
                y, = sess.run(None, {"x": x, "w": blob})
                _assert_matches(y, x, blocks, scales, (k, n, rows, edge))


def test_pack_then_unpack_gives_the_checkpoint_bytes():
    """The blob is a rearrangement: the checkpoint's blocks and scales come back bit for bit, at
    4.25 bits a weight."""
    rng = np.random.default_rng(0)
    for k, n in (*SHAPES, (2880, 64)):
        blocks, scales = _checkpoint(rng, n, k)
        scales[0, 0], scales[-1, -1] = 0, 255
        blob = quant.pack_mxfp4(blocks, scales)
        assert blob.dtype == np.uint8 and blob.ndim == 1 and blob.size == quant.mxfp4_bytes(k, n)
        back = quant.unpack_mxfp4(blob, k, n)
        assert np.array_equal(back[0], blocks) and np.array_equal(back[1], scales)
    assert quant.mxfp4_bytes(2880, 5760) * 8 / (2880 * 5760) == 4.25
    stacked = quant.pack_mxfp4_experts(np.stack([blocks, blocks]), np.stack([scales, scales]))
    assert stacked.shape == (2, blob.size) and (stacked == blob).all()
    with pytest.raises(ValueError, match="blocks uint8"):
        quant.pack_mxfp4(blocks[..., :8], scales)


def test_the_kernel_matches_the_reference():
    """This process's paths: at 1-2 rows the decode tile the host measured, above that VNNI where
    the CPU has it (else AVX2)."""
    _check_products()


@pytest.mark.parametrize("vnni", [0, 1], ids=["avx2", "vnni"])
def test_either_decode_tile_matches_the_reference(vnni):
    """A decode step's rows (1 and 2) take the tile the host measured faster for mxfp4: either one."""
    from llmc.plugins.cpu import host

    lib = native(library_path())
    seconds = (ctypes.c_double * 2)()
    if host._probe(lib, "llmc_probe_quant")(MXFP4, 1, 64, 32, 1, seconds) or seconds[vnni] < 0:
        pytest.skip("this CPU has no AVX-512 VNNI" if vnni else "this CPU has no AVX2")
    try:
        assert lib.llmc_set_decode_tile(MXFP4, vnni) == 0
        _check_products()
    finally:
        host.apply(lib, host.use_measured_kernels(library_path()))


@pytest.mark.parametrize("switch", ["LLMC_CPU_PLAIN", "LLMC_CPU_NO_VNNI"])
def test_the_other_paths_match_the_reference(switch):
    """LLMC_CPU_PLAIN=1: the plain C path (CPUs without AVX2); LLMC_CPU_NO_VNNI=1: the AVX2 tile at
    every row count where the CPU has AVX-512 VNNI."""
    tests = str(Path(__file__).parent)
    env = dict(os.environ, **{switch: "1"}, PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", "import test_mxfp4; test_mxfp4._check_products()"], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_reference_is_the_checkpoint_product_but_for_activation_rounding():
    """x @ dequantize(...).T, the float product transformers computes, differs from the reference only
    by the activations' rounding: at most half a step sx of each block times its sum of |w|."""
    rng = np.random.default_rng(1)
    blocks, scales = _checkpoint(rng, 70, 2880)
    x = rng.standard_normal((4, 2880)).astype(np.float32)
    w = quant.dequantize_mxfp4(blocks, scales).astype(np.float64)
    exact = x.astype(np.float64) @ w.T
    ref = quant.reference_mxfp4(x, blocks, scales)
    _, sx = quant.quantize_activations(x, 32)
    bound = 0.5 * np.einsum("mb,nb->mn", sx.astype(np.float64), np.abs(w).reshape(70, -1, 32).sum(-1))
    assert (np.abs(ref - exact) <= bound * (1 + 1e-6) + 1e-12).all()
    assert np.abs(ref - exact).max() < 0.01 * np.abs(exact).max()


def test_dequantize_is_transformers_bit_for_bit():
    """Every code at every scale byte, 0 (subnormal weights) and 255 (2^128 overflows: +-inf, but
    +-2^127 for +-0.5 and +-0 for the zero codes) included: transformers' convert_moe_packed_tensors."""
    torch = pytest.importorskip("torch")
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    i = np.arange(16, dtype=np.uint8)
    blocks = np.broadcast_to(i | (15 - i) << 4, (256, 1, 16)).copy()  # each code, low and high nibble
    scales = np.arange(256, dtype=np.uint8)[:, None]
    theirs = mxfp4.convert_moe_packed_tensors(torch.from_numpy(blocks[None]), torch.from_numpy(scales[None]),
                                              dtype=torch.float32)[0].numpy().T  # [K, N] -> [N, K]
    ours = quant.dequantize_mxfp4(blocks, scales)
    assert np.array_equal(ours.view(np.uint32), np.ascontiguousarray(theirs).view(np.uint32))
    assert ours[0, 2] == 2.0 ** -128 and ours[255, 2] == 2.0 ** 127  # code 1: 0.5
    assert ours[255, 4] == np.inf and ours[255, 1] == -np.inf and ours[255, 0] == 0  # codes 2, 15 and 0


def test_edge_scales_are_defined():
    """Scale byte 0: the block's factor is 2^-128, a subnormal float, and the products are tiny but
    exact to float32 rounding; 255: +inf (float32's 2^128), so the column's outputs are inf or NaN
    (NaN where 0 * inf: a zero block of x or of codes), as transformers' product over its +-inf
    weights is not finite either."""
    rng = np.random.default_rng(2)
    blocks, scales = _checkpoint(rng, 40, 96)
    _edge_scales(blocks, scales)
    x = rng.standard_normal((1, 3, 96), dtype=np.float32)
    sess = _session("PackedMatMul", ["x", "w"], ["y"], "mxfp4", n=40, weight_format=MXFP4, block_size=32,
                    zero_points=0)
    y = sess.run(None, {"x": x, "w": quant.pack_mxfp4(blocks, scales)})[0][0]
    _assert_matches(y, x, blocks, scales, "edge")
    assert (np.abs(y[:, 0]) < 1e-35).all() and (y[:, 0] != 0).all()
    assert np.isinf(y[:, 1]).all() and np.isnan(y[:, 2]).all() and np.isfinite(y[:, 3:]).all()
    with np.errstate(invalid="ignore", over="ignore"):
        assert not np.isfinite(x[0] @ quant.dequantize_mxfp4(blocks, scales).T[:, 1]).any()


def _experts_session(**attrs):
    return kernel_session("Experts", ["x", "ids", "w", "gate_up", "down"], ["y"],
                          {"ids": TensorProto.INT64, "gate_up": TensorProto.UINT8, "down": TensorProto.UINT8},
                          packed=1, weight_format=MXFP4, **attrs)


@pytest.mark.parametrize("tokens,top_k", [(1, 2), (19, 3)])
def test_experts_take_mxfp4(tokens, top_k):
    """Each chosen expert's two products as reference_mxfp4 computes them, the activation and the
    weighted sum in float64 (test_cpu_kernels' quantized experts, over checkpoint bytes)."""
    rng = np.random.default_rng(tokens)
    experts, hidden, inter = 6, 64, 96
    x = rng.standard_normal((tokens, hidden), np.float32)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int64)
    weights = rng.random((tokens, top_k), np.float32)
    stacks = [[_checkpoint(rng, n, k) for _ in range(experts)] for n, k in ((2 * inter, hidden), (hidden, inter))]
    blobs = [quant.pack_mxfp4_experts(np.stack([b for b, _ in s]), np.stack([e for _, e in s])) for s in stacks]
    out, = _experts_session(block_size=32).run(None, {"x": x, "ids": ids, "w": weights, "gate_up": blobs[0],
                                                      "down": blobs[1]})
    want = np.zeros((tokens, hidden))
    for t in range(tokens):
        for e, w in zip(ids[t], weights[t]):
            h = quant.reference_mxfp4(x[t:t + 1], *stacks[0][e])[0]
            act = _gated(h[:inter], h[inter:], cpu.ACT_SILU).astype(np.float32)
            want[t] += w * quant.reference_mxfp4(act[None], *stacks[1][e])[0]
    np.testing.assert_allclose(out, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


def test_mxfp4_attributes_are_checked():
    with pytest.raises(Exception, match="weight_format 6 \\(mxfp4\\) needs block_size 32 and zero_points 0"):
        _experts_session(block_size=64)
    with pytest.raises(Exception, match="weight_format 6 \\(mxfp4\\) needs block_size 32 and zero_points 0"):
        _session("PackedMatMul", ["x", "w"], ["y"], "mxfp4", n=40, weight_format=MXFP4, block_size=32,
                 zero_points=1)
    sess = _session("PackedMatMul", ["x", "w"], ["y"], "mxfp4", n=40, weight_format=MXFP4, block_size=32,
                    zero_points=0)
    blob = quant.pack_mxfp4(*_checkpoint(np.random.default_rng(3), 40, 64))
    with pytest.raises(Exception, match=r"mxfp4 weight must be a 1-D uint8 blob of 2176 bytes for K = 64"):
        sess.run(None, {"x": np.ones((1, 64), np.float32), "w": blob[:-1].copy()})


def test_quantize_keeps_mxfp4_values_and_rounds_to_the_nearest_code():
    """quantize_mxfp4 (what makes the released format's checkpoints here) gives back any MXFP4
    weight's values exactly, and rounds a float weight within half a code step of its block."""
    rng = np.random.default_rng(3)
    blocks, scales = _checkpoint(rng, 24, 96)
    values = quant.dequantize_mxfp4(blocks, scales)
    np.testing.assert_array_equal(quant.dequantize_mxfp4(*quant.quantize_mxfp4(values)), values)
    w = rng.standard_normal((24, 96)).astype(np.float32)
    back = quant.dequantize_mxfp4(*quant.quantize_mxfp4(w)).reshape(24, 3, 32)
    step = np.exp2(quant.quantize_mxfp4(w)[1].astype(np.int32) - 127)[..., None]  # the widest gap, 2, times 2^e
    assert (np.abs(back - w.reshape(24, 3, 32)) <= step + 1e-6).all()


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tmp_path_factory):
    """tiny-gpt-oss as OpenAI releases gpt-oss: its experts' stacks MXFP4 (`*_blocks`, `*_scales`,
    rows the output features, gate and up interleaved), everything else float, and config.json's
    quantization_config saying so."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    from llmc.compiler.recipes import materialize

    folder = tmp_path_factory.mktemp("gpt-oss-mxfp4") / "model"
    shutil.copytree(materialize("tiny-gpt-oss"), folder)
    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # transformers' float stacks are [E, in, out]; MXFP4 rows are the output features
        tensors[name + "_blocks"], tensors[name + "_scales"] = quant.quantize_mxfp4(tensors.pop(name).transpose(0, 2, 1))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, tensors


def test_a_gpt_oss_checkpoint_in_mxfp4_builds_with_its_codes_as_released(mxfp4_gpt_oss, tmp_path):
    """The engine's experts are the checkpoint's MXFP4 bytes rearranged (weight_format mxfp4, no
    requantization), at --quant int4 too; its next-token distributions are transformers' on the
    same checkpoint but for the kernel's rounding of the activations."""
    import json
    import shutil

    import onnx
    from click.testing import CliRunner
    from safetensors.numpy import save_file

    from llmc.cli import main
    from llmc.compiler.build import build, engine_bytes
    from llmc.compiler.frontend import load_checkpoint
    from llmc.contract.engine_dir import open_engine
    from llmc.contract.options import BuildOptions

    folder, tensors = mxfp4_gpt_oss
    for quant_option in ("fp32", "int4"):
        engine = build(str(folder), tmp_path / quant_option, BuildOptions(
            block_size=4, max_context=128, quant="none" if quant_option == "fp32" else quant_option,
            verify=True)).engine_dir
        model = onnx.load(engine / "model.onnx")
        nodes = [n for n in model.graph.node if n.op_type == "Experts"]
        assert len(nodes) == 3
        manifest = open_engine(engine).manifest
        # the size the build reserved before any work: the MXFP4 stacks at their own 4.25 bits
        stored = (engine / manifest.payload.weights).stat().st_size
        spec, weights = manifest.model_spec, load_checkpoint(folder, manifest.model_spec)[1]
        estimate = engine_bytes(spec, manifest.build_options, weights.mxfp4_parameters())
        assert 0.75 < estimate / stored < 1.25, (estimate, stored)
        records = manifest.quantization.tensors  # what `llmc inspect` lists
        assert sorted(r.format for r in records.values() if r.role == "experts") == ["mxfp4"] * 6
        blobs = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer if i.name.endswith(".mxfp4")}
        for node in nodes:
            attrs = {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}
            assert attrs["weight_format"] == MXFP4 and attrs["block_size"] == 32
            layer = node.input[3].split(".experts.")[0].removeprefix("model.")  # the exporter's prefix
            for stack, k, n in (("gate_up_proj", 64, 64), ("down_proj", 32, 64)):
                blob = blobs[f"model.{layer}.experts.{stack}.mxfp4"]
                blocks, scales = tensors[f"{layer}.experts.{stack}_blocks"], tensors[f"{layer}.experts.{stack}_scales"]
                order = np.r_[0:n:2, 1:n:2] if stack == "gate_up_proj" else np.arange(n)  # gate rows, then up
                for e in range(len(blob)):
                    got_blocks, got_scales = quant.unpack_mxfp4(blob[e], k, n)
                    np.testing.assert_array_equal(got_blocks, blocks[e][order])
                    np.testing.assert_array_equal(got_scales, scales[e][order])
    # The reference: transformers on the float checkpoint the codes mean (quant.dequantize_mxfp4 is
    # transformers' own dequantization bit for bit; loading MXFP4 itself needs accelerate).
    dequantized = tmp_path / "dequantized"
    shutil.copytree(folder, dequantized)
    floats = {n: t for n, t in tensors.items() if not n.endswith(("_blocks", "_scales"))}
    for name in {n[:-len("_blocks")] for n in tensors if n.endswith("_blocks")}:
        w = np.stack([quant.dequantize_mxfp4(b, s) for b, s in zip(tensors[name + "_blocks"], tensors[name + "_scales"])])
        floats[name] = np.ascontiguousarray(w.transpose(0, 2, 1))  # transformers' [E, in, out]
    save_file(floats, dequantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dequantized / "config.json").read_text())
    del config["quantization_config"]
    (dequantized / "config.json").write_text(json.dumps(config))
    (tmp_path / "text.txt").write_text("".join(f"def area_{i}(r):\n    return 3.14159 * r * r\n\n" for i in range(12)))
    result = CliRunner().invoke(main, ["eval", str(tmp_path / "fp32"), str(tmp_path / "text.txt"), "--reference",
                                       str(dequantized), "--context", "64", "--json"])
    assert result.exit_code == 0, result.output
    reference = json.loads(result.stdout)["reference"]
    # the same weights; the kernel rounds the activations to int8 per block of 32
    assert reference["kl_mean"] < 0.02 and reference["top1_agreement"] > 0.9, reference
