"""The TensorRT lowering, checked on a CPU: the graph TensorRT's parser gets (plugin nodes, their
attributes, 16-bit types, the contract's I/O), run by ONNX Runtime with the plugin replaced by
the op's reference function; the optimization profiles; and the one-line refusals."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir
import pytest

from llmc.contract import graph_io as io
from llmc.contract import profiles as prof
from llmc.contract.manifest import Backend
from llmc.contract.options import BuildOptions, RuntimeOptions
from llmc.errors import LlmcError
from llmc.passes import trt_lower
from llmc.passes.manager import PassManager
from llmc.passes.pipeline import phases, pipeline
from llmc.passes.verify import verifier
from llmc.plugins import paged_attention as pa

BLOCK = 4


@pytest.fixture(scope="module")
def exported():
    from llmc.compiler.export import export_onnx
    from llmc.compiler.frontend import load_hf_model, model_spec_from_config, read_config
    from llmc.compiler.recipes import materialize

    folder = materialize("tiny-llama")
    spec = model_spec_from_config(read_config(folder))
    return export_onnx(load_hf_model(folder), spec), spec


@pytest.fixture(scope="module", params=["fp16", "bf16"])
def lowered(request, exported):
    """(lowered model, spec, pass records with each pass's measured difference where ORT runs both sides)."""
    model, spec = exported
    model = ir.from_proto(ir.to_proto(model))
    options = BuildOptions(backend="tensorrt", precision=request.param, block_size=BLOCK)
    check = verifier(spec, BLOCK) if request.param == "fp16" else None  # ORT's CPU ops take no bf16 MatMul
    records = PassManager(pipeline(options), verifier=check).run(model, spec)
    return model, spec, {r.name: r for r in records}, request.param


def test_the_tensorrt_pipeline_shares_the_first_phases_then_lowers_for_tensorrt():
    names = [(ph.name, [p.name for p in ph.passes]) for ph in phases(BuildOptions(backend="tensorrt"))]
    assert names == [("canonicalize", ["cleanup", "native-gqa", "lm-head-scale", "rope-forms"]), ("fuse", ["merge-matmuls"]), ("quantize", []),
                     ("rewrite KV I/O", ["paged-kv-cache", "recurrent-state", "logits-indices"]), ("lower", ["trt-plugin"]),
                     ("precision", ["trt-precision"])]
    quantized = phases(BuildOptions(backend="tensorrt", quant="int4"))
    assert [p.name for p in quantized[2].passes] == ["quantize-weights"]
    for required in ("trt-plugin", "trt-precision"):
        with pytest.raises(LlmcError, match="cannot be disabled"):
            pipeline(BuildOptions(backend="tensorrt", disable_passes=(required,)))


def test_every_attention_is_the_plugin_node_with_its_attributes(lowered):
    model, spec, records, _ = lowered
    nodes = trt_lower.plugin_nodes(model)
    assert len(nodes) == spec.num_layers == records["trt-plugin"].counts["paged_attention_plugin"]
    for node in nodes:
        attrs = {name: a.value for name, a in node.attributes.items()}
        assert attrs["plugin_namespace"] == "llmc" and attrs["plugin_version"] == str(pa.VERSION)
        assert (attrs["num_heads"], attrs["num_kv_heads"]) == (spec.num_heads, spec.num_kv_heads)
        assert attrs["scale"] == pytest.approx(spec.head_dim ** -0.5) and attrs["sliding_window"] == 0
        assert set(attrs) == {f.name for f in dataclasses.fields(pa.PagedAttentionAttrs)} | {
            "plugin_namespace", "plugin_version", "rotary_interleaved"}
        assert [v.name for v in node.inputs[4:7]] == [io.PAST_LENS, io.QUERY_LENS, io.BLOCK_TABLES]
        assert node.inputs[3].name.startswith("kv_cache.") and node.outputs[1].name.startswith("kv_cache_out.")
        # RoPE inside the plugin: Q and K come unrotated, cos/sin [B, S, D/2] are its last inputs.
        assert len(node.inputs) == 9 and attrs["rotary_interleaved"] == 0
        assert all(v.producer() is None or v.producer().op_type != "RotaryEmbedding" for v in node.inputs[:2])
    assert records["trt-plugin"].counts["rope_fused"] == spec.num_layers
    assert not [n for n in model.graph if n.op_type == "RotaryEmbedding"]
    # Nothing TensorRT's parser would not know: standard ops and the plugin's nodes only (no
    # llmc.cpu or ORT-only ops), and no local function that it would inline in their place.
    assert {(n.domain, n.op_type) for n in model.graph if n.domain} == {(pa.DOMAIN, pa.OP_TYPE)}
    assert len(nodes) == sum(1 for n in model.graph if n.domain) and not model.functions


def test_every_float_is_the_precision_and_the_logits_float32(lowered):
    model, spec, records, precision = lowered
    low = trt_lower.PRECISIONS[precision]
    assert records["trt-precision"].counts["weights"] > 0
    floats = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)
    for value in model.graph.initializers.values():  # the weights; the rotary frequencies stay float32
        wanted = ir.DataType.FLOAT if "rotary_emb" in value.name else low
        assert value.const_value.dtype in (wanted, ir.DataType.INT64, ir.DataType.INT32), value.name
    typed = [v for n in model.graph for v in n.outputs if v.type is not None and v.dtype in floats]
    wide = {v for v in typed if v.dtype != low and v.name != io.LOGITS}
    # Only the rotary angles stay float32: what the plugin's cos/sin are computed from.
    angles, stack = set(), [v for n in trt_lower.plugin_nodes(model) for v in n.inputs[7:]]
    while stack:
        value = stack.pop()
        if value not in angles and value.producer() is not None:
            angles.add(value)
            stack += [v for v in value.producer().inputs if v is not None]
    assert wide and wide <= angles and all(v.dtype == ir.DataType.FLOAT for v in wide)
    assert records["trt-precision"].counts["rotary_fp32"] > 0
    for node in trt_lower.plugin_nodes(model):
        cos = node.inputs[7]
        assert cos.dtype == low and cos.producer().op_type == "Cast"
        assert cos.producer().inputs[0].dtype in (ir.DataType.FLOAT, None)  # computed in float32 (or untyped: inferred)
    outputs = {v.name: v for v in model.graph.outputs}
    assert outputs[io.LOGITS].dtype == ir.DataType.FLOAT
    assert [v.name for v in model.graph.inputs] == list(io.GraphIO.paged(spec.num_layers).inputs)
    assert [v.name for v in model.graph.outputs] == list(io.GraphIO.paged(spec.num_layers).outputs)
    for name in (io.cache_input(0), io.cache_output(0)):
        pool = next(v for v in [*model.graph.inputs, *model.graph.outputs] if v.name == name)
        assert pool.dtype == low and list(pool.shape)[2:] == [BLOCK, spec.num_kv_heads, spec.head_dim]


