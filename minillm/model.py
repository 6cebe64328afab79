"""A LLaMA-style causal decoder in one readable file.

Module and parameter names follow Hugging Face's LLaMA (``model.embed_tokens``,
``model.layers.N.self_attn.q_proj``, ``mlp.gate_proj``, ``input_layernorm``, ``model.norm``,
``lm_head``), so a LLaMA-architecture state dict loads with no renaming table.

One ``forward`` serves every use:
  * the whole sequence, no cache (the naive path):       ``model(ids)``
  * prefill: the prompt written into a cache:            ``model(ids, cache=cache)``
  * decode: one new token per row, rows at any position: ``model(next_ids, cache=cache)``
Positions default to "right after what the cache holds"; they may be given per row. The model asks a
cache for four things only (``cache.CacheView``), so every cache, the engine's included, runs this code.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .cache import CacheView, Mask, NoCache, SquareCausal
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

    def frequencies(self, device) -> torch.Tensor:
        """theta^(-2i/head_dim) for i < head_dim/2: (head_dim/2,), in float32 whatever the model's dtype
        (rounded to bfloat16 they would rotate position 1000 by a wrong angle of up to 0.18 rad at head_dim
        32, 1.2 rad at 128). Computed at each call, so no buffer can be cast or left uninitialized."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
        return 1.0 / self.theta ** exponents

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions: (B, T) -> cos, sin: (B, 1, T, head_dim)."""
        freqs = positions[..., None].float() * self.frequencies(positions.device)  # (B, T, head_dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, head_dim)
        return emb.cos()[:, None].to(dtype), emb.sin()[:, None].to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the last dimension's two halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, head_dim) rotated by the angle of each position."""
    return x * cos + rotate_half(x) * sin


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: CacheView) -> torch.Tensor:
        """x: (B, T, d_model) -> (B, T, d_model). The cache writes this call's keys and values, then
        calls ``kernel`` on every key the queries may see, with its causal mask."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        out = cache.attend(self.layer_idx, q, k, v, self.kernel)  # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: (B, T, d_model) -> q (B, H, T, D), k, v (B, Hkv, T, D); q, k rotated."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, Hkv, D).transpose(1, 2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def kernel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: Mask) -> torch.Tensor:
        """q: (B, H, T, D) over k, v: (B, Hkv, S, D) -> (B, H, T, D).

        mask: (B, 1, T, S), True where a query may see a key (``cache.attention_mask``), None when
        every key is visible, or a fresh prompt's ``SquareCausal``.
        """
        if isinstance(mask, SquareCausal):
            if self.impl == "sdpa":  # the masked half of the scores is never computed
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            mask = mask.dense()
        B, _, T, _ = q.shape
        # GQA without copying K/V: the G query heads sharing a kv head become G*T rows of it.
        G = self.n_heads // self.n_kv_heads
        q = q.reshape(B, self.n_kv_heads, G * T, self.head_dim)  # (B, Hkv, G*T, D), rows ordered (g, t)
        if mask is not None:
            mask = grouped(mask, G)  # (B, 1, G*T, S), the rows' order
        if self.impl == "eager":
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, Hkv, G*T, S)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            out = F.softmax(scores.float(), dim=-1).to(q.dtype) @ v  # (B, Hkv, G*T, D)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, Hkv, G*T, D)
        # (B, H, T, D): head h uses kv head h // G. reshape, not view: CUDA's kernels
        # return `out` in another memory layout (copied then, viewed otherwise)
        return out.reshape(B, self.n_heads, T, self.head_dim)


def grouped(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, 1, T, S) -> (B, 1, groups*T, S), rows ordered (g, t): the layout of the grouped queries."""
    B, _, T, S = mask.shape
    return mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(B, 1, groups * T, S)


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

    def forward(self, x, cos, sin, cache: CacheView):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Embedding, the stack of decoder layers, final norm (Hugging Face's ``LlamaModel``).

    It has no ``forward``: it holds the modules under Hugging Face's names (``model.layers.N...``), so
    checkpoints load as they are, and ``CausalLM.compute`` runs them."""

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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: CacheView | None = None) -> torch.Tensor:
        """input_ids: (B, T) -> logits (B, T, vocab_size).

        positions: (B, T) absolute positions; by default 0..T-1, or, with a cache, each row's
        cache length onwards. With a cache the new keys/values are written into it at those
        positions and the cache's lengths advance (see ``cache.CacheView``).
        """
        view = NoCache() if cache is None else cache
        positions = self._check(input_ids, positions, view)
        view.begin(positions)
        logits = self.compute(input_ids, positions, view)
        view.end(positions)
        return logits

    def compute(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: CacheView) -> torch.Tensor:
        """The forward pass itself, without checks or host syncs: ``cache.begin(positions)`` has run."""
        x = self.model.embed_tokens(input_ids)  # (B, T, d_model)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, cache)
        return self.lm_head(self.model.norm(x))  # (B, T, vocab_size)

    def _check(self, input_ids: torch.Tensor, positions: torch.Tensor | None, cache: CacheView) -> torch.Tensor:
        """Check the arguments of ``forward``; -> the positions (B, T), by default the cache's."""
        self._check_input(input_ids)
        B, T = input_ids.shape
        if positions is None:
            positions = cache.default_positions(B, T, input_ids.device)  # (B, T)
        check_integer_tensor("positions", positions)
        if positions.shape != input_ids.shape:
            raise ValueError(f"positions shape {tuple(positions.shape)} != input_ids shape {tuple(input_ids.shape)}")
        limit, lo, hi = self.config.max_seq_len, int(positions.min()), int(positions.max())
        if hi >= limit or lo < 0:
            raise ValueError(f"positions span [{lo}, {hi}], outside [0, max_seq_len={limit})")
        return positions

    def _check_input(self, input_ids: torch.Tensor) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a 2-D tensor (batch, seq), got {type(input_ids).__name__} "
                             f"of shape {tuple(getattr(input_ids, 'shape', ()))}")
        check_integer_tensor("input_ids", input_ids)
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids is empty (sequence length 0); give at least one token")
        check_token_ids(input_ids, self.config.vocab_size)


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
    model = model.to_empty(device=device).to(dtype=dtype)
    if config.tie_embeddings:  # to_empty gives each module its own tensor; tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    return model
