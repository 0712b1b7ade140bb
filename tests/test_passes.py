"""Every pass verified numerically on tiny-llama; rules count what they changed and explain misses;
the pipeline is the phased list the options call for."""

from __future__ import annotations

import pytest

from conftest import needs_kernels
from llmc.contract import kv_layout, open_engine
from llmc.contract.options import BuildOptions
from llmc.errors import LlmcError
from llmc.passes.manager import PassManager
from llmc.passes.pipeline import phases, pipeline
from llmc.passes.verify import ATOL, PassVerificationError, compare, verifier
from llmc.plugins import cpu
from llmc.plugins.cpu.library import library_path

# With llmc's CPU kernels (the default where they are built) attention, its RoPE and the packed
# projections go to the kernels, leaving ort-lower and the layout pass nothing to do on
# tiny-llama; without them ort-lower composes standard ops and the layout pass tidies those.
COMMON_COUNTS = {
    "native-gqa": {"attention_gqa": 2},
    "paged-kv-cache": {"paged_attention": 2},
    "logits-indices": {"lm_head_gather": 1},
    "merge-matmuls": {"qkv_merge": 2, "gate_up_merge": 2},
    "ort-fusions": {"skip_rmsnorm": 4, "swiglu": 2},
}
KERNEL_COUNTS = {**COMMON_COUNTS,
                 "cpu-kernels": {"paged_attention_kernel": 2, "rope_fused": 2, "qkv_packed": 2, "heads_merged": 2,
                                 "swiglu": 2},
                 "packed-matmul": {"packed_matmul": 9, "skip_rmsnorm_matmul": 3, "swiglu_matmul": 2},
                 "greedy-tokens": {"lm_head_argmax": 1},
                 "decoder-layers": {"decoder_layer": 1}}
COMPOSED_COUNTS = {**COMMON_COUNTS, "ort-lower": {"paged_attention_lowered": 2, "shared_step_metadata": 1},
                   "simplify-layout": {"rope_3d": 4, "transpose_pair": 4, "reshape_chain": 4}}
DEFAULT_PASSES = [p.name for p in pipeline(BuildOptions())]


@pytest.fixture(scope="module")
def exported():
    """tiny-llama's canonical export, shared by this module's tests (each clones it)."""
    from llmc.compiler.export import export_onnx
    from llmc.compiler.frontend import load_hf_model, model_spec_from_config, read_config
    from llmc.compiler.recipes import materialize

    folder = materialize("tiny-llama")
    spec = model_spec_from_config(read_config(folder))
    return export_onnx(load_hf_model(folder), spec), spec


def _clone(model):
    import onnx_ir as ir

    return ir.from_proto(ir.to_proto(model))


def _passes(*names: str):
    every = {p.name: p for phase in phases(BuildOptions(block_size=4, lossless_weights=True)) for p in phase.passes}
    return [every[n] for n in names]


def test_the_pipeline_is_one_phased_list_built_from_the_options():
    assert [(ph.name, [p.name for p in ph.passes]) for ph in phases(BuildOptions())] == [
        ("canonicalize", ["cleanup", "native-gqa", "lm-head-scale", "rope-forms"]),
        ("fuse", ["merge-matmuls"]),
        ("quantize", []),
        ("rewrite KV I/O", ["paged-kv-cache", "recurrent-state", "logits-indices"]),
        ("backend kernels", ["ort-fusions", "cpu-kernels", "rotary-tables"]),
        ("lower", ["ort-lower"]),
        ("layout", ["simplify-layout"]),
        ("weights", ["packed-matmul", "greedy-tokens"]),
        ("layers", ["decoder-layers"]),
    ]
    quantized = [(ph.name, [p.name for p in ph.passes]) for ph in phases(BuildOptions(quant="int4"))]
    assert quantized[2] == ("quantize", ["quantize-weights"])
    draft = [(ph.name, [p.name for p in ph.passes]) for ph in phases(BuildOptions(draft_vocab=64))]
    assert draft[1] == ("fuse", ["merge-matmuls", "draft-vocab"])
    names = [p.name for p in pipeline(BuildOptions(lossless_weights=True, disable_passes=("cleanup",)))]
    assert names == [n for n in DEFAULT_PASSES if n not in ("cleanup", "greedy-tokens", "decoder-layers")] + [
        "lossless-weights", "greedy-tokens", "decoder-layers"]
    with pytest.raises(LlmcError, match="unknown pass 'nope'"):
        pipeline(BuildOptions(disable_passes=("nope",)))
    for required in ("paged-kv-cache", "recurrent-state", "logits-indices", "ort-lower"):  # the contract's graph I/O needs them
        with pytest.raises(LlmcError, match="cannot be disabled"):
            pipeline(BuildOptions(disable_passes=(required,)))


@pytest.mark.parametrize("passes,expected", [
    pytest.param(DEFAULT_PASSES, KERNEL_COUNTS, marks=needs_kernels, id="kernels"),
    pytest.param([p for p in DEFAULT_PASSES if p not in ("cpu-kernels", "packed-matmul", "greedy-tokens",
                                                         "decoder-layers")],
                 COMPOSED_COUNTS,
                 id="standard-ops"),
])
def test_every_pass_verifies_on_tiny_llama(exported, passes, expected):
    model, spec = _clone(exported[0]), exported[1]
    records = PassManager(_passes(*passes), verifier=verifier(spec, 4)).run(model, spec)
    assert [r.name for r in records] == passes
    for r in records:
        assert r.changed == (r.name in expected or r.name == "cleanup"), r.name
        if r.changed:
            assert r.max_abs_diff is not None and r.max_abs_diff <= ATOL, (r.name, r.max_abs_diff)
        assert r.counts == expected.get(r.name, r.counts), (r.name, r.counts)
    # The exporter's repeat_kv chain (Unsqueeze -> Expand -> Reshape) is gone.
    def kind(value):
        return value.producer().op_type if value is not None and value.producer() is not None else None

    assert not any(n.op_type == "Reshape" and kind(n.inputs[0]) == "Expand"
                   and kind(n.inputs[0].producer().inputs[0]) == "Unsqueeze" for n in model.graph)
    assert not any(n.domain == "llmc" for n in model.graph)  # lowered for ORT
    assert any(n.domain == cpu.DOMAIN for n in model.graph) == ("cpu-kernels" in passes)


