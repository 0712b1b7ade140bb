"""draft-vocab: a speculative draft's LM head scores only the tokens it may propose.

A draft proposes and the target verifies each proposal against its own logits over the whole
vocabulary, so a draft that can only propose common tokens gives up nothing but its proposals of
rare ones. On a small draft the LM head (hidden x vocab) is most of a step's work, and a step
per proposed token is what a draft costs, so keeping N of V columns makes every proposal
cheaper. The build ranks the tokens by their count in text (`llmc.compiler.build`); the kept ids,
ascending, become the manifest's `lm_head_tokens`: logits column j is token lm_head_tokens[j].
An engine with them only proposes (`llmc.runtime.proposers`); LLM refuses it as a target.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from llmc.contract.model_spec import ModelSpec
from llmc.passes.graph import is_lm_head_output, matmul_weight
from llmc.passes.rewrite import Rule, RulePass

TOKENS_KEY = "llmc.lm_head_tokens"  # metadata the build reads back into the manifest


class NarrowLMHead(Rule):
    name = "narrow_lm_head"

    def __init__(self, tokens: np.ndarray):
        self.tokens = tokens

    def pattern(self, op, x, w):
        return op.MatMul(x, w)

    def match(self, node):
        m = super().match(node)
        return m if m is not None and is_lm_head_output(m.outputs[0]) else None

    def check(self, m):
        w = matmul_weight(m.w)
        if w is None or w.ndim != 2:
            return "the LM head's weight is not a constant 2-D initializer"
        if self.tokens[-1] >= w.shape[1]:
            return f"token {self.tokens[-1]} is beyond the LM head's {w.shape[1]} columns"
        return None

    def rewrite(self, op, m):
        w = np.ascontiguousarray(matmul_weight(m.w)[:, self.tokens])
        logits = op.MatMul(m.x, op.initializer(w, "lm_head.draft_vocab"))
        old = m.outputs[0].shape
        logits.shape = ir.Shape([*old[:-1], len(self.tokens)]) if old is not None else None
        return logits


class DraftVocab(RulePass):
    name = "draft-vocab"
    description = "a draft's LM head over only the tokens it may propose (--draft-vocab)"
    same_outputs = False  # the logits lose columns: nothing to verify them against

    def __init__(self, tokens: np.ndarray | None = None):
        self.tokens = tokens  # the kept ids, ascending; the build sets them

    def requires(self, model: ir.Model, spec: ModelSpec) -> str | None:
        if self.tokens is None:
            return "no tokens were ranked for it (the build ranks them from --calibrate's text)"
        return None

    def rules(self, spec: ModelSpec):
        return [NarrowLMHead(self.tokens)]

    def finish(self, model: ir.Model, spec: ModelSpec, counts) -> None:
        model.metadata_props[TOKENS_KEY] = ",".join(map(str, self.tokens.tolist()))


def kept_tokens(model: ir.Model) -> tuple[int, ...] | None:
    """The ids draft-vocab kept, taken off the graph; None where it did not run."""
    text = model.metadata_props.pop(TOKENS_KEY, None)
    return tuple(int(t) for t in text.split(",")) if text else None


def most_frequent(counts: np.ndarray, n: int) -> np.ndarray:
    """The n ids with the largest counts (ties: the lower id), ascending."""
    order = np.argsort(-counts, kind="stable")
    return np.sort(order[:n])
