"""Every pass verified numerically on tiny-llama; rules count what they changed and explain misses."""

from __future__ import annotations

import json

import pytest

from conftest import needs_kernels
from llmc import kernels
from llmc.passes import ALL_PASSES, BuildContext, PassManager, make_passes
from llmc.passes.verify import ATOL, PassVerificationError, compare, verifier

# With llmc's CPU kernels (the default where they are built) attention, its RoPE and the packed
# projections go to the kernels, leaving ort-lower and the layout pass nothing to do on
# tiny-llama; without them ort-lower composes standard ops and the layout pass tidies those.
COMMON_COUNTS = {
    "native-gqa": {"attention_gqa": 2},
    "paged-kv-cache": {"paged_attention": 2},
    "last-token-logits": {"lm_head_last_token": 1},
    "merge-matmuls": {"qkv_merge": 2, "gate_up_merge": 2},
    "ort-fusions": {"skip_rmsnorm": 4, "swiglu": 2},
}
KERNEL_COUNTS = {**COMMON_COUNTS, "cpu-kernels": {"paged_attention": 2, "rope_fused": 2, "qkv_packed": 2,
                                                  "swiglu": 2},
                 "packed-matmul": {"packed_matmul": 9, "skip_rmsnorm_matmul": 3,
                                   "swiglu_matmul": 2}}
COMPOSED_COUNTS = {**COMMON_COUNTS, "ort-lower": {"paged_attention_lowered": 2, "shared_step_metadata": 1},
                   "simplify-layout": {"rope_3d": 4, "transpose_pair": 4, "reshape_chain": 4}}
COMPOSED_PASSES = [p for p in ALL_PASSES if p not in ("cpu-kernels", "packed-matmul")]


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


@pytest.mark.parametrize("passes,expected", [
    pytest.param(list(ALL_PASSES), KERNEL_COUNTS, marks=needs_kernels, id="kernels"),
    pytest.param(COMPOSED_PASSES, COMPOSED_COUNTS, id="standard-ops"),
])
def test_every_pass_verifies_on_tiny_llama(exported, passes, expected):
    model, spec = _clone(exported[0]), exported[1]
    records = PassManager(make_passes(passes), verifier=verifier).run(model, BuildContext(spec, block_size=4))
    assert [r.name for r in records] == passes
    for r in records:
        assert r.changed == (r.name in expected or r.name == "cleanup"), r.name
        if r.changed:
            assert r.max_abs_diff is not None and r.max_abs_diff <= ATOL, (r.name, r.max_abs_diff)
        assert r.counts == expected.get(r.name, r.counts), (r.name, r.counts)
    # The exporter's repeat_kv chain (Unsqueeze -> Expand -> Reshape) is gone.
    assert not any(n.op_type == "Reshape" and n.inputs[0].producer() is not None
                   and n.inputs[0].producer().op_type == "Expand"
                   and n.inputs[0].producer().inputs[0].producer() is not None
                   and n.inputs[0].producer().inputs[0].producer().op_type == "Unsqueeze"
                   for n in model.graph)
    assert not any(n.domain == "llmc" for n in model.graph)  # lowered for ORT
    assert any(n.domain == kernels.DOMAIN for n in model.graph) == ("cpu-kernels" in passes)


def test_paged_rewrite_explains_a_miss_when_kv_is_still_expanded(exported):
    model, spec = _clone(exported[0]), exported[1]
    ctx = BuildContext(spec, block_size=4)
    result = make_passes(["paged-kv-cache"])[0].run(model, ctx)
    assert not result.changed
    assert len(result.misses) == spec.num_layers
    assert all("run native-gqa first" in m for m in result.misses)
    assert "block_tables" not in {v.name for v in model.graph.inputs}  # interface untouched


def test_verifier_catches_a_wrong_rewrite(exported):
    """The verifier is only worth something if it fails on a broken pass."""
    model, spec = _clone(exported[0]), exported[1]
    ctx = BuildContext(spec, block_size=4)
    before = _clone(model)
    attention = next(n for n in model.graph if n.op_type == "Attention")
    attention.attributes["scale"] = type(attention.attributes["scale"])("scale", attention.attributes["scale"].type, 0.5)
    with pytest.raises(PassVerificationError):
        compare(before, model, ctx)


def test_build_report_lists_each_pass_with_counts(llama_engine):
    report = json.loads((llama_engine / "build_report.json").read_text())
    names = [p["name"] for p in report["passes"]]
    assert names == list(ALL_PASSES)
    expected = KERNEL_COUNTS if kernels.library_path() is not None else COMPOSED_COUNTS
    for p in report["passes"]:
        if p["changed"]:
            assert p["max_abs_diff"] is not None and p["max_abs_diff"] <= ATOL
        assert p["counts"] == expected.get(p["name"], p["counts"]), p["name"]
    md = (llama_engine / "build_report.md").read_text()
    for name in ALL_PASSES:
        assert f"| {name} |" in md
    assert "paged_attention=2" in md
    manifest = json.loads((llama_engine / "manifest.json").read_text())
    assert [p["name"] for p in manifest["passes"]] == list(ALL_PASSES)


def test_disabling_an_optional_pass(tmp_path):
    from llmc.compiler.pipeline import BuildOptions, build

    out = build("tiny-llama", tmp_path / "e", BuildOptions(block_size=4, disable_passes=("last-token-logits",),
                                                           max_context=64)).engine_dir
    manifest = json.loads((out / "manifest.json").read_text())
    assert "last-token-logits" not in [p["name"] for p in manifest["passes"]]
    assert manifest["io"]["logits"] == "all"
    from llmc.runtime.llm import LLM
    from llmc.runtime.sampling import SamplingParams

    # An all-positions engine still serves generate(): the runtime picks each row's last token.
    out_tokens = LLM(out).generate("hello there", SamplingParams(max_tokens=5, ignore_eos=True)).token_ids
    assert len(out_tokens) == 5


@needs_kernels
def test_attention_kernel_takes_every_layer_or_none(exported):
    """The kernel's pools are head-major and an engine has one layout: one layer the kernel
    cannot take keeps every layer on the standard op (token-major), and the miss says why."""
    import onnx_ir as ir

    from llmc import kv_layout

    before = [p for p in ALL_PASSES if p not in ("cpu-kernels", "ort-lower", "simplify-layout", "packed-matmul")]
    model, spec = _clone(exported[0]), exported[1]
    ctx = BuildContext(spec, block_size=4)
    PassManager(make_passes(before)).run(model, ctx)
    taken = _clone(model)
    make_passes(["cpu-kernels"])[0].run(taken, ctx)
    assert kv_layout.of_model(taken) == kv_layout.HEAD_MAJOR
    pools = [v for v in [*taken.graph.inputs, *taken.graph.outputs] if v.name.startswith("kv_cache")]
    assert len(pools) == 2 * spec.num_layers
    assert all(tuple(v.shape)[2:] == (spec.num_kv_heads, 4, spec.head_dim) for v in pools)

    rope = next(n for n in model.graph if n.op_type == "RotaryEmbedding")  # one layer's Q or K
    rope.attributes["interleaved"] = ir.AttrInt64("interleaved", 1)
    result = make_passes(["cpu-kernels"])[0].run(model, ctx)
    assert result.counts.get("paged_attention") is None
    assert kv_layout.of_model(model) == kv_layout.TOKEN_MAJOR
    assert sum("all layers share one pool layout" in m for m in result.misses) == spec.num_layers - 1
    assert not any(n.op_type == "PagedAttention" and n.domain == kernels.DOMAIN for n in model.graph)
