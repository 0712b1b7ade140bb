"""A checkpoint's weights, read a tensor (or a range of its rows) at a time.

A model folder's `model.safetensors`, or the shards `model.safetensors.index.json` names, is opened
by reading each shard's header: names, dtypes, shapes and byte ranges. Nothing else is read until a
pass asks for a tensor, and then with `pread` into a fresh array: the page cache holds the file,
not this process, so a build's resident memory is what its passes hold, not the checkpoint's size.
A shard shorter than its header says (a truncated download) is refused when it is opened.

An MXFP4 checkpoint (gpt-oss as released) stores each expert stack as `<stack>_blocks` (uint8
[E, N, K / 32, 16]: two 4-bit codes a byte) and `<stack>_scales` (uint8 [E, N, K / 32]); they are
read as the bytes they are, and `KernelLayout` presents the stack they make.

A folder with PyTorch `.bin` weights only is read whole by transformers (`StateDictWeights`): those
files are pickles that cannot be read a tensor at a time without loading them.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from llmc.errors import ModelError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16)}
MXFP4_PARTS = ("_blocks", "_scales")  # the uint8 tensors of an MXFP4 stack, by their names' ends
_MAX_HEADER = 100 << 20  # safetensors' own limit on a header's size
READ_CHUNK = 16 << 20  # bytes read a time


@dataclass(frozen=True)
class StoredTensor:
    path: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file
    nbytes: int


class Weights:
    """name -> float32 arrays, as the checkpoint stores them (transformers' parameter names)."""

    def names(self) -> list[str]:
        raise NotImplementedError

    def has(self, name: str) -> bool:
        return name in self.names()

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) of tensor `name` (its first axis) as float32 (an MXFP4 part: its bytes)."""
        raise NotImplementedError

    def mxfp4(self, name: str, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
        """Experts [start, stop) of stack `name` as MXFP4 codes and scales where the checkpoint
        stores it so (KernelLayout), else None."""
        return None

    def mxfp4_parameters(self) -> int:
        """The weights the checkpoint stores in MXFP4 stacks (which an engine keeps so)."""
        return 0

    def note(self) -> str | None:
        """One line for the build's progress on what of the checkpoint it leaves out (TextModel)."""
        return None


class SafetensorsWeights(Weights):
    def __init__(self, folder: Path):
        self.folder = folder
        self.tensors: dict[str, StoredTensor] = {}
        for shard in _shards(folder):
            self.tensors.update(_read_header(shard))

    def names(self) -> list[str]:
        return list(self.tensors)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def parameter_count(self) -> int:
        """Weights stored (an MXFP4 stack's: two a byte of its blocks, its scales none)."""
        per_element = {MXFP4_PARTS[0]: 2, MXFP4_PARTS[1]: 0}
        return sum(int(np.prod(t.shape, dtype=np.int64)) * (per_element.get(name[-7:], 1) if t.dtype == np.uint8 else 1)
                   for name, t in self.tensors.items())

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        t = self.tensors[name]
        rows = t.shape[0] if t.shape else 1
        stop = rows if stop is None else stop
        row_bytes = t.nbytes // max(rows, 1)
        if t.dtype == np.uint8:  # an MXFP4 part: its bytes
            raw = np.empty((stop - start, *t.shape[1:]), np.uint8)
            with open(t.path, "rb", buffering=0) as f:
                f.seek(t.offset + start * row_bytes)
                _read_into(f, memoryview(raw.reshape(-1)), t.path, name)
            return raw
        values = np.empty((stop - start, *t.shape[1:]) if t.shape else (), np.float32)
        flat = values.reshape(-1)
        # Read and widened a chunk at a time: the only whole array is the float32 result.
        step = max(1, READ_CHUNK // max(t.dtype.itemsize, 1))
        buffer = np.empty(0 if t.dtype == np.float32 else min(step, flat.size), t.dtype)
        with open(t.path, "rb", buffering=0) as f:
            f.seek(t.offset + start * row_bytes)
            for a in range(0, flat.size, step):
                # float32 is read where it goes; the 16-bit types through the buffer
                chunk = flat[a:a + step] if t.dtype == np.float32 else buffer[:min(step, flat.size - a)]
                _read_into(f, memoryview(chunk.view(np.uint8)), t.path, name)
                if t.dtype == DTYPES["BF16"]:  # a bfloat16 is a float32's high half: widened by a shift
                    np.left_shift(chunk.view(np.uint16), 16, out=flat[a:a + len(chunk)].view(np.uint32),
                                  dtype=np.uint32)
                elif t.dtype != np.float32:
                    flat[a:a + len(chunk)] = chunk
                if not np.isfinite(flat[a:a + len(chunk)]).all():
                    raise ModelError(f"tensor {name}{layer_of(name)} holds NaN or Inf values; the checkpoint is "
                                     "damaged: download it again or fix the weights")
        return values


def _read_into(f, view: memoryview, path: Path, name: str) -> None:
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            raise ModelError(f"{path.name} ends inside tensor {name}; the file is truncated: "
                             "download the checkpoint again")
        done += got


class StateDictWeights(Weights):
    """Weights already in memory (a loaded transformers model's state dict)."""

    def __init__(self, state_dict):
        self.arrays = {name: t.detach().float().numpy() for name, t in state_dict.items()}

    def names(self) -> list[str]:
        return list(self.arrays)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.arrays[name].shape)

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        array = self.arrays[name]
        return array if array.ndim == 0 else array[start:stop]


