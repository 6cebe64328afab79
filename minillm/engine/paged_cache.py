"""Paged KV cache: one pool of blocks per layer, and a per-call view that speaks the model's cache protocol."""
from __future__ import annotations

import torch

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


class PagedBatchCache:
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
