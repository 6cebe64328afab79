"""Shared fixtures and helpers: small models built once, hypothesis settings that keep property tests fast, the
engine's invariants, a tiny-model server, a tiny GGUF file, and a spy on the attention kernel.

Test modules import helpers from here (``from conftest import SMALL``), never from each other."""
from __future__ import annotations

import os
import random
import time
from functools import cache

import gguf
import numpy as np
import pytest
import torch
from hypothesis import settings

from minillm import ByteTokenizer, ModelConfig, build_model, generate, get_config
from minillm.engine import Request, blocks_for
from minillm.serving import launch_server

# The tests use tiny tensors: one thread is faster, and on a busy machine it avoids intra-op threads
# waiting for each other (measured here: the model tests took 108 s with 2 threads, 6 s with 1).
torch.set_num_threads(1)

# A chapter's claim that does not hold on this run fails the test run (nbval's kernels inherit this), as in
# the book build and CI; on a reader's machine the chapter says so and goes on.
os.environ.setdefault("MINILLM_STRICT_CLAIMS", "1")

# Property tests: few examples, no per-example deadline (CPU timing is noisy here), and derandomized
# so a run is reproducible (the same examples every time, no example database needed).
settings.register_profile("minillm", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("minillm")

# A small model that still has every feature: GQA 6:2, head_dim (10) != d_model / n_heads (8).
SMALL = ModelConfig(vocab_size=61, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=10,
                    d_ff=96, max_seq_len=64)


@pytest.fixture(scope="session")
def tiny_model():
    """The "tiny" preset, float32 on the CPU, seed 0 (random weights)."""
    return build_model("tiny")


@pytest.fixture(scope="session")
def small_model():
    return build_model(SMALL)


@pytest.fixture(scope="session")
def tokenizer():
    return ByteTokenizer()


def random_ids(vocab_size: int, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Reproducible random token ids."""
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def write_kv(cache, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
    """Write ``k``, ``v`` (B, Hkv, T, D) of ``layer`` at ``positions`` (B, T) the one way there is: ``begin``,
    ``attend``, ``end``. -> K, V (B, Hkv, S, D): the keys and values the kernel was handed, by position."""
    handed = []

    def keep(q, K, V, mask):
        handed[:] = [K, V]
        return q

    cache.begin(positions)
    cache.attend(layer, None, k, v, keep)  # no queries: the kernel only keeps what it is handed
    cache.end(positions)
    return tuple(handed)


# --- the attention kernel, watched ------------------------------------------------------------------------

def sdpa_spy(monkeypatch) -> list[tuple[bool, str | None]]:
    """Record (is_causal, the mask's kind: None or "tensor") for every scaled_dot_product_attention call."""
    calls, real = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kwargs):
        kind = None if attn_mask is None else "tensor"
        calls.append((is_causal, kind))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


CAUSAL = [(True, None)]  # one layer of a fresh prompt: the causal kernel ran, with no mask built


# --- the engine: one small model, greedy references, invariants -------------------------------------------

ENGINE_CONFIG = get_config("tiny", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=96)
ENGINE_MODEL = build_model(ENGINE_CONFIG, seed=0)
REF_TOKENS = 24  # greedy outputs are prefixes of a longer greedy run


@cache
def greedy_reference(prompt: tuple[int, ...]) -> list[int]:
    return generate(ENGINE_MODEL, list(prompt), REF_TOKENS)


def workload(n, seed, max_prompt=20, max_tokens=20, **kwargs):
    rng = random.Random(seed)
    return [Request(i, [rng.randrange(256) for _ in range(rng.randint(1, max_prompt))], rng.randint(1, max_tokens),
                    **kwargs) for i in range(n)]


def check_tables(engine):
    """Memory, counted from the sequences' block tables (not from the allocator's own bookkeeping):
    every live sequence holds blocks for every token it has computed and no more than for all its
    tokens; a block is in two tables only when both hold the same tokens up to its end at the same
    index (a shared prefix block); the blocks held fit in the pool; the reference counts equal the
    number of tables holding each block, and the free blocks are exactly the ones no table holds."""
    blocks, bs = engine.blocks, engine.blocks.block_size
    live = engine.scheduler.running + engine.scheduler.padding
    holders = {}  # block -> [(sequence, index in its table)]
    for seq in live:
        assert blocks_for(seq.num_computed, bs) <= len(seq.block_table) <= blocks_for(seq.num_tokens, bs)
        for i, block in enumerate(seq.block_table):
            assert 0 <= block < blocks.num_blocks
            holders.setdefault(block, []).append((seq, i))
    for users in holders.values():
        if len(users) > 1:
            assert blocks.enable_prefix_caching
            (first, i), end = users[0], (users[0][1] + 1) * bs
            assert all(j == i and s.tokens[:end] == first.tokens[:end] for s, j in users)
    assert sum(len(s.block_table) for s in live) - sum(len(u) - 1 for u in holders.values()) <= blocks.num_blocks
    assert blocks.ref_counts == [len(holders.get(b, [])) for b in range(blocks.num_blocks)]
    assert set(blocks.free_blocks) == set(range(blocks.num_blocks)) - set(holders)
    assert all(not s.block_table and s.num_computed == 0 for s in engine.scheduler.waiting)
    return len(holders)


def check_invariants(engine, requests, result):
    """Every request ends once, finished or rejected; every block is free again and no reference is
    left; each step's token budget held; times are ordered; greedy tokens equal generate alone."""
    assert [r.request_id for r in result.requests] == [r.request_id for r in requests]
    assert all(r.status in ("finished", "rejected") for r in result.requests)
    assert all(s.blocks_used <= engine.blocks.num_blocks for s in result.steps)
    blocks = engine.blocks
    assert blocks.ref_counts == [0] * blocks.num_blocks and sorted(blocks.free_blocks) == list(range(blocks.num_blocks))
    assert not engine.has_unfinished() and not engine.scheduler.running and not engine.scheduler.padding
    budget = engine.config.max_num_batched_tokens
    for s in result.steps:
        assert s.n_running == s.n_prefill + s.n_decode and s.decode_tokens == s.n_decode + s.n_padding
        assert s.prefill_tokens + s.decode_tokens <= budget
    for req, rec in zip(requests, result.requests):
        if rec.status == "rejected":
            assert rec.reason and rec.output_ids == [] and rec.token_times == []
            continue
        assert len(rec.output_ids) == len(rec.token_times) == req.max_tokens  # no EOS id: runs to max_tokens
        assert rec.arrival_time <= rec.token_times[0]
        assert rec.token_times == sorted(rec.token_times) and rec.finish_time == rec.token_times[-1]
        assert rec.output_ids == greedy_reference(tuple(req.prompt_ids))[:req.max_tokens]
    assert sum(s.prefill_tokens for s in result.steps) == sum(r.prefill_tokens for r in result.requests)
    assert sum(s.cached_tokens for s in result.steps) == sum(r.cached_tokens for r in result.requests)
    assert sum(s.n_preempted for s in result.steps) == sum(r.preemptions for r in result.requests)


def drive(engine, arrivals, check=check_tables):
    """Serve requests online: ``arrivals`` maps a step number to the requests added before that step.
    Checks ``check(engine)`` after every step; returns {request_id: StepOutputs} and the step records."""
    outputs, records, step = {}, [], 0
    while engine.has_unfinished() or any(k >= step for k in arrivals):
        for request in arrivals.get(step, []):
            engine.add_request(request)
        result = engine.step()
        for out in result.outputs:
            outputs.setdefault(out.request_id, []).append(out)
        records.append(result.record)
        check(engine)
        step += 1
    return outputs, records


# --- a tiny-model server -------------------------------------------------------------------------------------

# a pool of 384 tokens (the context is 2048): some requests can never fit
SERVER_NUM_BLOCKS, SERVER_BLOCK_SIZE = 24, 16
TIMEOUT = 30  # s, any one HTTP call to a test server


@pytest.fixture(scope="module")
def server():
    """``python -m minillm serve`` with the tiny model on 127.0.0.1, one per test module."""
    args = ["--model", "tiny", "--device", "cpu", "--threads", "1", "--max-batch-size", "8",
            "--num-blocks", str(SERVER_NUM_BLOCKS), "--block-size", str(SERVER_BLOCK_SIZE), "--no-access-log"]
    with launch_server(args, startup_timeout=60) as s:
        yield s


def wait_until_idle(server, deadline_s: float = TIMEOUT) -> dict:
    """/health once nothing runs or waits and every KV block is free (a client's exit is noticed
    asynchronously); the last reading if that takes longer than the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        health = server.health()
        if (health["running"], health["waiting"], health["kv_blocks_used"]) == (0, 0, 0) or time.monotonic() > end:
            return health
        time.sleep(0.02)


# --- a tiny GGUF file of the checkpoint's own types -------------------------------------------------------------

GGML_TYPE = gguf.GGMLQuantizationType
STORY_PROMPT = "Once upon a time, in a small village,"  # SmolLM2 continues it in the int4 tests
# the model write_tiny_gguf stores (rotary theta, norm eps and context as written there)
TINY_GGUF = ModelConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=32, d_ff=128,
                        max_seq_len=64)


def llama_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permute() of q/k rows."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_tiny_gguf(path, types: dict[str, GGML_TYPE], default: GGML_TYPE = GGML_TYPE.Q4_1,
                    tie: bool = False) -> dict[str, np.ndarray]:
    """A 2-layer LLaMA GGUF (``TINY_GGUF``) with matmul weights of ``default`` type (``types`` overrides by GGUF
    name), the embedding Q8_0, norms F32; -> the float weights written (before quantization, GGUF names)."""
    c, rng = TINY_GGUF, np.random.default_rng(0)
    D, q_rows, kv_rows = c.d_model, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in [(writer.add_block_count, c.n_layers), (writer.add_embedding_length, D),
                       (writer.add_head_count, c.n_heads), (writer.add_head_count_kv, c.n_kv_heads),
                       (writer.add_rope_dimension_count, c.head_dim), (writer.add_feed_forward_length, c.d_ff),
                       (writer.add_context_length, c.max_seq_len), (writer.add_rope_freq_base, c.rope_theta),
                       (writer.add_layer_norm_rms_eps, c.norm_eps), (writer.add_vocab_size, c.vocab_size)]:
        add(value)
    shapes = {"token_embd.weight": (c.vocab_size, D)} | ({} if tie else {"output.weight": (c.vocab_size, D)})
    for i in range(c.n_layers):
        shapes |= {f"blk.{i}.attn_q.weight": (q_rows, D), f"blk.{i}.attn_k.weight": (kv_rows, D),
                   f"blk.{i}.attn_v.weight": (kv_rows, D), f"blk.{i}.attn_output.weight": (D, q_rows),
                   f"blk.{i}.ffn_gate.weight": (c.d_ff, D), f"blk.{i}.ffn_up.weight": (c.d_ff, D),
                   f"blk.{i}.ffn_down.weight": (D, c.d_ff)}
    weights = {}
    for name, shape in shapes.items():
        w = (rng.standard_normal(shape) / np.sqrt(shape[1] if "embd" not in name else 1)).astype(np.float32)
        heads = c.n_heads if "attn_q" in name else c.n_kv_heads if "attn_k" in name else None
        stored = w if heads is None else llama_permute(w, heads)
        kind = GGML_TYPE.Q8_0 if name == "token_embd.weight" else types.get(name, default)
        if kind == GGML_TYPE.F32:
            writer.add_tensor(name, stored)
        elif kind == GGML_TYPE.F16:
            writer.add_tensor(name, stored.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(stored, kind), raw_dtype=kind)
        weights[name] = w
    for i in range(c.n_layers):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + rng.standard_normal(D) / 10).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(D, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights
