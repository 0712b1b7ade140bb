"""Fusion passes: each rule fires where it should (counts and the graph it leaves), the fused
engine still matches HF, outputs do not change when fusions are off, and misses explain themselves."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir
import pytest
import torch
from click.testing import CliRunner

from conftest import BLOCK_SIZE, MAX_CONTEXT, needs_kernels
from llmc.contract import kv_layout, open_engine
from llmc.passes.merge_matmuls import MergeSiblingMatMuls
from llmc.passes.simplify_layout import ReshapeChain, TransposePair
from llmc.plugins import cpu
from llmc.plugins.cpu.library import library_path
from llmc.runtime.llm import LLM
from llmc.runtime.sampling import SamplingParams

FUSION_PASSES = ("merge-matmuls", "ort-fusions", "cpu-kernels", "simplify-layout", "packed-matmul", "decoder-layers")


def _expected_counts(layers: int, tied: bool, with_kernels: bool) -> dict[str, dict[str, int]]:
    layout = {"weight_layout": 1} if tied else {}  # the LM head reads the embedding transposed
    counts = {
        "merge-matmuls": {"qkv_merge": layers, "gate_up_merge": layers},
        # Two norms per layer plus the final one; only the very first reads no residual Add.
        "ort-fusions": {"skip_rmsnorm": 2 * layers, "swiglu": layers},
    }
    if with_kernels:
        # Attention takes the merged QKV projection as is and rotates Q/K itself, and its output
        # feeds the output projection as written; SwiGLU reads the merged gate/up projection: no
        # Split, RoPE, Transpose or Reshape is left around them.
        counts["cpu-kernels"] = {"paged_attention_kernel": layers, "rope_fused": layers, "qkv_packed": layers,
                                 "heads_merged": layers, "swiglu": layers}
        # The RoPE angle ops (Unsqueeze, Cast, Mul by inv_freq, Cos, Sin) become build-time tables.
        counts["rotary-tables"] = {"tables": layers, "angle_ops_removed": 5}
        counts["simplify-layout"] = layout
        # Every projection and the LM head; each residual norm but the final one (which feeds the
        # gather of the logits_indices rows) folds into the projection it feeds, and each SwiGLU
        # into the down one.
        counts["packed-matmul"] = {"packed_matmul": 4 * layers + 1, "skip_rmsnorm_matmul": 2 * layers - 1,
                                   "swiglu_matmul": layers}
        # Each layer's five kernel nodes as one, but the first layer's (its input norm reads no residual).
        counts["decoder-layers"] = {"decoder_layer": layers - 1}
    else:
        # Q and K each go through RoPE; V and the attention output each had a transpose pair.
        counts["simplify-layout"] = {**layout, "rope_3d": 2 * layers, "transpose_pair": 2 * layers,
                                     "reshape_chain": 2 * layers}
    return counts


def _ops(engine_dir) -> Counter:
    model = ir.load(engine_dir / "model.onnx")
    return Counter(n.op_type for n in model.graph)


@pytest.mark.parametrize("recipe,with_kernels", [
    pytest.param("tiny-llama", True, marks=needs_kernels),
    pytest.param("tiny-qwen2", True, marks=needs_kernels),
    ("tiny-llama", False),  # the standard-op realization (ort-lower) stays correct too
])
def test_fusions_fire_and_the_engine_still_matches_hf(recipe, with_kernels, engines, hf_models):
    engine_dir = engines(recipe) if with_kernels else engines(recipe, "cpu-kernels", "packed-matmul")
    manifest = open_engine(engine_dir).manifest
    spec = manifest.model_spec
    layers = spec.num_layers
    passes = {p.name: p for p in manifest.passes}
    for name, counts in _expected_counts(layers, spec.tie_word_embeddings, with_kernels).items():
        assert passes[name].counts == counts, name
        if counts:  # the build verified each pass that changed the graph numerically
            assert passes[name].max_abs_diff <= 1e-4
    assert (manifest.backend.custom_ops == (cpu.DOMAIN,)) == with_kernels
    assert manifest.kv_cache.layout == (kv_layout.HEAD_MAJOR if with_kernels else kv_layout.TOKEN_MAJOR)

    ops = _ops(engine_dir)
    # qkv, o, gate_up, down per layer, and the LM head: on llmc's packed GEMM with the kernels,
    # where the residual norms and SwiGLU fold into the projections they feed
    assert ops["Transpose"] == 0 and ops["Sigmoid"] == 0
    if with_kernels:
        # The first layer's five kernel nodes (its 4 projections), the LM head, one node per other layer.
        assert ops["DecoderLayer"] == layers - 1
        assert ops["PackedMatMul"] + ops["SkipRMSNormMatMul"] + ops["SwiGLUMatMul"] == 4 + 1
        assert ops["SkipRMSNormMatMul"] == 1 and ops["SkipSimplifiedLayerNormalization"] == 1
        assert ops["PagedAttention"] == ops["SwiGLUMatMul"] == 1 and ops["SwiGLU"] == 0
        assert sum(ops[op] for op in ("QuickGelu", "Split", "RotaryEmbedding", "GatherND", "ScatterND")) == 0
        # The rest is once per step (the embedding, the logits rows' gather): it must not grow with the layers.
        assert sum(ops.values()) - (layers - 1) - 5 <= 25
        assert sum(ops[op] for op in ("Cos", "Sin")) == 0
    else:
        assert ops["MatMul"] == 4 * layers + 1 and ops["SkipSimplifiedLayerNormalization"] == 2 * layers
        assert ops["QuickGelu"] == layers and ops["ScatterND"] == layers

    hf, _ = hf_models(recipe)
    llm = LLM(engine_dir)
    prompt = np.random.default_rng(5).integers(3, llm.engine.spec.vocab_size, 19).tolist()
    out = llm.generate(prompt, SamplingParams(max_tokens=24))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
        ref_logits = hf(torch.tensor([prompt])).logits[0, -1].numpy()
    assert out.token_ids == ref
    tables = np.arange(1, 1 + -(-len(prompt) // BLOCK_SIZE), dtype=np.int32)[None]
    logits = llm.engine.forward(np.array([prompt]), np.arange(len(prompt))[None], np.zeros(1, np.int32),
                                np.array([len(prompt)], np.int32), tables)
    np.testing.assert_allclose(logits[0], ref_logits, atol=1e-4, rtol=0)


@needs_kernels
@pytest.mark.parametrize("recipe", ["tiny-llama", "tiny-qwen2"])
def test_lossless_weights_change_no_output(recipe, tmp_path, engines, hf_models):
    """`--lossless-weights` adds a lossless copy to every packed GEMM; the engine's tokens and
    logits are the fp32 engine's (the copy decodes to the same bits) and still match HF."""
    from llmc.cli import main

    out = tmp_path / "lossless"
    result = CliRunner().invoke(main, ["build", recipe, "-o", str(out), "--block-size", str(BLOCK_SIZE),
                                       "--max-context", str(MAX_CONTEXT), "--verify", "--lossless-weights"])
    assert result.exit_code == 0, result.output
    manifest = open_engine(out).manifest
    layers = manifest.model_spec.num_layers
    record = {p.name: p for p in manifest.passes}["lossless-weights"]
    assert record.counts == {"lossless_weight": 4 * layers + 1} and record.max_abs_diff == 0.0
    assert manifest.build_options.lossless_weights is True
    graph = ir.load(out / "model.onnx").graph
    gemms = [n for n in graph if n.domain == cpu.DOMAIN and "MatMul" in n.op_type]  # the first layer's, the LM head
    assert len(gemms) == 4 + 1 and all(n.inputs[-1].name.endswith(".lossless") for n in gemms)
    layer_nodes = [n for n in graph if n.op_type == "DecoderLayer"]  # each carries its 4 GEMMs' copies
    assert len(layer_nodes) == layers - 1
    assert all(v is not None and v.name.endswith(".lossless") for n in layer_nodes for v in n.inputs[-4:])
    plain = open_engine(engines(recipe)).manifest
    assert "lossless-weights" not in [p.name for p in plain.passes]  # off by default: not in the pipeline

    prompts = [np.random.default_rng(i).integers(3, 1000, n).tolist() for i, n in enumerate((19, 5, 40))]
    params = SamplingParams(max_tokens=24)
    got = [o.token_ids for o in LLM(out).generate(prompts, params)]  # decode steps of 1-3 rows
    assert got == [o.token_ids for o in LLM(engines(recipe)).generate(prompts, params)]
    hf, _ = hf_models(recipe)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=24, do_sample=False)[0, 19:].tolist()
    assert got[0] == ref


def test_fusions_off_same_outputs_and_misses_are_listed(tmp_path, llama_engine):
    from llmc.cli import main

    args = ["build", "tiny-llama", "-o", str(tmp_path / "plain"), "--block-size", str(BLOCK_SIZE),
            "--max-context", "128", "--explain"]
    for name in FUSION_PASSES:
        args += ["--disable-pass", name]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    plain = tmp_path / "plain"
    ops = _ops(plain)
    assert ops["MatMul"] > 4 * 2 + 1 and ops["SkipSimplifiedLayerNormalization"] == 0 and ops["PackedMatMul"] == 0

    prompts = [np.random.default_rng(i).integers(3, 1000, n).tolist() for i, n in enumerate((7, 30))]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    fused = [o.token_ids for o in LLM(llama_engine).generate(prompts, params)]
    assert [o.token_ids for o in LLM(plain).generate(prompts, params)] == fused

    # --explain lists each near-miss with its reason: without merged projections a norm feeding
    # separate projections (Q, K, V: 3; gate, up: 2, twice) folds into none of them, as its normed
    # value has other consumers. (Nothing matches the SwiGLU kernel's pattern there: no miss.)
    result = CliRunner().invoke(main, ["build", "tiny-llama", "-o", str(tmp_path / "fused"), "--block-size",
                                       str(BLOCK_SIZE), "--max-context", "128", "--explain",
                                       "--disable-pass", "merge-matmuls"])
    assert result.exit_code == 0, result.output
    expected_misses = 7 if library_path() is not None else 0
    assert f"{expected_misses} near-misses" in result.output
    if library_path() is not None:
        assert result.output.count("skip_rmsnorm_matmul at") == 7 and "has other consumers" in result.output


