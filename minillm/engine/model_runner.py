"""Turns a step's plan into model calls: one mixed call, or (the old way) one call per prefill plus
one batched decode call. Returns the logits of every row that samples a token."""
from __future__ import annotations

import torch

from .paged_cache import MixedStepView, PagedCacheView, PagedKVPool
from .scheduler import StepPlan


class ModelRunner:
    """Runs one model over a paged KV pool (vLLM's name for the part that builds the input tensors).

    A plan is a list of batches: the decode rows as one ``(B, 1)`` batch (static padding rows
    included), then each prefill chunk as a ``(1, t)`` batch. ``mixed``: all of them in one model
    call, laid out back to back in one row of tokens (``MixedStepView``); otherwise each batch in a
    call of its own.
    """

    def __init__(self, model, pool: PagedKVPool):
        self.model, self.pool = model, pool

    def run(self, plan: StepPlan, mixed: bool) -> tuple[torch.Tensor, int]:
        """-> (the logits of ``plan.sampled``, in that order (n, vocab), the number of model calls made)."""
        batches = self._batches(plan)
        if not mixed or len(batches) == 1:
            logits = [self.model(ids, positions, cache).flatten(0, 1)[rows]  # (rows, vocab)
                      for ids, positions, cache, rows in batches]
            return torch.cat(logits), len(batches)
        ids = torch.cat([ids.flatten() for ids, _, _, _ in batches])[None]  # (1, N): batches back to back
        positions = torch.cat([p.flatten() for _, p, _, _ in batches])[None]  # (1, N)
        cache = MixedStepView([(*i.shape, c) for i, _, c, _ in batches], self.model.config.n_groups)
        rows, offset = [], 0
        for batch_ids, _, _, batch_rows in batches:
            rows += [offset + r for r in batch_rows]
            offset += batch_ids.numel()
        return self.model(ids, positions, cache)[0, rows], 1  # (n, vocab)

    def _batches(self, plan: StepPlan) -> list[tuple[torch.Tensor, torch.Tensor, PagedCacheView, list[int]]]:
        """(ids, positions, cache, the token indices whose logits are sampled) of each batch."""
        device, batches = self.model.device, []
        rows = [(s, s.num_tokens - 1) for s in plan.decode] + [(s, s.num_tokens - 2) for s in plan.padding]
        if rows:  # every running row at its own position, plus static padding rows
            ids = torch.tensor([[s.token_at(p)] for s, p in rows], device=device)  # (B, 1)
            positions = torch.tensor([[p] for _, p in rows], device=device)  # (B, 1)
            cache = PagedCacheView(self.pool, [s.block_table for s, _ in rows], [p for _, p in rows])
            batches.append((ids, positions, cache, list(range(len(plan.decode)))))
        for seq, n in plan.prefill:
            start = seq.num_computed
            ids = torch.tensor([seq.tokens[start:start + n]], device=device)  # (1, n)
            positions = torch.arange(start, start + n, device=device)[None]  # (1, n)
            last = [n - 1] if plan.finishes_prefill(seq, n) else []  # the same test as ``plan.sampled``
            batches.append((ids, positions, PagedCacheView(self.pool, [seq.block_table], [start]), last))
        return batches
