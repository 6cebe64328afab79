"""Paged KV cache: one pool of blocks per layer, a per-call view that implements ``minillm.cache.CacheView``,
and the mixed view of several batches in one row of tokens (the engine's mixed step)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..cache import Kernel, Mask, RowLengths, attention_mask
from ..config import ModelConfig


class PagedKVPool:
    """K and V for every layer as ``(num_blocks, block_size, n_kv_heads, head_dim)``, allocated once.

    Position ``p`` of a sequence lives in block ``table[p // block_size]`` at offset
    ``p % block_size``, i.e. in slot ``block * block_size + offset`` of the flattened pool (the
    layout of vLLM's FlashAttention backend: one slot holds all heads of one token, so a token is
    written or read with one index). Zero-filled so that unused slots hold finite values (the causal
    mask gives them weight 0, and 0 x finite = 0, whereas uninitialized memory could hold NaN).
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        shape = (num_blocks, block_size, config.n_kv_heads, config.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, torch.device(device)

    @property
    def nbytes(self) -> int:
        """Bytes of all K and V blocks (the whole budget, allocated up front)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of one layer viewed as (num_blocks * block_size, n_kv_heads, head_dim) token slots."""
        return self.k[layer].flatten(0, 1), self.v[layer].flatten(0, 1)


class _Slots(NamedTuple):
    """One call's plan: its positions (B, T), the slots it writes (B*T,) and reads (B, S), its mask."""
    positions: torch.Tensor
    write: torch.Tensor
    read: torch.Tensor
    mask: Mask


class PagedCacheView(RowLengths):
    """The rows of one batched model call, each reading and writing its own blocks.

    Implements ``minillm.cache.CacheView``: ``attend`` writes the new K, V into the blocks and hands
    the kernel every row's K, V gathered by position. ``lengths`` (B,): the tokens each row holds
    before the call. Rows shorter than the longest one gather padding slots past their own
    positions; the causal mask hides them.
    """

    def __init__(self, pool: PagedKVPool, block_tables: list[list[int]], lengths: list[int]):
        self.pool = pool
        self.lengths = torch.tensor(lengths, dtype=torch.long, device=pool.device)  # (B,)
        width = max(len(t) for t in block_tables)
        self.tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables],
                                   dtype=torch.long, device=pool.device)  # (B, width), padded with block 0
        self.n_blocks = torch.tensor([len(t) for t in block_tables], device=pool.device)  # (B,)
        self._call: _Slots | None = None

    def slot_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """positions (B, T) -> slot ids (B, T) in the flattened pool, through each row's block table."""
        bs = self.pool.block_size
        return self.tables.gather(1, positions // bs) * bs + positions % bs

    def check_room(self, positions: torch.Tensor) -> None:
        """Raise ValueError unless every position falls inside its own row's blocks."""
        self._check_rows(positions.shape[0])
        need = positions.max(dim=1).values // self.pool.block_size + 1  # (B,) blocks each row touches
        short = (need > self.n_blocks).nonzero()
        if len(short):
            row = int(short[0])
            raise ValueError(f"row {row} writes position {int(positions[row].max())} but holds only "
                             f"{int(self.n_blocks[row])} blocks of {self.pool.block_size} tokens")

    def begin(self, positions: torch.Tensor) -> None:
        """Check the room; compute this call's slot ids and causal mask once for every layer."""
        self.check_room(positions)
        B, n_keys = positions.shape[0], int(positions.max()) + 1
        read = torch.arange(n_keys, device=positions.device).expand(B, -1)  # (B, S)
        mask = attention_mask(positions, n_keys, cached=True)
        self._call = _Slots(positions, self.slot_ids(positions).flatten(), self.slot_ids(read), mask)

    def attend(self, layer, q, k, v, kernel: Kernel) -> torch.Tensor:
        """Write this call's k, v (B, Hkv, T, D) into the blocks, then attend over every row's keys by
        position. The keys are gathered into a dense (B, Hkv, S, D) copy, per layer and call: bytes that
        a paged attention kernel (vLLM's) spares by reading the blocks in place."""
        call = self._call
        B, H, T, D = k.shape
        pk, pv = self.pool.slots(layer)  # (slots, Hkv, D)
        pk.index_copy_(0, call.write, k.transpose(1, 2).reshape(B * T, H, D))
        pv.index_copy_(0, call.write, v.transpose(1, 2).reshape(B * T, H, D))
        S, read = call.read.shape[1], call.read.flatten()  # (B * S,)
        K = pk.index_select(0, read).view(B, S, H, D).transpose(1, 2)  # (B, Hkv, S, D), index = position
        V = pv.index_select(0, read).view(B, S, H, D).transpose(1, 2)
        return kernel(q, K, V, call.mask)


class MixedStepView:
    """Several batches in one row of tokens: the cache of the engine's mixed step (vLLM's flat layout).

    ``parts``: ``(rows, length, PagedCacheView)`` per batch, laid out back to back in the row
    (e.g. every decode row as a ``(B, 1)`` batch, then each prefill chunk as a ``(1, t)`` batch). The
    model computes every projection and the MLP once over all the row's tokens; ``attend`` cuts the
    row's q, k, v into the batches, lets each batch's view attend (its own blocks, its own causal
    mask, so no token attends to another sequence and no padding is computed), and joins the outputs.
    """

    def __init__(self, parts: list[tuple[int, int, PagedCacheView]]):
        self.parts = parts
        self._positions = None  # per part, set by begin

    def _cut(self, x: torch.Tensor):
        """x: (1, heads, N, D) -> one (rows, heads, length, D) tensor per part."""
        out, start = [], 0
        for rows, length, _ in self.parts:
            out.append(x[0, :, start:start + rows * length].unflatten(1, (rows, length)).transpose(0, 1))
            start += rows * length
        return out

    def default_positions(self, batch: int, length: int, device: torch.device) -> torch.Tensor:
        raise ValueError("a mixed batch needs explicit positions")

    def begin(self, positions: torch.Tensor) -> None:
        """positions: (1, N). Each part's view checks its room and plans its writes and mask."""
        n = sum(rows * length for rows, length, _ in self.parts)
        if positions.shape != (1, n):
            raise ValueError(f"positions shape {tuple(positions.shape)} != (1, {n}), the parts' tokens")
        self._positions, start = [], 0
        for rows, length, cache in self.parts:
            pos = positions[0, start:start + rows * length].view(rows, length)  # (rows, length)
            cache.begin(pos)
            self._positions.append(pos)
            start += rows * length

    def attend(self, layer, q, k, v, kernel: Kernel) -> torch.Tensor:
        """q: (1, H, N, D), k, v: (1, Hkv, N, D) -> (1, H, N, D), attended part by part."""
        outs = [cache.attend(layer, *qkv, kernel)  # (rows, H, length, D)
                for qkv, (_, _, cache) in zip(zip(self._cut(q), self._cut(k), self._cut(v)), self.parts)]
        return torch.cat([o.transpose(0, 1).flatten(1, 2) for o in outs], dim=1)[None]  # back in row order

    def end(self, positions: torch.Tensor) -> None:
        for (_, _, cache), pos in zip(self.parts, self._positions):
            cache.end(pos)
        self._positions = None
