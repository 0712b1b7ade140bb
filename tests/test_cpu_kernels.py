"""llmc's CPU kernels (llmc.cpu custom ops) in real ONNX Runtime sessions, against the numpy
reference of llmc::PagedAttention, plus the errors users see around them."""

from __future__ import annotations

import shutil

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from conftest import needs_kernels
from llmc.contract import kv_layout, open_engine
from llmc.errors import EngineError
from llmc.plugins import cpu
from llmc.plugins import paged_attention as pa
from llmc.plugins.cpu import lossless, pack_weight
from llmc.plugins.cpu.library import LIBRARY_ENV

pytestmark = needs_kernels
F32, I32 = TensorProto.FLOAT, TensorProto.INT32


# Input names the tests give their non-float32 inputs; any other name is float32.
INPUT_TYPES = {"past": I32, "qlen": I32, "tables": I32, "lossless": TensorProto.UINT8}


def _session(op_type: str, inputs: list[str], outputs: list[str], types: dict[str, int] | None = None,
             threads: int | None = None, **attrs) -> ort.InferenceSession:
    """One llmc.cpu node in a session; `types` gives element types (TensorProto) by input or output
    name beyond INPUT_TYPES (the rest float32)."""
    types = {**INPUT_TYPES, **(types or {})}
    node = helper.make_node(op_type, inputs, outputs, domain=cpu.DOMAIN, **attrs)
    graph = helper.make_graph([node], "kernel", [helper.make_tensor_value_info(n, types.get(n, F32), None)
                                                 for n in inputs if n],
                              [helper.make_tensor_value_info(n, types.get(n, F32), None) for n in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid(cpu.DOMAIN, cpu.VERSION)])
    model.ir_version = 10
    opts = ort.SessionOptions()
    if threads is not None:
        opts.intra_op_num_threads = threads
    cpu.register(opts)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _rotate(x, cos, sin, interleaved):
    """ONNX RotaryEmbedding on [B, H, S, D] with per-token cos/sin [B, S, R/2]."""
    rot, y = 2 * cos.shape[-1], x.copy()
    c, s = cos[:, None], sin[:, None]
    if interleaved:
        x0, x1 = x[..., 0:rot:2], x[..., 1:rot:2]
        y[..., 0:rot:2], y[..., 1:rot:2] = x0 * c - x1 * s, x1 * c + x0 * s
    else:
        x0, x1 = x[..., :rot // 2], x[..., rot // 2:rot]
        y[..., :rot // 2], y[..., rot // 2:rot] = x0 * c - x1 * s, x1 * c + x0 * s
    return y


CASES = {
    "decode-gqa": dict(seq=1, past=(37, 5, 0), qlen=(1, 1, 1), heads=9, kv_heads=3, head_dim=64, block=16),
    "ragged-prefill-with-past": dict(seq=5, past=(0, 7, 3), qlen=(5, 1, 3)),
    "long-prefill-chunk": dict(seq=40, past=(0, 20), qlen=(40, 33), heads=9, kv_heads=3, head_dim=64, block=16),
    "unpacked": dict(packed=False),
    "no-rope": dict(rotary=0),
    "interleaved-rope": dict(interleaved=1),
    "partial-rope": dict(rotary=8),
    "sliding-window": dict(window=3, seq=6, past=(9, 2, 0), qlen=(6, 6, 4)),
    "softcap": dict(softcap=2.0),
    "mha-head-dim-32": dict(heads=4, kv_heads=4, head_dim=32),
    # The kernel specializes (head_dim, block) pairs and blocks rows by 8/4/2/1 per step: cover
    # each specialization with row counts that leave remainders.
    "prefill-head-dim-16-block-16": dict(seq=21, past=(0, 3), qlen=(21, 17), heads=4, kv_heads=2, head_dim=16,
                                         block=16),
    "prefill-head-dim-128-block-16": dict(seq=13, past=(0, 9), qlen=(13, 10), heads=6, kv_heads=2, head_dim=128,
                                          block=16),
    "decode-head-dim-48-block-8": dict(seq=1, past=(3, 30), qlen=(1, 1), heads=10, kv_heads=5, head_dim=48, block=8),
    # Decode with fewer (row, KV head) pairs than threads need (a task per query head): long,
    # short and padding rows, and a window that starts mid-block.
    "decode-few-rows": dict(seq=1, past=(70, 3, 20), qlen=(1, 1, 0), heads=4, kv_heads=1, head_dim=64, block=16),
    "decode-few-rows-window": dict(seq=1, past=(90, 40), qlen=(1, 1), heads=6, kv_heads=2, head_dim=16, block=4,
                                  window=21),
    "decode-head-dim-6-block-16": dict(seq=1, past=(40, 17), qlen=(1, 1), heads=4, kv_heads=2, head_dim=6, block=16,
                                       rotary=0),
    # Decode with few (row, KV head) pairs splits each row's keys into chunks (how many depends on
    # the CPU count), merged after the tasks: one long row; a long, a one-block and a padding row
    # (empty chunks); a window starting mid-block with softcapped scores.
    "decode-split": dict(seq=1, past=(300,), qlen=(1,), heads=9, kv_heads=3, head_dim=64, block=16),
    "decode-split-uneven-rows": dict(seq=1, past=(250, 3, 40), qlen=(1, 1, 0), heads=4, kv_heads=1, head_dim=32,
                                     block=16),
    "decode-split-window-softcap": dict(seq=1, past=(200, 150), qlen=(1, 1), heads=6, kv_heads=2, head_dim=64,
                                        block=16, window=150, softcap=2.0),
    # A KV head's group of 2 query heads, and of 1 at head_dim 128: the other row groupings of the
    # AVX2 loops that read a converted (16-bit or int8) pool in place.
    "decode-head-pairs": dict(seq=1, past=(45, 18), qlen=(1, 1), heads=4, kv_heads=2, head_dim=64, block=16),
    "decode-mha-head-dim-128": dict(seq=1, past=(33,), qlen=(1,), heads=2, kv_heads=2, head_dim=128, block=16),
    # With 8 or more (row, query tile) pairs a task reads every KV head of its row.
    "decode-all-heads": dict(seq=1, past=(37, 5, 0, 16, 17, 100, 3, 60, 1), qlen=(1,) * 8 + (0,), heads=9, kv_heads=3,
                             head_dim=64, block=16),
    "decode-all-heads-window-block-8": dict(seq=1, past=(90, 40, 7, 0, 33, 8, 15, 64), qlen=(1,) * 8, heads=6,
                                            kv_heads=2, head_dim=32, block=8, window=21),
    "prefill-all-heads": dict(seq=40, past=(0, 20, 5), qlen=(40, 33, 12), heads=6, kv_heads=2, head_dim=16, block=16),
    # Gemma's shapes: head_dim 256, a window and Gemma 2's softcap.
    "decode-head-dim-256-window-softcap": dict(seq=1, past=(70, 9), qlen=(1, 1), heads=4, kv_heads=1, head_dim=256,
                                               block=16, window=33, softcap=1.5),
    "prefill-head-dim-256-window-softcap": dict(seq=19, past=(0, 30), qlen=(19, 7), heads=4, kv_heads=2,
                                                head_dim=256, block=16, window=12, softcap=1.5),
    # Qwen3.5's attention layers: GQA groups of 4 heads of 256, a long row split across tasks.
    "decode-gqa-head-dim-256-split": dict(seq=1, past=(300, 40), qlen=(1, 1), heads=8, kv_heads=2, head_dim=256,
                                          block=16),
    # QK-norm (Qwen3, Gemma 3): each query and key head RMS-normalized before its rotation.
    "qk-norm": dict(qk_norm=True),
    "decode-qk-norm-head-dim-128": dict(seq=1, past=(40, 3), qlen=(1, 1), heads=8, kv_heads=2, head_dim=128,
                                        block=16, qk_norm=True),
    # Attention sinks (gpt-oss): a logit per head in the softmax, some far above the scores (the
    # sum rescales to them), one -inf (no sink); in a prefill tile, a window, and a split decode.
    "sinks": dict(sinks=True),
    "prefill-sinks-window": dict(seq=19, past=(0, 30), qlen=(19, 7), heads=4, kv_heads=2, head_dim=64, block=16,
                                 window=12, sinks=True),
    "decode-split-sinks": dict(seq=1, past=(300, 3, 40), qlen=(1, 1, 0), heads=4, kv_heads=1, head_dim=64, block=16,
                               sinks=True),
}


def attention_case(case: dict) -> dict:
    """The inputs of one PagedAttention step for a CASES entry (defaults filled in): the node's
    input names and attributes, the feeds but the pool, the pool token-major ("cache") and the
    reference's per-head Q/K/V, rotated ("heads")."""
    c = dict(seq=5, past=(0, 7, 3), qlen=(5, 1, 3), heads=6, kv_heads=2, head_dim=16, block=4, packed=True,
             rotary=-1, interleaved=0, window=0, softcap=0.0, qk_norm=False, sinks=False) | case
    rng = np.random.default_rng(0)
    batch, seq, h, hkv, d, bs = len(c["past"]), c["seq"], c["heads"], c["kv_heads"], c["head_dim"], c["block"]
    rot = d if c["rotary"] < 0 else c["rotary"]
    past, qlen = np.array(c["past"], np.int32), np.array(c["qlen"], np.int32)
    width = int((past + seq).max() // bs + 1)
    num_blocks = 1 + batch * width + 3
    tables = rng.permutation(np.arange(1, num_blocks))[:batch * width].reshape(batch, width).astype(np.int32)
    q, k, v = (rng.standard_normal((batch, seq, n * d), dtype=np.float32) for n in (h, hkv, hkv))
    cache = rng.standard_normal((2, num_blocks, bs, hkv, d), dtype=np.float32)
    angles = (past[:, None] + np.arange(seq))[..., None] / 10000 ** (np.arange(rot // 2) / max(rot // 2, 1))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    names = ["q", "k", "v"] if not c["packed"] else ["q", "", ""]
    names += ["cache", "past", "qlen", "tables"] + (["cos", "sin"] if rot else [])
    attrs = {"num_heads": h, "num_kv_heads": hkv, "scale": 0.3, "sliding_window": c["window"],
             "softcap": c["softcap"]}
    feeds = {"q": np.concatenate([q, k, v], -1) if c["packed"] else q, "k": k, "v": v, "past": past, "qlen": qlen,
             "tables": tables, "cos": cos, "sin": sin}
    heads = [x.reshape(batch, seq, n, d).transpose(0, 2, 1, 3) for x, n in ((q, h), (k, hkv), (v, hkv))]
    if c["qk_norm"]:
        eps, norms = 1e-6, [(1 + 0.3 * rng.standard_normal(d)).astype(np.float32) for _ in range(2)]
        names += ["", "q_norm", "k_norm"]  # no positions: cos/sin per token
        attrs["qk_norm_epsilon"] = eps
        feeds["q_norm"], feeds["k_norm"] = norms
        for i, w in enumerate(norms):
            x = heads[i]
            heads[i] = (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * w).astype(np.float32)
    if rot:
        heads[0], heads[1] = (_rotate(x, cos, sin, c["interleaved"]) for x in heads[:2])
    if c["sinks"]:
        names += [""] * (12 - len(names)) + ["sinks"]  # ops.h: IN_SINKS
        feeds["sinks"] = np.resize(np.array([0.5, 8.0, -np.inf, -1.0], np.float32), h)
        attrs["sinks"] = feeds["sinks"]
    # The reference takes the heads already normalized: the kernel's attributes less the norm's.
    reference_attrs = {k: v for k, v in attrs.items() if k != "qk_norm_epsilon"}
    attrs.pop("sinks", None)  # an input of the kernel, an argument of the reference
    return dict(c=c, names=names, attrs=attrs, reference_attrs=reference_attrs, feeds=feeds, cache=cache,
                heads=heads)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_paged_attention_kernel_matches_the_reference(case):
    a = attention_case(case)
    c, names, feeds, cache, heads = a["c"], a["names"], a["feeds"], a["cache"], a["heads"]
    batch, seq, h, d = len(c["past"]), c["seq"], c["heads"], c["head_dim"]
    past, qlen, tables = feeds["past"], feeds["qlen"], feeds["tables"]
    sess = _session("PagedAttention", names, ["out", "cache_out"], **a["attrs"], rotary_interleaved=c["interleaved"])
    pool = kv_layout.from_token_major(cache, kv_layout.HEAD_MAJOR)  # the kernel's own layout
    feeds = {**feeds, "cache": pool}
    kept = pool.copy()
    out, cache_out = sess.run(None, {n: feeds[n] for n in names if n})
    np.testing.assert_array_equal(pool, kept)  # not aliased: the kernel wrote a copy, not its input
    cache_out = kv_layout.to_token_major(cache_out, kv_layout.HEAD_MAJOR)

    ref_out, ref_cache = pa.reference(*heads, cache, past, qlen, tables, **a["reference_attrs"])
    ref_out = ref_out.transpose(0, 2, 1, 3).reshape(batch, seq, h * d)
    valid = np.arange(seq)[None] < qlen[:, None]
    np.testing.assert_allclose(out[valid], ref_out[valid], atol=1e-5, rtol=0)
    assert not out[~valid].any()  # padding positions are zeros
    # Block 0 is scratch. Rotated keys may differ from numpy's in the last bit: the kernel's
    # rotation uses fused multiply-adds.
    np.testing.assert_allclose(cache_out[:, 1:], ref_cache[:, 1:], rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", ["decode-all-heads", "prefill-all-heads"])
def test_rotary_tables_indexed_by_position_give_the_per_token_bits(case):
    """cos/sin as [positions, R/2] tables plus position ids (the rotary-tables pass) rotate exactly
    as the same rows given per token; a position past the tables is refused in one line."""
    a = attention_case(CASES[case])
    feeds, seq = a["feeds"], a["c"]["seq"]
    positions = (feeds["past"][:, None] + np.arange(seq)).astype(np.int64)
    positions = np.minimum(positions, (feeds["past"] + feeds["qlen"] - 1)[:, None])  # padding: the last one
    rows = int((feeds["past"] + feeds["qlen"]).max())  # the last valid token's position + 1
    half = feeds["cos"].shape[-1]
    angles = np.arange(rows)[:, None] / 10000 ** (np.arange(half) / half)
    table_cos, table_sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    pool = kv_layout.from_token_major(a["cache"], kv_layout.HEAD_MAJOR)
    base = {**feeds, "cache": pool}
    per_token = _session("PagedAttention", a["names"], ["out", "cache_out"], **a["attrs"])
    want = per_token.run(None, {**{n: base[n] for n in a["names"] if n},
                                "cos": table_cos[positions], "sin": table_sin[positions]})
    names = a["names"] + ["positions"]
    indexed = _session("PagedAttention", names, ["out", "cache_out"], types={"positions": TensorProto.INT64},
                       **a["attrs"])
    got = indexed.run(None, {**{n: base[n] for n in a["names"] if n}, "cos": table_cos, "sin": table_sin,
                             "positions": positions})
    valid = np.arange(seq)[None] < feeds["qlen"][:, None]
    np.testing.assert_array_equal(got[0][valid], want[0][valid])
    np.testing.assert_array_equal(got[1], want[1])
    short = {**{n: base[n] for n in a["names"] if n}, "cos": table_cos[:-1], "sin": table_sin[:-1],
             "positions": positions}
    with pytest.raises(Exception, match="position_ids outside the rotary tables"):
        indexed.run(None, short)


@pytest.mark.parametrize("rows,k,n", [(1, 64, 96), *((r, 40, 70) for r in range(2, 8)), (8, 64, 32), (9, 40, 70),
                                     (10, 40, 70), (11, 40, 70), (12, 40, 70), (13, 17, 5), (20, 33, 64),
                                     (37, 96, 100)])
def test_packed_matmul_matches_numpy(rows, k, n):
    """Every row-tile size (1 to 12, then passes of 12 and the rest) and a partial last column panel."""
    rng = np.random.default_rng(rows)
    x, w = rng.standard_normal((1, rows, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
    sess = _session("PackedMatMul", ["x", "w"], ["y"], n=n)
    y, = sess.run(None, {"x": x, "w": pack_weight(w)})
    np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="does not match the weight's K"):
        sess.run(None, {"x": x[..., 1:].copy(), "w": pack_weight(w)})


@pytest.mark.parametrize("rows,n", [(1, 96), (3, 70), (13, 5), (20, 1000)])
def test_packed_matmul_argmax_output_is_numpys_argmax(rows, n):
    """The optional second output, each row's argmax, taken per panel: ties go to the first column
    (a tie across panels included), NaN beats everything (the first one), all -inf gives 0."""
    rng = np.random.default_rng(rows + n)
    k = 16
    x, w = rng.standard_normal((rows, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
    # Columns that copy another give exact ties: the copy of the largest column in a later panel.
    w[:, n - 1] = w[:, int(np.argmax((x @ w)[0]))]
    x[rows - 1] = 0.0  # a row of zeros: all tied
    sess = _session("PackedMatMul", ["x", "w"], ["y", "argmax"], {"argmax": TensorProto.INT64}, n=n)
    y, argmax = sess.run(None, {"x": x, "w": pack_weight(w)})
    assert argmax.dtype == np.int64 and argmax.shape == (rows,)
    np.testing.assert_array_equal(argmax, np.argmax(y, axis=-1))
    assert argmax[rows - 1] == 0
    # NaN and -inf rows come from the weights: a NaN column, and a row that makes every column -inf.
    if n > 40:
        w[:, 37] = np.nan
        w[:, 2] = np.nan
        y, argmax = sess.run(None, {"x": x[:1], "w": pack_weight(w)})
        np.testing.assert_array_equal(argmax, np.argmax(y, axis=-1))
        assert argmax[0] == 2
    y, argmax = sess.run(None, {"x": np.full((1, k), -np.inf, np.float32), "w": pack_weight(np.ones((k, n), np.float32))})
    assert np.isneginf(y).all() and argmax[0] == 0


@pytest.mark.parametrize("rows", [1, 13])
def test_skip_rmsnorm_matmul_matches_numpy(rows):
    """The residual sum, and the product of its RMS-normed rows with a packed weight."""
    rng = np.random.default_rng(rows)
    x, skip = (rng.standard_normal((1, rows, 40), dtype=np.float32) for _ in range(2))
    gamma, w = rng.standard_normal(40, dtype=np.float32), rng.standard_normal((40, 70), dtype=np.float32)
    sess = _session("SkipRMSNormMatMul", ["x", "skip", "gamma", "w"], ["y", "sum"], n=70, epsilon=1e-5)
    y, total = sess.run(None, {"x": x, "skip": skip, "gamma": gamma, "w": pack_weight(w)})
    ref_sum = x + skip
    normed = ref_sum / np.sqrt((ref_sum.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * gamma
    np.testing.assert_array_equal(total, ref_sum)
    np.testing.assert_allclose(y, normed @ w, rtol=1e-5, atol=1e-4)
    with pytest.raises(Exception, match="skip must match the input's shape"):
        sess.run(None, {"x": x, "skip": skip[..., :39].copy(), "gamma": gamma, "w": pack_weight(w)})


def _gated(gate: np.ndarray, up: np.ndarray, activation: int, alpha: float = 1.702, limit: float = 1.5) -> np.ndarray:
    """act(gate) * up in float64: SiLU, GELU's tanh approximation (torch's gelu_pytorch_tanh), or
    gpt-oss's clamped SwiGLU."""
    gate = gate.astype(np.float64)
    if activation == cpu.ACT_CLAMPED_SWIGLU:
        gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
        return (up + 1) * gate / (1 + np.exp(-alpha * gate))
    if activation == cpu.ACT_GELU_TANH:
        return 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3))) * up
    return gate / (1 + np.exp(-gate)) * up


@pytest.mark.parametrize("activation", [cpu.ACT_SILU, cpu.ACT_GELU_TANH])
@pytest.mark.parametrize("rows", [1, 13])
def test_swiglu_matmul_matches_numpy(rows, activation):
    rng = np.random.default_rng(rows)
    x, w = rng.standard_normal((1, rows, 2 * 40), dtype=np.float32), rng.standard_normal((40, 70), dtype=np.float32)
    sess = _session("SwiGLUMatMul", ["x", "w"], ["y"], n=70, activation=activation)
    y, = sess.run(None, {"x": x, "w": pack_weight(w)})
    np.testing.assert_allclose(y, _gated(x[..., :40], x[..., 40:], activation) @ w, rtol=1e-5, atol=1e-4)
    with pytest.raises(Exception, match="input's last dim does not match the weight's K"):
        sess.run(None, {"x": x[..., 2:].copy(), "w": pack_weight(w)})


def test_paged_attention_kernel_rejects_bad_metadata_with_a_message():
    sess = _session("PagedAttention", ["q", "", "", "cache", "past", "qlen", "tables"], ["out", "cache_out"],
                    num_heads=2, num_kv_heads=1, scale=1.0)
    feeds = {"q": np.zeros((1, 1, 16), np.float32), "cache": np.zeros((2, 3, 1, 4, 4), np.float32),
             "past": np.array([5], np.int32), "qlen": np.array([1], np.int32),
             "tables": np.array([[1, 7]], np.int32)}
    with pytest.raises(Exception, match="block_tables names a block outside the KV pool"):
        sess.run(None, feeds)
    feeds["tables"] = np.array([[1]], np.int32)  # position 5 needs a second block
    with pytest.raises(Exception, match="block_tables has fewer columns"):
        sess.run(None, feeds)
    feeds["q"] = np.zeros((1, 1, 15), np.float32)
    with pytest.raises(Exception, match="query's last dim"):
        sess.run(None, feeds)
    feeds["q"], feeds["cache"] = np.zeros((1, 1, 16), np.float32), np.zeros((2, 3, 1, 0, 4), np.float32)
    with pytest.raises(Exception, match="kv_cache has an empty dimension"):  # not a division by zero
        sess.run(None, feeds)


def _spread_weight(rng, k: int, n: int) -> np.ndarray:
    """Weights over many magnitudes, plus values whose top byte no panel's table holds: the
    exceptions path, and bits a float can have (signed zero, inf, subnormal, the largest)."""
    w = (rng.standard_normal((k, n)) * np.exp2(rng.integers(-12, 4, (k, n)))).astype(np.float32)
    w[0, 0], w[1, min(1, n - 1)], w[2, 0], w[3, n - 1] = -0.0, np.inf, 1e-40, np.finfo(np.float32).max
    return w


def test_the_lossless_format_round_trips_every_bit():
    packed = pack_weight(_spread_weight(np.random.default_rng(0), 96, 70))
    blob = lossless.encode(packed)
    assert np.array_equal(lossless.decode(blob, 96, 70).view(np.uint32), packed.view(np.uint32))
    panels = packed.shape[0]
    offsets = blob[panels * (64 + 96 * 112):][:4 * (panels + 1)].copy().view(np.int32)
    exceptions = int(offsets[-1])
    assert exceptions > 0  # the spread weight exercises the exception list
    assert blob.nbytes == panels * (64 + 96 * 112) + 4 * (panels + 1) + 8 * exceptions
    # A smollm2-like layer (normal, std 0.02): 28 bits a weight, almost no exceptions.
    normal = pack_weight((np.random.default_rng(1).standard_normal((576, 576)) * 0.02).astype(np.float32))
    assert lossless.encode(normal).nbytes / normal.nbytes < 0.877
    assert "multiple of 4" in lossless.supports(pack_weight(np.ones((6, 32), np.float32)))


LOSSLESS_OPS = {  # op -> (its inputs before the lossless one, the width of its `x` per K)
    "PackedMatMul": (["x", "w"], 1),
    "SkipRMSNormMatMul": (["x", "skip", "gamma", "w"], 1),
    "SwiGLUMatMul": (["x", "w"], 2),
}


@pytest.mark.parametrize("op", LOSSLESS_OPS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 13])
def test_lossless_weights_give_the_fp32_bits(op, rows):
    """Up to 8 rows the ops read the lossless copy (a corrupted copy changes the output, so the
    path is exercised), and the output equals the fp32 weight's to the bit; above, the fp32 one."""
    if "avx512f" not in open("/proc/cpuinfo").read():
        pytest.skip("no AVX-512 on this CPU: the ops read the fp32 weight and never the lossless copy")
    rng = np.random.default_rng(rows)
    k, n = 96, 70
    names, width = LOSSLESS_OPS[op]
    packed = pack_weight(_spread_weight(rng, k, n))
    feeds = {"x": rng.standard_normal((1, rows, width * k), dtype=np.float32), "w": packed,
             "skip": rng.standard_normal((1, rows, k), dtype=np.float32),
             "gamma": rng.standard_normal(k, dtype=np.float32)}
    outputs = ["y", "sum"] if op == "SkipRMSNormMatMul" else ["y"]
    attrs = {"n": n, **({"epsilon": 1e-5} if op == "SkipRMSNormMatMul" else {})}
    fp32 = _session(op, names, outputs, **attrs).run(None, {i: feeds[i] for i in names})[0]
    with_copy = _session(op, [*names, "lossless"], outputs, **attrs)
    blob = lossless.encode(packed)
    y = with_copy.run(None, {**{i: feeds[i] for i in names}, "lossless": blob})[0]
    assert np.array_equal(y.view(np.uint32), fp32.view(np.uint32))
    corrupt = blob.copy()
    corrupt[:64] = 0  # the first panel's code table
    y = with_copy.run(None, {**{i: feeds[i] for i in names}, "lossless": corrupt})[0]
    assert np.array_equal(y, fp32) == (rows > 8)
    with pytest.raises(Exception, match="lossless weight.*rebuild the engine"):
        with_copy.run(None, {**{i: feeds[i] for i in names}, "lossless": blob[:-8]})


@pytest.mark.parametrize("activation", [cpu.ACT_SILU, cpu.ACT_GELU_TANH])
@pytest.mark.parametrize("rows", [1, 37])
def test_swiglu_kernel(rows, activation):
    x = np.random.default_rng(rows).standard_normal((1, rows, 2 * 24), dtype=np.float32) * 4
    out, = _session("SwiGLU", ["x"], ["y"], activation=activation).run(None, {"x": x})
    np.testing.assert_allclose(out, _gated(x[..., :24], x[..., 24:], activation), rtol=1e-6, atol=1e-6)


def _experts_reference(x, ids, weights, gate_up, down, activation, biases=(None, None)):
    """transformers' experts: per token, its chosen experts' gated MLPs (with their biases, if any)
    weighted and summed (float64)."""
    inter, out = down.shape[2], np.zeros(x.shape, np.float64)
    for t, (chosen, w) in enumerate(zip(ids, weights)):
        for e, we in zip(chosen, w):
            h = gate_up[e].astype(np.float64) @ x[t] + (0 if biases[0] is None else biases[0][e])
            y = down[e].astype(np.float64) @ _gated(h[:inter], h[inter:], activation)
            out[t] += we * (y + (0 if biases[1] is None else biases[1][e]))
    return out


@pytest.mark.parametrize("activation", [cpu.ACT_SILU, cpu.ACT_GELU_TANH])
@pytest.mark.parametrize("packed", [0, 1])
@pytest.mark.parametrize("tokens,top_k,experts,hidden,inter", [(1, 2, 8, 64, 32), (5, 3, 8, 64, 40),
                                                               (37, 8, 64, 96, 40), (3, 1, 4, 33, 17)])
def test_experts_kernel_matches_numpy(tokens, top_k, experts, hidden, inter, packed, activation):
    """Decode (1 row), a few rows, a prefill chunk choosing most of 64 experts, sizes off the 32-column
    panels; the weights as the checkpoint holds them and packed."""
    rng = np.random.default_rng(tokens)
    x = rng.standard_normal((tokens, hidden), np.float32)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int64)
    weights = rng.random((tokens, top_k), np.float32)
    gate_up = (0.1 * rng.standard_normal((experts, 2 * inter, hidden))).astype(np.float32)
    down = (0.1 * rng.standard_normal((experts, hidden, inter))).astype(np.float32)
    stacks = (cpu.pack_experts(gate_up), cpu.pack_experts(down)) if packed else (gate_up, down)
    session = _session("Experts", ["x", "ids", "w", "gate_up", "down"], ["y"], {"ids": TensorProto.INT64},
                       activation=activation, packed=packed)
    out, = session.run(None, {"x": x, "ids": ids, "w": weights, "gate_up": stacks[0], "down": stacks[1]})
    np.testing.assert_allclose(out, _experts_reference(x, ids, weights, gate_up, down, activation), rtol=1e-5,
                               atol=2e-6)


@pytest.mark.parametrize("packed", [0, 1])
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (23, 3)])
def test_gpt_oss_experts_with_biases_and_the_clamped_swiglu_match_numpy(tokens, top_k, packed):
    """Biases after both products and gpt-oss's clamped SwiGLU, its clamps binding on about half
    the values."""
    rng = np.random.default_rng(tokens)
    experts, hidden, inter = 8, 64, 40
    x = rng.standard_normal((tokens, hidden), np.float32)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int64)
    weights = rng.random((tokens, top_k), np.float32)
    gate_up = (0.25 * rng.standard_normal((experts, 2 * inter, hidden))).astype(np.float32)
    down = (0.1 * rng.standard_normal((experts, hidden, inter))).astype(np.float32)
    biases = [rng.standard_normal((experts, n), np.float32) for n in (2 * inter, hidden)]
    stacks = (cpu.pack_experts(gate_up), cpu.pack_experts(down)) if packed else (gate_up, down)
    session = _session("Experts", ["x", "ids", "w", "gate_up", "down", "b1", "b2"], ["y"], {"ids": TensorProto.INT64},
                       activation=cpu.ACT_CLAMPED_SWIGLU, alpha=1.702, limit=1.5, packed=packed)
    out, = session.run(None, {"x": x, "ids": ids, "w": weights, "gate_up": stacks[0], "down": stacks[1],
                              "b1": biases[0], "b2": biases[1]})
    want = _experts_reference(x, ids, weights, gate_up, down, cpu.ACT_CLAMPED_SWIGLU, biases)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=2e-5)
    h = np.einsum("eoi,ti->teo", gate_up, x)[np.arange(tokens)[:, None], ids] + biases[0][ids]
    assert (np.abs(h) > 1.5).mean() > 0.3  # the clamps bind


@pytest.mark.parametrize("bits,symmetric", [(8, True), (8, False), (6, True), (4, True), (4, False)])
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (19, 3)])
def test_quantized_experts_match_the_quantized_reference(tokens, top_k, bits, symmetric):
    """Each chosen expert's two products as PackedMatMul computes a quantized weight (activations
    quantized per row and block: quant.reference), the activation and the weighted sum in float64."""
    from llmc.plugins.cpu import quant

    rng = np.random.default_rng(bits + tokens)
    experts, hidden, inter, block = 6, 64, 96, 32
    low, high = quant.value_range(bits, symmetric)
    x = rng.standard_normal((tokens, hidden), np.float32)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int64)
    weights = rng.random((tokens, top_k), np.float32)
    stacks = []
    for n, k in ((2 * inter, hidden), (hidden, inter)):
        q = rng.integers(low, high + 1, (experts, n, k)).astype(np.int8 if symmetric else np.uint8)
        scale = (0.01 * rng.random((experts, n, k // block)) + 1e-3).astype(np.float16).astype(np.float32)
        zp = None if symmetric else rng.integers(low, high + 1, (experts, n, k // block)).astype(np.uint8)
        stacks.append((q, scale, zp))
    session = _session("Experts", ["x", "ids", "w", "gate_up", "down"], ["y"],
                       {"ids": TensorProto.INT64, "gate_up": TensorProto.UINT8, "down": TensorProto.UINT8},
                       packed=1, weight_format=quant.WEIGHT_FORMATS[f"int{bits}"], block_size=block,
                       zero_points=int(not symmetric))
    blobs = [quant.pack_quantized_experts(q, scale, zp, bits, block) for q, scale, zp in stacks]
    out, = session.run(None, {"x": x, "ids": ids, "w": weights, "gate_up": blobs[0], "down": blobs[1]})

    def product(rows, e, stack):
        q, scale, zp = stack
        return quant.reference(rows, q[e].T, scale[e].T, None if zp is None else zp[e].T, bits, block)

    want = np.zeros((tokens, hidden))
    for t in range(tokens):
        for e, w in zip(ids[t], weights[t]):
            h = product(x[t:t + 1], e, stacks[0])[0]
            act = _gated(h[:inter], h[inter:], cpu.ACT_SILU).astype(np.float32)
            want[t] += w * product(act[None], e, stacks[1])[0]
    np.testing.assert_allclose(out, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


def test_experts_kernel_refuses_an_expert_id_out_of_range():
    session = _session("Experts", ["x", "ids", "w", "gate_up", "down"], ["y"], {"ids": TensorProto.INT64})
    feeds = {"x": np.ones((2, 8), np.float32), "ids": np.array([[0], [4]], np.int64), "w": np.ones((2, 1), np.float32),
             "gate_up": np.ones((4, 6, 8), np.float32), "down": np.ones((4, 8, 3), np.float32)}
    with pytest.raises(Exception, match="Experts: an expert id is outside"):
        session.run(None, feeds)


def test_an_unknown_activation_is_refused_in_one_line():
    with pytest.raises(Exception, match="attribute activation must be 0 \\(SiLU\\) or 1"):
        _session("SwiGLU", ["x"], ["y"], activation=7)


@pytest.mark.parametrize("kernel_pass", ["cpu-kernels", "packed-matmul", "lossless-weights", "decoder-layers"])
def test_the_pass_stands_aside_without_the_library(monkeypatch, kernel_pass):
    import onnx_ir as ir

    from llmc.contract.model_spec import ModelSpec
    from llmc.contract.options import BuildOptions
    from llmc.passes.pipeline import pipeline

    monkeypatch.setenv(LIBRARY_ENV, "")
    spec = ModelSpec(family="llama", architecture="LlamaForCausalLM", num_layers=1, hidden_size=8, num_heads=2,
                     num_kv_heads=1, head_dim=4, intermediate_size=16, vocab_size=32, max_position_embeddings=64,
                     rope_theta=1e4, norm_eps=1e-6, activation="silu", tie_word_embeddings=False)
    the_pass = next(p for p in pipeline(BuildOptions(lossless_weights=True)) if p.name == kernel_pass)
    result = the_pass.run(ir.Model(ir.Graph([], [], nodes=[]), ir_version=10), spec)
    assert not result.changed and "not built" in result.misses[0]


def test_an_engine_that_needs_the_kernels_fails_clearly_without_them(llama_engine, tmp_path, monkeypatch):
    from llmc.runtime.engine import Engine

    assert open_engine(llama_engine).manifest.backend.custom_ops == (cpu.DOMAIN,)
    monkeypatch.setenv(LIBRARY_ENV, "")
    with pytest.raises(EngineError, match="--disable-pass cpu-kernels") as err:
        Engine(llama_engine)
    assert "\n" not in str(err.value)
    # A library that ORT cannot load (here: not a shared object) is named as such, in one line.
    bogus = tmp_path / "libbogus.so"
    shutil.copy(llama_engine / "generation_config.json", bogus)
    monkeypatch.setenv(LIBRARY_ENV, str(bogus))
    with pytest.raises(EngineError, match="cannot load llmc's CPU kernels"):
        Engine(llama_engine)
