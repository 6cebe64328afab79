"""A decode step with static shapes, so that a compiler can trace it once.

``CausalLM.forward`` serves every use (prefill, decode, rows at mixed positions), so it
reads positions back to Python (``int(positions.max())``), picks a mask, and attends a
cache slice one position longer at every step: new shapes and host decisions each call,
which a compiler cannot capture once. The step here does one thing: each of B rows feeds
one token at its position and attends the *whole* preallocated cache, the positions not
yet written masked out (``StaticCacheView``, through the model's own layers). Its shapes never
change, so ``torch.compile`` traces it once (on a CPU it fuses the small element-wise operations
into generated C++ loops; on CUDA, mode ``"reduce-overhead"`` also records it as a CUDA graph
that replays with one launch).

    decoder = StaticDecoder(model, max_len=256)  # compiled where a compiler is present
    tokens = decoder.generate(prompt_ids, max_new_tokens=64)
    for event in decoder.stream(prompt_ids, 64, sampling, eos_token_id, seed): ...  # as stream_generate

What the compiled step still pays on a CPU each call is Python: the generated wrapper that
calls each kernel, and the guards that check the call's inputs before it runs. The guards
would check every weight of the model, each call; ``cpu_options`` turns those off (the
decoder's model must not change after it is built) along with the wrapper's size checks.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Iterator

import torch

from ..cache import Kernel, KVCache, causal_mask
from ..generate import TokenEvent, check_generation
from ..intmath import ceil_div
from ..model import CausalLM
from ..sampling import SamplingParams, sample
from ..timing import now
from ..validate import check_int, check_lengths
from .blockdot import BlockLinear

BACKENDS = ("auto", "compile", "eager")
CXX_NAMES = ("g++", "c++", "clang++")


class StaticCacheView:
    """A ``minillm.cache.CacheView`` of fixed shapes (gpt-fast's cache): every call
    attends all ``max_len`` preallocated positions, the mask made from the positions,
    no host sync.

    keys[i], values[i]: (B, n_kv_heads, max_len, head_dim) of layer i, e.g. a
    ``KVCache``'s ``k`` and ``v``. Written in place (their addresses never change, as a
    CUDA graph needs). It keeps no lengths (``end`` only forgets the call): the caller
    gives the positions and keeps the lengths.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.keys, self.values = keys, values
        self._positions = self._rows = self._mask = None

    def default_positions(self, batch: int, length: int,
                          device: torch.device) -> torch.Tensor:
        raise ValueError("the static view keeps no lengths: give the positions")

    def begin(self, positions: torch.Tensor) -> None:
        """positions: (B, T). Only tensor operations: the caller checks the room."""
        self._positions = positions
        B = positions.shape[0]
        self._rows = torch.arange(B, device=positions.device)[:, None]  # (B, 1)
        self._mask = causal_mask(positions, self.keys[0].shape[2])  # (B, 1, T, max_len)

    def attend(self, layer, q, k, v, kernel: Kernel) -> torch.Tensor:
        keys, values = self.keys[layer], self.values[layer]
        # (B, T, Hkv, D), each row at its positions
        keys[self._rows, :, self._positions] = k.transpose(1, 2)
        values[self._rows, :, self._positions] = v.transpose(1, 2)
        # every position; those after each query are masked
        return kernel(q, keys, values, self._mask)

    def end(self, positions: torch.Tensor) -> None:
        self._positions = self._rows = self._mask = None


