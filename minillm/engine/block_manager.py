"""Hands out KV-cache blocks from a fixed pool, counts who holds each, and can cache full blocks by content."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from ..intmath import ceil_div
from ..validate import check_int
from .request import Sequence


def blocks_for(n_tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` tokens needed to hold ``n_tokens`` tokens."""
    return ceil_div(n_tokens, block_size)


ROOT_DIGEST = hashlib.sha256(b"minillm prefix cache: no parent").digest()  # the parent of a first block


def block_key(parent: bytes | None, tokens: list[int]) -> bytes:
    """The identity of a full block: SHA-256 of its parent's key and its own tokens (32 bytes).

    A hash chain, as in vLLM and nano-vllm: the key of block i digests block i-1's key, so it stands
    for every token from the start of the sequence to the end of block i. The digest is cryptographic
    because the tokens come from clients: with Python's built-in ``hash()`` (which is invertible for
    tuples of small ints, and equal for -1 and -2), a client could craft a block whose key is another
    user's, and that user's reply would then be computed from the crafted block's KV (prefix-cache
    poisoning; vLLM moved to SHA-256 after GHSA-rm76-4mrf-v9r8). Finding two token sequences with one
    SHA-256 digest is out of reach, so equal keys mean equal prefixes.
    """
    ids = array("q", tokens)  # 8 bytes per id; the parent is always 32 bytes, so the encoding is unambiguous
    return hashlib.sha256((ROOT_DIGEST if parent is None else parent) + ids.tobytes()).digest()


class BlockManager:
    """The pool's blocks ``0 .. num_blocks-1``, each with a reference count: how many block tables hold it.

    A block held by nobody is free. With ``enable_prefix_caching``, a block full of computed tokens is
    registered under its ``block_key``; a later sequence whose tokens start the same way reuses it
    (its count goes up) instead of computing it again. A registered block stays findable after its
    last holder lets go, until the pool runs short: a new block is taken first from the free blocks
    that hold nothing reusable, then from the cached ones, least recently freed first (LRU eviction).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        check_int("num_blocks", num_blocks)
        check_int("block_size", block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # taken from the front
        self.key_of: dict[int, bytes] = {}  # block -> the key of the full block it holds (cached blocks only)
        self.block_of: dict[bytes, int] = {}  # key -> block: the prefix cache

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (cached ones included: they are evicted when needed)."""
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self.free_blocks)

    @property
    def num_cached(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return sum(1 for block in self.key_of if self.ref_counts[block] == 0)

    def can_hold(self, seq: Sequence, n_tokens: int) -> bool:
        """True when ``seq``'s table can grow to hold ``n_tokens`` tokens from the free blocks."""
        return blocks_for(n_tokens, self.block_size) - len(seq.block_table) <= len(self.free_blocks)

    def grow(self, seq: Sequence, n_tokens: int) -> None:
        """Give ``seq`` enough blocks for ``n_tokens`` tokens (call ``can_hold`` first)."""
        missing = blocks_for(n_tokens, self.block_size) - len(seq.block_table)
        if missing > len(self.free_blocks):
            raise RuntimeError(f"{missing} blocks needed, {len(self.free_blocks)} free")
        seq.block_table.extend(self._take() for _ in range(missing))

    def admit(self, seq: Sequence) -> int | None:
        """Give ``seq`` blocks for all its tokens, reusing the cached blocks that hold its first ones.

        Returns how many of its first tokens those cached blocks hold (0 without a hit; the caller, the
        scheduler, counts them as computed), or None, taking nothing, when the free blocks are too few.
        """
        keys, hits = self._cached_prefix(seq)
        missing = blocks_for(seq.num_tokens, self.block_size) - len(hits)
        if missing + sum(self.ref_counts[b] == 0 for b in hits) > len(self.free_blocks):
            return None
        for block in hits:  # before taking new blocks, so that none of these is evicted
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
        seq.block_table = hits + [self._take() for _ in range(missing)]
        seq.block_keys = keys
        return len(hits) * self.block_size

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register ``seq``'s blocks that are now full of computed tokens, for later sequences to reuse.

        A block whose content is already cached in another block is left unregistered (one copy each).
        """
        if not self.enable_prefix_caching:
            return
        for i in range(len(seq.block_keys), seq.num_computed // self.block_size):
            key = block_key(seq.block_keys[-1] if seq.block_keys else None, seq.block(i, self.block_size))
            seq.block_keys.append(key)
            if key not in self.block_of:
                self.block_of[key], self.key_of[seq.block_table[i]] = seq.block_table[i], key

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s hold on its blocks. A block nobody holds any more becomes free: at the back
        of the free list if it holds a cached prefix (tail blocks first, so they are evicted first),
        else at the front."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
                if block not in self.key_of:
                    self.free_blocks.move_to_end(block, last=False)
        seq.block_table, seq.block_keys = [], []

    def _take(self) -> int:
        """A free block for one holder; a cached one is evicted (its prefix forgotten)."""
        block, _ = self.free_blocks.popitem(last=False)
        key = self.key_of.pop(block, None)
        if key is not None:
            del self.block_of[key]
        self.ref_counts[block] = 1
        return block

    def _cached_prefix(self, seq: Sequence) -> tuple[list[bytes], list[int]]:
        """Keys and blocks of the longest run of ``seq``'s first full blocks found in the
        cache.

        At most ``(num_tokens - 1) // block_size`` blocks: at least one token is always
        computed, since its logits give the next token (vLLM's rule)."""
        keys, blocks = [], []
        if not self.enable_prefix_caching:
            return keys, blocks
        for i in range((seq.num_tokens - 1) // self.block_size):
            key = block_key(keys[-1] if keys else None, seq.block(i, self.block_size))
            block = self.block_of.get(key)
            if block is None:
                break
            keys.append(key)
            blocks.append(block)
        return keys, blocks