def test_paged_rewrite_explains_a_miss_when_kv_is_still_expanded(exported):
    model, spec = _clone(exported[0]), exported[1]
    result = _passes("paged-kv-cache")[0].run(model, spec)
    assert not result.changed
    assert len(result.misses) == spec.num_layers
    assert all("run native-gqa first" in m for m in result.misses)
    assert [v.name for v in model.graph.inputs] == ["input_ids", "position_ids"]  # interface untouched


def test_a_precondition_that_does_not_hold_changes_nothing_and_says_why(exported):
    model, spec = _clone(exported[0]), exported[1]
    before = len(list(model.graph))
    result = _passes("logits-indices")[0].run(model, spec)
    assert not result.changed and result.misses == ["the graph has no query_lens input; run paged-kv-cache first"]
    assert len(list(model.graph)) == before


def test_verifier_catches_a_wrong_rewrite(exported):
    """The verifier is only worth something if it fails on a broken pass."""
    model, spec = _clone(exported[0]), exported[1]
    before = _clone(model)
    attention = next(n for n in model.graph if n.op_type == "Attention")
    attention.attributes["scale"] = type(attention.attributes["scale"])("scale", attention.attributes["scale"].type, 0.5)
    with pytest.raises(PassVerificationError):
        compare(before, model, spec, 4)


def test_build_report_lists_each_pass_with_counts(llama_engine):
    import json

    report = json.loads((llama_engine / "build_report.json").read_text())
    passes = {p["name"]: p for p in report["passes"]}
    assert list(passes) == DEFAULT_PASSES
    expected = KERNEL_COUNTS if library_path() is not None else COMPOSED_COUNTS
    for name, p in passes.items():
        if p["changed"]:
            assert p["max_abs_diff"] is not None and p["max_abs_diff"] <= ATOL
        assert p["counts"] == expected.get(name, p["counts"]), name
    md = (llama_engine / "build_report.md").read_text()
    for name in DEFAULT_PASSES:
        assert f"| {name} |" in md
    assert "paged_attention=2" in md
    assert [p.name for p in open_engine(llama_engine).manifest.passes] == DEFAULT_PASSES


def test_disabling_an_optional_pass(tmp_path):
    from llmc.compiler.build import build
    from llmc.runtime.llm import LLM
    from llmc.runtime.sampling import SamplingParams

    out = build("tiny-llama", tmp_path / "e", BuildOptions(block_size=4, disable_passes=("merge-matmuls",),
                                                           max_context=64)).engine_dir
    manifest = open_engine(out).manifest
    assert "merge-matmuls" not in [p.name for p in manifest.passes]
    out_tokens = LLM(out).generate("hello there", SamplingParams(max_tokens=5, ignore_eos=True)).token_ids
    assert len(out_tokens) == 5


@needs_kernels
def test_attention_kernel_takes_every_layer_or_none(exported):
    """The kernel's pools are head-major and an engine has one layout: one layer the kernel
    cannot take keeps every layer on the standard op (token-major), and the misses say why."""
    import onnx_ir as ir

    model, spec = _clone(exported[0]), exported[1]
    PassManager(_passes("cleanup", "native-gqa", "merge-matmuls", "paged-kv-cache", "logits-indices",
                        "ort-fusions")).run(model, spec)
    taken = _clone(model)
    _passes("cpu-kernels")[0].run(taken, spec)
    assert kv_layout.of_model(taken) == kv_layout.HEAD_MAJOR
    pools = [v for v in [*taken.graph.inputs, *taken.graph.outputs] if v.name.startswith("kv_cache")]
    assert len(pools) == 2 * spec.num_layers
    assert all(tuple(v.shape)[2:] == (spec.num_kv_heads, 4, spec.head_dim) for v in pools)

    rope = next(n for n in model.graph if n.op_type == "RotaryEmbedding")  # one layer's Q or K
    rope.attributes["interleaved"] = ir.AttrInt64("interleaved", 1)
    result = _passes("cpu-kernels")[0].run(model, spec)
    assert "paged_attention_kernel" not in result.counts
    assert kv_layout.of_model(model) == kv_layout.TOKEN_MAJOR
    refused = [m for m in result.misses if "every one or none is rewritten" in m]
    assert len(refused) == 1 and "attributes differ" in refused[0]
    assert not any(n.op_type == "PagedAttention" and n.domain == cpu.DOMAIN for n in model.graph)


@needs_kernels
def test_a_scaling_of_the_logits_is_folded_into_the_lm_head(engines):
    """Granite divides its logits by logits_scaling: lm-head-scale folds that into the head's
    weight, so the head is again what logits-indices and greedy-tokens take (tiny-granite's
    tokens equal transformers' in test_hf_parity)."""
    passes = {p.name: p for p in open_engine(engines("tiny-granite")).manifest.passes}
    assert passes["lm-head-scale"].counts == {"logits_scale_folded": 1}
    assert passes["logits-indices"].counts == {"lm_head_gather": 1}
    assert passes["greedy-tokens"].counts == {"lm_head_argmax": 1}