def has_safetensors(folder: Path) -> bool:
    """Whether the folder's weights are safetensors (else SafetensorsWeights has nothing to open)."""
    return (folder / INDEX_FILE).is_file() or (folder / SINGLE_FILE).is_file()


def layer_of(name: str) -> str:
    """' (layer N)' for a tensor of a decoder layer."""
    parts = name.split(".")
    if "layers" in parts and parts.index("layers") + 1 < len(parts):
        return f" (layer {parts[parts.index('layers') + 1]})"
    return ""


def _shards(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if not index.is_file():
        return [folder / SINGLE_FILE]
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelError(f"cannot read {index}: {type(exc).__name__}: {exc}; the checkpoint's index is damaged: "
                         "download it again") from None
    missing = [f for f in files if not (folder / f).is_file()]
    if missing:
        raise ModelError(f"{INDEX_FILE} names {missing[0]}, which is not in {folder}"
                         f"{f' (nor {len(missing) - 1} more)' if len(missing) > 1 else ''}; the download is incomplete")
    return [folder / f for f in files]


def _read_header(path: Path) -> dict[str, StoredTensor]:
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if not 0 < length <= min(_MAX_HEADER, size - 8):
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as exc:
        raise ModelError(f"{path.name} is not a readable safetensors file ({exc}); download it again") from None
    tensors, data_start = {}, 8 + length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"{path.name}: the header entry of {name} is malformed ({exc}); download it again") from None
        if dtype_name == "U8" and name.endswith(MXFP4_PARTS):
            dtype = np.dtype(np.uint8)
        elif dtype_name not in DTYPES:
            raise ModelError(f"{path.name}: tensor {name} is {dtype_name}; llmc reads float32, float16 and bfloat16 "
                             "checkpoints (a pre-quantized checkpoint is not supported: use the original weights)")
        else:
            dtype = DTYPES[dtype_name]
        if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise ModelError(f"{path.name}: tensor {name}'s byte range does not match its shape {list(shape)}; "
                             "the file is damaged: download it again")
        if data_start + end > size:
            raise ModelError(f"{path.name} is {size:,} bytes but its header needs {data_start + end:,}: the file is "
                             "truncated (an interrupted download?); download it again")
        tensors[name] = StoredTensor(path, dtype, shape, data_start + begin, end - begin)
    return tensors


