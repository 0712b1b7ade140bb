"""KV block manager: hands out blocks of the paged pool to sequences.

Block 0 is the scratch block (padding tokens' writes land there), so it is never handed out.
A sequence's block table grows as it decodes; freeing a sequence returns all of its blocks.
"""

from __future__ import annotations

from collections import deque

from llmc.errors import RequestError


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError("the pool needs the scratch block and at least one more")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Blocks a sequence can ever use (all but the scratch block)."""
        return self.num_blocks - 1

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def ensure(self, table: list[int], num_tokens: int) -> None:
        """Grow `table` so it covers `num_tokens` positions."""
        need = blocks_for(num_tokens, self.block_size) - len(table)
        if need <= 0:
            return
        if need > len(self._free):
            raise RequestError(
                f"out of KV cache memory: need {need} more blocks, {len(self._free)} free of "
                f"{self.capacity}; raise kv_cache_blocks or run fewer requests at once"
            )
        table.extend(self._free.popleft() for _ in range(need))

    def free(self, table: list[int]) -> None:
        self._free.extend(table)
        table.clear()
