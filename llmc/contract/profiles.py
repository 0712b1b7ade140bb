"""TensorRT optimization profiles: the step shapes a plan is built for, recorded in its manifest.

TensorRT compiles kernels for a range of every dynamic dimension, one set of ranges per
profile, and a step runs under a profile whose ranges hold its shape. llmc builds two:
- decode: one new token per row (S = 1) and one logit row each (N = B), the steady state;
- prefill: chunks of S >= 2 tokens (and speculative verify steps), N up to B * S.
Both cover the block table's width up to the engine's context and pools of up to one full
context per batch slot; the runtime sizes its pools within that.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmc.contract import graph_io as io


@dataclass(frozen=True)
class Dim:
    min: int
    opt: int
    max: int

    def __post_init__(self):
        if not 1 <= self.min <= self.opt <= self.max:
            raise ValueError(f"a profile range must have 1 <= min <= opt <= max, got {self}")

    def holds(self, n: int) -> bool:
        return self.min <= n <= self.max


@dataclass(frozen=True)
class Profile:
    name: str
    batch: Dim
    seq: Dim
    num_logits: Dim
    max_blocks: Dim  # the block table's width
    num_blocks: Dim  # the pools' blocks (block 0 is scratch)

    def holds(self, batch: int, seq: int, num_logits: int, max_blocks: int, num_blocks: int) -> bool:
        return (self.batch.holds(batch) and self.seq.holds(seq) and self.num_logits.holds(num_logits)
                and self.max_blocks.holds(max_blocks) and self.num_blocks.holds(num_blocks))

    def shapes(self, num_layers: int, pool_dims: tuple[int, ...]) -> dict[str, tuple[tuple, tuple, tuple]]:
        """(min, opt, max) shape of every graph input; `pool_dims`: a pool's shape after its
        leading [2, num_blocks] (token-major: block_size, num_kv_heads, head_dim)."""
        sizes = {io.BATCH: self.batch, io.SEQ: self.seq, io.NUM_LOGITS: self.num_logits,
                 io.MAX_BLOCKS: self.max_blocks}
        shapes = {name: tuple(tuple(getattr(sizes[d], which) for d in dims) for which in ("min", "opt", "max"))
                  for name, dims in io.STEP_SHAPES.items()}
        pool = tuple((2, getattr(self.num_blocks, which), *pool_dims) for which in ("min", "opt", "max"))
        return {**shapes, **{io.cache_input(i): pool for i in range(num_layers)}}


def profiles(*, block_size: int, max_context: int, max_num_seqs: int = 16, chunk_size: int = 256) -> tuple[Profile, ...]:
    """Decode and prefill profiles for an engine of `max_context` tokens serving up to
    `max_num_seqs` rows a step in chunks of up to `chunk_size` tokens."""
    width = -(-max_context // block_size)
    blocks = Dim(1, max(1, width // 4), width)
    pool = Dim(2, 1 + max_num_seqs * max(1, width // 4), 1 + max_num_seqs * width)
    rows = Dim(1, max(1, max_num_seqs // 2), max_num_seqs)
    chunk = max(2, min(chunk_size, max_context))
    return (Profile("decode", rows, Dim(1, 1, 1), rows, blocks, pool),
            Profile("prefill", rows, Dim(2, max(2, chunk // 2), chunk), Dim(1, rows.opt, max_num_seqs * chunk),
                    blocks, pool))


def choose(options: tuple[Profile, ...], *, batch: int, seq: int, num_logits: int, max_blocks: int,
           num_blocks: int) -> int:
    """The index of the first profile that holds a step of this shape; ValueError naming the
    dimension out of range when none does."""
    for i, p in enumerate(options):
        if p.holds(batch, seq, num_logits, max_blocks, num_blocks):
            return i
    raise ValueError(f"no optimization profile holds a step of {batch} rows x {seq} tokens, {num_logits} logits, "
                     f"{max_blocks} table blocks and a pool of {num_blocks} blocks; rebuild the engine for "
                     "these limits (--max-context), or serve with smaller --max-num-seqs / --chunk-size")
