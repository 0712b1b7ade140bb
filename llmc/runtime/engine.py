"""Engine: an engine artifact loaded into an ONNX Runtime session with its KV block pool.

`Engine.forward` runs one step of the paged contract (design §4). The per-layer caches are
OrtValues bound once as both input and output of the session (IOBinding), so the graph's cache
write (llmc's PagedAttention kernel, or a ScatterND) lands in the pool in place; nothing
proportional to the pool is copied.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmc import kernels, kv_layout
from llmc.artifact import engine_file, load_manifest
from llmc.errors import EngineError, LlmcError, first_line
from llmc.spec import ModelSpec

DEFAULT_KV_CACHE_BYTES = 512 * 2**20
BACKENDS = ("onnxruntime",)
GRAPH_OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")  # ORT's, by our short names
STEP_INPUTS = ("input_ids", "position_ids", "past_lens", "query_lens", "block_tables")


def _import_ort():
    try:
        import onnxruntime as ort
    except ImportError:
        raise EngineError("ONNX Runtime is not installed; run `pip install llmc[cpu]` "
                          "(or llmc[gpu])") from None
    return ort


class Engine:
    def __init__(self, engine_dir: str | Path, *, num_threads: int | None = None,
                 kv_cache_blocks: int | None = None, kv_cache_bytes: int | None = None,
                 allow_spinning: bool = True, graph_optimization_level: str = "all",
                 verify_checksums: bool = True):
        if graph_optimization_level not in GRAPH_OPTIMIZATION_LEVELS:
            raise LlmcError(f"graph_optimization_level must be one of {', '.join(GRAPH_OPTIMIZATION_LEVELS)} "
                            f"(got {graph_optimization_level!r})")
        self.dir = Path(engine_dir)
        self.manifest = manifest = load_manifest(self.dir, verify_checksums=verify_checksums)
        backend = manifest["backend"]
        name = backend.get("name") if isinstance(backend, dict) else backend
        if name not in BACKENDS:
            raise EngineError(f"engine {self.dir} targets backend {name!r}, which this runtime "
                              f"cannot run ({', '.join(BACKENDS)}); rebuild it for onnxruntime")
        try:
            self.spec = ModelSpec.from_dict(manifest["model_spec"])
            kv = manifest["kv_cache"]
            self.block_size = int(kv["block_size"])
            self.kv_layout = kv["layout"]
            if self.kv_layout not in kv_layout.LAYOUTS:
                raise ValueError(f"unknown kv_cache.layout {self.kv_layout!r}")
            self.max_context = int(manifest["max_context"])
            self.io = manifest["io"]
            model_path = engine_file(self.dir, manifest, manifest["payload"]["model"])
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"engine {self.dir} has an incomplete manifest ({exc}); "
                              "rebuild it with `llmc build`") from None
        self.last_token_logits = self.io.get("logits") == "last"

        ort = _import_ort()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = num_threads or _physical_cores()
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }[graph_optimization_level]
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
        opts.log_severity_level = 3
        if isinstance(backend, dict) and kernels.DOMAIN in backend.get("custom_ops", ()):
            try:
                kernels.register(opts)
            except LlmcError as exc:
                raise EngineError(f"engine {self.dir}: {exc}") from None
            except Exception as exc:
                raise EngineError(f"engine {self.dir}: ONNX Runtime cannot load llmc's CPU kernels "
                                  f"({first_line(exc)}); reinstall llmc (pip install -e .)") from None
        weights_name = manifest["payload"].get("weights")
        if weights_name:
            self._weights = _read_weights(opts, engine_file(self.dir, manifest, weights_name), weights_name)
        try:
            self.session = ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise EngineError(f"ONNX Runtime cannot load {model_path} ({first_line(exc)}); "
                              "rebuild the engine with this llmc version") from None
        self.num_threads = opts.intra_op_num_threads
        self.allow_spinning = allow_spinning
        self.graph_optimization_level = graph_optimization_level

        self.num_blocks = self._pool_blocks(kv_cache_blocks, kv_cache_bytes)
        shape = kv_layout.pool_shape(self.kv_layout, self.num_blocks, self.block_size, self.spec.num_kv_heads,
                                     self.spec.head_dim)
        self._pools = []
        self._binding = self.session.io_binding()
        for cache_in, cache_out in zip(self.io["cache_inputs"], self.io["cache_outputs"]):
            pool = np.empty(shape, np.float32)
            pool.fill(0.0)  # touch every page now, not on the first write of a request
            value = ort.OrtValue.ortvalue_from_numpy(pool)
            self._pools.append((pool, value))
            self._binding.bind_ortvalue_input(cache_in, value)
            self._binding.bind_ortvalue_output(cache_out, value)
        self._steps: dict[tuple[int, int, int], _StepBuffers] = {}
        self._bound: _StepBuffers | None = None

    def _pool_blocks(self, blocks: int | None, budget: int | None) -> int:
        if blocks is not None:
            if blocks < 2:
                raise LlmcError(f"kv_cache_blocks must be >= 2 (got {blocks})")
            return int(blocks)
        per_block = 2 * self.spec.num_layers * self.block_size * self.spec.num_kv_heads * self.spec.head_dim * 4
        budget = DEFAULT_KV_CACHE_BYTES if budget is None else budget
        if budget < 2 * per_block:
            raise LlmcError(f"kv_cache_bytes {budget} holds fewer than 2 blocks of {per_block} bytes; raise it")
        # No point in more than a full context for 64 sequences.
        cap = 64 * -(-self.max_context // self.block_size) + 1
        return int(min(budget // per_block, cap))

    @property
    def kv_bytes(self) -> int:
        return sum(pool.nbytes for pool, _ in self._pools)

    def pool(self, layer: int) -> np.ndarray:
        """The numpy view of a layer's cache pool (shares memory with the session's buffer)."""
        return self._pools[layer][0]

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, past_lens: np.ndarray,
                query_lens: np.ndarray, block_tables: np.ndarray) -> np.ndarray:
        """One step; returns logits [B, V] (or [B, S, V] for an all-positions engine). The logits
        buffer is reused by the next step of the same shape: copy what must outlive it."""
        batch, seq = input_ids.shape
        step = self._step_buffers(batch, seq, block_tables.shape[1])
        for name, value in zip(STEP_INPUTS, (input_ids, position_ids, past_lens, query_lens, block_tables)):
            np.copyto(step.inputs[name], value, casting="unsafe")
        self.session.run_with_iobinding(self._binding)
        return step.logits

    def _step_buffers(self, batch: int, seq: int, width: int) -> "_StepBuffers":
        """Input and logits buffers for a step shape, bound to the session. Consecutive steps of one
        shape (a steady decode batch) bind nothing: they only fill the bound arrays in place."""
        key = (batch, seq, width)
        step = self._steps.get(key)
        if step is None:
            if len(self._steps) >= 16:  # shapes come and go with the batch; keep the recent ones
                self._steps.pop(next(iter(self._steps)))
            vocab = self.spec.vocab_size
            step = self._steps[key] = _StepBuffers(
                inputs={"input_ids": np.zeros((batch, seq), np.int64), "position_ids": np.zeros((batch, seq), np.int64),
                        "past_lens": np.zeros(batch, np.int32), "query_lens": np.zeros(batch, np.int32),
                        "block_tables": np.zeros((batch, width), np.int32)},
                logits=np.empty((batch, vocab) if self.last_token_logits else (batch, seq, vocab), np.float32))
        if self._bound is not step:
            ort = _import_ort()
            for name, array in step.inputs.items():
                self._binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
            self._binding.bind_output("logits", "cpu", 0, np.float32, list(step.logits.shape),
                                      step.logits.ctypes.data)
            self._bound = step
        return step


@dataclass
class _StepBuffers:
    inputs: dict[str, np.ndarray]
    logits: np.ndarray


def _read_weights(opts, path: Path, name: str):
    """Hand ORT the weights file read into anonymous memory advised to use huge pages, for it to
    use in place. ORT would otherwise map the file with 4 KB pages, and every decode step streams
    all the weights: a TLB walk per 4 KB, which cost a cold 128-token prefill on llmc's packed
    GEMM 11% (measured; with 2 MB pages it matched ORT's own prepacked GEMM). Resident memory is
    the same either way: the mapped file's pages end up resident too."""
    import mmap

    size = path.stat().st_size
    if size == 0:
        return None
    buffer = mmap.mmap(-1, size)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    with open(path, "rb") as f:
        f.readinto(buffer)
    opts.add_external_initializers_from_files_in_memory([name], [np.frombuffer(buffer, np.uint8)], [size])
    opts.add_session_config_entry("session.use_external_initializer_file_buffers_directly", "1")
    return buffer  # the session reads it in place: it lives as long as the engine


def _physical_cores() -> int:
    try:
        import psutil

        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:
        return os.cpu_count() or 1
