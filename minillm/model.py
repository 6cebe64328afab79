"""A LLaMA-style causal decoder in one readable file.

Module and parameter names follow Hugging Face's LLaMA (``model.embed_tokens``,
``model.layers.N.self_attn.q_proj``, ``mlp.gate_proj``, ``input_layernorm``, ``model.norm``,
``lm_head``), so a LLaMA-architecture state dict loads with no renaming table.

One ``forward`` serves three uses:
  * the whole sequence, no cache (the naive path):       ``model(ids)``
  * prefill: the prompt written into a cache:            ``model(ids, cache=cache)``
  * decode: one new token per row, rows at any position: ``model(next_ids, cache=cache)``
Positions default to "right after what the cache holds"; they may be given per row.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig, get_config
from .device import resolve_device, resolve_dtype
from .validate import check_integer_tensor, check_seed, check_token_ids

ATTENTION_IMPLS = ("eager", "sdpa")


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 as LLaMA does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, rotate-half convention (Hugging Face LLaMA)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", self._frequencies("cpu"), persistent=False)  # (head_dim/2,)

    def _frequencies(self, device) -> torch.Tensor:
        """theta^(-2i/head_dim) for i < head_dim/2, in float32."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
        return 1.0 / self.theta ** exponents

    def _apply(self, fn, recurse=True):
        """``model.to(dtype)`` keeps the frequencies in float32. Rounded to bfloat16 they would rotate
        position 1000 by a wrong angle of up to 0.18 rad (head_dim 32) or 1.2 rad (head_dim 128)."""
        super()._apply(fn, recurse)
        self.inv_freq = self._frequencies(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions: (B, T) -> cos, sin: (B, 1, T, head_dim)."""
        freqs = positions[..., None].float() * self.inv_freq  # (B, T, head_dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, head_dim)
        return emb.cos()[:, None].to(dtype), emb.sin()[:, None].to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the last dimension's two halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, head_dim) rotated by the angle of each position."""
    return x * cos + rotate_half(x) * sin


def causal_mask(query_positions: torch.Tensor, n_keys: int) -> torch.Tensor:
    """Boolean mask (B, 1, T, S): query at position p may see key j exactly when j <= p.

    Keys are indexed by position (0..S-1), with or without a cache, so this one rule is the whole
    mask: lower-triangular for a fresh sequence, a single row for a decode step.
    """
    key_positions = torch.arange(n_keys, device=query_positions.device)  # (S,)
    return (key_positions[None, None, :] <= query_positions[:, :, None])[:, None]


class Attention(nn.Module):
    """Multi-head attention with grouped-query heads (n_kv_heads divides n_heads)."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        c = config
        self.layer_idx, self.n_heads, self.n_kv_heads, self.head_dim = layer_idx, c.n_heads, c.n_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.d_model, c.n_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.d_model, bias=False)
        self.impl = "sdpa"
        self.last_weights: torch.Tensor | None = None  # (B, n_heads, T, S) when recorded

    def forward(self, x, cos, sin, positions, mask, cache=None, record_weights: bool = False):
        """x: (B, T, d_model); mask: (B, 1, G*T, S) from ``attention_mask``, or None when
        every key is visible.

        A mixed cache (``cache.parts``: the engine's step, several batches laid out in one
        row of tokens) gets the projections computed once for all its tokens, and attention
        batch by batch.
        """
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, Hkv, D).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if hasattr(cache, "parts"):
            parts = cache.split(q, k, v)
            out = cache.join([self.attend(*part) for part in parts])  # (1, H, T, D)
        else:
            out = self.attend(q, k, v, positions, mask, cache, record_weights)  # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def attend(self, q, k, v, positions, mask, cache=None,
               record_weights: bool = False) -> torch.Tensor:
        """q: (B, H, T, D) and the new k, v: (B, Hkv, T, D) -> the output (B, H, T, D)."""
        B, _, T, _ = q.shape
        if cache is not None:
            # (B, Hkv, S, D), index = position
            k, v = cache.update(self.layer_idx, k, v, positions)
        # GQA without copying K/V: the G query heads sharing a kv head become G*T rows of it.
        G, S = self.n_heads // self.n_kv_heads, k.shape[2]
        # (B, Hkv, G*T, D), rows ordered (g, t)
        q = q.reshape(B, self.n_kv_heads, G * T, self.head_dim)
        if self.impl == "eager" or record_weights:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, Hkv, G*T, S)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            weights = F.softmax(scores.float(), dim=-1).to(q.dtype)
            if record_weights:
                self.last_weights = weights.detach().view(B, self.n_heads, T, S)
            out = weights @ v  # (B, Hkv, G*T, D)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, Hkv, G*T, D)
        # (B, H, T, D): head h uses kv head h // G
        return out.view(B, self.n_heads, T, self.head_dim)


def attention_mask(positions: torch.Tensor, n_keys: int, groups: int, cached: bool) -> torch.Tensor | None:
    """The causal mask of one forward pass, laid out for grouped heads: (B, 1, groups*T, n_keys), or None.

    Keys are indexed by position. With a cache, key j is visible to a query at position p iff j <= p
    (``causal_mask``); a decode step whose rows all sit at the last position sees every key, so it
    needs no mask at all. Without a cache the keys are the queries themselves.
    """
    B, T = positions.shape
    if cached:
        if T == 1 and n_keys - 1 == int(positions.min()):
            return None
        mask = causal_mask(positions, n_keys)  # (B, 1, T, S)
    else:
        mask = causal_mask(positions, T) if _is_arange(positions) else _pairwise_mask(positions)
    return mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(B, 1, groups * T, mask.shape[-1])


def _is_arange(positions: torch.Tensor) -> bool:
    """True when every row's positions are 0, 1, ..., T-1."""
    return bool((positions == torch.arange(positions.shape[1], device=positions.device)).all())


def _pairwise_mask(positions: torch.Tensor) -> torch.Tensor:
    """Causal mask by position for a cache-less call whose positions are not 0..T-1: (B, 1, T, T)."""
    return (positions[:, None, :] <= positions[:, :, None])[:, None]


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, positions, mask, cache=None, record_weights=False):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, mask, cache,
                               record_weights)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Embedding, the stack of decoder layers, final norm (Hugging Face's ``LlamaModel``)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)


class CausalLM(nn.Module):
    """The causal language model: ids -> next-token logits at every position."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: the embedding table's, which every activation starts from (never
        quantized, unlike the linear layers, ``lm_head`` included)."""
        return self.model.embed_tokens.weight.dtype

    def set_attention_impl(self, impl: str) -> CausalLM:
        """``"sdpa"`` (fused, default) or ``"eager"`` (explicit scores, mask and softmax)."""
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"unknown attention impl {impl!r}; choose one of {ATTENTION_IMPLS}")
        for layer in self.model.layers:
            layer.self_attn.impl = impl
        return self

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, cache=None,
                record_attention: bool = False) -> torch.Tensor:
        """input_ids: (B, T) -> logits (B, T, vocab_size).

        positions: (B, T) absolute positions; by default 0..T-1, or, with a cache, each row's
        cache length onwards. With a cache the new keys/values are written into it at those
        positions and the cache's lengths advance. ``record_attention`` keeps each layer's
        attention weights in ``layer.self_attn.last_weights``.
        """
        self._check_input(input_ids)
        B, T = input_ids.shape
        mixed = hasattr(cache, "parts")  # the engine's mixed step (see Attention.forward)
        if mixed and positions is None:
            raise ValueError("a mixed batch needs explicit positions")
        if cache is not None and not mixed and cache.lengths.shape[0] != B:
            raise ValueError(f"input_ids has {B} rows but the cache has batch_size={cache.lengths.shape[0]}")
        if positions is None:
            start = cache.lengths[:, None] if cache is not None else 0
            positions = start + torch.arange(T, device=input_ids.device)[None, :]  # (B, T)
            positions = positions.expand(B, T)
        check_integer_tensor("positions", positions)
        if positions.shape != input_ids.shape:
            raise ValueError(f"positions shape {tuple(positions.shape)} != input_ids shape {tuple(input_ids.shape)}")
        limit, lo, hi = self.config.max_seq_len, int(positions.min()), int(positions.max())
        if hi >= limit or lo < 0:
            raise ValueError(f"positions span [{lo}, {hi}], outside [0, max_seq_len={limit})")
        if cache is not None:
            cache.check_room(positions)
        mask = None  # a mixed step's parts bring their own masks
        if not mixed:
            n_keys = hi + 1 if cache is not None else T
            mask = attention_mask(positions, n_keys, self.config.n_groups, cache is not None)
        x = self.model.embed_tokens(input_ids)  # (B, T, d_model)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, positions, mask, cache, record_attention)
        if cache is not None:
            cache.commit(positions)
        return self.lm_head(self.model.norm(x))  # (B, T, vocab_size)

    def _check_input(self, input_ids: torch.Tensor) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a 2-D tensor (batch, seq), got {type(input_ids).__name__} "
                             f"of shape {tuple(getattr(input_ids, 'shape', ()))}")
        check_integer_tensor("input_ids", input_ids)
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids is empty (sequence length 0); give at least one token")
        check_token_ids(input_ids, self.config.vocab_size)

    def attention_weights(self) -> list[torch.Tensor]:
        """Per layer, the weights recorded by the last ``record_attention=True`` call: (B, H, T, S)."""
        return [layer.self_attn.last_weights for layer in self.model.layers]


