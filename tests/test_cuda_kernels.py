"""llmc's CUDA paged attention (llmc/plugins/cuda): compiled here, run where there is a GPU.

Without a GPU: the kernels compile to sm_80 and sm_90 cubins that hold every expected kernel,
the shared library's host side validates its arguments and sizes its workspace, and plugin.cpp's
name, namespace, version and fields match paged_attention.py's op, so the two cannot drift.
With a GPU (CuPy, else torch with CUDA): the library is run through ctypes and compared with
paged_attention.reference() over dtypes, block sizes, GQA ratios, contexts up to 4096, ragged
batches with padding, prefill chunks, sliding windows and softcap.
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

# Mangled fragments of the kernels attention.cu must contain: name and template arguments.
KERNELS = ("paged_attention_decode", "paged_attention_prefill", "paged_attention_split_reduce")
TYPES = {"fp16": "6__half", "bf16": "13__nv_bfloat16"}
HEAD_DIMS = (64, 128)


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
    missing = [f"{kernel}<{dtype}, {d}>" for kernel in KERNELS for dtype, mangled in TYPES.items() for d in HEAD_DIMS
               if not any(f"{len(kernel)}{kernel}I{mangled}Li{d}E" in name for name in functions)]
    assert not missing, f"kernels missing from sm_{arch} cubin: {missing}"
    assert any("8kv_write" in name for name in functions)


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


def test_plugin_fields_match_the_attributes():
    text = _plugin_text()
    expected = [(f.name, {"int": "kINT32", "float": "kFLOAT32"}[f.type])
                for f in dataclasses.fields(pa.PagedAttentionAttrs)]
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
    names = [n.strip() for n in inputs.split(",")][:-1]  # drop kNumInputs
    assert len(names) == len(pa.INPUTS) == 7
    assert names == ["kQuery", "kKey", "kValue", "kCache", "kPastLens", "kQueryLens", "kBlockTables"]
    outputs = re.search(r"enum Output : int32_t \{([^}]*)\}", text).group(1)
    assert [n.strip() for n in outputs.split(",")][:-1] == ["kOutput", "kCacheOut"]
    assert len(pa.OUTPUTS) == 2


def test_ctypes_args_match_the_header():
    header = cuda.HEADER.read_text()
    body = header[header.index("typedef struct LlmcPagedAttentionArgs {"):header.index("} LlmcPagedAttentionArgs;")]
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.DOTALL)
    declared = re.findall(r"(\w+)\s*;", body)
    assert declared == [name for name, _ in cuda.PagedAttentionArgs._fields_]
    assert f"#define LLMC_ATTENTION_ABI_VERSION {cuda.ABI_VERSION}" in header


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
@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="a CUDA driver is present")
def test_library_without_a_driver_reports_cuda_error(lib):
    fake = 1 << 20
    args = decode_args(query=fake, key=fake, value=fake, cache=fake, output=fake, past_lens=fake, query_lens=fake,
                       block_tables=fake)
    assert lib.llmc_paged_attention(ctypes.byref(args), None) == 8


@needs_nvcc
def test_workspace_sizes(lib):
    # One decode row of 32 heads over 2048 blocks of 16: 8 KV-head CTAs, so 64 splits of 512 tokens.
    per_split = 128 * 4 + 8
    assert lib.llmc_paged_attention_workspace(ctypes.byref(decode_args())) == 32 * 64 * per_split
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
    ref_out, ref_cache = pa.reference(q, k, v, cache, past, qlens, tables, num_heads=case.heads,
                                      num_kv_heads=case.kv_heads, scale=scale, sliding_window=case.window,
                                      softcap=case.softcap)

    bufs = {name: dev.put(to_bits(x, case.dtype)) for name, x in (("query", q), ("key", k), ("value", v),
                                                                   ("cache", cache))}
    bufs["output"] = dev.put(np.full(shape_q, 0x7FFF, np.uint16))  # NaN in fp16 and bf16: every element must be written
    bufs.update(past_lens=dev.put(past), query_lens=dev.put(qlens), block_tables=dev.put(tables))
    args = cuda.PagedAttentionArgs(
        **{name: dev.ptr(buf) for name, buf in bufs.items()}, batch=batch, seq=case.seq, num_heads=case.heads,
        num_kv_heads=case.kv_heads, head_dim=d, num_blocks=num_blocks, block_size=bs, max_blocks=max_blocks,
        max_query_len=case.max_query_len, dtype=cuda.DTYPES[case.dtype], scale=scale, softcap=case.softcap,
        sliding_window=case.window)
    if case.workspace:
        size = lib.llmc_paged_attention_workspace(ctypes.byref(args))
        bufs["workspace"] = dev.zeros(size)
        args.workspace, args.workspace_size = dev.ptr(bufs["workspace"]), size
    status = lib.llmc_paged_attention(ctypes.byref(args), None)
    assert status == 0, lib.llmc_error_string(status).decode()
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
