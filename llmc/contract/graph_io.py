"""The engine graph's interface: the names and types the compiler writes and the runtime binds.

One step of the paged contract (design §4) runs rows of equal padded length S:
  inputs   input_ids [B, S] int64, position_ids [B, S] int64,
           past_lens [B] int32 (tokens already cached per row), query_lens [B] int32 (valid new
           tokens per row), block_tables [B, max_blocks] int32,
           logits_indices [N] int64 (the positions whose logits the step returns, as flat indices
           into the step's [B*S] token grid: row b, token j is b*S + j),
           and per layer the pool kv_cache.{i}
  outputs  logits [N, V] (row n is token logits_indices[n]), and per layer kv_cache_out.{i},
           which the runtime binds to the same buffer as kv_cache.{i}: the cache is written in place;
           optionally last, greedy_tokens [N] int64, each logits row's argmax (numpy's ranking).
The LM head runs on the N chosen tokens only: a prefill asks for each row's last token, a
scoring pass for every position, a speculative step for the k+1 tokens it verifies.
Block 0 of every pool is scratch: padding tokens write there and no sequence is given it.
A row's padding slots of position_ids hold the last position of the row's known sequence, so
the row's largest position id is its length - 1: length-dependent RoPE (longrope) reads it there.

A hybrid's graph (recurrent layers beside attention) also takes state_slots [B] int32, each row's
slot in the state pools, and per recurrent state tensor the pool state.{i} [num_slots, ...],
returned as state_out.{i} (bound to the same buffer). A row whose past_lens is 0 starts from a
zero state; after the step its slot holds the state after its last valid token. Slot 0 is
scratch, as block 0 is.
"""

from __future__ import annotations

from dataclasses import dataclass

INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
PAST_LENS = "past_lens"
QUERY_LENS = "query_lens"
BLOCK_TABLES = "block_tables"
LOGITS_INDICES = "logits_indices"
LOGITS = "logits"
GREEDY_TOKENS = "greedy_tokens"
_CACHE_INPUT = "kv_cache.{}"
_CACHE_OUTPUT = "kv_cache_out.{}"
STATE_SLOTS = "state_slots"
_STATE_INPUT = "state.{}"
_STATE_OUTPUT = "state_out.{}"

# The canonical (exported, cache-free) graph reads only the tokens and their positions.
TOKEN_INPUTS = (INPUT_IDS, POSITION_IDS)
# Every step input with its element type, in the graph's order.
STEP_INPUTS = {INPUT_IDS: "int64", POSITION_IDS: "int64", PAST_LENS: "int32", QUERY_LENS: "int32",
               BLOCK_TABLES: "int32", LOGITS_INDICES: "int64"}
SCRATCH_BLOCK = 0
SCRATCH_SLOT = 0

# Symbolic dimension names in the graph.
BATCH, SEQ, MAX_BLOCKS, NUM_BLOCKS, NUM_LOGITS = "batch", "seq", "max_blocks", "num_blocks", "num_logits"
NUM_SLOTS = "num_slots"
STEP_SHAPES = {INPUT_IDS: (BATCH, SEQ), POSITION_IDS: (BATCH, SEQ), PAST_LENS: (BATCH,), QUERY_LENS: (BATCH,),
               BLOCK_TABLES: (BATCH, MAX_BLOCKS), LOGITS_INDICES: (NUM_LOGITS,)}
# A hybrid's graph also takes each row's state slot (after the pools).
STATE_SLOTS_TYPE, STATE_SLOTS_SHAPE = "int32", (BATCH,)


def cache_input(layer: int) -> str:
    return _CACHE_INPUT.format(layer)


def cache_output(layer: int) -> str:
    return _CACHE_OUTPUT.format(layer)


def caches(num_layers: int) -> list[tuple[str, str]]:
    """(input, output) per layer: the names bound to one buffer."""
    return [(cache_input(i), cache_output(i)) for i in range(num_layers)]


def state_input(index: int) -> str:
    return _STATE_INPUT.format(index)


def state_output(index: int) -> str:
    return _STATE_OUTPUT.format(index)


def is_state(name: str | None) -> bool:
    """Whether `name` is a recurrent state pool, as input or as output."""
    return bool(name) and (name.startswith(_STATE_INPUT[:-2]) or name.startswith(_STATE_OUTPUT[:-2]))


def is_cache(name: str | None) -> bool:
    """Whether `name` is a layer's pool, as input or as output."""
    return bool(name) and (name.startswith(_CACHE_INPUT[:-2]) or name.startswith(_CACHE_OUTPUT[:-2]))


@dataclass(frozen=True)
class GraphIO:
    """An engine graph's inputs and outputs, in the contract's order."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    @classmethod
    def paged(cls, num_layers: int, greedy_tokens: bool = False, num_states: int = 0) -> "GraphIO":
        """`num_layers` KV pools (a hybrid: its attention layers') and `num_states` state pools."""
        states = (STATE_SLOTS, *map(state_input, range(num_states))) if num_states else ()
        return cls(inputs=(*STEP_INPUTS, *map(cache_input, range(num_layers)), *states),
                   outputs=(LOGITS, *map(cache_output, range(num_layers)), *map(state_output, range(num_states)),
                            *((GREEDY_TOKENS,) if greedy_tokens else ())))

    @property
    def num_layers(self) -> int:
        """The KV pools."""
        return sum(map(is_cache, self.inputs))

    @property
    def num_states(self) -> int:
        return sum(name.startswith(_STATE_INPUT[:-2]) for name in self.inputs)

    @property
    def greedy_tokens(self) -> bool:
        return GREEDY_TOKENS in self.outputs

    def caches(self) -> list[tuple[str, str]]:
        return caches(self.num_layers)

    def states(self) -> list[tuple[str, str]]:
        """(input, output) per state pool: the names bound to one buffer."""
        return [(state_input(i), state_output(i)) for i in range(self.num_states)]


Dim = int | str | None  # a size, a symbolic dimension's name, or None: unknown


@dataclass(frozen=True)
class TensorType:
    """A graph input's or output's element type (numpy's name) and shape. `keys` names, per
    dimension, the manifest key its size comes from (empty for a graph's own tensors)."""

    dtype: str
    shape: tuple[Dim, ...]
    keys: tuple[str | None, ...] = ()


def _shape_text(shape: tuple[Dim, ...]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def disagreement(kind: str, graph: dict[str, TensorType], manifest: dict[str, TensorType]) -> str | None:
    """The first way a graph's inputs (or outputs: `kind`) differ from what the manifest says they
    are, in words; None when they agree. A symbolic or unknown size agrees with any."""
    missing = [name for name in manifest if name not in graph]
    extra = [name for name in graph if name not in manifest]
    if missing or extra:
        which = f"{missing[0]} is not in the graph" if missing else f"the manifest's io lacks {extra[0]}"
        return f"the graph has {len(graph)} {kind}s, the manifest's io names {len(manifest)}: {which}"
    for name, want in manifest.items():
        have = graph[name]
        if have.dtype != want.dtype:
            return f"{kind} {name} is {have.dtype} in the graph, {want.dtype} per the manifest"
        differ = [i for i, (size, expected) in enumerate(zip(have.shape, want.shape))
                  if isinstance(size, int) and isinstance(expected, int) and size != expected]
        if differ or len(have.shape) != len(want.shape):
            key = want.keys[differ[0]] if differ and want.keys and want.keys[differ[0]] else None
            return (f"{kind} {name} has shape {_shape_text(have.shape)} in the graph, {_shape_text(want.shape)} "
                    f"per the manifest" + (f"'s {key}" if key else ""))
    return None
