"""Instruments that only the chapters use: counting the kernels a call runs, timing the engine's mixed step
against separate calls, serving an engine step by step while noting what each step did, reading which
bfloat16 instructions the CPU reports, and recording attention weights around any cache view."""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ..cache import CacheView, Kernel, Mask, NoCache, SquareCausal
from ..engine import MixedStepView, PagedCacheView, PagedKVPool, blocks_for
from ..validate import check_int


class _OpCounter(TorchDispatchMode):
    """Counts the tensor operations that reach the kernels, views (no work) left out."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def count_ops(fn) -> int:
    """Tensor operations one call of ``fn()`` runs (views excluded). Eagerly each is a
    kernel of its own: on a GPU, at least one launch, a fixed cost however few bytes."""
    with torch.inference_mode(), _OpCounter() as counter:
        fn()
    return counter.count


def mixed_step_calls(model, decode_rows: int, context_len: int, chunk_lens,
                     block_size: int = 16, seed: int = 0) -> dict[str, Callable]:
    """The calls that time one mixed step against its parts, on one paged KV pool.

    ``"decode"``: ``decode_rows`` rows each feed one token that attends ``context_len``
    positions (the earlier ones hold zeros, as in ``time_decode_step``). For each ``C`` of
    ``chunk_lens``, ``"chunk C"``: a prefill chunk of ``C`` random tokens at position 0,
    and ``"fused C"``: the decode tokens then the chunk in one row, one call, as the
    engine's mixed step (``MixedStepView``). Each call returns its logits, one row per
    token: ``(decode_rows, vocab)``, ``(C, vocab)``, ``(decode_rows + C, vocab)``; every
    call of a kind repeats the same work.
    """
    B = check_int("decode_rows", decode_rows)
    last = check_int("context_len", context_len) - 1
    chunk_lens = [check_int(f"chunk_lens[{i}]", C) for i, C in enumerate(chunk_lens)]
    if not chunk_lens:
        raise ValueError("chunk_lens=[] must name at least one chunk length")
    check_int("block_size", block_size)
    c, device = model.config, model.device
    per_row = blocks_for(context_len, block_size)
    pool = PagedKVPool(c, B * per_row + blocks_for(max(chunk_lens), block_size),
                       block_size, device, model.dtype)
    rows = [list(range(i * per_row, (i + 1) * per_row)) for i in range(B)]  # block tables
    chunk_table = list(range(B * per_row, pool.num_blocks))
    gen = torch.Generator().manual_seed(seed)
    dec_ids = torch.randint(c.vocab_size, (B, 1), generator=gen).to(device)  # (B, 1)
    dec_pos = torch.full((B, 1), last, device=device)  # (B, 1)

    def decode_cache():
        return PagedCacheView(pool, rows, [last] * B)

    @torch.inference_mode()
    def decode():
        return model(dec_ids, dec_pos, decode_cache())[:, -1]  # (B, vocab)

    def chunk_pair(ids):  # ids: (1, C)
        pos = torch.arange(ids.shape[1], device=device)[None]  # (1, C)

        @torch.inference_mode()
        def chunk():
            cache = PagedCacheView(pool, [chunk_table], [0])
            return model(ids, pos, cache)[0]  # (C, vocab)

        @torch.inference_mode()
        def fused():
            parts = [(B, 1, decode_cache()),
                     (1, ids.shape[1], PagedCacheView(pool, [chunk_table], [0]))]
            row = torch.cat([dec_ids.flatten(), ids.flatten()])[None]  # (1, B + C)
            row_pos = torch.cat([dec_pos.flatten(), pos.flatten()])[None]  # (1, B + C)
            cache = MixedStepView(parts)
            return model(row, row_pos, cache)[0]  # (B + C, vocab)

        return chunk, fused

    calls = {"decode": decode}
    for C in chunk_lens:
        ids = torch.randint(c.vocab_size, (1, C), generator=gen).to(device)  # (1, C)
        calls[f"chunk {C}"], calls[f"fused {C}"] = chunk_pair(ids)
    return calls


def cpu_bfloat16_instructions() -> list[str] | None:
    """The CPU's bfloat16 instruction sets named in /proc/cpuinfo ("avx512_bf16",
    "amx_bf16", Arm's "bf16"); [] when it has none; None without /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            flags = next((line.split(":", 1)[1].split() for line in info
                          if line.startswith(("flags", "Features"))), [])
    except OSError:
        return None
    names = ("avx512_bf16", "amx_bf16", "bf16")
    return sorted(flag for flag in set(flags) if flag in names)


