"""Weight quantization and 16-bit weights: the quantizers, the pass's canonical graph, engines
built with --quant / --weight-dtype / --kv-cache-dtype, what they record and what they refuse."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from click.testing import CliRunner

from conftest import needs_kernels
from llmc.cli import main
from llmc.contract import open_engine
from llmc.contract.options import BuildOptions
from llmc.errors import LlmcError
from llmc.passes import quantizers
from llmc.passes.quantizers import SYMMETRIC_RANGE, quantize, relative_error
from llmc.plugins.cpu import quant
from llmc.plugins.cpu.library import LIBRARY_ENV
from llmc.runtime.llm import LLM
from llmc.runtime.sampling import SamplingParams


def _weight(rng, k=256, n=96):
    w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
    w[rng.random(w.shape) < 0.002] *= 10  # outliers, as trained weights have
    return w


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_the_scale_search_beats_round_to_nearest(bits, symmetric):
    w = _weight(np.random.default_rng(bits))
    rtn = quantize(w, bits, 32, symmetric, "rtn")
    searched = quantize(w, bits, 32, symmetric, "search")
    assert relative_error(w, searched) < relative_error(w, rtn)
    for q in (rtn, searched):
        assert np.array_equal(q.scale, q.scale.astype(np.float16).astype(np.float32))  # stored as fp16
        low, high = SYMMETRIC_RANGE[bits] if symmetric else (0, 2 ** bits - 1)
        assert q.q.min() >= low and q.q.max() <= high
        assert (q.zero_point is None) == symmetric


def test_importance_moves_the_error_off_the_rows_that_matter():
    rng = np.random.default_rng(0)
    w = _weight(rng)
    importance = np.ones(w.shape[0], np.float32)
    importance[::8] = 100.0  # rows whose activations are large
    plain = quantize(w, 4, 32, True, "search")
    aware = quantize(w, 4, 32, True, "search", importance)

    def weighted(q):
        return float((importance[:, None] * (w - q.dequantize()) ** 2).sum())

    assert weighted(aware) < weighted(plain)


def test_an_all_zero_block_stays_zero():
    w = np.zeros((64, 8), np.float32)
    w[32:] = 0.5
    q = quantize(w, 4, 32, True, "search")
    assert np.all(q.dequantize()[:32] == 0) and np.all(np.isfinite(q.dequantize()))


@pytest.mark.parametrize("block, symmetric, aware", [(32, True, False), (64, False, True), (128, True, True)])
def test_tiles_change_no_result(monkeypatch, block, symmetric, aware):
    """The quantizer works on tiles of columns (in threads): quantizing column ranges apart, cut
    anywhere but into single columns, gives the whole weight's integers and scales."""
    monkeypatch.setattr(quantizers, "TILE", block * 40)  # tiles of at most 40 columns: 7 over 261
    rng = np.random.default_rng(block)
    w = _weight(rng, k=256, n=261)
    w[:block, 5] = 0  # an all-zero block
    importance = rng.random(256).astype(np.float32) * 10 if aware else None
    assert len(quantizers.column_chunks(261, block)) == 7
    whole = quantizers.quantize_numpy(w, 4, block, symmetric, "search", importance)
    cuts = [0, 2, 41, 100, 187, 189, 261]
    parts = [quantizers.quantize_numpy(np.ascontiguousarray(w[:, a:b]), 4, block, symmetric, "search", importance)
             for a, b in zip(cuts, cuts[1:])]
    for field in ("q", "scale") + (() if symmetric else ("zero_point",)):
        together = np.concatenate([getattr(p, field) for p in parts], axis=1)
        assert together.dtype == getattr(whole, field).dtype
        assert np.array_equal(together, getattr(whole, field)), field


