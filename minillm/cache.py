"""KV cache: K and V for every layer, allocated once and written by index."""
from __future__ import annotations

import torch

from .config import ModelConfig
from .validate import check_int


class KVCache:
    """Contiguous KV cache, one row per sequence.

    Each layer holds ``k`` and ``v`` of shape ``(batch, n_kv_heads, max_len, head_dim)``. A token at
    position ``p`` of row ``b`` is stored at index ``p`` of that row; ``lengths[b]`` says how many
    positions of row ``b`` hold real keys. Nothing is ever concatenated: the memory is fixed at
    construction and ``nbytes`` is exactly ``2 x layers x batch x kv_heads x max_len x head_dim x bytes``.
    """

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        max_len = config.max_seq_len if max_len is None else max_len
        check_int("batch_size", batch_size)
        if not isinstance(max_len, int) or not 0 < max_len <= config.max_seq_len:
            raise ValueError(f"max_len={max_len!r} must be in [1, max_seq_len={config.max_seq_len}]")
        shape = (batch_size, config.n_kv_heads, max_len, config.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,)
        self.batch_size, self.max_len = batch_size, max_len
        self._n_keys, self._shared = 0, None  # the write plan of the current call, set by check_room

    @property
    def nbytes(self) -> int:
        """Bytes held by all K and V tensors (allocated, not just used)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def check_room(self, positions: torch.Tensor) -> None:
        """Raise ValueError if any position falls outside the cache; plan this call's writes.

        positions: (B, T). When every row writes the same positions (one sequence, or a batch in
        step), ``update`` writes with one ``index_copy_`` instead of a scatter over rows.
        """
        top = int(positions.max())
        if top >= self.max_len:
            raise ValueError(f"position {top} does not fit in the cache (max_len={self.max_len})")
        self._n_keys = top + 1
        self._shared = positions[0] if bool((positions == positions[:1]).all()) else None  # (T,) or None

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """Write new keys/values at ``positions`` and return every row's keys/values so far.

        Call ``check_room(positions)`` first (the model does).
        k, v: (B, n_kv_heads, T, head_dim); positions: (B, T).
        Returns K, V of shape (B, n_kv_heads, S, head_dim), S = 1 + the largest position
        written; index j along S holds position j (entries past a row's own length are stale
        and must be masked by the caller, which the causal mask does).
        """
        if self._shared is not None:  # every row writes the same positions
            self.k[layer].index_copy_(2, self._shared, k)
            self.v[layer].index_copy_(2, self._shared, v)
        else:
            rows = torch.arange(k.shape[0], device=k.device)[:, None]  # (B, 1)
            # (B, T, H, D) written by index
            self.k[layer][rows, :, positions] = k.transpose(1, 2)
            self.v[layer][rows, :, positions] = v.transpose(1, 2)
        return self.k[layer][:, :, :self._n_keys], self.v[layer][:, :, :self._n_keys]

    def commit(self, positions: torch.Tensor) -> None:
        """After a forward pass: each row's length becomes its last position + 1."""
        self.lengths = positions[:, -1] + 1  # (B,)

    def reset(self) -> None:
        """Forget every row (the memory stays allocated)."""
        self.lengths = torch.zeros_like(self.lengths)  # a new tensor: lengths may come from inference mode