def build_model(config: ModelConfig | str = "tiny", device="cpu", dtype="float32", seed: int | None = 0):
    """A randomly initialized model in eval mode.

    Embeddings ~ N(0, 1), each linear weight ~ N(0, 1/fan_in), norms 1. This keeps activations at
    unit scale through the stack, so an untrained model's next token depends on its whole context
    (with LLaMA's training init, std 0.02, a random model repeats one token forever, which hides
    bugs). Built on the CPU in float32, so a seed gives the same weights on any device.
    """
    config = get_config(config) if isinstance(config, str) else config
    device, dtype = resolve_device(device), resolve_dtype(dtype)
    generator = torch.Generator().manual_seed(seed) if check_seed("seed", seed) is not None else None
    model = CausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                continue
            std = 1.0 if "embed_tokens" in name else p.shape[1] ** -0.5
            p.normal_(0.0, std, generator=generator)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def empty_model(config: ModelConfig, device="cpu", dtype="float32") -> CausalLM:
    """A model with uninitialized weights on ``device`` in ``dtype``, ready for a checkpoint's state dict.

    Built on the meta device, so no time is spent drawing random weights that are overwritten next.
    """
    device, dtype = resolve_device(device), resolve_dtype(dtype)
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to_empty(device=device).to(dtype=dtype)  # the rotary frequencies are recomputed
    if config.tie_embeddings:  # to_empty gives each module its own tensor; tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    return model
