"""Hands out KV-cache blocks from a fixed pool and keeps each sequence's block table."""
from __future__ import annotations

from collections import deque

from ..checks import check_int
from .request import Sequence


def blocks_for(n_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``n_tokens`` tokens (ceiling division)."""
    return -(-n_tokens // block_size)


class BlockManager:
    """A free list over block ids ``0 .. num_blocks-1``; a block belongs to at most one sequence."""

    def __init__(self, num_blocks: int, block_size: int):
        check_int("num_blocks", num_blocks)
        check_int("block_size", block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def can_hold(self, seq: Sequence, n_tokens: int) -> bool:
        """True when ``seq``'s table can grow to hold ``n_tokens`` tokens from the free blocks."""
        return blocks_for(n_tokens, self.block_size) - len(seq.block_table) <= len(self.free_ids)

    def grow(self, seq: Sequence, n_tokens: int) -> None:
        """Give ``seq`` enough blocks for ``n_tokens`` tokens (call ``can_hold`` first)."""
        missing = blocks_for(n_tokens, self.block_size) - len(seq.block_table)
        if missing > len(self.free_ids):
            raise RuntimeError(f"{missing} blocks needed, {len(self.free_ids)} free")
        seq.block_table.extend(self.free_ids.popleft() for _ in range(missing))

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks to the pool."""
        self.free_ids.extend(seq.block_table)
        seq.block_table = []
