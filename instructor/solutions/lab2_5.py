"""Reference solutions of lab 2.5 (book/labs/lab2_5_precision.ipynb), for instructors."""
import statistics

import torch


def quantize_int8(weight):
    """Symmetric int8, one scale per output row: weight ~ q * scales[:, None]."""
    amax = weight.abs().amax(dim=1)  # (out,)
    scales = torch.where(amax > 0, amax / 127, torch.ones_like(amax))  # (out,)
    q = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)  # (out, in)
    return q, scales


def quantize_int4(weight):
    """4 bits a weight, a scale and a minimum per 32 weights of a row: q * scale + min."""
    out, width = weight.shape
    groups = weight.reshape(out, width // 32, 32)  # (out, G, 32)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # (out, G)
    scales = torch.where(high > low, (high - low) / 15, torch.ones_like(low))  # (out, G)
    q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15)  # (out, G, 32)
    return q.reshape(out, width).to(torch.uint8), scales, low


def bytes_per_step(model, context_len):
    """Bytes one decode step of one sequence reads: its weights once, and the KV cache."""
    table = model.model.embed_tokens.weight
    tied = any(t.data_ptr() == table.data_ptr() for t in model.lm_head.state_dict().values())
    seen, total = set(), 0
    for tensor in model.state_dict().values():
        if tensor.data_ptr() in seen or (tensor.data_ptr() == table.data_ptr() and not tied):
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    c = model.config
    kv = 2 * c.n_layers * c.n_kv_heads * c.head_dim * context_len * model.dtype.itemsize
    return total + kv


def predict_tokens_per_s(step_bytes, bandwidth_gb_s):
    """The most decode steps a second, each reading step_bytes at bandwidth_gb_s GB/s."""
    return bandwidth_gb_s * 1e9 / step_bytes


def decode_tokens_per_s(start, token_times):
    """The steady decode rate (tokens/s): 1 / the median gap between consecutive tokens."""
    if len(token_times) < 2:
        raise ValueError(f"{len(token_times)} token time(s): a rate needs at least two tokens")
    gaps = [b - a for a, b in zip(token_times, token_times[1:])]
    return 1 / statistics.median(gaps)
