"""llmc.cpu::PagedAttention over fp16, bf16 and int8 KV pools (llmc.contract.kv_layout), against
the numpy reference with the same rounding, in real ONNX Runtime sessions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from conftest import needs_kernels
from onnx import TensorProto, helper
from test_cpu_kernels import CASES, attention_case
from test_cpu_kernels import _session as kernel_session

from llmc.contract import kv_layout
from llmc.plugins import cpu
from llmc.plugins import paged_attention as pa

pytestmark = needs_kernels
HEAD_MAJOR = kv_layout.HEAD_MAJOR
DTYPES = kv_layout.KV_DTYPES
MAIN_CASES = ("decode-gqa", "ragged-prefill-with-past", "long-prefill-chunk", "sliding-window", "softcap",
              # and the kernel's other paths: exact keys, all heads per task, the other shapes
              "no-rope", "unpacked", "decode-all-heads", "prefill-head-dim-128-block-16",
              "decode-head-dim-48-block-8", "decode-few-rows-window", "decode-head-dim-6-block-16",
              "decode-split", "decode-split-uneven-rows", "decode-split-window-softcap", "decode-head-pairs",
              "decode-mha-head-dim-128", "prefill-head-dim-16-block-16", "decode-head-dim-256-window-softcap",
              "prefill-head-dim-256-window-softcap", "decode-gqa-head-dim-256-split")
# int8 tiles of 3 * (6 + 4) = 30 bytes: the scales lie unaligned in the pool
ODD_TILES = {"seq": 4, "past": (5, 0), "qlen": (4, 3), "heads": 4, "kv_heads": 2, "head_dim": 6, "block": 3,
             "rotary": 0}


def _session(names: list[str], dtype: str, **attrs) -> ort.InferenceSession:
    """One PagedAttention node whose pool input and output are of `dtype`."""
    pool = kv_layout.ELEMENT_TYPES[dtype]
    return kernel_session("PagedAttention", names, ["out", "cache_out"], {"cache": pool, "cache_out": pool}, **attrs)


def _value(array: np.ndarray, dtype: str) -> ort.OrtValue:
    """An OrtValue over the array's own memory, as the engine binds its pools."""
    return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(*kv_layout.ort_value_args(array, dtype))


def _setup(case: dict, dtype: str):
    a = attention_case(case)
    sess = _session(a["names"], dtype, **a["attrs"], rotary_interleaved=a["c"]["interleaved"])
    pool = kv_layout.from_token_major(a["cache"], HEAD_MAJOR, dtype)
    return a["c"], sess, a["names"], a["feeds"], pool, a["heads"], a["attrs"]


def _run(sess, names, feeds, pool, dtype):
    """One step with the pool bound in and out as the same OrtValue; returns the output."""
    binding = sess.io_binding()
    value = _value(pool, dtype)
    binding.bind_output("out")
    binding.bind_ortvalue_input("cache", value)
    binding.bind_ortvalue_output("cache_out", value)
    for name in names:
        if name and name != "cache":
            binding.bind_cpu_input(name, feeds[name])
    sess.run_with_iobinding(binding)
    return binding.get_outputs()[0].numpy()


def _tolerance(ref: np.ndarray, dtype: str) -> np.ndarray:
    """One step of the dtype's rounding at each of ref's values (token-major [..., D] vectors)."""
    if dtype == "int8":
        return np.abs(ref).max(-1, keepdims=True) / 127 * np.ones_like(ref)
    return np.abs(ref) * {"fp32": 0.0, "fp16": 2.0 ** -10, "bf16": 2.0 ** -7}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", MAIN_CASES + ("odd-tiles",))
