"""KV block manager: reference-counted blocks of the paged pool, with automatic prefix caching.

A full block is identified by a hash chained over every token before and in it, so two
sequences with the same prefix map their leading blocks to the same physical blocks. Freed
blocks keep their contents and hash and wait in an LRU free list: a later request with the
same prefix takes them back (a hit); fresh allocations take the least recently freed block and
evict its hash. Block 0 is the graph's scratch block (padding writes land there) and is never
handed out.

A hybrid's sequence also holds a slot of the recurrent state pools while it has blocks: taken
with its first block, given back when it is freed (slot 0 is scratch, as block 0 is). Its state is
the whole prefix's, not a block's, so a hybrid's blocks are never shared: prefix caching is off.

A sequence (anything with `token_ids`, `block_table`, `num_computed_tokens`,
`num_hashed_blocks`, `cache_salt`, and for a hybrid `state_slot`) meets the manager
through five verbs: `allocate_prefix` (take cached blocks for its prompt), `can_append` /
`append` (grow its table to cover tokens it is about to compute), `commit` (hash blocks that
have become full), `truncate` (give back the tail a rejected speculation used) and `free`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from llmc.contract.graph_io import SCRATCH_BLOCK, SCRATCH_SLOT


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def chain_hash(prefix_hash: int | None, tokens: tuple[int, ...]) -> int:
    """`prefix_hash` is the previous block's hash, or for the first block the sequence's cache
    salt: what else than its tokens a block's contents depend on (None: nothing)."""
    return hash((prefix_hash, tokens))


@dataclass
class CacheStats:
    queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    hit_tokens: int = 0  # of which were found cached
    evictions: int = 0  # cached blocks whose contents were dropped for a new allocation


class _Block:
    __slots__ = ("ref_count", "hash", "tokens")

    def __init__(self):
        self.ref_count = 0
        self.hash: int | None = None
        self.tokens: tuple[int, ...] | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, state_slots: int = 0):
        if num_blocks < 2:
            raise ValueError("the pool needs the scratch block and at least one more")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching and not state_slots
        # A hybrid's free state slots (the scheduler runs at most max_num_seqs, one slot each).
        self.state_slots = state_slots
        self._slots = [s for s in range(state_slots - 1, -1, -1) if s != SCRATCH_SLOT]
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks) if i != SCRATCH_BLOCK)
        self._by_hash: dict[int, int] = {}
        self.stats = CacheStats()

    # -- queries ----------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Blocks sequences can use (all but the scratch block)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.capacity

    def blocks_needed(self, seq, num_tokens: int) -> int:
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_table))

    def can_append(self, seq, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    # -- verbs ------------------------------------------------------------------------------

    def allocate_prefix(self, seq) -> int:
        """Give a sequence with an empty table the cached blocks of its longest cached prefix;
        returns the number of tokens covered. The block holding the last token is never taken
        from the cache: that token must be computed to produce logits."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        tokens = seq.token_ids
        if not self.enable_prefix_caching:
            return 0
        prefix = seq.cache_salt
        for i in range((len(tokens) - 1) // self.block_size):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            prefix = chain_hash(prefix, chunk)
            bid = self._by_hash.get(prefix)
            if bid is None or self._blocks[bid].tokens != chunk:
                break
            block = self._blocks[bid]
            if block.ref_count == 0:
                del self._free[bid]
            block.ref_count += 1
            seq.block_table.append(bid)
        cached = len(seq.block_table) * self.block_size
        seq.num_computed_tokens = cached
        seq.num_hashed_blocks = len(seq.block_table)
        return cached

    def record_lookup(self, num_tokens: int, cached_tokens: int) -> None:
        """Count a prefix lookup once the sequence is really admitted (not on retries)."""
        self.stats.queried_tokens += num_tokens
        self.stats.hit_tokens += cached_tokens

    def append(self, seq, num_tokens: int) -> None:
        """Grow the table to cover `num_tokens` positions with fresh blocks."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self._free):
            raise MemoryError(f"need {need} KV blocks, {len(self._free)} free")
        if self.state_slots and seq.state_slot == SCRATCH_SLOT and need:
            if not self._slots:
                raise MemoryError("every state slot is taken: more sequences run than the engine has slots for")
            seq.state_slot = self._slots.pop()
        for _ in range(need):
            bid, _ = self._free.popitem(last=False)  # least recently freed first
            block = self._blocks[bid]
            if block.hash is not None:
                if self._by_hash.get(block.hash) == bid:
                    del self._by_hash[block.hash]
                block.hash = block.tokens = None
                self.stats.evictions += 1
            block.ref_count = 1
            seq.block_table.append(bid)

    def commit(self, seq) -> None:
        """Register blocks that the computed tokens have filled, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        start = seq.num_hashed_blocks
        prefix = self._blocks[seq.block_table[start - 1]].hash if start else seq.cache_salt
        for i in range(start, full):
            block = self._blocks[seq.block_table[i]]
            if block.hash is None:
                chunk = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
                block.hash, block.tokens = chain_hash(prefix, chunk), chunk
                self._by_hash.setdefault(block.hash, seq.block_table[i])
            prefix = block.hash
        seq.num_hashed_blocks = max(start, full)

    def free(self, seq) -> None:
        """Drop the sequence's references; unreferenced blocks keep their contents for reuse.
        Tail blocks are freed first so they are evicted before the prefix they extend."""
        self.truncate(seq, 0)
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
        if self.state_slots and seq.state_slot != SCRATCH_SLOT:
            self._slots.append(seq.state_slot)
            seq.state_slot = SCRATCH_SLOT

    def truncate(self, seq, num_tokens: int) -> None:
        """Give back the table's blocks past the first `num_tokens` positions (a rejected
        speculation's); the sequence's computed tokens must already fit in what is left."""
        keep = blocks_for(num_tokens, self.block_size)
        while len(seq.block_table) > keep:
            bid = seq.block_table.pop()
            block = self._blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                if not self.enable_prefix_caching:
                    block.hash = block.tokens = None
                self._free[bid] = None

    # -- invariants (tests) -----------------------------------------------------------------

    def check(self, live_tables: list[list[int]]) -> None:
        """Assert the bookkeeping is consistent with the given live block tables."""
        refs = [0] * self.num_blocks
        for table in live_tables:
            for bid in table:
                refs[bid] += 1
        assert refs[SCRATCH_BLOCK] == 0 and SCRATCH_BLOCK not in self._free
        for bid in range(self.num_blocks):
            if bid == SCRATCH_BLOCK:
                continue
            block = self._blocks[bid]
            assert block.ref_count == refs[bid], (bid, block.ref_count, refs[bid])
            assert (bid in self._free) == (block.ref_count == 0), bid
        for h, bid in self._by_hash.items():
            assert self._blocks[bid].hash == h, (h, bid)
