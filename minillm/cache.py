"""The model's cache contract (``CacheView``), the causal mask, and the contiguous KV cache.

``CausalLM.forward`` calls four methods on a cache and nothing else; ``CacheView`` names them. Every
cache implements them: ``KVCache`` here (one contiguous row per sequence), the view of a call without a
cache (``NoCache``, which the model makes itself), and the paged and compiled views built on this contract.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from .config import ModelConfig
from .validate import check_int, check_integer_tensor

# --- what a view hands the kernel ------------------------------------------------------------------------


class SquareCausal(NamedTuple):
    """The causal mask of a fresh prompt, not built: every row's T queries sit at positions 0..T-1 and see
    those T keys, query t the keys 0..t. ``Attention.kernel`` hands it to
    ``scaled_dot_product_attention(is_causal=True)``, which never computes the masked half of the scores
    (FlashAttention's causal kernel, as vLLM uses for prefill); ``dense`` is the explicit mask it stands for.
    """
    length: int  # T: queries and keys
    device: torch.device

    def dense(self) -> torch.Tensor:
        """The explicit mask: (1, 1, T, T)."""
        return causal_mask(torch.arange(self.length, device=self.device)[None], self.length)


# One call's mask: (B, 1, T, S), True where a query may see a key; None when every key is visible; or SquareCausal
Mask = torch.Tensor | SquareCausal | None
# kernel(q (B, H, T, D), K (B, Hkv, S, D), V (B, Hkv, S, D), mask) -> (B, H, T, D)
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Mask], torch.Tensor]


@runtime_checkable
class CacheView(Protocol):
    """What ``CausalLM.forward`` asks of a KV cache during one call, and all that it asks.

    One call runs ``default_positions`` (only when the caller gives no positions), then ``begin``
    once, ``attend`` once per layer (layer 0 first), and ``end`` once. Keys are indexed by position:
    the key of position ``j`` sits at index ``j`` of the ``S`` axis that ``attend`` hands the kernel,
    and the view's mask lets a query at position ``p`` see key ``j`` exactly when ``j <= p``.
    """

    def default_positions(self, batch: int, length: int, device: torch.device) -> torch.Tensor:
        """The positions (batch, length) of a call that gives none: each row's next ``length``
        positions. Reads only; raises ValueError where the view cannot say (or ``batch`` is wrong)."""
        ...

    def begin(self, positions: torch.Tensor) -> None:
        """Mutates the view (not its keys and values): raise ValueError if ``positions`` (B, T) do
        not fit, then plan this call's writes and build its mask. Called once, before layer 0."""
        ...

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kernel: Kernel) -> torch.Tensor:
        """Mutates the stored keys and values: write this call's ``k``, ``v`` (B, Hkv, T, D) of
        ``layer`` at the positions given to ``begin``, then return ``kernel(q, K, V, mask)``, (B, H, T, D):
        K, V (B', Hkv, S, D) every key the queries may see, by position, and the mask ``begin`` built."""
        ...

    def end(self, positions: torch.Tensor) -> None:
        """Mutates the view: after the last layer, each row holds its positions up to its last one."""
        ...


# --- the causal mask ---------------------------------------------------------------------------------

def causal_mask(query_positions: torch.Tensor, n_keys: int) -> torch.Tensor:
    """Boolean mask (B, 1, T, S): query at position p may see key j exactly when j <= p.

    Keys are indexed by position (0..S-1), with or without a cache, so this one rule is the whole
    mask: lower-triangular for a fresh sequence, a single row for a decode step.
    """
    key_positions = torch.arange(n_keys, device=query_positions.device)  # (S,)
    return (key_positions[None, None, :] <= query_positions[:, :, None])[:, None]


def attention_mask(positions: torch.Tensor, n_keys: int, cached: bool) -> Mask:
    """The causal mask of one forward pass over ``n_keys`` keys: (B, 1, T, n_keys), None, or, for a fresh
    prompt (every row at 0..T-1, no earlier keys), a ``SquareCausal`` that the kernel never builds.
    With a cache, key j is visible to a query at position p iff j <= p (``causal_mask``); a decode step
    whose rows all sit at the last position sees every key, so it needs no mask at all. Without a cache
    the keys are the queries themselves.
    """
    T = positions.shape[1]
    if T > 1 and n_keys == T and _is_arange(positions):
        return SquareCausal(T, positions.device)  # attention skips the masked half
    if cached and T == 1 and n_keys - 1 == int(positions.min()):
        return None
    # a call without a cache whose positions are not 0..T-1 masks pair by pair
    return causal_mask(positions, n_keys) if cached else _pairwise_mask(positions)


def _is_arange(positions: torch.Tensor) -> bool:
    """True when every row's positions are 0, 1, ..., T-1."""
    return bool((positions == torch.arange(positions.shape[1], device=positions.device)).all())


def _pairwise_mask(positions: torch.Tensor) -> torch.Tensor:
    """Causal mask by position for a cache-less call whose positions are not 0..T-1: (B, 1, T, T)."""
    return (positions[:, None, :] <= positions[:, :, None])[:, None]


# --- the views -----------------------------------------------------------------------------------------

