"""Reference solutions of lab 2.1 (book/labs/lab2_1_attention.ipynb), for instructors."""
import math

import torch


def apply_rope(x, positions, theta):
    """Rotate each head's vector by its position (rotary embedding, rotate-half layout)."""
    D = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, D, 2, dtype=torch.float32, device=x.device) / D)  # (D/2,)
    angles = positions[:, None, :, None].float() * inv_freq  # (B, 1, T, D/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : D // 2], x[..., D // 2:]  # the pairs (x1[i], x2[i])
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def causal_attention(q, k, v, positions):
    """Softmax attention of each query over the keys at or before its position."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)  # (B, H, S, D): head h reads kv head h // groups
    v = v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    key_positions = torch.arange(k.shape[2], device=q.device)  # (S,)
    visible = key_positions[None, None, None, :] <= positions[:, None, :, None]  # (B, 1, T, S)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v  # (B, H, T, D)


def next_token_probs(logits, temperature, top_k, top_p):
    """The distribution the next token is drawn from."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the more likely tokens
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, before >= top_p)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
