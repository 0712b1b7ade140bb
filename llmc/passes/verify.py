"""Numeric verification of a pass: run the graph before and after in ONNX Runtime and compare.

Graphs on both sides of the KV-cache rewrite have different inputs, so the comparison is a
scenario both can express:
- unpaged vs unpaged: one call on random tokens, all logits compared;
- unpaged vs paged: the paged graph prefills every row from an empty cache (past 0, no padding)
  and its logits are compared with the unpaged graph's;
- paged vs paged: a ragged prefill (padded rows, many blocks per row, shuffled block ids) then
  two decode steps, each graph carrying its own cache; logits at valid positions and the
  written cache blocks are compared.
Every paged step asks for the logits of all its valid tokens, in a shuffled order
(`logits_indices`); a graph without that input returns [B, S, V], which is gathered the same way.
A hybrid's graph with state pools (recurrent-state) carries them from step to step as it carries
its cache, its rows in slots 1 and 2; a graph gaining them is compared on the prefill only, which
a graph without them computes alike (from zero states, over whole rows).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from llmc.contract import graph_io as io
from llmc.contract import kv_layout
from llmc.contract.model_spec import ModelSpec

ATOL = 1e-4


class PassVerificationError(AssertionError):
    pass


def _session(model: ir.Model):
    import onnxruntime as ort

    from llmc.passes import trt_lower
    from llmc.plugins import cpu

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    # The graph as written: ORT's own rewrites (DequantizeLinear + MatMul -> MatMulNBits, say) may
    # fire on one side of a pass and not the other, and change the numbers between them.
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if cpu.DOMAIN in model.opset_imports:
        cpu.register(opts)
    if trt_lower.plugin_nodes(model):  # TensorRT's plugin, by its meaning
        model = trt_lower.with_reference_plugin(model)
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])


def _input_names(model: ir.Model) -> set[str]:
    return {v.name for v in model.graph.inputs}


def _is_paged(model: ir.Model) -> bool:
    return io.BLOCK_TABLES in _input_names(model)


def _state_feeds(model: ir.Model, batch: int) -> dict[str, np.ndarray]:
    """Zeroed state pools (slot 0 scratch, rows in slots 1..batch) and state_slots, where the graph
    takes them; {} for one without."""
    pools = {v.name: np.zeros((batch + 1, *v.shape[1:]), np.float32)
             for v in model.graph.inputs if io.is_state(v.name)}
    return {io.STATE_SLOTS: np.arange(1, batch + 1, dtype=np.int32), **pools} if pools else {}


def _kv_dtype(model: ir.Model) -> str:
    """The storage of a graph's pools (fp32 unless llmc's kernel took a --kv-cache-dtype)."""
    value = next((v for v in model.graph.inputs if io.is_cache(v.name)), None)
    if value is None or value.dtype is None:
        return "fp32"
    return {code: name for name, code in kv_layout.ELEMENT_TYPES.items()}.get(value.dtype.value, "fp32")


def _storage_step(values: np.ndarray, dtype: str) -> np.ndarray:
    """The gap between stored neighbours at each of `values` (float32, token-major [2, N, bs, H, D])
    in a pool of `dtype`: 0 for fp32; an int8 pool's step is its token and head's scale."""
    if dtype == "fp32":
        return np.zeros_like(values)
    if dtype == "int8":
        return values.max(axis=-1, keepdims=True) / 127.0
    mantissa = {"fp16": 10, "bf16": 7}[dtype]
    exponent = np.floor(np.log2(np.maximum(values, np.finfo(np.float32).tiny)))
    return np.exp2(exponent - mantissa).astype(np.float32)


def _run(sess, feeds: dict) -> dict[str, np.ndarray]:
    """The session's outputs for `feeds`, through IOBinding so pools of any dtype (bfloat16 has
    no numpy type ORT converts) go in, and come back as new arrays of the pool's type."""
    import onnxruntime as ort

    def bound(pool: np.ndarray):
        dtype = next(d for d in kv_layout.KV_DTYPES if kv_layout.numpy_dtype(d) == pool.dtype)
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(*kv_layout.ort_value_args(pool, dtype))

    binding = sess.io_binding()
    names = [arg.name for arg in sess.get_inputs()]
    for name in names:
        if io.is_cache(name):
            binding.bind_ortvalue_input(name, bound(feeds[name]))
        else:
            binding.bind_cpu_input(name, np.ascontiguousarray(feeds[name]))
    written = {cache_out: np.empty_like(feeds[cache_in])
               for cache_in, cache_out in io.caches(sum(map(io.is_cache, names)))}
    outputs = [arg.name for arg in sess.get_outputs()]
    for name in outputs:
        if name in written:
            binding.bind_ortvalue_output(name, bound(written[name]))
        else:
            binding.bind_output(name)
    sess.run_with_iobinding(binding)
    return {name: written[name] if name in written else value.numpy()
            for name, value in zip(outputs, binding.get_outputs())}


def _chosen(logits: np.ndarray, feeds: dict) -> np.ndarray:
    """The logits of the tokens `feeds` names in logits_indices: as they are from a graph that
    takes that input ([N, V]), gathered from one that returns every position ([B, S, V])."""
    if logits.ndim == 2:
        return logits
    return logits.reshape(-1, logits.shape[-1])[feeds[io.LOGITS_INDICES]]


