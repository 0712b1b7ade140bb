"""decoder-layers: a fused DecoderLayer node computes what the layer's five kernel nodes did, bit
for bit, for every weight format and KV dtype, in prefill chunks and in-flight decode steps."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest

from conftest import needs_kernels
from llmc.contract import open_engine
from llmc.contract.options import RuntimeOptions
from llmc.runtime.engine import Engine
from llmc.runtime.step import Row

CASES = {
    "fp32": ("tiny-llama", {}),
    "lossless": ("tiny-llama", dict(lossless_weights=True)),
    "int4-asym": ("tiny-llama", dict(quant="int4", quant_symmetric=False)),
    "int8-kv8": ("tiny-llama", dict(quant="int8", kv_cache_dtype="int8")),
    "bf16-kv16": ("tiny-llama", dict(weight_dtype="bf16", kv_cache_dtype="fp16")),
    "qwen2-bias": ("tiny-qwen2", {}),  # an Add of the QKV bias inside the layer
    "mistral-window": ("tiny-mistral", {}),  # a sliding window
    "qwen3-qk-norm": ("tiny-qwen3", {}),  # the attention's QK-norm weights
}


def _ops(engine) -> Counter:
    return Counter(n.op_type for n in onnx.load(engine / "model.onnx", load_external_data=False).graph.node)


def _steps(engine_dir, threads: int | None = None) -> list[np.ndarray]:
    """The logits of a fixed schedule: two rows prefilled in chunks of uneven lengths, then both
    decoding together with a third row's prefill, then three-row decode steps."""
    engine = Engine(engine_dir, RuntimeOptions(num_threads=threads))
    vocab, bs = engine.spec.vocab_size, engine.block_size
    rng = np.random.default_rng(0)
    tokens = [rng.integers(3, vocab, 40).tolist() for _ in range(3)]
    tables = [list(range(1 + 12 * i, 13 + 12 * i)) for i in range(3)]
    done = [0, 0, 0]
    out = []

    def step(plan):  # (row, tokens this step)
        rows = [Row(tokens[r][done[r]:done[r] + n], done[r], tables[r][:-(-(done[r] + n) // bs)]) for r, n in plan]
        out.append(engine.forward_rows(rows).copy())
        for r, n in plan:
            done[r] += n

    step([(0, 13), (1, 5)])
    step([(0, 9), (1, 17)])
    step([(0, 1), (1, 1), (2, 11)])
    for _ in range(6):
        step([(0, 1), (1, 1), (2, 1)])
    return out


@needs_kernels
@pytest.mark.parametrize("case", list(CASES))
def test_a_fused_layer_computes_what_its_five_nodes_did(engines, case):
    recipe, options = CASES[case]
    fused, plain = engines(recipe, **options), engines(recipe, "decoder-layers", **options)
    layers = open_engine(fused).manifest.model_spec.num_layers
    record = {p.name: p for p in open_engine(fused).manifest.passes}["decoder-layers"]
    # Every layer but the first, whose input norm reads no residual yet; verified as it was built.
    assert record.counts == {"decoder_layer": layers - 1}
    assert record.max_abs_diff is not None and record.max_abs_diff <= 1e-4
    ops, before = _ops(fused), _ops(plain)
    assert ops["DecoderLayer"] == layers - 1 and ops["PagedAttention"] == 1
    per_layer = 6 if case == "qwen2-bias" else 5  # the kernel nodes, and the bias Add
    assert sum(ops.values()) == sum(before.values()) - (per_layer - 1) * (layers - 1)
    expected = _steps(plain)
    # One thread runs every item itself (ORT has no pool then); the default, one per core.
    for threads in (None, 1) if case == "fp32" else (None,):
        for got, want in zip(_steps(fused, threads), expected, strict=True):
            assert np.array_equal(got, want)
