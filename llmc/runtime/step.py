"""A step's rows and the input arrays every backend takes for them (llmc.contract.graph_io): the
runtime builds `Row`s, and ONNX Runtime's Engine and TensorRT's TrtEngine both turn them into
the same arrays and check a step's logits_indices the same way. Backend-neutral, so a backend
imports this rather than another backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmc.contract import graph_io as io
from llmc.errors import RequestError


@dataclass
class Row:
    """One row of a step: the tokens it computes, the tokens already in its cache, its block
    table, and the position its padding slots carry (default: its last new token's)."""
    tokens: list[int]
    past: int
    block_table: list[int]
    pad_position: int | None = None
    slot: int = io.SCRATCH_SLOT  # a hybrid's state slot


def pack(rows: list[Row], seq: int | None = None):
    """The step inputs (input_ids, position_ids, past_lens, query_lens, block_tables) of rows,
    padded to the longest row (or to `seq`); a hybrid's state_slots are not among them."""
    seq = max(len(r.tokens) for r in rows) if seq is None else seq
    inputs = {name: np.empty(dims, io.STEP_INPUTS[name]) for name, dims in (
        (io.INPUT_IDS, (len(rows), seq)), (io.POSITION_IDS, (len(rows), seq)), (io.PAST_LENS, len(rows)),
        (io.QUERY_LENS, len(rows)), (io.BLOCK_TABLES, (len(rows), max(len(r.block_table) for r in rows))))}
    fill(rows, inputs)
    return tuple(inputs.values())


def fill(rows: list[Row], inputs: dict[str, np.ndarray], last: np.ndarray | None = None) -> None:
    """Write rows into a step's input arrays (shaped for them), and each row's last valid token's
    index in the token grid into `last`. Padding tokens are 0 and carry the row's pad position; a
    short row's block-table tail is the scratch block, which reads nothing. Element by element:
    right after a step's graph run the caches hold none of numpy's code, and each numpy routine
    touched costs microseconds then (docs/attention_cpu.md)."""
    ids, positions, past, lens, tables = (inputs[name] for name in (
        io.INPUT_IDS, io.POSITION_IDS, io.PAST_LENS, io.QUERY_LENS, io.BLOCK_TABLES))
    slots = inputs.get(io.STATE_SLOTS)
    seq, max_width = ids.shape[1], tables.shape[1]
    for i, r in enumerate(rows):
        n, width = len(r.tokens), len(r.block_table)
        past[i], lens[i] = r.past, n
        if n == seq == 1:  # a decode row
            ids[i, 0], positions[i, 0] = r.tokens[0], r.past
        else:
            ids[i, :n], ids[i, n:] = r.tokens, 0
            positions[i, :n] = np.arange(r.past, r.past + n)
            positions[i, n:] = r.past + n - 1 if r.pad_position is None else r.pad_position
        tables[i, :width] = r.block_table
        if slots is not None:
            slots[i] = r.slot
        if width < max_width:
            tables[i, width:] = io.SCRATCH_BLOCK
        if last is not None:
            last[i] = i * seq + n - 1


def checked_indices(indices, batch: int, seq: int) -> np.ndarray:
    """`indices` as a 1-D integer array inside the step's [batch*seq] token grid, else a
    RequestError: ONNX Runtime would fail with a multi-line Gather error (or wrap a negative one)."""
    if type(indices) is list and indices and all(type(i) is int for i in indices):
        # The runtime's own lists (a verify step's): numpy's min and max on a few ints, run cold
        # after a step, cost more than the Python around them.
        array, low, high = np.array(indices, np.int64), min(indices), max(indices)
    else:
        array = np.asarray(indices)
        if array.shape == (0,):  # none wanted (a prefill chunk that samples nothing): [] is float to numpy
            return array.astype(np.int64)
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise RequestError(f"logits_indices must be a 1-D array of integer indices into {_grid(batch, seq)}; "
                               f"got {array.ndim}-D {array.dtype}")
        low, high = int(array.min()), int(array.max())
    if low < 0 or high >= batch * seq:
        raise RequestError(f"logits_indices holds {low if low < 0 else high}, outside {_grid(batch, seq)}: "
                           f"each index must be 0 to {batch * seq - 1}")
    return array


def _grid(batch: int, seq: int) -> str:
    return f"the step's {batch}x{seq} token grid (row b, token j is b*{seq} + j)"
