"""llmc's CUDA paged attention (llmc/plugins/cuda): compiled here, run where there is a GPU.

Without a GPU: the kernels compile to sm_80 and sm_90 cubins that hold every expected kernel,
the shared library's host side validates its arguments and sizes its workspace, and plugin.cpp's
name, namespace, version and fields match paged_attention.py's op, so the two cannot drift.
With a GPU (CuPy, else torch with CUDA): the library is run through ctypes and compared with
paged_attention.reference() over dtypes, block sizes, GQA ratios, contexts up to 4096, ragged
batches with padding, prefill chunks, sliding windows, softcap and the fused RoPE (query and key
rotated by cuda.apply_rotary and rounded, then reference(); the numpy rotation is checked against
ONNX's RotaryEmbedding here, without a GPU).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import dataclasses
import re
import struct

import numpy as np
import pytest

from llmc.errors import LlmcError
from llmc.plugins import cuda
from llmc.plugins import paged_attention as pa

NO_NVCC = "nvcc not installed: pip install 'llmc[cuda-build]'"
needs_nvcc = pytest.mark.skipif(cuda.find_nvcc() is None, reason=NO_NVCC)

# Mangled fragments of the kernels attention.cu must contain: name and template arguments. The
# attention kernels come with and without the fused RoPE (a trailing bool), the reduce without.
ATTENTION_KERNELS = ("paged_attention_decode", "paged_attention_prefill")
TYPES = {"fp16": "6__half", "bf16": "13__nv_bfloat16"}
HEAD_DIMS = (64, 128)
# kv_write: one bit-copying instantiation for both dtypes, and a rotating one per dtype.
KV_WRITES = ("8kv_writeI6__halfLb0E", "8kv_writeI6__halfLb1E", "8kv_writeI13__nv_bfloat16Lb1E")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Both cubins and the shared library, compiled concurrently (nvcc is mostly single-threaded)."""
    if cuda.find_nvcc() is None:
        pytest.skip(NO_NVCC)
    out = tmp_path_factory.mktemp("cuda")
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        cubins = {arch: pool.submit(cuda.compile_cubin, f"sm_{arch}", out) for arch in ("80", "90")}
        library = pool.submit(cuda.build_shared_library, out)
        return {"cubins": {arch: f.result() for arch, f in cubins.items()}, "library": library.result()}


