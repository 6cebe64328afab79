"""Shared fixtures: small models built once, and hypothesis settings that keep property tests fast."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

from minillm import ByteTokenizer, ModelConfig, build_model

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