class TextModel(Weights):
    """A multimodal checkpoint's text model (frontend.Wrapper): `<text_prefix>X` read as
    `<model_prefix>X`, the parts llmc leaves out (`skipped`: tensor prefix -> what it is) hidden and
    counted, for the build's note and so the size check counts the text model alone; every other
    tensor (the LM head) as stored."""

    def __init__(self, stored: Weights, text_prefix: str, model_prefix: str, skipped: tuple[tuple[str, str], ...]):
        self.stored = stored
        self.renamed: dict[str, str] = {}  # the text model's name -> the stored one
        self.kept: dict[str, None] = {}  # stored as the text model names them (the LM head), in order
        self.skipped: dict[str, tuple[int, int]] = {}  # what -> (tensors, parameters), in `skipped`'s order
        for name in stored.names():
            part = next((what for prefix, what in skipped if name.startswith(prefix)), None)
            if part is not None:
                tensors, parameters = self.skipped.get(part, (0, 0))
                self.skipped[part] = tensors + 1, parameters + int(np.prod(stored.shape(name), dtype=np.int64))
            elif name.startswith(text_prefix):
                self.renamed[model_prefix + name[len(text_prefix):]] = name
            else:
                self.kept[name] = None
        self.skipped = {what: self.skipped[what] for _, what in skipped if what in self.skipped}

    def names(self) -> list[str]:
        return [*self.renamed, *self.kept]

    def has(self, name: str) -> bool:
        return name in self.renamed or name in self.kept

    def _stored(self, name: str) -> str:
        if name in self.renamed:
            return self.renamed[name]
        if name in self.kept:
            return name
        raise KeyError(name)  # a left-out part's tensor, or one under the text model's name only

    def shape(self, name: str) -> tuple[int, ...]:
        return self.stored.shape(self._stored(name))

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        return self.stored.read(self._stored(name), start, stop)

    def parameter_count(self) -> int:
        return self.stored.parameter_count() - sum(p for _, p in self.skipped.values())

    def note(self) -> str | None:
        """One line on what the build leaves out, or None where the checkpoint holds the text model alone."""
        if not self.skipped:
            return None
        parts = [f"{what} ({tensors} tensor{'s' * (tensors != 1)}, {parameters:,} parameters)"
                 for what, (tensors, parameters) in self.skipped.items()]
        listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
        return f"skipping {listed}: llmc builds the text model"


class ExpertStacks(Weights):
    """A mixture-of-experts checkpoint as transformers 5 names its parameters: each layer's experts
    stacked, `experts.gate_up_proj` [E, 2 inter, hidden] (gate rows, then up rows) and
    `experts.down_proj` [E, hidden, inter], made from the per-expert Linears the hub ships
    (`experts.{e}.gate_proj` / `up_proj` / `down_proj`, or `w1` / `w3` / `w2`), after the
    family's renamings as transformers' own conversion mapping lists them (Mixtral's
    `block_sparse_moe` -> `mlp`, Granite MoE's stacked `input_linear`, PhiMoE's `gate` -> `router`).
    Rows of a stacked tensor are experts, so a pass reads a layer's experts a range at a time;
    every other tensor is the stored one."""

    PER_EXPERT = re.compile(r"(.*)\.experts\.(\d+)\.(\w+)\.weight$")
    GATE_UP = (("gate_proj", "up_proj"), ("w1", "w3"))
    DOWN = ("down_proj", "w2")

    def __init__(self, stored: Weights, renames: list[tuple[re.Pattern, str]]):
        self.stored, self.renames = stored, renames
        self.stacks: dict[str, list[list[str]]] = {}  # stacked name -> per expert, the stored rows to join
        self.renamed: dict[str, str] = {}
        by_layer: dict[str, dict[int, dict[str, str]]] = {}
        for name in stored.names():
            if m := self.PER_EXPERT.match(name):
                by_layer.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = name
            elif (renamed := self._rename(name)) != name:
                self.renamed[renamed] = name
        for prefix, experts in by_layer.items():
            ids = sorted(experts)
            if ids != list(range(len(ids))):
                raise ModelError(f"the checkpoint's experts under {prefix} are numbered {ids[0]}..{ids[-1]} with gaps; "
                                 "the download is incomplete")
            target = self._rename(f"{prefix}.experts")
            for parts, stacked in ((gu, "gate_up_proj") for gu in self.GATE_UP):
                if all(p in experts[e] for e in ids for p in parts):
                    self.stacks[f"{target}.{stacked}"] = [[experts[e][p] for p in parts] for e in ids]
            for part in self.DOWN:
                if all(part in experts[e] for e in ids):
                    self.stacks[f"{target}.down_proj"] = [[experts[e][part]] for e in ids]

    def _rename(self, name: str) -> str:
        for pattern, new in self.renames:
            name = pattern.sub(new, name)
        return name

    def names(self) -> list[str]:
        consumed = {n for rows in self.stacks.values() for parts in rows for n in parts} | set(self.renamed.values())
        return [n for n in self.stored.names() if n not in consumed] + list(self.renamed) + list(self.stacks)

    def has(self, name: str) -> bool:
        return name in self.stacks or name in self.renamed or self.stored.has(name)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.stacks:
            first = [self.stored.shape(n) for n in self.stacks[name][0]]
            return (len(self.stacks[name]), sum(s[0] for s in first), *first[0][1:])
        return self.stored.shape(self.renamed.get(name, name))

    def parameter_count(self) -> int:
        return self.stored.parameter_count()

    def note(self) -> str | None:
        return self.stored.note()

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        if name not in self.stacks:
            return self.stored.read(self.renamed.get(name, name), start, stop)
        rows = self.stacks[name][start:stop]
        out = np.empty((len(rows), *self.shape(name)[1:]), np.float32)
        for e, parts in enumerate(rows):
            at = 0
            for part in parts:
                block = self.stored.read(part)
                out[e, at:at + len(block)] = block
                at += len(block)
        return out