def serve_live(engine, requests, late=None, at_step: int = 0) -> SimpleNamespace:
    """Serve ``requests`` with the engine's online interface (``add_request``, then ``step``
    until nothing is unfinished); ``late`` arrives after ``at_step`` steps.

    Returns what a chapter draws: ``times`` and ``tokens`` (per request id, each token's time
    and id), ``steps`` (each step's ``StepRecord``), ``tables`` and ``held`` (after each step,
    the block table and computed tokens of every running request, in order of admission) and
    ``arrival`` (the engine clock when ``late`` was added, or None).
    """
    check_int("at_step", at_step, minimum=0)
    live = SimpleNamespace(times=defaultdict(list), tokens=defaultdict(list), steps=[],
                           tables=[], held=[], arrival=None)
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished():
        if late is not None and len(live.steps) == at_step:
            engine.add_request(late)
            live.arrival = engine.clock()
        step = engine.step()
        for out in step.outputs:  # one StepOutput per request that got a token
            live.times[out.request_id].append(out.time)
            live.tokens[out.request_id] += out.new_token_ids
        live.steps.append(step.record)
        running = engine.scheduler.running
        live.tables.append({s.request.request_id: list(s.block_table) for s in running})
        live.held.append({s.request.request_id: s.num_computed for s in running})
    return live


def attention_weights(q: torch.Tensor, k: torch.Tensor, mask: Mask) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) under ``mask``: q (B, H, T, D), k (B, Hkv, S, D) -> (B, H, T, S), float32
    softmax. Written for reading, not speed: each kv head is copied to the query heads that share it."""
    G = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(G, dim=1)  # (B, H, S, D): query head h reads kv head h // G
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    if isinstance(mask, SquareCausal):
        mask = mask.dense()
    if mask is not None:  # (B, 1, T, S), the same for every head
        scores = scores.masked_fill(~mask, float("-inf"))
    return F.softmax(scores.float(), dim=-1).to(q.dtype)


class RecordingView:
    """Any cache view, with each layer's attention weights kept: a ``CacheView`` around ``inner`` (no cache
    when None) whose ``attend`` hands the inner view a kernel that notes the weights, then runs the model's
    own kernel. The logits are the model's own, bit for bit; the model knows nothing of it.

        recorder = RecordingView()            # or RecordingView(cache): a KVCache, a PagedCacheView
        logits = model(ids, cache=recorder)
        recorder.weights                      # per layer, (B, H, T, S) of this call

    A view that attends part by part (the engine's ``MixedStepView``) calls the kernel several times a layer:
    its weights are no single tensor, so that call raises ValueError and ``weights`` is left empty.
    """

    def __init__(self, inner: CacheView | None = None):
        self.inner = NoCache() if inner is None else inner
        self.weights: list[torch.Tensor] = []  # per layer, of the last call

    def default_positions(self, batch: int, length: int, device: torch.device) -> torch.Tensor:
        return self.inner.default_positions(batch, length, device)

    def begin(self, positions: torch.Tensor) -> None:
        self.weights = []  # a new call: nothing of the last one is kept
        self.inner.begin(positions)

    def attend(self, layer, q, k, v, kernel: Kernel) -> torch.Tensor:
        def recording(q, K, V, mask):
            if len(self.weights) > layer:
                self.weights = []  # no part of this call's weights is kept
                raise ValueError(f"layer {layer}'s attention ran in several pieces in one forward pass (a "
                                 "view that attends part by part, such as the engine's MixedStepView), so its "
                                 "weights are no single (B, H, T, S) tensor: record around one batch's view")
            self.weights.append(attention_weights(q, K, mask).detach())
            return kernel(q, K, V, mask)

        return self.inner.attend(layer, q, k, v, recording)

    def end(self, positions: torch.Tensor) -> None:
        self.inner.end(positions)