def decode_step(model: CausalLM, keys: list[torch.Tensor], values: list[torch.Tensor],
                token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """One new token per row, written into the preallocated cache; logits (B, vocab).

    token: (B, 1) ids; position: (B,) where each row's token goes. keys[i], values[i]:
    (B, n_kv_heads, max_len, head_dim) of layer i, every position < ``position`` written.
    The model's own layers run through a ``StaticCacheView``: each call attends all
    max_len positions and masks those after ``position``.
    """
    cache = StaticCacheView(keys, values)
    positions = position[:, None]  # (B, 1)
    cache.begin(positions)
    logits = model.compute(token, positions, cache)  # (B, 1, vocab): no checks, no sync
    cache.end(positions)
    return logits[:, 0]


def find_compiler(device: torch.device) -> str | None:
    """What ``torch.compile`` needs, if present: a C++ compiler (CPU), Triton (CUDA)."""
    if device.type == "cuda":
        return "triton" if importlib.util.find_spec("triton") is not None else None
    for name in ((os.environ["CXX"],) if os.environ.get("CXX") else ()) + CXX_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def choose_backend(device: torch.device, backend: str = "auto") -> tuple[str, str]:
    """``(backend, reason)``: "compile" where torch.compile runs on ``device``, else
    "eager".

    On CUDA without Triton the step is still captured as a CUDA graph (torch.compile's
    "cudagraphs" backend), so "compile" is available on every GPU.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; choose one of {BACKENDS}")
    if backend == "eager":
        return "eager", "eager, as asked"
    compiler = find_compiler(device)
    if device.type == "cuda":
        how = "inductor + CUDA graphs" if compiler else "CUDA graphs only (no Triton)"
        return "compile", f"torch.compile, {how}"
    if compiler:
        return "compile", f"torch.compile (inductor, C++ compiler {compiler})"
    if backend == "compile":
        raise ValueError(f"backend='compile' needs a C++ compiler on the CPU; none of "
                         f"{CXX_NAMES} (or $CXX) is on the PATH")
    return "eager", (f"eager: no C++ compiler ({', '.join(CXX_NAMES)}) found, "
                     f"torch.compile cannot run")


def cpu_vector_width() -> dict[str, int]:
    """Inductor's option ``cpp.simdlen`` pinned to the vector width (bits) it picks now.

    Inductor writes its C++ loops for the width that ``ATEN_CPU_CAPABILITY`` selects (16 floats
    a vector on AVX-512, 8 on AVX2), but its FX graph cache key leaves the width out (torch
    2.13): a graph cached by an AVX-512 run and reloaded under ``ATEN_CPU_CAPABILITY=avx2`` is
    rebuilt with AVX2 flags, steps 16 floats with 8-float vectors and leaves half of each output
    unwritten (NaN logits); the other way round it writes past its buffers. The key holds the
    options, so with the width among them each ISA gets its own cache entry.
    """
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    return {"cpp.simdlen": pick_vec_isa().bit_width()}  # 0 where it does not vectorize


def cpu_options() -> dict:
    """The CPU compile's options, those this torch has: the vector width (``cpu_vector_width``),
    no guards on the model's modules and weights (each call checked every one of SmolLM2's 450
    weights: 1 ms of a 7 ms int4 step), no size and alignment asserts in the generated wrapper."""
    from torch._inductor import config

    options = {**cpu_vector_width(), **{name: False for name in ("size_asserts", "alignment_asserts")
                                        if hasattr(config, name)}}
    skip = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)  # torch >= 2.8
    if skip is not None:
        options["guard_filter_fn"] = skip
    return options


def compile_step(device: torch.device, backend: str):
    """``decode_step`` compiled for ``device`` (backend "compile"), or as it is."""
    if backend == "eager":
        return decode_step
    if device.type == "cuda":
        if find_compiler(device):
            return torch.compile(decode_step, mode="reduce-overhead", fullgraph=True)
        return torch.compile(decode_step, backend="cudagraphs", fullgraph=True)
    return torch.compile(decode_step, fullgraph=True, options=cpu_options())


class StaticDecoder:
    """Generation of one sequence: prefill by ``CausalLM.forward``, then the static step. The KV
    cache (``max_len`` positions) is allocated once and keeps its addresses, as a CUDA graph
    needs. ``backend``: "auto" compiles where possible, else says why (``reason``); "compile"
    insists; "eager" runs the same step uncompiled. The model must not change once the decoder
    is built (the compiled step does not check it again).
    """

    def __init__(self, model: CausalLM, max_len: int, backend: str = "auto",
                 verbose: bool = False):
        check_int("max_len", max_len)
        if max_len > model.config.max_seq_len:
            raise ValueError(f"max_len={max_len} exceeds the model's "
                             f"max_seq_len={model.config.max_seq_len}")
        self.model = model
        self.cache = KVCache(model.config, 1, max_len, model.device, model.dtype)
        if model.device.type == "cuda":
            for tensor in self.cache.k + self.cache.v:
                torch._dynamo.mark_static_address(tensor)  # replays write here
        self.backend, self.reason = choose_backend(model.device, backend)
        self.step = compile_step(model.device, self.backend)
        if verbose:
            print(f"decode step: {self.reason}")

    def stream(self, prompt_ids, max_new_tokens: int, sampling: SamplingParams | None = None,
               eos_token_id: int | None = None, seed: int | None = None) -> Iterator[TokenEvent]:
        """``minillm.stream_generate``'s events, from the static step: each new token as a
        TokenEvent, EOS included when it ends the run. Bad arguments raise here."""
        ids, sampling = check_generation(self.model, prompt_ids, max_new_tokens, sampling,
                                         eos_token_id, seed)
        check_lengths(ids.shape[1], max_new_tokens, self.cache.max_len, "the decoder's max_len")
        return self._stream(ids, max_new_tokens, sampling, eos_token_id, seed)

    @torch.inference_mode()
    def _stream(self, ids: torch.Tensor, max_new_tokens: int, sampling: SamplingParams,
                eos_token_id: int | None, seed: int | None) -> Iterator[TokenEvent]:
        model, cache, device = self.model, self.cache, self.model.device
        generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        cache.reset()
        logits = model(ids, cache=cache)[:, -1]  # prefill: (1, vocab)
        position = cache.lengths.clone()  # (1,) where the next token goes
        for index in range(max_new_tokens):
            token = sample(logits, sampling, generator)  # (1,)
            yield TokenEvent(int(token), index, "prefill" if index == 0 else "decode", now(device))
            if int(token) == eos_token_id or index == max_new_tokens - 1:
                break
            logits = self.step(model, cache.k, cache.v, token[:, None], position)  # (1, vocab)
            position = position + 1
        cache.end(position[:, None] - 1)  # the steps wrote every position before `position`

    def generate(self, prompt_ids, max_new_tokens: int, eos_token_id: int | None = None,
                 sampling: SamplingParams | None = None, seed: int | None = None) -> list[int]:
        """The new token ids (EOS included when it ends the run); greedy by default."""
        return [e.token_id for e in self.stream(prompt_ids, max_new_tokens, sampling,
                                                eos_token_id, seed)]


STEPS = ("auto", "compiled", "eager")  # what ``python -m minillm --step`` decodes with
LENGTH_BUCKET = 256  # a decoder's max_len, rounded up: one compiled step serves many prompt lengths


def command_line_decoder(model: CausalLM, prompt_len: int, max_new_tokens: int,
                         step: str = "auto") -> tuple[StaticDecoder | None, str]:
    """The decoder the command line streams from (None: the model's own cached path,
    ``stream_generate``) and the line that says which. "auto" compiles the static step where
    the model's matmuls run the block kernel (the file's int4 blocks on an x86 CPU) and a C++
    compiler exists: there it is the fast path (``benchmarks/bench_peers.py``) and the compile
    (tens of seconds the first time, seconds once inductor's cache holds it) pays back within a
    reply. max_len is rounded up to a multiple of ``LENGTH_BUCKET`` so that other prompts reuse
    the compiled step."""
    if step not in STEPS:
        raise ValueError(f"step={step!r}; choose one of {STEPS}")
    if step == "eager":
        return None, "eager (CausalLM.forward, as asked)"
    block_kernel = any(isinstance(m, BlockLinear) for m in model.modules())
    if step == "auto" and not (block_kernel and model.device.type == "cpu"):
        return None, "eager (CausalLM.forward; --step compiled compiles the static step)"
    backend = "compile" if step == "compiled" else "auto"
    max_len = min(ceil_div(prompt_len + max_new_tokens, LENGTH_BUCKET) * LENGTH_BUCKET,
                  model.config.max_seq_len)
    decoder = StaticDecoder(model, max_len, backend)
    if decoder.backend == "eager":
        return None, f"eager (CausalLM.forward; the static step cannot compile here: {decoder.reason})"
    return decoder, (f"the static step compiled for {max_len} positions, {decoder.reason} (the first "
                     "run compiles for tens of seconds; --step eager skips it)")
