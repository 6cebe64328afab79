"""The engine's settings, checked once, and the rules derived from them: the default KV pool size and
the longest request the pool can hold."""
from __future__ import annotations

from dataclasses import dataclass

from ..validate import check_int
from .block_manager import blocks_for

POLICIES = ("continuous", "static")
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # a step's token budget unless told (vLLM's varies by version and GPU)
DEFAULT_TOKENS_PER_SEQUENCE = 2048  # the default pool's tokens per batch slot, at most (see EngineConfig)


def kv_tokens_needed(total_tokens: int) -> int:
    """KV slots a request of ``total_tokens`` = prompt + max_tokens needs at most: one fewer, since its
    last token is never fed back (nothing is sampled after it, so its K and V are never computed)."""
    return total_tokens - 1


@dataclass(frozen=True)
class EngineConfig:
    """What an ``Engine`` is built from; every field is checked here, once.

    ``num_blocks`` x ``block_size`` tokens is the KV budget, allocated once. The default pool size, the
    one rule for it (see ``pool_blocks``): room for ``max_batch_size`` sequences of the model's whole
    context, each capped at ``DEFAULT_TOKENS_PER_SEQUENCE`` tokens. Up to the cap (the tiny model's
    whole context) nothing is ever preempted; the cap keeps a long-context model (SmolLM2's 8192 tokens)
    from reserving gigabytes by default: a longer request may then be preempted, or rejected if the
    whole pool cannot hold it.

    Every step is one model call over every decode token and prefill chunk, back to back (chunked
    prefill, Sarathi-Serve's mixed step): at most ``max_num_batched_tokens`` tokens (default
    ``DEFAULT_MAX_NUM_BATCHED_TOKENS``, at least ``max_batch_size``), at most ``max_prefill_chunk`` of
    one request (default: the budget), so a long prompt is prefilled over several steps.
    ``enable_prefix_caching``: full KV blocks are shared between requests whose tokens start the same
    way (continuous policy only: static padding rows rewrite cached positions).
    """

    policy: str = "continuous"
    max_batch_size: int = 8
    num_blocks: int | None = None  # None: the default pool (pool_blocks)
    block_size: int = 16
    eos_token_id: int | None = None
    max_num_batched_tokens: int | None = None  # None: DEFAULT_MAX_NUM_BATCHED_TOKENS, or max_batch_size if more
    max_prefill_chunk: int | None = None
    enable_prefix_caching: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {POLICIES}")
        check_int("max_batch_size", self.max_batch_size)
        if self.num_blocks is not None:
            check_int("num_blocks", self.num_blocks)
        check_int("block_size", self.block_size)
        if self.eos_token_id is not None:
            check_int("eos_token_id", self.eos_token_id, minimum=0)
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_batch_size))
        check_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_num_batched_tokens < self.max_batch_size:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_batch_size="
                             f"{self.max_batch_size}: every running request's decode token must fit in a step")
        if self.max_prefill_chunk is not None:
            check_int("max_prefill_chunk", self.max_prefill_chunk)
        if self.enable_prefix_caching and self.policy == "static":
            raise ValueError("enable_prefix_caching needs policy='continuous' (static padding rows "
                             "recompute positions that cached blocks may share)")

    def pool_blocks(self, max_seq_len: int) -> int:
        """The pool's blocks for a model of context ``max_seq_len``: ``num_blocks``, or the default rule
        (``max_batch_size`` sequences of ``min(max_seq_len, DEFAULT_TOKENS_PER_SEQUENCE)`` tokens)."""
        if self.num_blocks is not None:
            return self.num_blocks
        return self.max_batch_size * blocks_for(min(max_seq_len, DEFAULT_TOKENS_PER_SEQUENCE), self.block_size)
