"""Reference solutions of lab 2.2 (book/labs/lab2_2_kv_cache.ipynb), for instructors."""
import math

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


def read_paged(pool, block_table, lengths):
    """What attention reads from a paged pool: every row's first S positions, S = the longest row."""
    block_size, S = pool.shape[2], int(lengths.max())
    positions = torch.arange(S, device=pool.device)  # (S,)
    blocks = block_table[:, positions // block_size]  # (B, S): the physical block of each position
    kv = pool[blocks, :, positions % block_size]  # (B, S, H_kv, D), gathered by (block, slot)
    return kv.transpose(1, 2), positions[None, :] < lengths[:, None]


def make_room(block_tables, lengths, new_tokens, free_blocks, block_size):
    """Give each running row the blocks its next tokens need, evicting the newest rows when they run out."""
    def need(b):
        return max(0, math.ceil((lengths[b] + new_tokens[b]) / block_size) - len(block_tables[b]))

    running, evicted = [b for b in range(len(block_tables)) if new_tokens[b] > 0], []
    while running and sum(need(b) for b in running) > len(free_blocks):
        victim = running.pop()  # the most recently admitted
        free_blocks.extend(block_tables[victim])
        block_tables[victim].clear()
        evicted.append(victim)
    for b in running:
        for _ in range(need(b)):
            block_tables[b].append(free_blocks.pop(0))
    return evicted
