"""The pass pipeline, as one list in phases, built from the build's options.

    canonicalize      cleanup, native-gqa, lm-head-scale (a constant scaling of the logits into the head),
                      rope-forms (RoPE on interleaved pairs or part of each head as ONNX RotaryEmbedding)
    fuse              merge-matmuls, draft-vocab (with --draft-vocab: the LM head's kept columns)
    quantize          quantize-weights (with --quant or --weight-dtype: DequantizeLinear/Cast -> MatMul)
    rewrite KV I/O    paged-kv-cache, recurrent-state (a hybrid's state pools), logits-indices (the LM head on
                      the step's chosen tokens)
    backend kernels   ort-fusions (ORT's), cpu-kernels (llmc's own), rotary-tables
    lower             ort-lower (what no kernel took, in standard ops)
    layout            simplify-layout
    weights           packed-matmul, lossless-weights (with --lossless-weights), greedy-tokens
    layers            decoder-layers (each layer's kernel nodes as one)

With --backend tensorrt the first four phases are the same and the rest is TensorRT's lowering
(trt_lower.py): the attention as llmc's plugin node, then the whole graph in fp16 or bf16.

    lower             trt-plugin
    precision         trt-precision

The engine contract needs paged-kv-cache, recurrent-state, logits-indices and ort-lower (`Pass.required`); any
other pass can be left out with --disable-pass. Passes that target llmc's CPU kernels stand aside,
saying why, where the kernel library is not built.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmc.contract.options import BuildOptions
from llmc.errors import LlmcError
from llmc.passes.cleanup import Cleanup
from llmc.passes.cpu_kernels import CPUKernels
from llmc.passes.decoder_layers import DecoderLayers
from llmc.passes.draft_vocab import DraftVocab
from llmc.passes.greedy_tokens import GreedyTokens
from llmc.passes.rope_forms import RopeForms
from llmc.passes.lm_head_scale import LMHeadScale
from llmc.passes.logits_indices import LogitsIndices
from llmc.passes.lossless_weights import LosslessWeights
from llmc.passes.manager import Pass
from llmc.passes.merge_matmuls import MergeMatMuls
from llmc.passes.native_gqa import NativeGQA
from llmc.passes.ort_fusions import ORTFusions
from llmc.passes.ort_lower import LowerPagedAttentionORT
from llmc.passes.packed_matmul import PackedMatMuls
from llmc.passes.paged_kv_cache import PagedKVCache
from llmc.passes.quantize_weights import QuantizeWeights
from llmc.passes.recurrent_state import RecurrentState
from llmc.passes.rotary_tables import RotaryTables
from llmc.passes.simplify_layout import SimplifyLayout
from llmc.passes.trt_lower import TensorRTPlugin, TensorRTPrecision


@dataclass(frozen=True)
class Phase:
    name: str
    passes: tuple[Pass, ...]


def phases(options: BuildOptions) -> list[Phase]:
    """Every pass the options call for, in order and by phase (--disable-pass not yet applied)."""
    block = options.block_size
    common = [
        Phase("canonicalize", (Cleanup(), NativeGQA(), LMHeadScale(), RopeForms())),
        Phase("fuse", (MergeMatMuls(),) + ((DraftVocab(),) if options.draft_vocab else ())),
        Phase("quantize", (QuantizeWeights(options),) if options.reduces_weights else ()),
        Phase("rewrite KV I/O", (PagedKVCache(block), RecurrentState(), LogitsIndices())),
    ]
    if options.backend == "tensorrt":
        return common + [Phase("lower", (TensorRTPlugin(),)),
                         Phase("precision", (TensorRTPrecision(options.compute_dtype),))]
    return common + [
        Phase("backend kernels", (ORTFusions(), CPUKernels(block, options.kv_dtype),
                                  RotaryTables(options.max_context))),
        Phase("lower", (LowerPagedAttentionORT(block),)),
        Phase("layout", (SimplifyLayout(),)),
        Phase("weights", (PackedMatMuls(),) + ((LosslessWeights(),) if options.lossless_weights else ())
              + (GreedyTokens(),)),
        Phase("layers", (DecoderLayers(),)),
    ]


def pipeline(options: BuildOptions) -> list[Pass]:
    """The passes a build with these options runs, in order; refuses a --disable-pass it cannot honour."""
    every = {p.name: p for backend in ("onnxruntime", "tensorrt")
             for phase in phases(BuildOptions(lossless_weights=True, quant="int8", backend=backend, draft_vocab=1))
             for p in phase.passes}
    for name in options.disable_passes:
        if name not in every:
            raise LlmcError(f"unknown pass {name!r}; passes are: {', '.join(every)}")
        if every[name].required:
            raise LlmcError(f"pass {name!r} cannot be disabled: the engine contract needs it")
    return [p for phase in phases(options) for p in phase.passes if p.name not in options.disable_passes]


def optional_passes() -> list[str]:
    """The passes --disable-pass can take away from a default build (for ablations and tuning)."""
    return [p.name for phase in phases(BuildOptions()) for p in phase.passes if not p.required]
