"""Inference arithmetic: KV-cache and weight bytes, FLOPs per token, capacity planning.

Everything here is computed from a config's shapes alone, so it works on the shape-only presets
(LLaMA-7B, LLaMA-13B, Llama-2-70B) without allocating them. Bytes are plain integers; convert them
for display with ``format_bytes``, which keeps decimal (MB = 10^6, GB = 10^9) and binary
(MiB = 2^20, GiB = 2^30) units apart.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..config import ModelConfig, get_config
from ..intmath import ceil_div
from ..validate import check_int, check_number

BYTES_PER_ELEMENT: dict[str, int] = {
    "float32": 4, "bfloat16": 2, "float16": 2,
    "fp8": 1, "int8": 1,  # 1-byte caches (scales per block ignored)
}
UNITS: dict[str, int] = {
    "B": 1, "kB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}


def bytes_per_element(dtype: str | torch.dtype) -> int:
    """Bytes of one element: a name in ``BYTES_PER_ELEMENT`` or a torch dtype (its itemsize)."""
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    if not isinstance(dtype, str):
        raise TypeError(f"dtype={dtype!r} must be a str or torch.dtype")
    if dtype not in BYTES_PER_ELEMENT:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {list(BYTES_PER_ELEMENT)}")
    return BYTES_PER_ELEMENT[dtype]


def _config(config: ModelConfig | str) -> ModelConfig:
    """A ModelConfig, or a preset name resolved to one."""
    if isinstance(config, str):
        return get_config(config)
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig or a preset name, got {type(config).__name__}")
    return config


# --- memory --------------------------------------------------------------------------------------

def kv_bytes_per_token(config: ModelConfig | str,
                       dtype: str | torch.dtype = "float16") -> int:
    """K and V of one token, all layers: 2 x n_layers x n_kv_heads x head_dim x bytes."""
    c = _config(config)
    return 2 * c.n_layers * c.n_kv_heads * c.head_dim * bytes_per_element(dtype)


def kv_cache_bytes(config: ModelConfig | str, seq_len: int, batch_size: int = 1,
                   dtype: str | torch.dtype = "float16",
                   window: int | None = None) -> int:
    """KV cache of ``batch_size`` sequences of ``seq_len`` tokens:
    2 x L x H_kv x S x D x bytes x B.

    ``window``: sliding-window attention keeps only the last ``window`` positions, so
    S = min(seq_len, window). GQA/MQA enter through ``config.n_kv_heads``.
    """
    check_int("seq_len", seq_len)
    check_int("batch_size", batch_size)
    kept = seq_len if window is None else min(seq_len, check_int("window", window))
    return kv_bytes_per_token(config, dtype) * kept * batch_size


def weight_bytes(config: ModelConfig | str, dtype: str | torch.dtype = "float16") -> int:
    """All parameters (tied embeddings counted once) x bytes per element."""
    return _config(config).n_params * bytes_per_element(dtype)


def kv_share(config: ModelConfig | str, seq_len: int, batch_size: int = 1,
             dtype: str | torch.dtype = "float16", weight_dtype: str | torch.dtype = "float16") -> float:
    """Fraction of (weights + KV cache) that the KV cache takes."""
    kv = kv_cache_bytes(config, seq_len, batch_size, dtype)
    return kv / (kv + weight_bytes(config, weight_dtype))


# --- FLOPs and bytes moved -----------------------------------------------------------------------

def matmul_params(config: ModelConfig | str) -> int:
    """Weights that multiply every token: attention and MLP projections plus ``lm_head``.

    The embedding lookup (no multiply) and the norms (element-wise) are left out; with tied
    embeddings the shared matrix still counts once, as ``lm_head``.
    """
    c = _config(config)
    counts = c.param_counts()
    return counts["attention"] + counts["mlp"] + c.vocab_size * c.d_model


def _attention_flops_per_query(config: ModelConfig, n_keys: int) -> int:
    """QK^T and AV for one query position attending ``n_keys`` keys, all layers: 4 x L x H x D x S."""
    return 4 * config.n_layers * config.n_heads * config.head_dim * n_keys


def prefill_flops(config: ModelConfig | str, prompt_len: int) -> int:
    """Matmul FLOPs of one forward pass over ``prompt_len`` tokens (no cache before it).

    2 x matmul_params x T for the projections, plus the causal attention term: the query at
    position p (0-based) attends p + 1 keys, so QK^T and AV cost 4 x L x H x D x T(T+1)/2.
    (A dense kernel that computes the masked half too does about twice the attention work.)
    """
    c = _config(config)
    t = check_int("prompt_len", prompt_len)
    return 2 * matmul_params(c) * t + _attention_flops_per_query(c, t * (t + 1) // 2)


def decode_flops(config: ModelConfig | str, context_len: int) -> int:
    """Matmul FLOPs of one decode step of one sequence whose new token attends ``context_len``
    positions (itself included): 2 x matmul_params + 4 x L x H x D x context_len."""
    c = _config(config)
    return 2 * matmul_params(c) + _attention_flops_per_query(c, check_int("context_len", context_len))


def generation_flops(config: ModelConfig | str, prompt_len: int, new_tokens: int,
                     use_cache: bool = True) -> int:
    """Total matmul FLOPs to generate ``new_tokens`` after a ``prompt_len`` prompt (batch 1).

    Cached: one prefill over the prompt, then ``new_tokens - 1`` decode steps (the last token is
    never fed back). Naive: a full forward over prompt_len + i tokens for i = 0 .. new_tokens-1.
    """
    check_int("prompt_len", prompt_len)
    check_int("new_tokens", new_tokens)
    if use_cache:
        return prefill_flops(config, prompt_len) + sum(
            decode_flops(config, prompt_len + i + 1) for i in range(new_tokens - 1))
    return sum(prefill_flops(config, prompt_len + i) for i in range(new_tokens))


def streamed_weight_bytes(config: ModelConfig | str, dtype: str | torch.dtype = "float16") -> int:
    """Weight bytes one forward pass reads: all parameters except an untied embedding table
    (a lookup reads only the rows of the batch's tokens)."""
    c = _config(config)
    embed = 0 if c.tie_embeddings else c.param_counts()["embed_tokens"]
    return (c.n_params - embed) * bytes_per_element(dtype)


def decode_bytes(config: ModelConfig | str, context_len: int, batch_size: int = 1,
                 dtype: str | torch.dtype = "float16") -> int:
    """Bytes one decode step reads: the weights once for the whole batch, plus each row's KV cache
    of ``context_len`` positions (same dtype for both)."""
    return (streamed_weight_bytes(config, dtype)
            + kv_cache_bytes(config, context_len, batch_size, dtype))


def prefill_bytes(config, prompt_len: int, batch_size: int = 1, dtype: str | torch.dtype = "float16") -> int:
    """Least bytes one prefill moves: the weights read once, plus the K and V it writes for
    ``batch_size`` prompts of ``prompt_len`` tokens. Activations are left out, so this is a lower
    bound on traffic (and the intensity computed from it an upper bound)."""
    return streamed_weight_bytes(config, dtype) + kv_cache_bytes(config, prompt_len, batch_size, dtype)


def arithmetic_intensity(flops: int | float, bytes_moved: int | float) -> float:
    """FLOPs per byte moved."""
    check_number("flops", flops, inclusive=True)
    check_number("bytes_moved", bytes_moved)
    return flops / bytes_moved


# --- capacity ------------------------------------------------------------------------------------


# --- allocation waste (reserve max_len vs blocks) -----------------------------------------------

def reserved_slots(lengths: Sequence[int], max_len: int | None = None,
                   block_size: int | None = None) -> int:
    """Token slots of KV cache reserved for sequences of these lengths.

    Exactly one of: ``max_len`` (every sequence reserves max_len slots up front) or ``block_size``
    (each sequence holds ceil(length / block_size) blocks, as a paged cache does).
    """
    if (max_len is None) == (block_size is None):
        raise ValueError(f"give exactly one of max_len={max_len!r} and block_size={block_size!r}")
    lengths = [check_int("length", n) for n in lengths]
    if not lengths:
        raise ValueError("lengths is empty; give at least one sequence length")
    if max_len is not None:
        check_int("max_len", max_len)
        if max(lengths) > max_len:
            raise ValueError(f"a sequence of length {max(lengths)} exceeds max_len={max_len}")
        return max_len * len(lengths)
    check_int("block_size", block_size)
    return sum(ceil_div(n, block_size) * block_size for n in lengths)


def allocation_waste(lengths: Sequence[int], max_len: int | None = None,
                     block_size: int | None = None) -> float:
    """Fraction of reserved KV slots that hold no token: 1 - sum(lengths) / reserved_slots."""
    return 1 - sum(lengths) / reserved_slots(lengths, max_len, block_size)


# --- weight-only quantization and the bandwidth bound --------------------------------------------

def quantized_weight_bytes(config: ModelConfig | str, bits: int, group_size: int | None = None,
                           scale_bytes: int = 2, dtype: str | torch.dtype = "float16") -> int:
    """Weight bytes one decode step streams when the matmul weights (``matmul_params``) are stored
    in ``bits`` bits, with ``scale_bytes`` of scales per group (one group per output row when
    ``group_size`` is None, else per ``group_size`` weights of a row). The norms stay in ``dtype``;
    an untied embedding table is not streamed (``streamed_weight_bytes``).
    """
    c = _config(config)
    if bits not in (2, 3, 4, 8, 16):
        raise ValueError(f"bits={bits!r}; choose one of (2, 3, 4, 8, 16)")
    check_int("scale_bytes", scale_bytes, minimum=0)
    rows = c.n_layers * (c.n_heads * c.head_dim + 2 * c.n_kv_heads * c.head_dim + c.d_model
                         + 2 * c.d_ff + c.d_model) + c.vocab_size  # output rows of every matmul
    if group_size is None:
        groups = rows
    else:
        check_int("group_size", group_size)
        groups = ceil_div(matmul_params(c), group_size)
    norms = (2 * c.n_layers + 1) * c.d_model * bytes_per_element(dtype)
    return ceil_div(matmul_params(c) * bits, 8) + groups * scale_bytes + norms


def bandwidth_bound_steps_per_s(bytes_per_step: int | float, bandwidth: float) -> float:
    """The most decode steps per second a memory system of ``bandwidth`` bytes/s allows when every
    step reads ``bytes_per_step``: bandwidth / bytes_per_step."""
    check_number("bytes_per_step", bytes_per_step)
    check_number("bandwidth", bandwidth)
    return bandwidth / bytes_per_step


def bandwidth_utilisation(bytes_per_step: int | float, steps_per_s: float, bandwidth: float) -> float:
    """Fraction of ``bandwidth`` (bytes/s) a decode loop achieves: bytes_per_step x steps_per_s /
    bandwidth (gpt-fast's "bandwidth achieved", as a fraction)."""
    check_number("steps_per_s", steps_per_s, inclusive=True)
    return steps_per_s / bandwidth_bound_steps_per_s(bytes_per_step, bandwidth)


# --- display -------------------------------------------------------------------------------------

def format_bytes(n_bytes: int | float, unit: str, digits: int = 2) -> str:
    """``n_bytes`` in one explicit unit, e.g. ``format_bytes(2**30, "GB") == "1.07 GB"``."""
    if unit not in UNITS:
        raise ValueError(f"unknown unit {unit!r}; choose one of {list(UNITS)}")
    if not isinstance(n_bytes, (int, float)) or isinstance(n_bytes, bool) or not math.isfinite(n_bytes):
        raise TypeError(f"n_bytes={n_bytes!r} must be a finite number")
    return f"{n_bytes / UNITS[unit]:,.{digits}f} {unit}"
