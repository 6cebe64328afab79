"""A decode step with static shapes, so that a compiler can trace it once.

``CausalLM.forward`` serves every use (prefill, decode, rows at mixed positions), so it
reads positions back to Python (``int(positions.max())``), picks a mask, and attends a
cache slice one position longer at every step: new shapes and host decisions each call,
which a compiler cannot capture once. The step here does one thing: each of B rows feeds
one token at its position and attends the *whole* preallocated cache, the positions not
yet written masked out. Its shapes never change, so ``torch.compile`` traces it once (on a
CPU it fuses the small element-wise operations into generated C++ loops; on CUDA, mode
``"reduce-overhead"`` also records it as a CUDA graph that replays with one launch).

    decoder = StaticDecoder(model, max_len=256)  # compiled where a compiler is present
    tokens = decoder.generate(prompt_ids, max_new_tokens=64)
"""
from __future__ import annotations

import importlib.util
import os
import shutil

import torch
import torch.nn.functional as F

from ..cache import KVCache
from ..generate import as_prompt_tensor, check_lengths
from ..model import CausalLM, apply_rotary
from ..validate import check_int

BACKENDS = ("auto", "compile", "eager")
CXX_NAMES = ("g++", "c++", "clang++")


def decode_step(model: CausalLM, keys: list[torch.Tensor], values: list[torch.Tensor],
                token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """One new token per row, written into the preallocated cache; logits (B, vocab).

    token: (B, 1) ids; position: (B,) where each row's token goes. keys[i], values[i]:
    (B, n_kv_heads, max_len, head_dim) of layer i, every position < ``position`` written.
    Each call attends all max_len positions and masks those after ``position``.
    """
    B = token.shape[0]
    x = model.model.embed_tokens(token)  # (B, 1, d_model)
    cos, sin = model.model.rotary_emb(position[:, None], x.dtype)  # (B, 1, 1, head_dim)
    max_len = keys[0].shape[2]
    visible = torch.arange(max_len, device=token.device) <= position[:, None]  # (B, S)
    mask = visible[:, None, None, :]  # (B, 1, 1, S): the same for every head
    rows = torch.arange(B, device=token.device)  # (B,)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        H, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
        h = layer.input_layernorm(x)  # (B, 1, d_model)
        q = attn.q_proj(h).view(B, 1, H, D).transpose(1, 2)  # (B, H, 1, D)
        k = attn.k_proj(h).view(B, 1, Hkv, D).transpose(1, 2)  # (B, Hkv, 1, D)
        v = attn.v_proj(h).view(B, 1, Hkv, D).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        keys[i][rows, :, position] = k[:, :, 0]  # (B, Hkv, D), each row at its position
        values[i][rows, :, position] = v[:, :, 0]
        q = q.reshape(B, Hkv, H // Hkv, D)  # (B, Hkv, G, D): the query heads of a kv head
        out = F.scaled_dot_product_attention(q, keys[i], values[i], attn_mask=mask)
        x = x + attn.o_proj(out.reshape(B, 1, H * D))  # out: (B, Hkv, G, D)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.model.norm(x))[:, 0]  # (B, vocab)


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


def compile_step(device: torch.device, backend: str):
    """``decode_step`` compiled for ``device`` (backend "compile"), or as it is."""
    if backend == "eager":
        return decode_step
    if device.type == "cuda":
        if find_compiler(device):
            return torch.compile(decode_step, mode="reduce-overhead", fullgraph=True)
        return torch.compile(decode_step, backend="cudagraphs", fullgraph=True)
    return torch.compile(decode_step, fullgraph=True)


class StaticDecoder:
    """Greedy generation of one sequence: prefill by ``CausalLM.forward``, then the
    static step. The KV cache (``max_len`` positions) is allocated once and keeps its
    addresses, as a CUDA graph needs. ``backend``: "auto" compiles where possible, else
    says why (``reason``); "compile" insists; "eager" runs the same step uncompiled.
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

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens: int,
                 eos_token_id: int | None = None) -> list[int]:
        """Greedy new token ids (EOS included when it ends the run)."""
        model, cache = self.model, self.cache
        ids = as_prompt_tensor(prompt_ids, model.config.vocab_size, model.device)  # (1,T)
        check_lengths(ids.shape[1], max_new_tokens, cache.max_len,
                      "the decoder's max_len")
        cache.reset()
        token = model(ids, cache=cache)[:, -1].argmax(-1)  # prefill: (1,)
        position = cache.lengths.clone()  # (1,) where the next token goes
        tokens = [token]
        for _ in range(max_new_tokens - 1):
            if eos_token_id is not None and int(token) == eos_token_id:
                break
            logits = self.step(model, cache.k, cache.v, token[:, None], position)
            token, position = logits.argmax(-1), position + 1  # (1,), (1,)
            tokens.append(token)
        cache.lengths = position
        return torch.cat(tokens).tolist()