class _PagedScenario:
    """Feeds for a ragged prefill followed by decode steps over a shuffled block pool."""

    def __init__(self, spec: ModelSpec, block_size: int, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.bs = block_size
        self.prompt_lens = np.array([3 * self.bs + 2, self.bs + 1], dtype=np.int32)
        self.max_blocks = int(-(-(self.prompt_lens.max() + 4) // self.bs))
        num_blocks = 1 + 2 * self.max_blocks
        usable = np.delete(np.arange(num_blocks), io.SCRATCH_BLOCK)
        perm = self.rng.permutation(usable).astype(np.int32)
        self.tables = perm.reshape(2, self.max_blocks)
        self.pool_dims = (num_blocks, self.bs, spec.num_kv_heads, spec.head_dim)
        self.vocab = spec.vocab_size
        self.num_layers = len(spec.attention_layers)  # a hybrid's recurrent layers have no pool
        self.caches = io.caches(self.num_layers)

    def empty_caches(self, layout: str, dtype: str = "fp32") -> dict[str, np.ndarray]:
        shape = kv_layout.pool_shape(layout, *self.pool_dims, dtype)
        return {io.cache_input(i): np.zeros(shape, kv_layout.numpy_dtype(dtype)) for i in range(self.num_layers)}

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
            io.INPUT_IDS: ids.astype(np.int64),
            io.POSITION_IDS: (past[:, None] + np.arange(seq)[None, :]).astype(np.int64),
            io.PAST_LENS: past.astype(np.int32),
            io.QUERY_LENS: qlens.astype(np.int32),
            io.BLOCK_TABLES: self.tables,
            io.LOGITS_INDICES: self.valid_tokens(seq, qlens),
        }

    def valid_tokens(self, seq: int, qlens) -> np.ndarray:
        """Every valid token's flat index in the [B*S] grid, shuffled: the gather must not
        assume rows in order or one token per row."""
        flat = np.concatenate([b * seq + np.arange(n) for b, n in enumerate(qlens)])
        return self.rng.permutation(flat).astype(np.int64)


def compare(before: ir.Model, after: ir.Model, spec: ModelSpec, block_size: int, atol: float = ATOL) -> float:
    """Max abs difference of the logits (and written caches) of the two graphs; raises
    PassVerificationError beyond `atol`."""
    s_before, s_after = _session(before), _session(after)
    paged_before, paged_after = _is_paged(before), _is_paged(after)
    if paged_before and not paged_after:
        raise PassVerificationError("a pass removed the paged KV-cache interface")
    diffs: list[float] = []
    if not paged_after:
        rng = np.random.default_rng(0)
        ids = rng.integers(0, spec.vocab_size, (2, 2 * block_size + 3))
        feeds = {io.INPUT_IDS: ids, io.POSITION_IDS: np.broadcast_to(np.arange(ids.shape[1]), ids.shape).copy()}
        diffs.append(float(np.abs(_run(s_before, feeds)[io.LOGITS] - _run(s_after, feeds)[io.LOGITS]).max()))
    elif not paged_before:
        scenario = _PagedScenario(spec, block_size)
        feeds = next(scenario.steps())
        seq = feeds[io.INPUT_IDS].shape[1]
        feeds[io.QUERY_LENS] = np.full(2, seq, np.int32)
        feeds[io.LOGITS_INDICES] = scenario.valid_tokens(seq, feeds[io.QUERY_LENS])
        ref = _chosen(_run(s_before, feeds)[io.LOGITS], feeds)
        caches = scenario.empty_caches(kv_layout.of_model(after), _kv_dtype(after))
        got = _chosen(_run(s_after, {**feeds, **caches})[io.LOGITS], feeds)
        diffs.append(float(np.abs(ref - got).max()))
    else:
        scenario = _PagedScenario(spec, block_size)
        layouts = [kv_layout.of_model(before), kv_layout.of_model(after)]
        dtypes = [_kv_dtype(before), _kv_dtype(after)]
        caches = [scenario.empty_caches(layout, dtype) for layout, dtype in zip(layouts, dtypes)]
        states = [_state_feeds(model, len(scenario.prompt_lens)) for model in (before, after)]
        gains_state = bool(states[1]) and not states[0]
        for step, feeds in enumerate(scenario.steps()):
            if gains_state and step > 0:
                break  # the graph before has no state to carry into a decode step
            outs = []
            for k, sess in enumerate((s_before, s_after)):
                out = _run(sess, {**feeds, **caches[k], **states[k]})
                caches[k] = {cache_in: out[cache_out] for cache_in, cache_out in scenario.caches}
                pools = sum(map(io.is_state, states[k]))
                states[k].update({io.state_input(i): out[io.state_output(i)] for i in range(pools)})
                outs.append(_chosen(out[io.LOGITS], feeds))
            diffs.append(float(np.abs(outs[0] - outs[1]).max()))
        for name in caches[0]:  # compared token-major, but for the scratch block padding writes in any order
            pools = [np.delete(kv_layout.to_token_major(caches[k][name], layouts[k], dtypes[k], head_dim=spec.head_dim),
                               io.SCRATCH_BLOCK, axis=1) for k in (0, 1)]
            # fp32 sums in another order may round a stored value to its neighbour: one step of
            # the pool's storage is not the pass's error.
            slack = _storage_step(np.maximum(np.abs(pools[0]), np.abs(pools[1])), dtypes[1])
            diffs.append(float(np.maximum(np.abs(pools[0] - pools[1]) - slack, 0.0).max()))
    worst = max(diffs)
    if not worst <= atol:
        raise PassVerificationError(f"outputs differ by {worst:.3g} (> {atol:g}) after the pass")
    return worst


def verifier(spec: ModelSpec, block_size: int):
    """The PassManager's check of each pass on this model."""
    return lambda before, after, strict=True: compare(before, after, spec, block_size,
                                                      ATOL if strict else float("inf"))