def _graph(nodes, inputs, outputs, initializers=()):
    graph = ir.Graph(inputs, outputs, nodes=nodes, initializers=list(initializers), opset_imports={"": 23})
    return ir.Model(graph, ir_version=10)


def test_merge_explains_a_non_constant_weight():
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 2, 8]))
    w = ir.Value(name="w", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([8, 4]))  # a graph input
    consts = [ir.Value(name=f"c{i}", const_value=ir.tensor(np.ones((8, 4), np.float32))) for i in range(2)]
    nodes = [ir.Node("", "MatMul", [x, v], name=f"mm{i}") for i, v in enumerate([consts[0], consts[1], w])]
    _graph(nodes, [x, w], [n.outputs[0] for n in nodes], consts)
    rule = MergeSiblingMatMuls("qkv_merge", 3, "Q/K/V projections")
    m = rule.match(nodes[0])
    assert m is not None and "not a constant initializer" in rule.check(m)
    assert rule.match(nodes[1]) is None  # anchored at the first sibling only


def test_lossless_rule_refuses_what_would_not_shrink():
    """A weight whose floats span many octaves leaves too many exceptions; one with K not a
    multiple of 4 has no layout. Both keep their fp32 form only, and say why."""
    from llmc.passes.lossless_weights import LosslessWeight
    from llmc.plugins.cpu import pack_weight

    rng = np.random.default_rng(0)
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 2, 64]))
    weights = {"normal": (rng.standard_normal((64, 40)) * 0.02).astype(np.float32),
               "spread": (rng.standard_normal((64, 40)) * np.exp2(rng.integers(-30, 30, (64, 40)))).astype(np.float32),
               "odd_k": np.ones((6, 40), np.float32)}
    values = [ir.Value(name=k, const_value=ir.tensor(pack_weight(w))) for k, w in weights.items()]
    nodes = [ir.Node(cpu.DOMAIN, "PackedMatMul", [x, v], attributes=[ir.AttrInt64("n", 40)], name=v.name)
             for v in values]
    _graph(nodes, [x], [n.outputs[0] for n in nodes], values)
    rule = LosslessWeight("PackedMatMul")
    checks = {n.name: rule.check(rule.match(n)) for n in nodes}
    assert checks["normal"] is None
    assert "top byte outside" in checks["spread"] and "multiple of 4" in checks["odd_k"]


def test_layout_rules_refuse_what_they_cannot_prove():
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 2, 3, 4]))
    t1 = ir.Node("", "Transpose", [x], attributes=[ir.AttrInt64s("perm", [0, 2, 1, 3])], name="t1")
    t2 = ir.Node("", "Transpose", [t1.outputs[0]], attributes=[ir.AttrInt64s("perm", [0, 1, 3, 2])], name="t2")
    rule = TransposePair()
    assert "do not cancel" in rule.check(rule.match(t2))

    shape1 = ir.Value(name="s1", const_value=ir.tensor(np.array([2, 12], np.int64)))
    shape2 = ir.Value(name="s2", const_value=ir.tensor(np.array([0, -1], np.int64)))
    r1 = ir.Node("", "Reshape", [x, shape1], name="r1")
    r2 = ir.Node("", "Reshape", [r1.outputs[0], shape2], name="r2")
    chain = ReshapeChain()
    # [0, -1] copies dim 0 of the intermediate (2), which is not dim 0 of x (1): must not skip it.
    assert "copy dims" in chain.check(chain.match(r2))
