"""Engine: an engine artifact loaded into an ONNX Runtime session with its KV block pool.

`Engine.forward` runs one step of the paged contract (llmc.contract.graph_io). Each layer's pool
is an OrtValue bound once as both the cache input and the cache output of the session
(IOBinding), so the graph's cache write (llmc's PagedAttention kernel, or a ScatterND) lands in
the pool in place; nothing proportional to the pool is copied.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmc.contract import graph_io as io
from llmc.contract import kv_layout
from llmc.contract.engine_dir import EngineFiles, open_engine
from llmc.contract.options import DEFAULT_KV_CACHE_BYTES, GRAPH_OPTIMIZATION_LEVELS, RuntimeOptions
from llmc.errors import EngineError, LlmcError, first_line
from llmc.plugins import cpu
from llmc.runtime import backends
from llmc.runtime.step import Row, checked_indices, fill

_ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(bfloat16)": "bfloat16",
              "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(int8)": "int8"}  # ORT's element type names, as numpy's


def _import_ort():
    try:
        import onnxruntime as ort
    except ImportError:
        raise EngineError("ONNX Runtime is not installed; run `pip install llmc[cpu]` (or llmc[gpu])") from None
    return ort


def load_engine(engine: str | Path | EngineFiles, options: RuntimeOptions | None = None):
    """The engine loaded by the backend its manifest names: ONNX Runtime's `Engine`, or another
    registered with llmc.runtime.backends (TensorRT's, which loads TensorRT and CUDA only then)."""
    files = engine if isinstance(engine, EngineFiles) else open_engine(
        engine, verify_checksums=(options or RuntimeOptions()).verify_checksums, hash_later=("weights",))
    return backends.load(files, options)


TABLE_STEP = 16  # forward_rows pads block tables to a multiple of this many blocks


class Engine:
    def __init__(self, engine: str | Path | EngineFiles, options: RuntimeOptions | None = None):
        options = options or RuntimeOptions()
        files = engine if isinstance(engine, EngineFiles) else open_engine(
            engine, verify_checksums=options.verify_checksums, hash_later=("weights",))
        self.files, self.dir, self.manifest = files, files.root, files.manifest
        manifest = files.manifest
        if manifest.backend.name != "onnxruntime":
            b = manifest.backend
            raise EngineError(f"engine {self.dir} is a TensorRT plan ({b.gpu_arch}, TensorRT {b.tensorrt_version}), "
                              "which ONNX Runtime cannot run; load it with LLM (or load_engine) on a GPU with "
                              "TensorRT, or build a CPU engine with --backend onnxruntime")
        self.spec = manifest.model_spec
        self.kv = manifest.kv_cache
        self.block_size = self.kv.block_size
        self.max_context = manifest.max_context
        self.context_blocks = -(-self.max_context // self.block_size)  # the blocks a full context fills
        self.io = manifest.io
        self.num_blocks = self._pool_blocks(options.kv_cache_blocks, options.kv_cache_bytes)  # before the slow load

        ort = _import_ort()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = options.num_threads or _physical_cores()
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel,
                                                GRAPH_OPTIMIZATION_LEVELS[options.graph_optimization_level])
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if options.allow_spinning else "0")
        opts.log_severity_level = 3
        if cpu.DOMAIN in manifest.backend.custom_ops:
            try:
                cpu.register(opts)
            except LlmcError as exc:
                raise EngineError(f"engine {self.dir}: {exc}") from None
            except Exception as exc:
                raise EngineError(f"engine {self.dir}: ONNX Runtime cannot load llmc's CPU kernels "
                                  f"({first_line(exc)}); reinstall llmc (pip install -e .)") from None
        if files.weights is not None:
            self._weights = _read_weights(opts, files.weights, manifest.payload.weights,
                                          files.unverified.get("weights"))
        try:
            self.session = ort.InferenceSession(str(files.model), opts, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise EngineError(f"ONNX Runtime cannot load {files.model} ({first_line(exc)}); "
                              "rebuild the engine with this llmc version") from None
        self._check_graph()
        self.num_threads = opts.intra_op_num_threads

        shape = self.kv.pool_shape(self.num_blocks)
        self._pools = []
        for cache_in, cache_out in self.io.caches():
            pool = np.empty(shape, self.kv.numpy_dtype)
            pool.fill(0)  # touch every page now, not on the first write of a request
            # Over the pool's own memory (no copy), typed as the graph wants (bf16 has no numpy type ORT takes).
            value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(*kv_layout.ort_value_args(pool, self.kv.dtype))
            self._pools.append((pool, value))
        # A hybrid's recurrent state pools: a slot per running request and the scratch slot.
        self.num_slots = options.max_num_seqs + 1 if manifest.states else 0
        self._states = []
        for state in manifest.states:
            pool = np.empty((self.num_slots, *state.shape), np.float32)
            pool.fill(0)  # touched now, as the KV pools are, not on a request's first step
            self._states.append((pool, ort.OrtValue.ortvalue_from_numpy(pool)))
        self._steps: dict[tuple[int, int, int, int], _StepBuffers] = {}
        self._last: _StepBuffers | None = None  # the step last run

    def _check_graph(self) -> None:
        """Hold the loaded graph's inputs and outputs against the manifest, so an edited manifest
        fails here in one line rather than at the first step."""
        inputs, outputs = self.manifest.graph_types()
        for kind, expected, args in (("input", inputs, self.session.get_inputs()),
                                     ("output", outputs, self.session.get_outputs())):
            graph = {a.name: io.TensorType(_ORT_TYPES.get(a.type, a.type), tuple(a.shape)) for a in args}
            problem = io.disagreement(kind, graph, expected)
            if problem:
                raise EngineError(f"engine {self.dir}: {self.files.model.name} does not match the manifest "
                                  f"({problem}); rebuild it with `llmc build`")

    def _pool_blocks(self, blocks: int | None, budget: int | None) -> int:
        per_block = self.kv.block_bytes
        option, value = ("kv_cache_blocks", blocks) if blocks is not None else ("kv_cache_bytes", budget)
        if blocks is None:
            budget = DEFAULT_KV_CACHE_BYTES if budget is None else budget
            if budget < 2 * per_block:
                raise LlmcError(f"kv_cache_bytes {budget} holds fewer than 2 blocks of {per_block} bytes; raise it")
            # No point in more than a full context for 64 sequences.
            cap = 64 * self.context_blocks + 1
            blocks = int(min(budget // per_block, cap))
        import psutil

        # The pool is zero-filled at load: one larger than free memory swaps or gets the process killed.
        available = psutil.virtual_memory().available
        if blocks * per_block > available:
            raise LlmcError(f"{option} {value} makes a KV pool of {blocks * per_block / 2**20:,.1f} MiB ({blocks} "
                            f"blocks of {per_block} bytes) but this machine has {available / 2**20:,.1f} MiB "
                            f"available; lower {option}")
        return blocks

    @property
    def kv_bytes(self) -> int:
        return sum(pool.nbytes for pool, _ in self._pools)

    @property
    def state_bytes(self) -> int:
        """The recurrent state pools' bytes (a hybrid's; 0 for a transformer)."""
        return sum(pool.nbytes for pool, _ in self._states)

    def pool(self, layer: int) -> np.ndarray:
        """The numpy view of a layer's cache pool (shares memory with the session's buffer)."""
        return self._pools[layer][0]

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, past_lens: np.ndarray,
                query_lens: np.ndarray, block_tables: np.ndarray, logits_indices=None,
                state_slots: np.ndarray | None = None) -> np.ndarray:
        """One step; returns logits [N, V], row n for the token logits_indices[n] names in the step's
        flattened [B*S] token grid (row b, token j is b*S + j). None: each row's last valid token
        (b*S + query_lens[b] - 1), so N = B; empty: none, N = 0. A padding token's logits mean
        nothing. The logits buffer is reused by the next step of the same shape: copy what must
        outlive it. A hybrid's rows use `state_slots` (default: slots 1 to B)."""
        batch, seq = input_ids.shape
        step = self._bound(batch, seq, block_tables.shape[1], logits_indices)
        for name, value in ((io.INPUT_IDS, input_ids), (io.POSITION_IDS, position_ids), (io.PAST_LENS, past_lens),
                            (io.QUERY_LENS, query_lens), (io.BLOCK_TABLES, block_tables)):
            np.copyto(step.inputs[name], value, casting="unsafe")
        if self.num_slots:
            slots = np.arange(1, batch + 1) if state_slots is None else state_slots
            np.copyto(step.inputs[io.STATE_SLOTS], slots, casting="unsafe")
        if logits_indices is None:
            np.add(step.last_of_row, query_lens, out=step.inputs[io.LOGITS_INDICES])
        return self._run(step)

    def forward_rows(self, rows: list[Row], seq: int | None = None, logits_indices=None) -> np.ndarray:
        """`forward` of `pack(rows, seq)`, the rows written straight into the step's bound arrays:
        a decode step's inputs are a few scalars, and building them as arrays first (then copying)
        took a measurable share of a batch-1 step (docs/attention_cpu.md)."""
        seq = max(len(r.tokens) for r in rows) if seq is None else seq
        width = max(len(r.block_table) for r in rows)
        # Tables padded (with the scratch block) to a multiple of TABLE_STEP blocks: a step's shape,
        # and so its bound buffers and ONNX Runtime's plan for it, then change every TABLE_STEP
        # blocks of context instead of every block, and steps that alternate row lengths
        # (speculation) find their shapes bound; a new shape's first run costs ~0.2 ms.
        width = max(width, min(-(-width // TABLE_STEP) * TABLE_STEP, self.context_blocks))
        step = self._bound(len(rows), seq, width, logits_indices)
        fill(rows, step.inputs, step.inputs[io.LOGITS_INDICES] if logits_indices is None else None)
        return self._run(step)

    def greedy_tokens(self, logits: np.ndarray) -> np.ndarray | None:
        """Each row's argmax of `logits`, as the graph computed it, when they are the last step's
        logits and the graph has the greedy_tokens output; else None."""
        step = self._last
        return step.greedy if step is not None and logits is step.logits else None

    def _bound(self, batch: int, seq: int, width: int, logits_indices) -> "_StepBuffers":
        """The step's buffers, with logits_indices written unless None (each row's last valid token,
        which the caller writes)."""
        if logits_indices is None:
            return self._step_buffers(batch, seq, width, batch)
        logits_indices = checked_indices(logits_indices, batch, seq)
        step = self._step_buffers(batch, seq, width, len(logits_indices))
        np.copyto(step.inputs[io.LOGITS_INDICES], logits_indices, casting="unsafe")
        return step

    def _run(self, step: "_StepBuffers") -> np.ndarray:
        self._last = step
        self.session.run_with_iobinding(step.binding)
        return step.logits

    def _step_buffers(self, batch: int, seq: int, width: int, num_logits: int) -> "_StepBuffers":
        """Input and logits buffers for a step shape, each shape with its own IOBinding: steps that
        alternate shapes (decode and prefill, plain and speculative) bind nothing, they only fill
        the bound arrays in place."""
        key = (batch, seq, width, num_logits)
        step = self._steps.get(key)
        if step is None:
            if len(self._steps) >= 16:  # shapes come and go with the batch; keep the recent ones
                self._steps.pop(next(iter(self._steps)))
            ort = _import_ort()
            sizes = {io.BATCH: batch, io.SEQ: seq, io.MAX_BLOCKS: width, io.NUM_LOGITS: num_logits}
            step = self._steps[key] = _StepBuffers(
                inputs={name: np.zeros([sizes[d] for d in io.STEP_SHAPES[name]], dtype)
                        for name, dtype in io.STEP_INPUTS.items()} |
                       ({io.STATE_SLOTS: np.zeros(batch, io.STATE_SLOTS_TYPE)} if self.num_slots else {}),
                logits=np.empty((num_logits, self.manifest.logits_width), np.float32),
                greedy=np.empty(num_logits, np.int64) if self.io.greedy_tokens else None,
                last_of_row=np.arange(batch, dtype=np.int64) * seq - 1,
                binding=self.session.io_binding())
            for (pool_in, pool_out), (_, value) in zip([*self.io.caches(), *self.io.states()],
                                                       [*self._pools, *self._states]):
                step.binding.bind_ortvalue_input(pool_in, value)
                step.binding.bind_ortvalue_output(pool_out, value)
            for name, array in step.inputs.items():
                step.binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
            for name, array in ((io.LOGITS, step.logits), (io.GREEDY_TOKENS, step.greedy)):
                if array is not None:
                    step.binding.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
        return step


@dataclass
class _StepBuffers:
    inputs: dict[str, np.ndarray]  # in io.STEP_INPUTS order (a hybrid's state_slots last)
    logits: np.ndarray
    greedy: np.ndarray | None  # each logits row's argmax, when the graph returns it
    last_of_row: np.ndarray  # b*S - 1 per row: + query_lens is each row's last valid token
    binding: object  # the session's IOBinding of these arrays and the pools


def _read_weights(opts, path: Path, name: str, sha256: str | None = None):
    """Hand ORT the weights file read into anonymous memory advised to use huge pages, for it to
    use in place. ORT would otherwise map the file with 4 KB pages, and every decode step streams
    all the weights: a TLB walk per 4 KB, which costs a cold prefill on llmc's packed GEMM
    (docs/attention_cpu.md). Resident memory is the same either way: the mapped file's pages end
    up resident too. With `sha256` (the manifest's, left by open_engine) the file is hashed as it
    is read, a chunk behind, on a second thread: one pass over it, not two."""
    import hashlib
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    size = path.stat().st_size
    if size == 0:
        return None
    # Private: a shared anonymous map is shmem, which got no huge pages here (docs/streamed_build.md).
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    view, digest, step = memoryview(buffer), hashlib.sha256(), 64 << 20
    with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(1) as hasher:
        pending = None
        for start in range(0, size, step):
            chunk = view[start:start + step]
            f.readinto(chunk)
            if sha256 is not None:
                if pending is not None:
                    pending.result()
                pending = hasher.submit(digest.update, chunk)  # hashlib lets go of the GIL
        if pending is not None:
            pending.result()
    if sha256 is not None and digest.hexdigest() != sha256:
        raise EngineError(f"engine {path.parent}: checksum mismatch for {path.name} (file changed or corrupt); "
                          "rebuild it with `llmc build`")
    opts.add_external_initializers_from_files_in_memory([name], [np.frombuffer(buffer, np.uint8)], [size])
    opts.add_session_config_entry("session.use_external_initializer_file_buffers_directly", "1")
    return buffer  # the session reads it in place: it lives as long as the engine


def _physical_cores() -> int:
    try:
        import psutil

        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:
        return os.cpu_count() or 1


backends.register("onnxruntime", Engine)  # the runtime's own backend, always there with load_engine
