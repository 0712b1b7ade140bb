"""Graph passes. `PIPELINES` names the pass sequences a build can run."""

from __future__ import annotations

from llmc.passes.base import BuildContext, Pass, PassManager, PassRecord, PassResult, RewriteRule

__all__ = ["BuildContext", "Pass", "PassManager", "PassRecord", "PassResult", "RewriteRule",
           "ALL_PASSES", "REQUIRED_PASSES", "OPT_IN_PASSES", "OPTIONAL_PASSES", "make_passes"]


def _registry() -> dict[str, type[Pass]]:
    from llmc.passes.cleanup import Cleanup
    from llmc.passes.cpu_kernels import CPUKernels, LosslessWeights, PackedMatMuls
    from llmc.passes.last_token import LastTokenLogits
    from llmc.passes.layout import SimplifyLayout
    from llmc.passes.merge_matmuls import MergeMatMuls
    from llmc.passes.native_gqa import NativeGQA
    from llmc.passes.ort_fusions import ORTFusions
    from llmc.passes.ort_lower import LowerPagedAttentionORT
    from llmc.passes.paged_kv import PagedKVCache

    return {p.name: p for p in (Cleanup, NativeGQA, MergeMatMuls, PagedKVCache, LastTokenLogits,
                                ORTFusions, CPUKernels, LowerPagedAttentionORT, SimplifyLayout, PackedMatMuls,
                                LosslessWeights)}


# In pipeline order, in phases: canonicalize, fuse, rewrite the KV-cache I/O, fuse into the
# backend's kernels (ORT's, then llmc's own), lower what is left to standard ops, tidy the layout,
# then pack the settled weights for llmc's GEMM (and, when asked, add their lossless copies).
# The runtime contract needs the paged rewrite and a backend lowering.
ALL_PASSES = ("cleanup", "native-gqa", "merge-matmuls", "paged-kv-cache", "last-token-logits", "ort-fusions",
              "cpu-kernels", "ort-lower", "simplify-layout", "packed-matmul", "lossless-weights")
REQUIRED_PASSES = ("paged-kv-cache", "ort-lower")
# Passes that change nothing unless a build option asks (`--lossless-weights`): disabling them is moot.
OPT_IN_PASSES = ("lossless-weights",)
# What `--disable-pass` can usefully take away (ablations, tuning).
OPTIONAL_PASSES = tuple(p for p in ALL_PASSES if p not in REQUIRED_PASSES + OPT_IN_PASSES)


def make_passes(names: list[str]) -> list[Pass]:
    registry = _registry()
    return [registry[n]() for n in names]
