"""Paged KV cache: one pool of blocks per layer, a per-call view that speaks the model's cache protocol, and
the mixed view of several batches in one row of tokens (the engine's mixed step)."""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..model import attention_mask


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


class PagedCacheView:
    """The rows of one batched model call, each reading and writing its own blocks.

    Implements the model's cache protocol: ``lengths`` (B,) (tokens each row holds before the call),
    ``check_room``, ``update`` (writes the new K, V into the blocks, returns every row's K, V
    gathered by position) and ``commit``. Rows shorter than the longest one gather padding slots
    past their own positions; the causal mask hides them.
    """

    def __init__(self, pool: PagedKVPool, block_tables: list[list[int]], lengths: list[int]):
        self.pool = pool
        self.lengths = torch.tensor(lengths, dtype=torch.long, device=pool.device)  # (B,)
        width = max(len(t) for t in block_tables)
        self.tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables],
                                   dtype=torch.long, device=pool.device)  # (B, width), padded with block 0
        self.n_blocks = torch.tensor([len(t) for t in block_tables], device=pool.device)  # (B,)
        self._write = self._read = None  # slot ids, set by check_room

    def slot_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """positions (B, T) -> slot ids (B, T) in the flattened pool, through each row's block table."""
        bs = self.pool.block_size
        return self.tables.gather(1, positions // bs) * bs + positions % bs

    def check_room(self, positions: torch.Tensor) -> None:
        """Every position must fall inside its own row's blocks; computes this call's slot ids once."""
        need = positions.max(dim=1).values // self.pool.block_size + 1  # (B,) blocks each row touches
        short = (need > self.n_blocks).nonzero()
        if len(short):
            row = int(short[0])
            raise ValueError(f"row {row} writes position {int(positions[row].max())} but holds only "
                             f"{int(self.n_blocks[row])} blocks of {self.pool.block_size} tokens")
        B = positions.shape[0]
        read = torch.arange(int(positions.max()) + 1, device=positions.device).expand(B, -1)  # (B, S)
        self._write, self._read = self.slot_ids(positions).flatten(), self.slot_ids(read)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """k, v: (B, Hkv, T, D) written at ``positions`` (B, T) -> K, V: (B, Hkv, S, D), index = position."""
        B, H, T, D = k.shape
        pk, pv = self.pool.slots(layer)  # (slots, Hkv, D)
        pk.index_copy_(0, self._write, k.transpose(1, 2).reshape(B * T, H, D))
        pv.index_copy_(0, self._write, v.transpose(1, 2).reshape(B * T, H, D))
        S = self._read.shape[1]
        read = self._read.flatten()  # (B * S,)
        return (pk.index_select(0, read).view(B, S, H, D).transpose(1, 2),  # (B, Hkv, S, D)
                pv.index_select(0, read).view(B, S, H, D).transpose(1, 2))

    def commit(self, positions: torch.Tensor) -> None:
        """After a forward pass: each row's length becomes its last position + 1."""
        self.lengths = positions[:, -1] + 1


class MixedStepView:
    """Several batches in one row of tokens: the cache of the engine's mixed step (vLLM's flat layout).

    ``parts``: ``(rows, length, PagedCacheView)`` per batch, laid out back to back in the row
    (e.g. every decode row as a ``(B, 1)`` batch, then each prefill chunk as a ``(1, t)`` batch). The
    model computes every projection and the MLP once over all the row's tokens; attention runs batch
    by batch (``split``, then ``join``), each batch reading and writing its own blocks with its own
    causal mask, so no token attends to another sequence and no padding is computed.
    """

    def __init__(self, parts: list[tuple[int, int, PagedCacheView]], n_groups: int):
        self.parts, self.n_groups = parts, n_groups
        self._positions = self._masks = None  # per part, set by check_room

    def _cut(self, x: torch.Tensor):
        """x: (1, heads, N, D) -> one (rows, heads, length, D) tensor per part."""
        out, start = [], 0
        for rows, length, _ in self.parts:
            out.append(x[0, :, start:start + rows * length].unflatten(1, (rows, length)).transpose(0, 1))
            start += rows * length
        return out

    def check_room(self, positions: torch.Tensor) -> None:
        """positions: (1, N). Checks each part's room and builds each part's causal mask once per call."""
        n = sum(rows * length for rows, length, _ in self.parts)
        if positions.shape != (1, n):
            raise ValueError(f"positions shape {tuple(positions.shape)} != (1, {n}), the parts' tokens")
        self._positions, self._masks, start = [], [], 0
        for rows, length, cache in self.parts:
            pos = positions[0, start:start + rows * length].view(rows, length)  # (rows, length)
            cache.check_room(pos)
            self._positions.append(pos)
            self._masks.append(attention_mask(pos, int(pos.max()) + 1, self.n_groups, cached=True))
            start += rows * length

    def split(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """q: (1, H, N, D), k, v: (1, Hkv, N, D) -> per part, the arguments of ``Attention.attend``."""
        return zip(self._cut(q), self._cut(k), self._cut(v), self._positions, self._masks,
                   [cache for _, _, cache in self.parts])

    def join(self, outs: list[torch.Tensor]) -> torch.Tensor:
        """Per part (rows, H, length, D) -> (1, H, N, D), back in the row's order."""
        return torch.cat([o.transpose(0, 1).flatten(1, 2) for o in outs], dim=1)[None]

    def commit(self, positions: torch.Tensor) -> None:
        for (_, _, cache), pos in zip(self.parts, self._positions):
            cache.commit(pos)