def test_the_kernel_over_each_pool_dtype_matches_the_reference(name, dtype):
    case, sess, names, feeds, pool, heads, attrs = _setup(ODD_TILES if name == "odd-tiles" else CASES[name], dtype)
    d, qlen, past, tables = case["head_dim"], feeds["qlen"], feeds["past"], feeds["tables"]
    start = kv_layout.to_token_major(pool, HEAD_MAJOR, dtype, head_dim=d)  # the values the pool holds
    out = _run(sess, names, feeds, pool, dtype)  # in place
    got = kv_layout.to_token_major(pool, HEAD_MAJOR, dtype, head_dim=d)
    _, ref_cache = pa.reference(*heads, start, past, qlen, tables, **attrs, kv_dtype=dtype)

    # The pool: values as numpy rounds them, to the bit; keys too, but for the rotation: the
    # kernel's may use fused multiply-adds, and a key one float32 ulp away can round to the
    # neighbouring step (then within one step). Block 0 is scratch (the reference writes padding there).
    np.testing.assert_array_equal(got[1, 1:], ref_cache[1, 1:])
    keys, ref_keys = got[0, 1:], ref_cache[0, 1:]
    close = np.abs(keys - ref_keys) <= 2e-6 * np.abs(ref_keys) + 1e-7
    assert (np.abs(keys - ref_keys) <= _tolerance(ref_keys, dtype) * 1.0001 + 2e-6 * np.abs(ref_keys) + 1e-7).all()
    assert close.mean() > 0.999
    if case.get("rotary") == 0:
        np.testing.assert_array_equal(keys, ref_keys)

    # The output against the reference attending over the same stored keys.
    batch, seq = feeds["q"].shape[:2]
    block = got.shape[2]
    stored = heads[1].copy()
    for b in range(batch):
        for j in range(int(qlen[b])):
            p = int(past[b]) + j
            stored[b, :, j] = got[0, tables[b, p // block], p % block]
    ref_out, _ = pa.reference(heads[0], stored, heads[2], start, past, qlen, tables, **attrs, kv_dtype=dtype)
    h = attrs["num_heads"]
    ref_out = ref_out.transpose(0, 2, 1, 3).reshape(batch, seq, -1)
    valid = np.arange(seq)[None] < qlen[:, None]
    np.testing.assert_allclose(out[valid], ref_out[valid], rtol=1e-4, atol=1e-5)
    assert not out[~valid].any()
    assert out.shape[-1] == h * stored.shape[-1]


@pytest.mark.skipif(os.environ.get("LLMC_CPU_PLAIN") == "1", reason="this is the run under LLMC_CPU_PLAIN")
def test_the_portable_path_over_each_pool_dtype_matches_the_reference():
    """The comparisons above again with LLMC_CPU_PLAIN=1 (read once per process, hence a process
    of its own): the portable loops, which widen each converted tile first. A CPU with AVX2 runs
    its in-place loops over a converted pool, so only this run covers the other path."""
    env = dict(os.environ, LLMC_CPU_PLAIN="1")
    test = f"{Path(__file__).name}::test_the_kernel_over_each_pool_dtype_matches_the_reference"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                         cwd=Path(__file__).parent, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_separate_output_pool_gets_the_input_pool_and_the_new_tokens(dtype):
    """Bound to two different OrtValues (or in a plain run) the op's output pool is not its input
    pool: the kernel copies the input's bytes over first and leaves the input alone."""
    _, sess, names, feeds, pool, _, _ = _setup(CASES["ragged-prefill-with-past"], dtype)
    in_place = pool.copy()
    out_in_place = _run(sess, names, feeds, in_place, dtype)
    kept, separate = pool.copy(), np.zeros_like(pool)
    binding = sess.io_binding()
    binding.bind_output("out")
    binding.bind_ortvalue_input("cache", _value(pool, dtype))
    binding.bind_ortvalue_output("cache_out", _value(separate, dtype))
    for name in names:
        if name and name != "cache":
            binding.bind_cpu_input(name, feeds[name])
    sess.run_with_iobinding(binding)
    np.testing.assert_array_equal(binding.get_outputs()[0].numpy(), out_in_place)
    np.testing.assert_array_equal(pool.view(np.uint8), kept.view(np.uint8))
    np.testing.assert_array_equal(separate.view(np.uint8), in_place.view(np.uint8))
    if dtype != "bf16":  # ORT's Python run() has no numpy type for bfloat16
        out, pool_out = sess.run(None, {**{n: feeds[n] for n in names if n and n != "cache"}, "cache": pool})
        assert pool_out.dtype == pool.dtype
        np.testing.assert_array_equal(pool_out, in_place)
        np.testing.assert_array_equal(out, out_in_place)


@pytest.mark.parametrize("dtype", DTYPES)
def test_steps_update_the_bound_pool_in_place(dtype):
    """A prefill then two decode steps through IOBinding with one OrtValue as the pool's input and
    output, as llmc.runtime.engine binds it: each step sees the tokens the earlier ones wrote."""
    h, hkv, d, bs, num_blocks = 4, 2, 16, 4, 8
    rng = np.random.default_rng(1)
    shape = kv_layout.pool_shape(HEAD_MAJOR, num_blocks, bs, hkv, d, dtype)
    pool = np.zeros(shape, kv_layout.numpy_dtype(dtype))
    value = _value(pool, dtype)
    assert value.data_ptr() == pool.ctypes.data  # the OrtValue is the numpy array's memory
    attrs = {"num_heads": h, "num_kv_heads": hkv, "scale": 0.25}
    sess = _session(["qkv", "", "", "cache", "past", "qlen", "tables"], dtype, **attrs)
    tables = np.array([[3, 5, 1]], np.int32)
    tokens = rng.standard_normal((1, 7, (h + 2 * hkv) * d), dtype=np.float32)
    reference = np.zeros(kv_layout.pool_shape(kv_layout.TOKEN_MAJOR, num_blocks, bs, hkv, d), np.float32)
    for past, n in ((0, 5), (5, 1), (6, 1)):
        step = tokens[:, past:past + n]
        feeds = {"qkv": step, "past": np.array([past], np.int32), "qlen": np.array([n], np.int32), "tables": tables}
        binding = sess.io_binding()
        binding.bind_output("out")
        binding.bind_ortvalue_input("cache", value)
        binding.bind_ortvalue_output("cache_out", value)
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        sess.run_with_iobinding(binding)
        out = binding.get_outputs()[0].numpy()
        q, k, v = (step[..., a:b].reshape(1, n, -1, d).transpose(0, 2, 1, 3)
                   for a, b in ((0, h * d), (h * d, (h + hkv) * d), ((h + hkv) * d, None)))
        ref_out, reference = pa.reference(q, k, v, reference, feeds["past"], feeds["qlen"], tables, **attrs,
                                          kv_dtype=dtype)
        np.testing.assert_allclose(out, ref_out.transpose(0, 2, 1, 3).reshape(out.shape), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(kv_layout.to_token_major(pool, HEAD_MAJOR, dtype, head_dim=d), reference)


def test_a_pool_of_another_type_or_shape_is_named_in_one_line():
    feeds = {"q": np.zeros((1, 1, 4 * 8), np.float32), "past": np.array([0], np.int32),
             "qlen": np.array([1], np.int32), "tables": np.array([[1]], np.int32)}
    names = ["q", "", "", "cache", "past", "qlen", "tables"]
    attrs = {"num_heads": 2, "num_kv_heads": 1, "scale": 1.0}  # head_dim 8 (packed: 2 + 2 * 1 heads)
    bad = [("fp32", np.zeros((2, 3, 1, 4 * 12), np.float32), "kv_cache must be \\[2, num_blocks"),
           ("fp16", np.zeros((2, 3, 1, 4), np.float16), "kv_cache must be \\[2, num_blocks"),
           ("int8", np.zeros((2, 3, 1, 4, 8), np.int8), "an int8 kv_cache must be"),
           ("int8", np.zeros((2, 3, 1, 4 * 12 + 1), np.int8), "last dim must be block_size \\* \\(head_dim \\+ 4\\)"),
           ("int8", np.zeros((2, 3, 2, 4 * 12), np.int8), "head count does not match")]
    for dtype, pool, message in bad:
        with pytest.raises(Exception, match=message) as err:
            _session(names, dtype, **attrs).run(None, {**feeds, "cache": pool})
        assert "\n" not in str(err.value).strip()
    # float64 is no pool dtype at all
    types = {"past": TensorProto.INT32, "qlen": TensorProto.INT32, "tables": TensorProto.INT32,
             "cache": TensorProto.DOUBLE}
    node = helper.make_node("PagedAttention", names, ["out", "cache_out"], domain=cpu.DOMAIN, **attrs)
    graph = helper.make_graph([node], "kernel", [helper.make_tensor_value_info(n, types.get(n, TensorProto.FLOAT),
                                                                               None) for n in names if n],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("cache_out", TensorProto.DOUBLE, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid(cpu.DOMAIN, cpu.VERSION)])
    model.ir_version = 10
    opts = ort.SessionOptions()
    cpu.register(opts)
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="kv_cache must be float32, float16, bfloat16 or int8"):
        sess.run(None, {**feeds, "cache": np.zeros((2, 3, 1, 4, 8))})


def test_layout_helpers():
    shape = kv_layout.pool_shape(HEAD_MAJOR, 5, 16, 3, 64, "int8")
    assert shape == (2, 5, 3, 16 * 68)
    assert kv_layout.pool_shape(HEAD_MAJOR, 5, 16, 3, 64, "bf16") == (2, 5, 3, 16, 64)
    assert kv_layout.pool_shape(HEAD_MAJOR, None, "bs", "h", "d", "int8")[3] == "bs * (d + 4)"
    # 16-bit token-major pools are TensorRT's; int8 tiles are the CPU kernel's, head-major only.
    assert kv_layout.pool_shape(kv_layout.TOKEN_MAJOR, 5, 16, 3, 64, "fp16") == (2, 5, 16, 3, 64)
    with pytest.raises(ValueError, match="int8 KV cache needs llmc's CPU attention kernel"):
        kv_layout.pool_shape(kv_layout.TOKEN_MAJOR, 5, 16, 3, 64, "int8")
    with pytest.raises(ValueError, match="unknown KV-cache dtype"):
        kv_layout.pool_shape(HEAD_MAJOR, 5, 16, 3, 64, "fp8")
    assert kv_layout.bytes_per_token(3, 64, "fp32") / kv_layout.bytes_per_token(3, 64, "int8") == 1536 / 408
    assert [kv_layout.bytes_per_token(3, 64, t) for t in ("fp16", "bf16")] == [768, 768]
    rng = np.random.default_rng(0)
    cache = rng.standard_normal((2, 5, 16, 3, 64), dtype=np.float32)
    cache[0, 2, 3, 1] = 0  # a zero vector quantizes to zeros with scale 0
    for dtype in DTYPES:
        pool = kv_layout.from_token_major(cache, HEAD_MAJOR, dtype)
        assert pool.shape == kv_layout.pool_shape(HEAD_MAJOR, 5, 16, 3, 64, dtype)
        assert pool.dtype == kv_layout.numpy_dtype(dtype)
        back = kv_layout.to_token_major(pool, HEAD_MAJOR, dtype, head_dim=64)
        assert back.dtype == np.float32
        np.testing.assert_array_equal(back, kv_layout.round_trip(cache, dtype))
        np.testing.assert_allclose(back, cache, atol={"fp32": 0, "fp16": 4e-3, "bf16": 3e-2, "int8": 3e-2}[dtype])
    assert not kv_layout.round_trip(cache, "int8")[0, 2, 3, 1].any()
    with pytest.raises(ValueError, match="head_dim="):
        kv_layout.to_token_major(kv_layout.from_token_major(cache, HEAD_MAJOR, "int8"), HEAD_MAJOR, "int8")