def _hard_weight(rng, k, n):
    """Trained-like columns next to every edge the scale search has: an all-zero block, a tie of
    signs, values below float16's normals, ones whose scale overflows float16, and a column slice's
    row stride."""
    w = _weight(rng, k, n + 7)[:, 3:n + 3]
    w[:32, 0] = 0
    w[32:64, 1] = np.where(np.arange(32) % 3, 0.25, -0.25)
    w[:32, 2] = rng.standard_normal(32) * 1e-7
    w[32:64, 3] = rng.standard_normal(32) * 1e-4
    w[64:96, 4] = rng.standard_normal(32).astype(np.float32) * 6e5
    w[:, 5] = rng.standard_normal(k).astype(np.float32) * 50
    return w


@needs_kernels
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the overflowing column: an infinite scale, a NaN error
@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("block", [32, 64, 128])
@pytest.mark.parametrize("method, aware", [("search", False), ("search", True), ("rtn", False)])
@pytest.mark.parametrize("transposed", [False, True])
def test_the_c_quantizer_is_the_numpy_one(bits, block, method, aware, transposed):
    """plugins/cpu/quantize.c takes the symmetric blocks of a build: its integers, scales and
    errors are numpy's to the bit, on every edge a block can have and on a width that is not a
    multiple of its 32-column groups, its rows or its columns contiguous."""
    rng = np.random.default_rng(bits * block)
    w = _hard_weight(rng, 256, 203)
    if transposed:  # a checkpoint's Linear, [N, K], read as [K, N]
        w = np.ascontiguousarray(w.T).T
    assert not w.flags.c_contiguous
    importance = rng.random(256).astype(np.float32) * 10 if aware else None
    assert quantizers._native_quantizer() is not None
    native = quantize(w, bits, block, True, method, importance)
    reference = quantizers.quantize_numpy(w, bits, block, True, method, importance)
    for field in ("q", "scale", "errors"):
        assert getattr(native, field).dtype == getattr(reference, field).dtype
        assert np.array_equal(getattr(native, field), getattr(reference, field), equal_nan=True), field


@pytest.mark.parametrize("options, message", [
    (dict(quant="int3"), "--quant must be one of none, int8, int6, int4"),
    (dict(quant="int4", quant_block_size=48), "--quant-block-size must be one of 32, 64, 128"),
    (dict(kv_cache_dtype="int2"), "--kv-cache-dtype must be one of auto, fp32, fp16, bf16, int8"),
    (dict(weight_dtype="int8"), "--weight-dtype must be one of fp32, bf16, fp16"),
    (dict(quant="int4", quant_method="gptq"), "--quant-method must be one of rtn, search, awq"),
    (dict(quant="int8", calibrate="x.txt"), "--calibrate is read by --quant-method awq and --draft-vocab only"),
    (dict(draft_vocab=0), "--draft-vocab must be a token count >= 1"),
    (dict(quant="int4", embedding="int4"), "--embedding must be one of auto, fp32, bf16, fp16, int8"),
])
def test_bad_quantization_options_are_one_line_errors(options, message):
    with pytest.raises(LlmcError, match=message):
        BuildOptions(**options)


def test_the_roles_take_their_formats():
    int4 = BuildOptions(quant="int4")
    assert (int4.format_of("body"), int4.format_of("lm_head"), int4.format_of("embedding")) == ("int4", "int6", "int8")
    int8 = BuildOptions(quant="int8")
    assert {int8.format_of(r) for r in ("body", "lm_head", "embedding")} == {"int8"}
    bf16 = BuildOptions(weight_dtype="bf16")
    assert {bf16.format_of(r) for r in ("body", "lm_head", "embedding")} == {"bf16"}
    mixed = BuildOptions(quant="int4", lm_head="int4", embedding="fp32")
    assert (mixed.format_of("lm_head"), mixed.format_of("embedding")) == ("int4", "fp32")


def test_the_kv_cache_is_fp16_by_default_where_weights_are_reduced():
    assert BuildOptions().kv_dtype == "fp32"  # fp32 engines match transformers' cache exactly
    assert BuildOptions(quant="int4").kv_dtype == BuildOptions(weight_dtype="bf16").kv_dtype == "fp16"
    assert BuildOptions(quant="int8", kv_cache_dtype="fp32").kv_dtype == "fp32"
    # Only llmc's attention kernel reads a 16-bit pool.
    assert BuildOptions(quant="int4", disable_passes=("cpu-kernels",)).kv_dtype == "fp32"


