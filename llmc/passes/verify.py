"""Numeric verification of a pass: run the graph before and after in ONNX Runtime and compare.

Graphs on both sides of the KV-cache rewrite have different inputs, so the comparison is a
scenario both can express:
- unpaged vs unpaged: one call on random tokens, all logits compared;
- unpaged vs paged: the paged graph prefills every row from an empty cache (past 0, no padding)
  and its logits are compared with the unpaged graph's (last position when it has only that);
- paged vs paged: a ragged prefill (padded rows, many blocks per row, shuffled block ids) then
  two decode steps, each graph carrying its own cache; logits at valid positions and the
  written cache blocks are compared.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from llmc import kv_layout
from llmc.passes.base import BuildContext

ATOL = 1e-4


class PassVerificationError(AssertionError):
    pass


def _session(model: ir.Model):
    import onnxruntime as ort

    from llmc import kernels

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if kernels.uses_kernels(model.opset_imports):
        kernels.register(opts)
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])


def _input_names(model: ir.Model) -> set[str]:
    return {v.name for v in model.graph.inputs}


def _is_paged(model: ir.Model) -> bool:
    return "block_tables" in _input_names(model)


def _run(sess, feeds: dict) -> dict[str, np.ndarray]:
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()}
    return dict(zip(names, sess.run(None, {k: v for k, v in feeds.items() if k in wanted})))


def _last_valid(logits: np.ndarray, query_lens: np.ndarray) -> np.ndarray:
    if logits.ndim == 2:
        return logits
    return logits[np.arange(len(query_lens)), query_lens - 1]


class _PagedScenario:
    """Feeds for a ragged prefill followed by decode steps over a shuffled block pool."""

    def __init__(self, ctx: BuildContext, seed: int = 0):
        spec = ctx.spec
        self.rng = np.random.default_rng(seed)
        self.bs = ctx.block_size
        self.prompt_lens = np.array([3 * self.bs + 2, self.bs + 1], dtype=np.int32)
        self.max_blocks = int(-(-(self.prompt_lens.max() + 4) // self.bs))
        num_blocks = 1 + 2 * self.max_blocks
        perm = self.rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
        self.tables = perm.reshape(2, self.max_blocks)
        self.pool_dims = (num_blocks, self.bs, spec.num_kv_heads, spec.head_dim)
        self.vocab = spec.vocab_size
        self.num_layers = spec.num_layers

    def empty_caches(self, layout: str) -> dict[str, np.ndarray]:
        shape = kv_layout.pool_shape(layout, *self.pool_dims)
        return {f"kv_cache.{i}": np.zeros(shape, np.float32) for i in range(self.num_layers)}

    def steps(self):
        batch, seq = len(self.prompt_lens), int(self.prompt_lens.max())
        ids = self.rng.integers(0, self.vocab, (batch, seq))
        past = np.zeros(batch, np.int32)
        yield self._feeds(ids, past, self.prompt_lens)
        past = self.prompt_lens.copy()
        for _ in range(2):
            ids = self.rng.integers(0, self.vocab, (batch, 1))
            yield self._feeds(ids, past, np.ones(batch, np.int32))
            past = past + 1

    def _feeds(self, ids, past, qlens):
        seq = ids.shape[1]
        return {
            "input_ids": ids.astype(np.int64),
            "position_ids": (past[:, None] + np.arange(seq)[None, :]).astype(np.int64),
            "past_lens": past.astype(np.int32),
            "query_lens": qlens.astype(np.int32),
            "block_tables": self.tables,
        }


def compare(before: ir.Model, after: ir.Model, ctx: BuildContext, atol: float = ATOL) -> float:
    """Max abs difference of the logits (and written caches) of the two graphs; raises
    PassVerificationError beyond `atol`."""
    s_before, s_after = _session(before), _session(after)
    paged_before, paged_after = _is_paged(before), _is_paged(after)
    if paged_before and not paged_after:
        raise PassVerificationError("a pass removed the paged KV-cache interface")
    diffs: list[float] = []
    if not paged_after:
        rng = np.random.default_rng(0)
        ids = rng.integers(0, ctx.spec.vocab_size, (2, 2 * ctx.block_size + 3))
        feeds = {"input_ids": ids, "position_ids": np.broadcast_to(np.arange(ids.shape[1]), ids.shape).copy()}
        diffs.append(float(np.abs(_run(s_before, feeds)["logits"] - _run(s_after, feeds)["logits"]).max()))
    elif not paged_before:
        scenario = _PagedScenario(ctx)
        feeds = next(scenario.steps())
        seq = feeds["input_ids"].shape[1]
        feeds["query_lens"] = np.full(2, seq, np.int32)
        ref = _run(s_before, feeds)["logits"]
        got = _run(s_after, {**feeds, **scenario.empty_caches(kv_layout.of_model(after))})["logits"]
        ref = ref[:, -1] if got.ndim == 2 else ref
        diffs.append(float(np.abs(ref - got).max()))
    else:
        scenario = _PagedScenario(ctx)
        layouts = [kv_layout.of_model(before), kv_layout.of_model(after)]
        caches = [scenario.empty_caches(layout) for layout in layouts]
        for feeds in scenario.steps():
            outs = []
            for k, sess in enumerate((s_before, s_after)):
                out = _run(sess, {**feeds, **caches[k]})
                caches[k] = {name.replace("kv_cache_out.", "kv_cache."): v
                             for name, v in out.items() if name.startswith("kv_cache_out.")}
                outs.append(_last_valid(out["logits"], feeds["query_lens"]))
            diffs.append(float(np.abs(outs[0] - outs[1]).max()))
        for name in caches[0]:  # compared token-major; block 0 is scratch: padding writes land there in any order
            pools = [kv_layout.to_token_major(caches[k][name], layouts[k]) for k in (0, 1)]
            diffs.append(float(np.abs(pools[0][:, 1:] - pools[1][:, 1:]).max()))
    worst = max(diffs)
    if not worst <= atol:
        raise PassVerificationError(f"outputs differ by {worst:.3g} (> {atol:g}) after the pass")
    return worst


def verifier(before: ir.Model, after: ir.Model, ctx: BuildContext) -> float:
    return compare(before, after, ctx)
