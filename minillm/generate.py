"""Autoregressive generation: the naive path (recompute everything) and the cached path.

naive : every step runs the model on the whole sequence so far, prompt included.
cached: one prefill over the prompt fills the KV cache; each decode step feeds one token.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .cache import KVCache
from .model import CausalLM
from .sampling import SamplingParams, sample
from .timing import now
from .validate import as_prompt_tensor, check_int, check_lengths, check_seed


@dataclass(frozen=True)
class TokenEvent:
    """One generated token, stamped after the device finished computing it."""

    token_id: int
    index: int  # 0 for the first generated token
    phase: str  # "prefill" (the step that read the prompt) or "decode"
    time: float  # time.perf_counter() seconds, after synchronizing the device


def check_generation(model: CausalLM, prompt_ids, max_new_tokens: int, sampling: SamplingParams | None,
                     eos_token_id: int | None, seed: int | None) -> tuple[torch.Tensor, SamplingParams]:
    """The checks of every generation call, before its first step: -> the prompt (1, T) on the model's
    device and the sampling parameters (greedy when None)."""
    sampling = SamplingParams() if sampling is None else sampling
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling={sampling!r} must be a SamplingParams or None")
    vocab_size = model.config.vocab_size
    if eos_token_id is not None and check_int("eos_token_id", eos_token_id, minimum=0) >= vocab_size:
        raise ValueError(f"eos_token_id={eos_token_id} is outside the vocabulary [0, {vocab_size})")
    check_seed("seed", seed)
    ids = as_prompt_tensor(prompt_ids, vocab_size, model.device)  # (1, T)
    check_lengths(ids.shape[1], max_new_tokens, model.config.max_seq_len)
    return ids, sampling


def stream_generate(model: CausalLM, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
                    use_cache: bool = True, sampling: SamplingParams | None = None,
                    eos_token_id: int | None = None, seed: int | None = None, *,
                    cache: KVCache | None = None) -> Iterator[TokenEvent]:
    """Yield each new token as a TokenEvent; stops after EOS (which is yielded) or max_new_tokens.

    ``cache``: a batch-1 KVCache to reuse (it is reset first); by default the cached path allocates
    one of exactly prompt + max_new_tokens positions. Either way it never grows. Bad arguments
    raise here, at the call, not at the first ``next()``.
    """
    ids, sampling = check_generation(model, prompt_ids, max_new_tokens, sampling, eos_token_id, seed)
    if cache is not None:
        if not use_cache:
            raise ValueError("a cache was given with use_cache=False; the naive path uses no cache")
        if cache.batch_size != 1:
            raise ValueError(f"generate decodes one sequence; the cache has batch_size={cache.batch_size}, not 1")
        check_lengths(ids.shape[1], max_new_tokens, cache.max_len, "the cache's max_len")
        cache.reset()
    elif use_cache:
        cache = KVCache(model.config, 1, ids.shape[1] + max_new_tokens, model.device, model.dtype)
    return _stream(model, ids, max_new_tokens, cache, sampling, eos_token_id, seed)


@torch.inference_mode()
def _stream(model: CausalLM, ids: torch.Tensor, max_new_tokens: int, cache: KVCache | None,
            sampling: SamplingParams, eos_token_id: int | None, seed: int | None) -> Iterator[TokenEvent]:
    """The loop behind stream_generate; ``cache`` None is the naive path."""
    device = model.device
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    seq = ids  # (1, T + generated so far); the naive path feeds all of it every step
    logits = model(ids, cache=cache)[:, -1]  # prefill: (1, vocab)
    for index in range(max_new_tokens):
        token = sample(logits, sampling, generator)  # (1,)
        yield TokenEvent(int(token), index, "prefill" if index == 0 else "decode", now(device))
        if int(token) == eos_token_id or index == max_new_tokens - 1:
            return
        if cache is not None:
            logits = model(token[:, None], cache=cache)[:, -1]  # decode: one token in
        else:
            seq = torch.cat([seq, token[:, None]], dim=1)
            logits = model(seq)[:, -1]  # recompute the whole sequence


def generate(model: CausalLM, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
             use_cache: bool = True, sampling: SamplingParams | None = None,
             eos_token_id: int | None = None, seed: int | None = None, *,
             cache: KVCache | None = None) -> list[int]:
    """The new token ids (EOS included when it ends the run)."""
    return [e.token_id for e in stream_generate(model, prompt_ids, max_new_tokens, use_cache,
                                                sampling, eos_token_id, seed, cache=cache)]