def test_onnx_runtime_runs_the_lowered_graph_with_the_reference_plugin(lowered):
    """The plugin node with the op's function is the graph before it, bit for bit; fp16 costs what
    fp16 rounding costs (the verifier's ragged prefill and decode steps over a shuffled pool)."""
    model, spec, records, precision = lowered
    if precision != "fp16":
        pytest.skip("ONNX Runtime's CPU ops take no bf16 MatMul; the bf16 graph is checked by its types")
    assert records["trt-plugin"].max_abs_diff == 0.0
    rounded = records["trt-precision"].max_abs_diff
    assert rounded is not None and 0 < rounded < 0.1, rounded  # tiny-llama's logits span about +-3
    assert records["trt-plugin"].counts["rope_fused"] == spec.num_layers  # checked with RoPE unfolded again


def test_profiles_cover_decode_and_prefill_steps_and_refuse_what_they_do_not_hold():
    decode, prefill = prof.profiles(block_size=16, max_context=4096, max_num_seqs=16, chunk_size=256)
    assert decode.seq == prof.Dim(1, 1, 1) and prefill.seq.min == 2 and prefill.seq.max == 256
    assert decode.max_blocks.max == 256 and decode.num_blocks.max == 1 + 16 * 256
    step = dict(num_logits=16, max_blocks=40, num_blocks=600)
    assert prof.choose((decode, prefill), batch=16, seq=1, **step) == 0
    assert prof.choose((decode, prefill), batch=3, seq=5, **{**step, "num_logits": 15}) == 1  # a verify step
    with pytest.raises(ValueError, match="no optimization profile holds a step of 17 rows"):
        prof.choose((decode, prefill), batch=17, seq=1, **step)
    shapes = decode.shapes(2, (16, 2, 64))
    assert shapes[io.INPUT_IDS] == ((1, 1), (8, 1), (16, 1))
    assert shapes[io.BLOCK_TABLES] == ((1, 1), (8, 64), (16, 256))
    assert shapes[io.cache_input(1)] == ((2, 2, 16, 2, 64), (2, 1025, 16, 2, 64), (2, 4097, 16, 2, 64))
    assert set(shapes) == set(io.STEP_SHAPES) | {io.cache_input(0), io.cache_input(1)}