class NoCache:
    """The view of a call without a cache: each layer attends to the call's own keys and values."""

    def __init__(self):
        self._mask: Mask = None

    def default_positions(self, batch: int, length: int, device: torch.device) -> torch.Tensor:
        return torch.arange(length, device=device).expand(batch, length)  # (B, T): 0..T-1

    def begin(self, positions: torch.Tensor) -> None:
        self._mask = attention_mask(positions, positions.shape[1], cached=False)

    def attend(self, layer, q, k, v, kernel: Kernel) -> torch.Tensor:
        return kernel(q, k, v, self._mask)

    def end(self, positions: torch.Tensor) -> None:
        self._mask = None


class RowLengths:
    """What every cache with rows of its own keeps: ``lengths`` (B,), the positions each row holds, and
    the bookkeeping around it (``default_positions``, the row check, ``end``). A subclass sets ``lengths``
    and plans each call into ``_call`` in its ``begin``."""

    lengths: torch.Tensor  # (B,)
    _call: NamedTuple | None  # this call's plan, from begin to end

    def default_positions(self, batch: int, length: int, device: torch.device) -> torch.Tensor:
        """Right after what each row holds: (B, T)."""
        self._check_rows(batch)
        return self.lengths[:, None] + torch.arange(length, device=device)  # (B, T)

    def end(self, positions: torch.Tensor) -> None:
        """After a forward pass: each row's length becomes its last position + 1."""
        self.lengths = positions[:, -1] + 1  # (B,)
        self._call = None

    def _check_rows(self, batch: int) -> None:
        if batch != self.lengths.shape[0]:
            raise ValueError(f"input_ids has {batch} rows but the cache has batch_size={self.lengths.shape[0]}")


class _Writes(NamedTuple):
    """One call's plan: its positions (B, T), the keys it reads (0..n_keys-1), the (T,) positions every row
    shares (then one ``index_copy_`` writes them) or None, and its mask."""
    positions: torch.Tensor
    n_keys: int
    shared: torch.Tensor | None
    mask: Mask


class KVCache(RowLengths):
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
        check_int("max_len", max_len)
        if max_len > config.max_seq_len:
            raise ValueError(f"max_len={max_len} must be <= the model's max_seq_len={config.max_seq_len}")
        shape = (batch_size, config.n_kv_heads, max_len, config.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,)
        self.batch_size, self.max_len = batch_size, max_len
        self._call: _Writes | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held by all K and V tensors (allocated, not just used)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def check_room(self, positions: torch.Tensor) -> int:
        """Raise ValueError unless ``positions`` (B, T) has ``batch_size`` rows and fits in ``max_len``;
        -> the largest position."""
        self._check_rows(positions.shape[0])
        top = int(positions.max())
        if top >= self.max_len:
            raise ValueError(f"position {top} does not fit in the cache (max_len={self.max_len})")
        return top

    def begin(self, positions: torch.Tensor) -> None:
        """Check the room, plan this call's writes and build its causal mask."""
        n_keys = self.check_room(positions) + 1
        shared = positions[0] if bool((positions == positions[:1]).all()) else None  # (T,) or None
        mask = attention_mask(positions, n_keys, cached=True)
        self._call = _Writes(positions, n_keys, shared, mask)

    def attend(self, layer, q, k, v, kernel: Kernel) -> torch.Tensor:
        """Write this call's k, v (B, Hkv, T, D) at its positions, then attend over every key
        held so far."""
        call = self._call
        K, V = self.k[layer], self.v[layer]  # (B, Hkv, max_len, D), index = position
        if call.shared is not None:  # every row writes the same positions
            K.index_copy_(2, call.shared, k)
            V.index_copy_(2, call.shared, v)
        else:
            rows = torch.arange(k.shape[0], device=k.device)[:, None]  # (B, 1)
            K[rows, :, call.positions] = k.transpose(1, 2)  # (B, T, Hkv, D) written by index
            V[rows, :, call.positions] = v.transpose(1, 2)
        # keys 0..n_keys-1; those past a row's own positions are stale: its mask hides them
        return kernel(q, K[:, :, :call.n_keys], V[:, :, :call.n_keys], call.mask)

    def truncate(self, length: int | torch.Tensor) -> None:
        """Roll rows back to their first ``length`` positions (an int for every row, or (B,) one per row):
        the cache then behaves exactly as one that never saw the later tokens (speculative decoding's
        rollback of rejected draft tokens). Their keys stay in memory, masked, until a call overwrites them.
        The engine's paged view has no truncate: it lives for one step, and a paged rollback is the
        scheduler's (a sequence's computed tokens and its block table)."""
        if isinstance(length, torch.Tensor):
            check_integer_tensor("length", length)
            if length.shape != self.lengths.shape:
                raise ValueError(f"length has shape {tuple(length.shape)}; give one per row: ({self.batch_size},)")
            new = length.to(self.lengths.device)  # (B,)
        else:
            new = torch.full_like(self.lengths, check_int("length", length, minimum=0))
        bad = ((new < 0) | (new > self.lengths)).nonzero()
        if len(bad):
            row = int(bad[0])
            raise ValueError(f"cannot truncate row {row} to {int(new[row])} positions: it holds "
                             f"{int(self.lengths[row])}, and a length must be in [0, {int(self.lengths[row])}]")
        self.lengths = new.clone()

    def reset(self) -> None:
        """Forget every row (the memory stays allocated)."""
        self.lengths = torch.zeros_like(self.lengths)  # a new tensor: lengths may come from inference mode
