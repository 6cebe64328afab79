"""The book's instruments around the model: attention recorded from outside it (``RecordingView``), around any
view that attends each layer in one piece, without changing a logit."""
import pytest
import torch
from conftest import SMALL, random_ids

from minillm import KVCache
from minillm.book.instruments import RecordingView, attention_weights
from minillm.cache import SquareCausal, causal_mask
from minillm.engine import MixedStepView, PagedCacheView, PagedKVPool

F32 = {"rtol": 0, "atol": 1e-5}


def test_recorded_attention_is_causal_and_rows_sum_to_one(small_model):
    T, recorder = 8, RecordingView()
    small_model(random_ids(SMALL.vocab_size, (2, T)), cache=recorder)
    assert len(recorder.weights) == SMALL.n_layers
    above = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    for w in recorder.weights:
        assert w.shape == (2, SMALL.n_heads, T, T)
        assert (w[..., above] == 0).all() and (w[..., ~above] > 0).all()
        torch.testing.assert_close(w.sum(-1), torch.ones(2, SMALL.n_heads, T), rtol=0, atol=1e-6)
        torch.testing.assert_close(w[..., 0, 0], torch.ones(2, SMALL.n_heads))  # the first token sees itself only


def test_recording_changes_no_logit(small_model):
    ids = random_ids(SMALL.vocab_size, (2, 9), seed=2)
    assert torch.equal(small_model(ids, cache=RecordingView()), small_model(ids))
    plain, inner = KVCache(SMALL, 2, 12), KVCache(SMALL, 2, 12)
    for chunk in (ids[:, :6], ids[:, 6:8], ids[:, 8:]):  # prefill, a chunk, a decode step
        assert torch.equal(small_model(chunk, cache=RecordingView(inner)), small_model(chunk, cache=plain))
    assert inner.lengths.tolist() == plain.lengths.tolist() == [9, 9]


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("mask_kind", ["square", "tensor", "none"])
def test_the_recorded_weights_are_those_the_kernel_applies(small_model, impl, mask_kind):
    """weights @ V (each kv head read by its query heads) is the model's kernel output, for every kind of mask."""
    attn, T, S = small_model.model.layers[0].self_attn, 5, 5 if mask_kind == "square" else 9
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, SMALL.n_heads, T, SMALL.head_dim, generator=gen)  # (B, H, T, D)
    k, v = (torch.randn(2, SMALL.n_kv_heads, S, SMALL.head_dim, generator=gen) for _ in "kv")  # (B, Hkv, S, D)
    mask = {"square": SquareCausal(T, q.device), "none": None,
            "tensor": causal_mask(torch.arange(S - T, S).expand(2, T), S)}[mask_kind]  # (B, 1, T, S)
    weights = attention_weights(q, k, mask)  # (B, H, T, S)
    G = SMALL.n_heads // SMALL.n_kv_heads
    try:
        small_model.set_attention_impl(impl)
        out = attn.kernel(q, k, v, mask)  # (B, H, T, D)
    finally:
        small_model.set_attention_impl("sdpa")
    torch.testing.assert_close(weights @ v.repeat_interleave(G, dim=1), out, **F32)


def test_a_decode_step_records_every_key_of_the_cache(small_model):
    cache = KVCache(SMALL, 1, 10)
    small_model(random_ids(SMALL.vocab_size, (1, 6)), cache=cache)
    recorder = RecordingView(cache)
    small_model(torch.tensor([[1]]), cache=recorder)
    for w in recorder.weights:
        assert w.shape == (1, SMALL.n_heads, 1, 7)  # one query, the 6 cached keys and its own
        torch.testing.assert_close(w.sum(-1), torch.ones(1, SMALL.n_heads, 1))


def test_recording_on_a_paged_view_equals_recording_on_a_kv_cache(small_model):
    ids = random_ids(SMALL.vocab_size, (1, 7), seed=6)
    cache = KVCache(SMALL, 1, 8)
    small_model(ids[:, :6], cache=cache)
    expected = RecordingView(cache)
    small_model(ids[:, 6:], cache=expected)
    pool = PagedKVPool(SMALL, num_blocks=4, block_size=4)
    small_model(ids[:, :6], cache=PagedCacheView(pool, [[3, 1]], [0]))
    got = RecordingView(PagedCacheView(pool, [[3, 1]], [6]))
    small_model(ids[:, 6:], cache=got)
    for g, want in zip(got.weights, expected.weights, strict=True):
        assert g.shape == (1, SMALL.n_heads, 1, 7)
        torch.testing.assert_close(g, want, **F32)


def test_recording_a_mixed_step_raises_and_keeps_no_partial_weights(small_model):
    pool = PagedKVPool(SMALL, num_blocks=4, block_size=4)
    parts = [(1, 2, PagedCacheView(pool, [[0]], [0])), (1, 3, PagedCacheView(pool, [[1]], [0]))]
    step = MixedStepView(parts)
    recorder = RecordingView(step)
    small_model(random_ids(SMALL.vocab_size, (1, 4)), cache=RecordingView())  # an earlier recorder's call
    row, positions = random_ids(SMALL.vocab_size, (1, 5), seed=7), torch.tensor([[0, 1, 0, 1, 2]])
    with pytest.raises(ValueError, match="layer 0's attention ran in several pieces.*MixedStepView"):
        small_model(row, positions, recorder)
    assert recorder.weights == []  # nothing partial
    assert [view.lengths.tolist() for _, _, view in parts] == [[0], [0]]  # the failed call ended nothing
    small_model(row, positions, step)  # without recording the same step runs
