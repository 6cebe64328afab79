"""Reference solutions of lab 2.2 (book/labs/lab2_2_kv_cache.ipynb), for instructors."""
import torch


def write_kv(cache, new, positions):
    """Write new keys (or values) into the cache, in place, each at its own position."""
    rows = torch.arange(cache.shape[0], device=cache.device)[:, None]  # (B, 1)
    cache[rows, :, positions] = new.transpose(1, 2)  # (B, T, H_kv, D) placed by (row, position)


def read_kv(cache, lengths):
    """What attention reads: every row's first S positions, S = the longest row."""
    S = int(lengths.max())
    positions = torch.arange(S, device=cache.device)  # (S,)
    valid = positions[None, :] < lengths[:, None]  # (B, S)
    return cache[:, :, :S], valid


def kv_cache_bytes(n_layers, n_kv_heads, head_dim, seq_len, batch_size, bytes_per_element):
    """Bytes of the K and V of batch_size sequences of seq_len tokens."""
    return 2 * n_layers * n_kv_heads * head_dim * seq_len * batch_size * bytes_per_element


def write_paged(pool, block_table, new, positions):
    """Write new keys (or values) into a paged pool through each row's block table, in place."""
    block_size = pool.shape[2]
    rows = torch.arange(positions.shape[0], device=pool.device)[:, None]  # (B, 1)
    blocks = block_table[rows, positions // block_size]  # (B, T): each entry's physical block
    pool[blocks, :, positions % block_size] = new.transpose(1, 2)  # (B, T, H_kv, D) placed by (block, slot)
