"""Turns a step's plan into one model call and returns the logits of every row that samples a token."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import CacheView
from ..model import CausalLM
from .paged_cache import MixedStepView, PagedCacheView, PagedKVPool
from .request import Sequence
from .scheduler import StepPlan


@dataclass(frozen=True)
class CallBatch:
    """One batch of a step: token ids and positions (B, t), its cache view, the rows that sample."""

    ids: torch.Tensor  # (B, t) token ids
    positions: torch.Tensor  # (B, t) their positions
    cache: PagedCacheView  # the rows' block tables and cached lengths
    sampled_rows: list[int]  # indices into the flattened (B * t) tokens whose logits give a token


def padding_position(seq: Sequence) -> int:
    """Where a static padding row is fed: its last cached position.

    A finished sequence of a static batch stays in the batch (a fixed-shape batch on a GPU computes
    every row until the whole batch is done). Its cache holds every token but the last
    (``num_computed = num_tokens - 1``), so feeding the token at ``num_computed - 1`` (that is,
    ``num_tokens - 2``) recomputes K and V that the cache already holds, into the slot that holds them
    (the sequence never reads them again); its logits are thrown away."""
    return seq.num_computed - 1


class ModelRunner:
    """Runs one model over a paged KV pool (vLLM's name for the part that builds the input tensors).

    A plan is a list of batches: the decode rows as one ``(B, 1)`` batch (static padding rows
    included), then each prefill chunk as a ``(1, t)`` batch. A step runs them in one model call, laid
    out back to back in one row of tokens (``MixedStepView``); a step of one batch runs it as it is.

    The call is the model's unchecked ``compute``: the engine has checked every token id when it
    admitted the request (each sampled id indexes the logits' vocabulary axis, so it is in range too),
    and every position lies below the context (``Engine.max_total_tokens``).
    """

    def __init__(self, model: CausalLM, pool: PagedKVPool):
        self.model, self.pool = model, pool

    def run(self, plan: StepPlan) -> torch.Tensor:
        """-> the logits of ``plan.sampled``, in that order: (n, vocab)."""
        batches = self._batches(plan)
        if len(batches) == 1:
            (b,) = batches
            return self._call(b.ids, b.positions, b.cache).flatten(0, 1)[b.sampled_rows]  # (n, vocab)
        ids = torch.cat([b.ids.flatten() for b in batches])[None]  # (1, N): batches back to back
        positions = torch.cat([b.positions.flatten() for b in batches])[None]  # (1, N)
        cache = MixedStepView([(*b.ids.shape, b.cache) for b in batches])
        rows, offset = [], 0
        for b in batches:
            rows += [offset + r for r in b.sampled_rows]
            offset += b.ids.numel()
        return self._call(ids, positions, cache)[0, rows]  # (n, vocab)

    def _call(self, ids: torch.Tensor, positions: torch.Tensor, cache: CacheView) -> torch.Tensor:
        """ids, positions (B, T) -> logits (B, T, vocab), the cache written and advanced."""
        cache.begin(positions)
        logits = self.model.compute(ids, positions, cache)
        cache.end(positions)
        return logits

    def _batches(self, plan: StepPlan) -> list[CallBatch]:
        device, batches = self.model.device, []
        rows = [(s, s.num_tokens - 1) for s in plan.decode] + [(s, padding_position(s)) for s in plan.padding]
        if rows:  # every running row at its own position, plus static padding rows
            ids = torch.tensor([[s.token_at(p)] for s, p in rows], device=device)  # (B, 1)
            positions = torch.tensor([[p] for _, p in rows], device=device)  # (B, 1)
            cache = PagedCacheView(self.pool, [s.block_table for s, _ in rows], [p for _, p in rows])
            batches.append(CallBatch(ids, positions, cache, list(range(len(plan.decode)))))
        for seq, n in plan.prefill:
            start = seq.num_computed
            ids = torch.tensor([seq.tokens[start:start + n]], device=device)  # (1, n)
            positions = torch.arange(start, start + n, device=device)[None]  # (1, n)
            last = [n - 1] if plan.finishes_prefill(seq, n) else []  # the same test as ``plan.sampled``
            batches.append(CallBatch(ids, positions, PagedCacheView(self.pool, [seq.block_table], [start]), last))
        return batches