def test_a_tensorrt_manifest_section_round_trips_and_a_cpu_manifest_still_reads():
    from llmc.contract.codec import from_json, to_json

    backend = Backend("tensorrt", "cuda", (), "sm_90", "10.9.0", "libllmc_trt_plugin.so",
                      prof.profiles(block_size=16, max_context=2048))
    assert from_json(Backend, to_json(backend)) == backend
    old = {"name": "onnxruntime", "target": "cpu", "custom_ops": ["llmc.cpu"]}  # written before these fields
    assert from_json(Backend, old) == Backend("onnxruntime", "cpu", ("llmc.cpu",))


def test_a_plan_for_another_gpu_or_tensorrt_is_refused_in_one_line():
    from llmc.trt.plan import Toolchain, check_plan

    backend = Backend("tensorrt", "cuda", (), "sm_90", "10.9.0", "libllmc_trt_plugin.so")
    check_plan(backend, Toolchain(None, "10.9.0", "sm_90"))
    with pytest.raises(LlmcError, match="built for GPU architecture sm_90, and this machine has sm_80.*rebuild"):
        check_plan(backend, Toolchain(None, "10.9.0", "sm_80"))
    with pytest.raises(LlmcError, match="TensorRT version 10.9.0, and this machine has 11.0.0"):
        check_plan(backend, Toolchain(None, "11.0.0", "sm_90"))


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(precision="fp16"), "--precision fp16 is for --backend tensorrt"),
    (dict(backend="tensorrt", precision="fp32"), "computes in fp16 or bf16"),
    (dict(backend="tensorrt", precision="bf16", kv_cache_dtype="fp16"), "KV cache is in its --precision (bf16)"),
    (dict(backend="tvm"), "--backend must be one of onnxruntime, tensorrt"),
])
def test_bad_backend_options_are_one_line(kwargs, fragment):
    with pytest.raises(LlmcError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        BuildOptions(**kwargs)


def test_build_without_tensorrt_fails_in_one_line_before_any_work(tmp_path):
    try:
        import tensorrt  # noqa: F401
        pytest.skip("TensorRT is installed here")
    except ImportError:
        pass
    from click.testing import CliRunner

    from llmc.cli import main

    result = CliRunner().invoke(main, ["build", "tiny-llama", "-o", str(tmp_path / "e"), "--backend", "tensorrt"])
    assert result.exit_code != 0 and not (tmp_path / "e").exists()
    message = result.output.strip()
    assert "\n" not in message and "needs TensorRT" in message and "pip install 'llmc[trt]'" in message


def test_mixture_of_experts_and_attention_sinks_are_refused_naming_the_missing_plugin():
    from llmc.compiler.export import export_onnx
    from llmc.compiler.frontend import load_checkpoint, model_spec_from_config, read_config
    from llmc.compiler.recipes import materialize

    for recipe, lacks in (("tiny-qwen3-moe", "no plugin for mixture-of-experts layers"),
                          ("tiny-gpt-oss", "attention plugin has no attention sinks")):
        folder = materialize(recipe)
        spec = model_spec_from_config(read_config(folder))
        hf_model, weights = load_checkpoint(folder, spec)
        model = export_onnx(hf_model, spec, weights)
        with pytest.raises(LlmcError, match=f"{lacks} .*--backend onnxruntime"):
            PassManager(pipeline(BuildOptions(backend="tensorrt", block_size=BLOCK))).run(model, spec)


def test_an_fp16_pool_reads_back_token_major():
    from llmc.contract import kv_layout

    pool = np.arange(2 * 3 * 4 * 2 * 2, dtype=np.float16).reshape(2, 3, 4, 2, 2)
    back = kv_layout.to_token_major(pool, kv_layout.TOKEN_MAJOR, "fp16")
    assert back.dtype == np.float32 and np.array_equal(back, pool.astype(np.float32))


def test_int4_weights_stay_blockwise_dequantize_linear_with_16_bit_scales(exported):
    """The Q/DQ form TensorRT consumes for weight-only int4: int4 blocks of 32 along K, their
    scales rounded to the network's precision, the whole graph still checked in ORT."""
    model, spec = exported
    model = ir.from_proto(ir.to_proto(model))
    options = BuildOptions(backend="tensorrt", precision="fp16", block_size=BLOCK, quant="int4")
    records = {r.name: r for r in PassManager(pipeline(options), verifier=verifier(spec, BLOCK)).run(model, spec)}
    projections = [n for n in model.graph if n.op_type == "DequantizeLinear" and n.inputs[0].is_initializer()]
    assert len(projections) == records["quantize-weights"].counts["quantize_matmul"]  # the embedding's is gathered
    for node in projections:
        weights, scales = (ir.convenience.get_const_tensor(v) for v in node.inputs[:2])
        assert node.attributes.get_int("block_size") == 32
        assert weights.dtype in (ir.DataType.INT4, ir.DataType.INT8) and scales.dtype == ir.DataType.FLOAT16
    assert any(ir.convenience.get_const_tensor(n.inputs[0]).dtype == ir.DataType.INT4 for n in projections)
    assert records["trt-plugin"].max_abs_diff == 0.0 and 0 < records["trt-precision"].max_abs_diff < 0.1


# -- the runtime's decode padding (CUDA graphs), checked through the ONNX Runtime engine -------

def test_decode_buckets_are_powers_of_two_up_to_the_batch():
    from llmc.trt.engine import buckets

    assert buckets(16) == [1, 2, 4, 8, 16] and buckets(12) == [1, 2, 4, 8, 12] and buckets(1) == [1]


@pytest.mark.parametrize("disabled", [(), ("cpu-kernels",)])
def test_a_decode_step_padded_to_its_bucket_gives_the_same_logits_and_cache(engines, disabled):
    """What TrtEngine replays from a CUDA graph: the step padded with token-less rows and a wider
    block table. The same padding through the CPU engine (its kernel, and the standard-op
    lowering) leaves the real rows' logits and every non-scratch block as the unpadded step does."""
    from llmc.runtime.engine import Engine
    from llmc.trt.engine import pad_decode

    path = engines("tiny-llama", *disabled)
    plain, padded = (Engine(path, RuntimeOptions(kv_cache_blocks=16, num_threads=1)) for _ in range(2))
    rng = np.random.default_rng(0)
    lens = np.array([5, 9, 2], np.int32)
    tables = np.array([[1, 2, 0], [3, 4, 5], [6, 0, 0]], np.int32)
    ids = rng.integers(0, plain.spec.vocab_size, (3, int(lens.max())))
    positions = np.tile(np.arange(ids.shape[1]), (3, 1))
    for engine in (plain, padded):  # the same prefill on both
        engine.forward(ids, positions, np.zeros(3, np.int32), lens, tables)
    step = {io.INPUT_IDS: rng.integers(0, plain.spec.vocab_size, (3, 1)), io.POSITION_IDS: lens[:, None].astype(np.int64),
            io.PAST_LENS: lens, io.QUERY_LENS: np.ones(3, np.int32), io.BLOCK_TABLES: tables,
            io.LOGITS_INDICES: np.arange(3, dtype=np.int64)}
    want = plain.forward(*map(step.get, io.STEP_INPUTS)).copy()
    wide = pad_decode(step, rows=8, width=6)
    assert wide[io.INPUT_IDS].shape == (8, 1) and wide[io.BLOCK_TABLES].shape == (8, 6)
    got = padded.forward(*map(wide.get, io.STEP_INPUTS))
    np.testing.assert_allclose(got[:3], want, rtol=1e-5, atol=1e-5)
    for layer in range(plain.spec.num_layers):
        np.testing.assert_array_equal(np.delete(padded.pool(layer), io.SCRATCH_BLOCK, axis=1),
                                      np.delete(plain.pool(layer), io.SCRATCH_BLOCK, axis=1))
    with pytest.raises(ValueError, match="cannot pad"):
        pad_decode(step, rows=2, width=6)