class KernelLayout(Weights):
    """Stacked experts stored transposed or with gate and up interleaved (gpt-oss), read in the
    layout of llmc's experts op (compiler/experts.py, to_kernel_layout); every other tensor as stored.
    A stack stored in MXFP4 (its `_blocks` and `_scales`; rows are output features, whatever the
    float stacks' transposition) is the stack they make: `read` dequantizes it, `mxfp4` gives its
    codes and scales, rows in the op's order."""

    STACKS = ("gate_up_proj", "gate_up_proj_bias", "down_proj")

    def __init__(self, stored: Weights, transposed: bool, interleaved: bool):
        self.stored, self.transposed, self.interleaved = stored, transposed, interleaved
        blocks, scales = MXFP4_PARTS
        self.mxfp4_stacks = {name[:-len(blocks)] for name in stored.names()
                             if name.endswith(blocks) and self._stack(name[:-len(blocks)]) and
                             stored.has(name[:-len(blocks)] + scales)}

    def _stack(self, name: str) -> str | None:
        last = name.rsplit(".", 2)
        return last[-1] if len(last) == 3 and last[-2] == "experts" and last[-1] in self.STACKS else None

    def names(self) -> list[str]:
        parts = {stack + part for stack in self.mxfp4_stacks for part in MXFP4_PARTS}
        return [n for n in self.stored.names() if n not in parts] + sorted(self.mxfp4_stacks)

    def has(self, name: str) -> bool:
        return name in self.mxfp4_stacks or self.stored.has(name)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.mxfp4_stacks:
            experts, rows, blocks, _ = self.stored.shape(name + MXFP4_PARTS[0])
            return experts, rows, 32 * blocks
        shape = self.stored.shape(name)
        return (shape[0], shape[2], shape[1]) if self.transposed and self._stack(name) in self.STACKS[::2] else shape

    def parameter_count(self) -> int:
        return self.stored.parameter_count()

    def note(self) -> str | None:
        return self.stored.note()

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        from llmc.compiler.experts import to_kernel_layout

        if name in self.mxfp4_stacks:
            from llmc.plugins.cpu.quant import dequantize_mxfp4

            return np.stack([dequantize_mxfp4(b, s) for b, s in zip(*self.mxfp4(name, start, stop))])
        w = self.stored.read(name, start, stop)
        stack = self._stack(name)
        return w if stack is None else to_kernel_layout(stack, w, self.transposed, self.interleaved)

    def mxfp4_parameters(self) -> int:
        return sum(int(np.prod(self.shape(name), dtype=np.int64)) for name in self.mxfp4_stacks)

    def mxfp4(self, name: str, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
        from llmc.compiler.experts import to_kernel_layout

        if name not in self.mxfp4_stacks:
            return None
        stack = self._stack(name)
        # The rows of the codes are the stack's rows already: only gate and up are unwoven.
        return tuple(to_kernel_layout(stack, self.stored.read(name + part, start, stop), False, self.interleaved)
                     for part in MXFP4_PARTS)


def with_expert_stacks(stored: Weights, model_type: str) -> Weights:
    """`stored` as a mixture-of-experts model of `model_type` names its parameters (ExpertStacks)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    renames = [(re.compile(source), target[0] if len(target) == 1 else target[i])
               for t in get_checkpoint_conversion_mapping(model_type) or [] if type(t) is WeightRenaming
               for i, source in enumerate(t.source_patterns) for target in [t.target_patterns]]
    return ExpertStacks(stored, renames)