@pytest.mark.parametrize("flags, line", [
    (["--quant", "int4", "--quant-block-size", "128"],
     "--quant-block-size 128 does not divide the model's hidden size (64); use 32 or 64"),
    (["--quant", "int4", "--quant-method", "awq", "--calibrate", "/nope.txt"],
     "--calibrate /nope.txt: no such file; give a text file (UTF-8)"),
    (["--kv-cache-dtype", "int8", "--disable-pass", "cpu-kernels"],
     "--kv-cache-dtype int8 needs the cpu-kernels pass; do not disable it, or drop --kv-cache-dtype"),
    (["--draft-vocab", "99999"],
     "--draft-vocab 99999 keeps the whole vocabulary (1024 tokens); give fewer, or drop --draft-vocab"),
])
def test_options_the_model_cannot_honour_are_refused_before_export(tmp_path, flags, line):
    result = CliRunner().invoke(main, ["build", "tiny-llama", "-o", str(tmp_path / "e"), *flags])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == f"error: {line}"
    assert "export" not in result.output and not (tmp_path / "e").exists()


def test_the_canonical_graph_runs_in_onnx_runtime_with_dequantize_linear(hf_models):
    """quantize-weights alone: standard ONNX any runtime can run, close to the fp32 graph at 8 bits."""
    import onnxruntime as ort

    from llmc.compiler.export import export_onnx
    from llmc.compiler.frontend import model_spec_from_config, read_config
    from llmc.passes.quantize_weights import QuantizeWeights, records_of

    hf, folder = hf_models("tiny-llama")
    spec = model_spec_from_config(read_config(folder))
    model = export_onnx(hf, spec)
    fp32 = ir.to_proto(model).SerializeToString()
    result = QuantizeWeights(BuildOptions(quant="int8")).run(model, spec)
    ops = [n.op_type for n in model.graph]
    # 2 layers x 7 projections, the LM head; the embedding's Gather feeds one DequantizeLinear.
    assert result.counts == {"quantize_matmul": 15, "quantize_embedding": 1}
    assert ops.count("DequantizeLinear") == 16
    quantized = ir.to_proto(model).SerializeToString()  # computes the lazily quantized weights
    records = records_of(model)
    assert {r["role"] for r in records.values()} == {"body", "lm_head", "embedding"}
    assert all(0 < r["relative_error"] < 0.02 for r in records.values())
    feeds = {"input_ids": np.arange(3, 19, dtype=np.int64).reshape(2, 8),
             "position_ids": np.tile(np.arange(8, dtype=np.int64), (2, 1))}
    run = [ort.InferenceSession(m, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
           for m in (fp32, quantized)]
    # The weights differ by 0.5% (int8); this random model's logits by ~4% (bf16 weights, 0.17%
    # off, move them ~0.9%). A wrong block axis or scale would be off by the logits' own size.
    assert np.abs(run[0] - run[1]).mean() < 0.06 * np.abs(run[0]).mean()


# -- engines -----------------------------------------------------------------------------------------


def _greedy(engine, prompts, **options):
    llm = LLM(engine, **options)
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))]