def elf_symbols(path) -> dict[str, int]:
    """Name -> st_info of every symbol in an ELF64 little-endian file's .symtab (a cubin is one)."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not an ELF64 LE file"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    symbols = {}
    for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        strtab = sections[link]
        str_off = strtab[4]
        for i in range(size // entsize):
            st_name, st_info = struct.unpack_from("<IB", data, offset + i * entsize)
            end = data.index(b"\0", str_off + st_name)
            symbols[data[str_off + st_name:end].decode()] = st_info
    return symbols


@needs_nvcc
@pytest.mark.parametrize("arch", ["80", "90"])
def test_cubin_holds_every_kernel(built, arch):
    cubin = built["cubins"][arch]
    assert cubin.is_file() and cubin.stat().st_size > 0
    symbols = elf_symbols(cubin)
    functions = [name for name, info in symbols.items() if info & 0xF == 2]  # STT_FUNC
    expected = {f"{kernel}<{dtype}, {d}, {rope}>": f"{len(kernel)}{kernel}I{mangled}Li{d}ELb{int(rope)}E"
                for kernel in ATTENTION_KERNELS for dtype, mangled in TYPES.items() for d in HEAD_DIMS
                for rope in (False, True)}
    reduce = "paged_attention_split_reduce"
    expected.update({f"{reduce}<{dtype}, {d}>": f"{len(reduce)}{reduce}I{mangled}Li{d}E"
                     for dtype, mangled in TYPES.items() for d in HEAD_DIMS})
    expected.update({fragment: fragment for fragment in KV_WRITES})
    missing = [label for label, fragment in expected.items() if not any(fragment in name for name in functions)]
    assert not missing, f"kernels missing from sm_{arch} cubin: {missing}"


@needs_nvcc
def test_compile_errors_name_the_problem(tmp_path):
    with pytest.raises(LlmcError, match="sm_80 or newer"):
        cuda.compile_cubin("sm_75", tmp_path)


def test_missing_nvcc_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv(cuda.NVCC_ENV, str(tmp_path / "no-such-nvcc"))
    with pytest.raises(LlmcError, match=re.escape("pip install 'llmc[cuda-build]'")):
        cuda.compile_cubin("sm_90", tmp_path)


# --- plugin.cpp against paged_attention.py -------------------------------------------------------

def _plugin_text() -> str:
    return cuda.PLUGIN_SOURCE.read_text()


def test_plugin_identity_matches_the_op():
    text = _plugin_text()

    def constant(name):
        found = re.search(rf'constexpr char {name}\[\] = "([^"]*)";', text)
        assert found, f"{name} not found in plugin.cpp"
        return found.group(1)

    assert constant("kPluginName") == pa.OP_TYPE
    assert constant("kPluginNamespace") == pa.DOMAIN
    assert constant("kPluginVersion") == str(pa.VERSION)


# The plugin's own attribute beyond PagedAttentionAttrs: how the optional cos/sin inputs pair dims.
PLUGIN_ONLY_FIELDS = [("rotary_interleaved", "kINT32")]


def test_plugin_fields_match_the_attributes():
    text = _plugin_text()
    expected = [(f.name, {"int": "kINT32", "float": "kFLOAT32"}[f.type])
                for f in dataclasses.fields(pa.PagedAttentionAttrs)]
    expected += [field for field in PLUGIN_ONLY_FIELDS if field not in expected]
    creator = text[text.index("class PagedAttentionCreator"):]
    advertised = re.findall(r'fields_\.emplace_back\("(\w+)", nullptr, PluginFieldType::(\w+), 1\)', creator)
    assert advertised == expected
    plugin = text[text.index("void init_fields()"):text.index("LlmcPagedAttentionArgs shape_args")]
    serialized = re.findall(r'fields_\.emplace_back\("(\w+)", &attrs_\.(\w+), PluginFieldType::(\w+), 1\)', plugin)
    assert [(name, kind) for name, _member, kind in serialized] == expected
    assert all(name == member for name, member, _kind in serialized)
    for name, _kind in expected:
        assert f'std::strcmp(f.name, "{name}")' in creator, f"createPlugin does not read {name}"


def test_plugin_io_order_matches_the_op():
    text = _plugin_text()
    inputs = re.search(r"enum Input : int32_t \{([^}]*)\}", text).group(1)
    names = [n.strip() for n in inputs.split(",")]
    # The op's 7 inputs, then the optional cos and sin of a fused RoPE (9 inputs).
    assert len(pa.INPUTS) == 7
    assert names == ["kQuery", "kKey", "kValue", "kCache", "kPastLens", "kQueryLens", "kBlockTables", "kCos", "kSin"]
    assert "constexpr int32_t kNumInputs = kBlockTables + 1;" in text
    assert "constexpr int32_t kNumInputsRope = kSin + 1;" in text
    outputs = re.search(r"enum Output : int32_t \{([^}]*)\}", text).group(1)
    assert [n.strip() for n in outputs.split(",")][:-1] == ["kOutput", "kCacheOut"]
    assert len(pa.OUTPUTS) == 2


def test_plugin_accepts_7_or_9_inputs():
    """Every method TensorRT hands nbInputs to takes both counts; enqueue, which is not told,
    relies on what onShapeChange recorded."""
    text = _plugin_text()

    def body(method):
        start = text.index(f" {method}(")
        return text[start:text.index("\n    }\n", start)]

    for method in ("configurePlugin", "getOutputDataTypes", "getOutputShapes", "supportsFormatCombination",
                   "onShapeChange"):
        assert "valid_io(nbInputs, nbOutputs)" in body(method), method
    assert "nbInputs != kNumInputs && nbInputs != kNumInputsRope" in body("getWorkspaceSize")
    for method in ("configurePlugin", "onShapeChange"):
        assert "rope_ = nbInputs == kNumInputsRope;" in body(method), method
        assert "check_rope_dims(" in body(method), method
    enqueue = body("enqueue")
    assert "if (rope_)" in enqueue and "args.rotary_dim = static_cast<int32_t>(2 * inputDesc[kCos].dims.d[2]);" in enqueue
    assert "args.rotary_interleaved = attrs_.rotary_interleaved;" in enqueue


def test_ctypes_args_match_the_header():
    header = cuda.HEADER.read_text()
    body = header[header.index("typedef struct LlmcPagedAttentionArgs {"):header.index("} LlmcPagedAttentionArgs;")]
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.DOTALL)
    declared = re.findall(r"(\w+)\s*;", body)
    assert declared == [name for name, _ in cuda.PagedAttentionArgs._fields_]
    assert f"#define LLMC_ATTENTION_ABI_VERSION {cuda.ABI_VERSION}" in header
    statuses = header[header.index("typedef enum LlmcStatus {"):header.index("} LlmcStatus;")]
    assert dict((int(v), k) for k, v in re.findall(r"(LLMC_\w+) = (\d+)", statuses)) == cuda.STATUS


# --- the RoPE oracle (no GPU needed) -------------------------------------------------------------

def onnx_rotary(x, cos, sin, interleaved, rotary_dim):
    """ONNX's RotaryEmbedding (opset 23, the reference evaluator) on x [B, H, S, D], float32."""
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    def info(name, shape):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))

    node = helper.make_node("RotaryEmbedding", ["x", "cos", "sin"], ["y"], interleaved=int(interleaved),
                            rotary_embedding_dim=rotary_dim)
    graph = helper.make_graph([node], "rope", [info("x", x.shape), info("cos", cos.shape), info("sin", sin.shape)],
                              [info("y", x.shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    return ReferenceEvaluator(model).run(None, {"x": x, "cos": cos, "sin": sin})[0]


def rope_tables(past_lens, seq, rotary_dim, base=10000.0):
    """cos and sin [B, S, R/2] of the positions past_lens[b] + j (float32, Llama's frequencies)."""
    inv_freq = base ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    pos = np.asarray(past_lens, np.float64)[:, None] + np.arange(seq)
    angles = pos[..., None] * inv_freq
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [16, 8, 6])
def test_apply_rotary_is_onnx_rotary_embedding(interleaved, rotary_dim):
    # Bit for bit: the same fp32 products and sums, so the kernels that match apply_rotary match ONNX.
    rng = np.random.default_rng(rotary_dim)
    x = rng.standard_normal((2, 3, 5, 16), np.float32)
    cos, sin = rope_tables([0, 37], 5, rotary_dim)
    ours = cuda.apply_rotary(x, cos, sin, interleaved)
    np.testing.assert_array_equal(ours, onnx_rotary(x, cos, sin, interleaved, rotary_dim))
    np.testing.assert_array_equal(ours[..., rotary_dim:], x[..., rotary_dim:])
    # A rotation: each pair keeps its length.
    first = slice(0, rotary_dim, 2) if interleaved else slice(0, rotary_dim // 2)
    second = slice(1, rotary_dim, 2) if interleaved else slice(rotary_dim // 2, rotary_dim)
    np.testing.assert_allclose(np.hypot(ours[..., first], ours[..., second]), np.hypot(x[..., first], x[..., second]),
                               rtol=1e-5)


# --- the library's host side (no GPU needed) -----------------------------------------------------

@pytest.fixture(scope="module")
def lib(built):
    return cuda.load_library(built["library"])


def decode_args(**overrides) -> cuda.PagedAttentionArgs:
    fields = dict(batch=1, seq=1, num_heads=32, num_kv_heads=8, head_dim=128, num_blocks=4096, block_size=16,
                  max_blocks=2048, dtype=cuda.DTYPES["fp16"], scale=128 ** -0.5)
    fields.update(overrides)
    return cuda.PagedAttentionArgs(**fields)


@needs_nvcc
def test_library_rejects_bad_arguments(lib):
    fake = 1 << 20  # never dereferenced: the checks come first
    pointers = dict(query=fake, key=fake, value=fake, cache=fake, output=fake, past_lens=fake, query_lens=fake,
                    block_tables=fake)
    cases = {3: dict(head_dim=96), 5: dict(num_heads=6, num_kv_heads=4), 4: dict(dtype=7), 2: dict(block_size=0),
             7: dict(sliding_window=-1), 6: dict(query=fake + 8), 1: dict(output=None)}
    for status, change in cases.items():
        args = decode_args(**{**pointers, **change})
        assert lib.llmc_paged_attention(ctypes.byref(args), None) == status, (status, change)
        assert lib.llmc_error_string(status).decode()
    assert lib.llmc_paged_attention(None, None) == 1
    assert lib.llmc_paged_attention(ctypes.byref(decode_args(batch=0)), None) == 0  # nothing to do


@needs_nvcc
def test_library_rejects_bad_rope_arguments(lib):
    fake = 1 << 20
    pointers = dict(query=fake, key=fake, value=fake, cache=fake, output=fake, past_lens=fake, query_lens=fake,
                    block_tables=fake)
    tables = dict(rope_cos=fake, rope_sin=fake + 4096)
    rotary = 9
    assert cuda.STATUS[rotary] == "LLMC_ERR_ROTARY"
    bad = [dict(rotary_dim=3, **tables), dict(rotary_dim=130, **tables), dict(rotary_dim=-2, **tables),
           dict(rotary_dim=66, head_dim=64, **tables), dict(rotary_dim=128, rotary_interleaved=2, **tables),
           dict(rotary_dim=128, rope_cos=fake), dict(rotary_dim=128, rope_sin=fake),  # one table without the other
           dict(rotary_dim=128),  # RoPE asked for without its tables
           dict(rotary_dim=0, **tables)]  # tables without a rotary_dim
    for change in bad:
        args = decode_args(**{**pointers, **change})
        assert lib.llmc_paged_attention(ctypes.byref(args), None) == rotary, change
    assert "rotary_dim" in lib.llmc_error_string(rotary).decode()
    # Shape errors come first and make the workspace 0; the table checks wait for a non-empty call.
    assert lib.llmc_paged_attention_workspace(ctypes.byref(decode_args(rotary_dim=5))) == 0
    assert lib.llmc_paged_attention(ctypes.byref(decode_args(batch=0, rotary_dim=128)), None) == 0
    assert lib.llmc_paged_attention(ctypes.byref(decode_args(**{**pointers, "output": None, "rotary_dim": 128})),
                                    None) == 1


@needs_nvcc
@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="a CUDA driver is present")
def test_library_without_a_driver_reports_cuda_error(lib):
    fake = 1 << 20
    args = decode_args(query=fake, key=fake, value=fake, cache=fake, output=fake, past_lens=fake, query_lens=fake,
                       block_tables=fake)
    assert lib.llmc_paged_attention(ctypes.byref(args), None) == 8
    reason = cuda.status_message(lib, 8).split(": ", 1)[1]  # CUDA's own words, e.g. no device found
    assert reason and reason != "no error", reason
    # Valid RoPE arguments pass every check too (2-byte aligned tables are enough), in both modes.
    for rotary_dim, interleaved in ((128, 0), (64, 1), (2, 0)):
        args.rope_cos, args.rope_sin = fake + 2, fake + 6
        args.rotary_dim, args.rotary_interleaved = rotary_dim, interleaved
        assert lib.llmc_paged_attention(ctypes.byref(args), None) == 8


@needs_nvcc
def test_workspace_sizes(lib):
    # One decode row of 32 heads over 2048 blocks of 16: 8 KV-head CTAs, so 32 splits of 1024 tokens
    # (a wave of 256 CTAs).
    per_split = 128 * 4 + 8
    assert lib.llmc_paged_attention_workspace(ctypes.byref(decode_args())) == 32 * 32 * per_split
    # Enough rows fill the GPU unsplit: no workspace.
    assert lib.llmc_paged_attention_workspace(ctypes.byref(decode_args(batch=64))) == 0
    # A short context is not split below 256 tokens: 4 blocks of 16 -> 1 split.
    assert lib.llmc_paged_attention_workspace(ctypes.byref(decode_args(max_blocks=4))) == 0
    # Never decreasing in max_blocks: the size for the longest table covers every shorter one.
    sizes = [lib.llmc_paged_attention_workspace(ctypes.byref(decode_args(batch=b, seq=s, max_blocks=m)))
             for b, s in ((1, 1), (3, 1), (2, 7), (1, 40)) for m in range(1, 700, 7)]
    for i in range(1, len(sizes)):
        if i % 100:
            assert sizes[i] >= sizes[i - 1]


# --- on a GPU: the library against paged_attention.reference() -----------------------------------

class Device:
    """Device buffers through CuPy, or torch.cuda where CuPy is missing; all data is 16-bit or int32."""

    def __init__(self):
        self.cp = self.torch = None
        try:
            import cupy
            if cupy.cuda.runtime.getDeviceCount() > 0:
                self.cp = cupy
                return
        except Exception:  # noqa: BLE001 - any failure means "no CuPy GPU"
            pass
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
        self.torch = torch

    def put(self, array: np.ndarray):
        array = np.ascontiguousarray(array)
        if self.cp is not None:
            return self.cp.asarray(array)
        if array.dtype == np.uint16:
            array = array.view(np.int16)
        return self.torch.from_numpy(array).cuda()

    def zeros(self, nbytes: int):
        return self.put(np.zeros(max(nbytes, 16), np.uint8))

    def ptr(self, buf) -> int:
        return buf.data.ptr if self.cp is not None else buf.data_ptr()

    def get(self, buf) -> np.ndarray:
        host = self.cp.asnumpy(buf) if self.cp is not None else buf.cpu().numpy()
        return host.view(np.uint16) if host.dtype == np.int16 else host

    def sync(self):
        if self.cp is not None:
            self.cp.cuda.runtime.deviceSynchronize()
        else:
            self.torch.cuda.synchronize()


@pytest.fixture(scope="module")
def gpu():
    try:
        return Device()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"needs a CUDA GPU with CuPy or torch: {exc}")


def to_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> the 16-bit pattern of fp16 or bf16 (round to nearest even)."""
    if dtype == "fp16":
        return x.astype(np.float16).view(np.uint16)
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bits(bits: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "fp16":
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    return from_bits(to_bits(x, dtype), dtype)


@dataclasses.dataclass
class Case:
    past_lens: list[int]
    query_lens: list[int]
    seq: int
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "fp16"
    window: int = 0
    softcap: float = 0.0
    max_query_len: int = 0
    workspace: bool = True
    seed: int = 0
    rotary_dim: int = 0  # > 0: fused RoPE over the first rotary_dim dims
    interleaved: bool = False


def run_case(lib, dev: Device, case: Case):
    """Run one case on the GPU and return (output, cache, reference output, reference cache)."""
    rng = np.random.default_rng(case.seed)
    batch, d, bs = len(case.past_lens), case.head_dim, case.block_size
    lengths = [p + q for p, q in zip(case.past_lens, case.query_lens)]
    max_blocks = max(1, -(-max(lengths) // bs)) + 1  # one spare column, as a real table has
    num_blocks = 1 + batch * max_blocks
    # Rows get scattered, disjoint blocks; block 0 stays the scratch block; unused columns hold 0.
    order = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((batch, max_blocks), np.int32)
    for b, length in enumerate(lengths):
        used = -(-length // bs)
        tables[b, :used] = order[b * max_blocks:b * max_blocks + used]
    shape_q, shape_kv = (batch, case.heads, case.seq, d), (batch, case.kv_heads, case.seq, d)
    q = rounded(rng.standard_normal(shape_q, np.float32), case.dtype)
    k = rounded(rng.standard_normal(shape_kv, np.float32), case.dtype)
    v = rounded(rng.standard_normal(shape_kv, np.float32), case.dtype)
    cache = rounded(rng.standard_normal((2, num_blocks, bs, case.kv_heads, d), np.float32), case.dtype)
    past = np.array(case.past_lens, np.int32)
    qlens = np.array(case.query_lens, np.int32)
    scale = d ** -0.5
    ropes = {}
    q_ref, k_ref = q, k
    if case.rotary_dim:
        # The op with RoPE is the op on q and k rotated in fp32 and rounded once to the dtype.
        cos, sin = (rounded(t, case.dtype) for t in rope_tables(case.past_lens, case.seq, case.rotary_dim))
        q_ref, k_ref = (rounded(cuda.apply_rotary(x, cos, sin, case.interleaved), case.dtype) for x in (q, k))
        ropes = {"rope_cos": cos, "rope_sin": sin}
    ref_out, ref_cache = pa.reference(q_ref, k_ref, v, cache, past, qlens, tables, num_heads=case.heads,
                                      num_kv_heads=case.kv_heads, scale=scale, sliding_window=case.window,
                                      softcap=case.softcap)

    bufs = {name: dev.put(to_bits(x, case.dtype)) for name, x in (("query", q), ("key", k), ("value", v),
                                                                   ("cache", cache), *ropes.items())}
    bufs["output"] = dev.put(np.full(shape_q, 0x7FFF, np.uint16))  # NaN in fp16 and bf16: every element must be written
    bufs.update(past_lens=dev.put(past), query_lens=dev.put(qlens), block_tables=dev.put(tables))
    args = cuda.PagedAttentionArgs(
        **{name: dev.ptr(buf) for name, buf in bufs.items()}, batch=batch, seq=case.seq, num_heads=case.heads,
        num_kv_heads=case.kv_heads, head_dim=d, num_blocks=num_blocks, block_size=bs, max_blocks=max_blocks,
        max_query_len=case.max_query_len, dtype=cuda.DTYPES[case.dtype], scale=scale, softcap=case.softcap,
        sliding_window=case.window, rotary_dim=case.rotary_dim, rotary_interleaved=int(case.interleaved))
    if case.workspace:
        size = lib.llmc_paged_attention_workspace(ctypes.byref(args))
        bufs["workspace"] = dev.zeros(size)
        args.workspace, args.workspace_size = dev.ptr(bufs["workspace"]), size
    status = lib.llmc_paged_attention(ctypes.byref(args), None)
    assert status == 0, cuda.status_message(lib, status)
    dev.sync()
    out = from_bits(dev.get(bufs["output"]).reshape(shape_q), case.dtype)
    new_cache = from_bits(dev.get(bufs["cache"]).reshape(cache.shape), case.dtype)
    return out, new_cache, ref_out, ref_cache


def check_case(lib, dev, case: Case):
    out, cache, ref_out, ref_cache = run_case(lib, dev, case)
    tol = {"fp16": 2e-3, "bf16": 2e-2}[case.dtype]
    valid = np.zeros(out.shape, bool)
    for b, n in enumerate(case.query_lens):
        valid[b, :, :n] = True
    assert np.all(out[~valid] == 0), "padding rows must be zero"
    if valid.any():
        err = np.abs(out[valid] - ref_out[valid]).max()
        scale = max(np.abs(ref_out[valid]).max(), 1e-3)
        assert err <= tol * scale, f"max abs diff {err:.3g} > {tol} x output scale {scale:.3g}"
    # Block 0 is scratch: the reference writes padding there, the kernel skips it.
    np.testing.assert_array_equal(cache[:, 1:], ref_cache[:, 1:])


@pytest.mark.parametrize("context", [1, 17, 300, 1000, 4096])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_decode_matches_reference(lib, gpu, dtype, block_size, group, context):
    # Ragged rows, one of them padding (query_len 0); the longest has `context` tokens after the step.
    past = [context - 1, context // 2, 0, max(context - 5, 0)]
    check_case(lib, gpu, Case(past_lens=past, query_lens=[1, 1, 1, 0], seq=1, heads=2 * group, kv_heads=2,
                              block_size=block_size, dtype=dtype))


@pytest.mark.parametrize(("past", "chunk"), [(0, 37), (100, 64), (1000, 130), (4000, 96)])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_prefill_matches_reference(lib, gpu, dtype, block_size, group, past, chunk):
    # A chunk row, a shorter chunk, a decode row and a padding row in one step.
    check_case(lib, gpu, Case(past_lens=[past, past // 3, past + 5, 7], query_lens=[chunk, chunk // 2, 1, 0],
                              seq=chunk, heads=2 * group, kv_heads=2, block_size=block_size, dtype=dtype))


@pytest.mark.parametrize("window", [1, 16, 100])
@pytest.mark.parametrize(("past", "chunk"), [(0, 1), (500, 1), (300, 70), (2000, 33)])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_sliding_window(lib, gpu, dtype, past, chunk, window):
    check_case(lib, gpu, Case(past_lens=[past, past // 2], query_lens=[chunk, max(chunk // 2, 1)], seq=chunk,
                              heads=8, kv_heads=2, window=window, dtype=dtype))


@pytest.mark.parametrize("softcap", [5.0, 30.0])
@pytest.mark.parametrize(("past", "chunk"), [(700, 1), (200, 50)])
def test_softcap(lib, gpu, past, chunk, softcap):
    check_case(lib, gpu, Case(past_lens=[past, 3], query_lens=[chunk, 1], seq=chunk, softcap=softcap))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize(("past", "chunk", "group"), [(0, 1, 4), (900, 1, 8), (64, 90, 2), (3000, 20, 7)])
def test_head_dim_64_and_odd_groups(lib, gpu, dtype, past, chunk, group):
    check_case(lib, gpu, Case(past_lens=[past, past + 1], query_lens=[chunk, chunk], seq=chunk, heads=3 * group,
                              kv_heads=3, head_dim=64, dtype=dtype))


def test_decode_padded_to_longer_seq(lib, gpu):
    # S = 4 with max_query_len 1: the decode kernel runs and rows 1..3 read as zeros.
    check_case(lib, gpu, Case(past_lens=[300, 40], query_lens=[1, 1], seq=4, max_query_len=1))


@pytest.mark.parametrize(("past", "chunk"), [(3000, 1), (2000, 40)])
def test_without_workspace(lib, gpu, past, chunk):
    # No workspace: the context is not split; same answer.
    check_case(lib, gpu, Case(past_lens=[past], query_lens=[chunk], seq=chunk, workspace=False))


def test_large_gqa_group(lib, gpu):
    # MQA-style: 32 query heads on one KV head, more rows than a decode tile holds.
    check_case(lib, gpu, Case(past_lens=[1200, 5], query_lens=[1, 1], seq=1, heads=32, kv_heads=1))


# RoPE: (head_dim, rotary_dim) with the rotation over the whole head, half of it, and a rotary_dim
# whose halves do not fall on 16-byte chunks (a chunk straddles R/2 and R).
ROPE_DIMS = [(128, 128), (128, 64), (64, 64), (64, 32), (128, 20)]


# Ragged decode rows (one split across the context, one padding) with GQA 4; a prefill chunk after
# a cached prefix, a first chunk, a decode row and a padding row.
ROPE_STEPS = {
    "decode": dict(past_lens=[1000, 17, 0, 5], query_lens=[1, 1, 1, 0], seq=1, heads=8, kv_heads=2),
    "prefill": dict(past_lens=[300, 0, 40, 7], query_lens=[70, 33, 1, 0], seq=70, heads=6, kv_heads=2),
}


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), ROPE_DIMS)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("step", ROPE_STEPS.values(), ids=ROPE_STEPS.keys())
def test_rope(lib, gpu, step, dtype, head_dim, rotary_dim, interleaved):
    check_case(lib, gpu, Case(**step, head_dim=head_dim, dtype=dtype, rotary_dim=rotary_dim,
                              interleaved=interleaved))


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_rope_with_window_padded_decode_and_no_workspace(lib, gpu, interleaved):
    check_case(lib, gpu, Case(past_lens=[500, 3], query_lens=[1, 1], seq=4, max_query_len=1, window=100,
                              rotary_dim=128, interleaved=interleaved))
    check_case(lib, gpu, Case(past_lens=[2000], query_lens=[40], seq=40, workspace=False, rotary_dim=64,
                              interleaved=interleaved, dtype="bf16"))
