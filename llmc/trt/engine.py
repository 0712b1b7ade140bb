"""The TensorRT runtime backend: `TrtEngine`, with the ONNX Runtime `Engine`'s interface
(`forward` -> logits, `spec`, `block_size`, `max_context`, `num_blocks`, `pool`), so `LLM`, the
scheduler, the sampler and `llmc bench` run a plan unchanged.

- The plan and llmc's plugin library load into one TensorRT runtime; a plan from another GPU
  architecture or TensorRT version is refused in one line (plan.check_plan).
- The KV pools live in device memory, one tensor per layer, bound as both `kv_cache.i` and
  `kv_cache_out.i`: the plugin writes in place.
- One execution context per optimization profile; a step runs under the first profile that
  holds its shape (llmc.contract.profiles.choose).
- Decode steps are replayed from CUDA graphs, one per batch bucket: the step is padded to its
  bucket (`pad_decode`: rows with no tokens, whose K/V go to the scratch block and whose
  logits nobody reads) and copied into the graph's static inputs.

Device memory is torch's (the GPU install has it); nothing here is imported on the CPU path.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from llmc.contract import graph_io as io
from llmc.contract.engine_dir import EngineFiles, open_engine
from llmc.contract.options import RuntimeOptions
from llmc.contract.profiles import choose
from llmc.errors import LlmcError
from llmc.runtime.step import Row, checked_indices, pack

DEVICE_MEMORY_SHARE = 0.9  # of the GPU memory free after loading the plan, for the KV pools by default


def buckets(max_rows: int) -> list[int]:
    """The decode batch sizes captured as CUDA graphs: powers of two up to `max_rows`, and it."""
    sizes = [1 << i for i in range(max_rows.bit_length()) if 1 << i < max_rows]
    return sizes + [max_rows]


def pad_decode(arrays: dict[str, np.ndarray], rows: int, width: int) -> dict[str, np.ndarray]:
    """A decode step (S = 1) padded to `rows` rows and a block table `width` blocks wide, the
    shape of a captured graph. Added rows have no token (query_lens 0): their K/V go to the
    scratch block, their table is the scratch block, and their logits (after the step's own N)
    are read by nobody. The step's logits are the first N rows of the padded step's."""
    batch = arrays[io.INPUT_IDS].shape[0]
    if arrays[io.INPUT_IDS].shape[1] != 1 or batch > rows or arrays[io.BLOCK_TABLES].shape[1] > width:
        raise ValueError(f"cannot pad a step of shape {arrays[io.INPUT_IDS].shape} and table width "
                         f"{arrays[io.BLOCK_TABLES].shape[1]} to {rows} rows x {width} blocks")
    padded = {}
    for name in (io.INPUT_IDS, io.POSITION_IDS, io.PAST_LENS, io.QUERY_LENS):
        value = arrays[name]
        padded[name] = np.zeros((rows, *value.shape[1:]), value.dtype)
        padded[name][:batch] = value
    table = arrays[io.BLOCK_TABLES]
    padded[io.BLOCK_TABLES] = np.full((rows, width), io.SCRATCH_BLOCK, table.dtype)
    padded[io.BLOCK_TABLES][:batch, :table.shape[1]] = table
    indices = arrays[io.LOGITS_INDICES]
    padded[io.LOGITS_INDICES] = np.concatenate([indices, np.arange(len(indices), rows, dtype=indices.dtype)])
    return padded


class TrtEngine:
    def __init__(self, engine: str | Path | EngineFiles, options: RuntimeOptions | None = None):
        from llmc.trt import plan

        options = options or RuntimeOptions()
        files = engine if isinstance(engine, EngineFiles) else open_engine(engine,
                                                                           verify_checksums=options.verify_checksums)
        manifest = self.manifest = files.manifest
        self.files, self.dir = files, files.root
        self.spec, self.kv, self.io = manifest.model_spec, manifest.kv_cache, manifest.io
        self.block_size, self.max_context = self.kv.block_size, manifest.max_context
        self.num_threads = 1  # host threads: the GPU does the work
        backend = manifest.backend
        tools = plan.toolchain()
        plan.check_plan(backend, tools)
        import torch

        trt = tools.trt
        self._torch, self._trt = torch, trt
        self._logger = trt.Logger(trt.Logger.WARNING)
        if trt.get_plugin_registry().load_library(str(self.dir / backend.plugin_library)) is None:
            raise LlmcError(f"TensorRT could not load {backend.plugin_library} from {self.dir}; rebuild the engine")
        self._runtime = trt.Runtime(self._logger)
        self._plan = self._runtime.deserialize_cuda_engine((self.dir / manifest.payload.model).read_bytes())
        if self._plan is None:
            raise LlmcError(f"TensorRT could not load the plan of {self.dir}; rebuild it with llmc build --backend "
                            "tensorrt")
        self.profiles = backend.profiles
        self._stream = torch.cuda.Stream()
        self._contexts = []
        for i, _ in enumerate(self.profiles):
            context = self._plan.create_execution_context()
            context.set_optimization_profile_async(i, self._stream.cuda_stream)
            self._contexts.append(context)
        self.num_blocks = self._pool_blocks(options)
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[self.kv.dtype]
        self._pools = [torch.zeros(self.kv.pool_shape(self.num_blocks), dtype=dtype, device="cuda")
                       for _ in range(self.spec.num_layers)]
        for context in self._contexts:
            for (cache_in, cache_out), pool in zip(self.io.caches(), self._pools):
                context.set_input_shape(cache_in, tuple(pool.shape))
                context.set_tensor_address(cache_in, pool.data_ptr())
                context.set_tensor_address(cache_out, pool.data_ptr())  # the plugin writes in place
        self._graphs: dict[int, tuple] = {}  # decode bucket -> (CUDA graph, static inputs, static logits)
        self._width = -(-self.max_context // self.block_size)

    def _pool_blocks(self, options: RuntimeOptions) -> int:
        largest = min(p.num_blocks.max for p in self.profiles)
        if options.kv_cache_blocks is not None:
            blocks = options.kv_cache_blocks
        else:
            free, _ = self._torch.cuda.mem_get_info()
            budget = options.kv_cache_bytes if options.kv_cache_bytes is not None else free * DEVICE_MEMORY_SHARE
            blocks = int(budget // self.kv.block_bytes)
        if not 2 <= blocks <= largest:
            raise LlmcError(f"a KV pool of {blocks} blocks is outside what this plan's profiles hold (2 to "
                            f"{largest}); set kv_cache_blocks or kv_cache_bytes within it, or rebuild with a longer "
                            "--max-context")
        return blocks

    @property
    def kv_bytes(self) -> int:
        return sum(pool.numel() * pool.element_size() for pool in self._pools)

    def pool(self, layer: int) -> np.ndarray:
        """A host copy of a layer's pool (for tests and tools; the pool itself is on the GPU)."""
        pool = self._pools[layer]
        return pool.view(self._torch.int16).cpu().numpy().view(self.kv.numpy_dtype)

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, past_lens: np.ndarray,
                query_lens: np.ndarray, block_tables: np.ndarray, logits_indices=None) -> np.ndarray:
        """One step, as the ONNX Runtime Engine's `forward` (llmc.runtime.engine)."""
        batch, seq = input_ids.shape
        if logits_indices is None:
            logits_indices = np.arange(batch, dtype=np.int64) * seq + np.asarray(query_lens, np.int64) - 1
        else:  # the ONNX Runtime engine's check: one line, not a CUDA fault
            logits_indices = checked_indices(logits_indices, batch, seq)
        arrays = {io.INPUT_IDS: input_ids, io.POSITION_IDS: position_ids, io.PAST_LENS: past_lens,
                  io.QUERY_LENS: query_lens, io.BLOCK_TABLES: block_tables, io.LOGITS_INDICES: logits_indices}
        arrays = {name: np.ascontiguousarray(value, io.STEP_INPUTS[name]) for name, value in arrays.items()}
        count = len(arrays[io.LOGITS_INDICES])
        if seq == 1 and count == batch and batch <= self.profiles[0].batch.max:
            return self._decode(arrays)[:count]
        index = choose(self.profiles, batch=batch, seq=seq, num_logits=count,
                       max_blocks=block_tables.shape[1], num_blocks=self.num_blocks)
        with self._torch.cuda.stream(self._stream):  # copies, step and read-back in one stream's order
            inputs = {name: self._torch.from_numpy(value).to("cuda") for name, value in arrays.items()}
            logits = self._torch.empty((count, self.spec.vocab_size), dtype=self._torch.float32, device="cuda")
            self._bind(self._contexts[index], inputs, logits)
            self._contexts[index].execute_async_v3(self._stream.cuda_stream)
            return logits.cpu().numpy()

    def forward_rows(self, rows: list[Row], seq: int | None = None, logits_indices=None) -> np.ndarray:
        """`forward` of `pack(rows, seq)`, as the ONNX Runtime Engine's."""
        return self.forward(*pack(rows, seq), logits_indices=logits_indices)

    def greedy_tokens(self, logits: np.ndarray) -> None:
        """None: the plan returns logits only (the runtime takes their argmax)."""
        return None

    def _decode(self, arrays: dict[str, np.ndarray]) -> np.ndarray:
        rows = next(b for b in buckets(self.profiles[0].batch.max) if b >= arrays[io.INPUT_IDS].shape[0])
        padded = pad_decode(arrays, rows, self._width)
        graph, inputs, logits = self._graphs.get(rows) or self._capture(rows, padded)
        with self._torch.cuda.stream(self._stream):
            for name, value in padded.items():
                inputs[name].copy_(self._torch.from_numpy(value))
            graph.replay()
            return logits.cpu().numpy()

    def _capture(self, rows: int, padded: dict[str, np.ndarray]):
        """The decode graph of `rows` rows: static inputs and logits bound once, one enqueue to let
        TensorRT set up, then the capture."""
        torch = self._torch
        context = self._contexts[0]  # the decode profile
        with torch.cuda.stream(self._stream):
            inputs = {name: torch.from_numpy(value).to("cuda") for name, value in padded.items()}
            logits = torch.empty((rows, self.spec.vocab_size), dtype=torch.float32, device="cuda")
            self._bind(context, inputs, logits)
            context.execute_async_v3(self._stream.cuda_stream)
        self._stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self._stream):
            context.execute_async_v3(self._stream.cuda_stream)
        self._graphs[rows] = (graph, inputs, logits)
        return self._graphs[rows]

    @staticmethod
    def _bind(context, inputs: dict, logits) -> None:
        for name, tensor in inputs.items():
            context.set_input_shape(name, tuple(tensor.shape))
            context.set_tensor_address(name, tensor.data_ptr())
        context.set_tensor_address(io.LOGITS, logits.data_ptr())