def _assert_batched_like_alone(engine, seed: int, requests: int, kv_cache_blocks: int) -> None:
    """Random prompts in flight together (8 at a time, 16-token chunks, a pool small enough to
    preempt) give each prompt's greedy tokens alone."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 1024, int(n)).tolist() for n in rng.integers(3, 60, requests)]
    alone = [_greedy(engine, [p], enable_prefix_caching=False)[0] for p in prompts]
    llm = LLM(engine, max_num_seqs=8, max_num_batched_tokens=24, chunk_size=16, kv_cache_blocks=kv_cache_blocks)
    together = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))]
    assert llm.scheduler.num_preemptions > 0
    assert together == alone


@needs_kernels
@pytest.mark.parametrize("options", [dict(quant="int8"), dict(quant="int4", quant_symmetric=False),
                                     dict(quant="int8", kv_cache_dtype="int8"),
                                     dict(weight_dtype="bf16", kv_cache_dtype="fp16")],
                         ids=["int8", "int4-asym", "int8-kv8", "bf16-kv16"])
def test_quantized_engines_batch_chunk_and_preempt_like_running_alone(engines, options):
    """Greedy outputs of a quantized engine under in-flight batching, chunked prefill and
    preemption equal the same engine's one request at a time."""
    engine = engines("tiny-llama", **options)
    _assert_batched_like_alone(engine, seed=1, requests=10, kv_cache_blocks=30)
    if "kv_cache_dtype" not in options:  # the default cache of a quantized build, as recorded
        assert open_engine(engine).manifest.kv_cache.dtype == "fp16"
        assert open_engine(engine).manifest.build_options.kv_cache_dtype == "fp16"


@needs_kernels
def test_a_quantized_engine_records_what_it_stored(engines):
    engine = engines("tiny-llama", quant="int4", kv_cache_dtype="int8")
    manifest = open_engine(engine).manifest
    q = manifest.quantization
    assert (q.method, q.block_size, q.symmetric, q.scale_dtype) == ("search", 32, True, "float16")
    # 2 x (QKV, o, gate/up, down); the LM head at 6 bits, the embedding at 8
    assert q.formats == {"int4": 8, "int6": 1, "int8": 1}
    graph = onnx.load(engine / "model.onnx", load_external_data=False).graph
    formats = sorted(a.i for n in graph.node for a in n.attribute if a.name.endswith("weight_format"))
    assert formats == [4] * 8 + [5]  # the kernels read the LM head's int8 initializer as int6
    assert manifest.kv_cache.dtype == "int8"
    assert manifest.build_options.quant == "int4"
    report = json.loads((engine / "build_report.json").read_text())
    assert len(report["quantized"]) == 10
    assert "## Quantized weights" in (engine / "build_report.md").read_text()
    text = CliRunner().invoke(main, ["inspect", str(engine)]).output
    assert "Quantization" in text and "int4" in text and "KV cache" in text
    # which tile this host's decode steps take, as measured here (plugins/cpu/host.py)
    assert "This host's kernels" in text and re.search(r"int8 decode rows    (avx2|vnni)  +\(avx2 [\d.]+ ms", text)
    fp32 = sum(f.bytes for f in open_engine(engines("tiny-llama")).manifest.files.values() if f.bytes > 10000)
    quantized = sum(f.bytes for f in manifest.files.values() if f.bytes > 10000)
    assert quantized < 0.3 * fp32


@needs_kernels
@pytest.mark.parametrize("recipe,sparse_layers", [("tiny-qwen3-moe", 2), ("tiny-gpt-oss", 3)])
@pytest.mark.parametrize("options", [dict(quant="int8"), dict(quant="int4", quant_symmetric=False)],
                         ids=["int8", "int4-asym"])
def test_experts_are_stored_quantized_and_batch_chunk_and_preempt_like_running_alone(engines, options, recipe,
                                                                                     sparse_layers):
    """A MoE engine's experts in the body's format (the router a Gemm at fp32), read by the
    Experts kernel in that format (gpt-oss's biases beside them at fp32); per-pass verification held
    the packed kernel to the DequantizeLinear graph while building; batching, chunking and
    preemption change no token."""
    engine = engines(recipe, **options)
    records = open_engine(engine).manifest.quantization.tensors
    experts = {name: r for name, r in records.items() if r.role == "experts"}
    assert len(experts) == 2 * sparse_layers and {r.format for r in experts.values()} == {options["quant"]}
    assert all(0 < r.relative_error < (0.02 if options["quant"] == "int8" else 0.2) for r in experts.values())
    qkv = {r.format for name, r in records.items() if "qkv_merge" in name}
    assert qkv == {"int8"}  # a MoE's Q/K/V projection takes 8 bits at int4 too
    graph = onnx.load(engine / "model.onnx", load_external_data=False).graph
    nodes = [n for n in graph.node if n.op_type == "Experts"]
    formats = {a.i for n in nodes for a in n.attribute if a.name == "weight_format"}
    assert len(nodes) == sparse_layers and formats == {quant.WEIGHT_FORMATS[options["quant"]]}
    _assert_batched_like_alone(engine, seed=2, requests=8, kv_cache_blocks=40)


@needs_kernels
def test_an_int8_kv_cache_holds_more_blocks_in_the_same_bytes(engines):
    fp32 = LLM(engines("tiny-llama"), kv_cache_bytes=1 << 20)
    int8 = LLM(engines("tiny-llama", quant="int8", kv_cache_dtype="int8"), kv_cache_bytes=1 << 20)
    assert int8.engine.num_blocks > 3 * fp32.engine.num_blocks


def test_without_llmc_kernels_onnx_runtime_runs_the_quantized_graph_as_matmul_nbits(tmp_path, monkeypatch):
    """Where the kernel library is not built, the engine keeps DequantizeLinear -> MatMul and ONNX
    Runtime fuses each into its own MatMulNBits when it loads the graph."""
    import onnx
    import onnxruntime as ort

    from llmc.compiler.build import build

    monkeypatch.setenv(LIBRARY_ENV, "")
    engine = build("tiny-llama", tmp_path / "e", BuildOptions(block_size=4, max_context=64, quant="int4")).engine_dir
    assert open_engine(engine).manifest.backend.custom_ops == ()
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(engine / "model.onnx"), options, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx"), load_external_data=False).graph.node]
    assert ops.count("MatMulNBits") == 9 and "DequantizeLinear" in ops  # the embedding's stays
    assert len(_greedy(engine, [[5, 6, 7, 8]])[0]) == 12


def test_calibration_runs_a_segment_of_weights_at_a_time(hf_models):
    """The calibration statistics of a model run one segment (here: one weight) at a time are those
    of the model run whole, and the LM head's logits are never computed."""
    from llmc.compiler.export import export_onnx
    from llmc.compiler.frontend import model_spec_from_config, read_config
    from llmc.passes import calibrate

    hf, folder = hf_models("tiny-llama")
    model = export_onnx(hf, model_spec_from_config(read_config(folder)))
    windows = np.random.default_rng(0).integers(0, 250, (3, 24))
    whole = calibrate.mean_square_inputs(model, windows, segment_bytes=1 << 40)
    needed = calibrate._needed(model, {n.inputs[0] for n in model.graph if n.op_type == "MatMul"})
    segments = calibrate._segments(needed, 1)
    assert len(segments) > 15 and not any(n.outputs[0].name == "logits" for n in needed)
    apart = calibrate.mean_square_inputs(model, windows, segment_bytes=1)
    assert whole.keys() == apart.keys() and len(whole) == 15
    for name in whole:
        np.testing.assert_allclose(apart[name], whole[name], rtol=1e-5, atol=1e-9)


@needs_kernels
def test_activation_aware_quantization_scales_the_norm_fed_projections(tmp_path):
    from llmc.compiler.build import build
    from llmc.bench import corpus

    text = tmp_path / "calibration.txt"
    text.write_text("\n".join(corpus.read(corpus.files("heldout")[:20])))
    engine = build("tiny-llama", tmp_path / "e", BuildOptions(block_size=4, max_context=64, quant="int4",
                                                             quant_method="awq", calibrate=str(text))).engine_dir
    manifest = open_engine(engine).manifest
    quantize = next(p for p in manifest.passes if p.name == "quantize-weights")
    # QKV and gate/up of both layers and the LM head read a norm's output: scaled; o and down are not.
    assert quantize.counts["quantize_matmul_scaled"] == 5 and quantize.counts["quantize_matmul"] == 4
    assert manifest.quantization.calibration == str(text)
    assert len(_greedy(engine, [[5, 6, 7, 8]])[0]) == 12
