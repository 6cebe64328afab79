"""The model: shapes, causality, cached == naive, batched decode, attention, dtypes, bad input."""
import math

import pytest
import torch
from conftest import CAUSAL, SMALL, random_ids, sdpa_spy
from hypothesis import given
from hypothesis import strategies as st

from minillm import KVCache, ModelConfig, build_model
from minillm.cache import SquareCausal
from minillm.model import RotaryEmbedding, apply_rotary

F32 = dict(rtol=0, atol=1e-5)  # cached vs naive, eager vs sdpa: float32 rounding only


def decode_step_by_step(model, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Prefill ids[:, :prompt_len] into a cache, then feed the rest one token at a time: (B, T, V)."""
    cache = KVCache(model.config, ids.shape[0], ids.shape[1])
    steps = [model(ids[:, :prompt_len], cache=cache)]
    for t in range(prompt_len, ids.shape[1]):
        steps.append(model(ids[:, t:t + 1], cache=cache))
    assert cache.lengths.tolist() == [ids.shape[1]] * ids.shape[0]
    return torch.cat(steps, dim=1)


def greedy_tokens(model, prompt: torch.Tensor, n: int, use_cache: bool) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens after a (1, T) prompt, and the logits each was chosen from: (n, V)."""
    cache = KVCache(model.config, 1, prompt.shape[1] + n) if use_cache else None
    seq, tokens, logits = prompt, [], []
    nxt = prompt
    for _ in range(n):
        out = model(nxt if use_cache else seq, cache=cache)[0, -1]  # (V,)
        token = int(out.argmax())
        tokens.append(token)
        logits.append(out)
        seq = torch.cat([seq, torch.tensor([[token]])], dim=1)
        nxt = seq[:, -1:]
    return tokens, torch.stack(logits)


def test_logits_shape(small_model):
    ids = random_ids(SMALL.vocab_size, (3, 7))
    assert small_model(ids).shape == (3, 7, SMALL.vocab_size)
    assert small_model(ids[:, :1]).shape == (3, 1, SMALL.vocab_size)


def test_changing_a_later_token_never_changes_earlier_logits(small_model):
    ids = random_ids(SMALL.vocab_size, (1, 12))
    before = small_model(ids)
    for j in (0, 5, 11):
        changed = ids.clone()
        changed[0, j] = (changed[0, j] + 1) % SMALL.vocab_size
        after = small_model(changed)
        torch.testing.assert_close(after[:, :j], before[:, :j], rtol=0, atol=1e-6)
        assert (after[:, j:] - before[:, j:]).abs().amax(-1).min() > 1e-3  # every later position sees it


def test_cached_equals_naive_on_the_tiny_preset(tiny_model, tokenizer):
    prompt = torch.tensor([tokenizer.encode("请介绍一下Transformer")])  # (1, 26)
    cached, cached_logits = greedy_tokens(tiny_model, prompt, 24, use_cache=True)
    naive, naive_logits = greedy_tokens(tiny_model, prompt, 24, use_cache=False)
    assert cached == naive
    assert len(set(cached)) > 3  # the random model does not just repeat one token
    torch.testing.assert_close(cached_logits, naive_logits, **F32)


@st.composite
def configs(draw):
    """Small random configs: MHA, GQA or MQA; head_dim equal to or different from d_model/n_heads; tied or not."""
    n_kv_heads = draw(st.integers(1, 3))
    n_heads = n_kv_heads * draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([2, 4, 8, 12]))
    d_model = draw(st.sampled_from([n_heads * head_dim, 8, 24]))
    return ModelConfig(vocab_size=draw(st.integers(5, 40)), d_model=d_model, n_layers=draw(st.integers(1, 3)),
                       n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, d_ff=draw(st.sampled_from([8, 20])),
                       max_seq_len=32, tie_embeddings=draw(st.booleans()))


@given(config=configs(), seed=st.integers(0, 2**16), prompt_len=st.integers(1, 10), n_new=st.integers(1, 8),
       batch=st.integers(1, 3))
def test_cached_equals_naive_property(config, seed, prompt_len, n_new, batch):
    model = build_model(config, seed=seed)
    ids = random_ids(config.vocab_size, (batch, prompt_len + n_new), seed)
    naive = model(ids)  # (B, T, V): every position from the full sequence
    cached = decode_step_by_step(model, ids, prompt_len)
    torch.testing.assert_close(cached, naive, **F32)
    tokens, _ = greedy_tokens(model, ids[:1, :prompt_len], n_new, use_cache=True)
    assert tokens == greedy_tokens(model, ids[:1, :prompt_len], n_new, use_cache=False)[0]


def test_batched_decode_of_rows_at_different_positions_equals_each_row_alone(small_model):
    """Row 0 has a 7-token prompt, row 1 a 3-token one (right-padded); both decode together."""
    lengths, n_new = [7, 3], 5
    full = random_ids(SMALL.vocab_size, (2, 7 + n_new), seed=3)  # each row's own prompt + continuation
    cache = KVCache(SMALL, batch_size=2, max_len=16)
    prefill = small_model(full[:, :7], cache=cache)  # row 1's positions 3..6 are padding, overwritten later
    last = [prefill[b, lengths[b] - 1] for b in range(2)]
    batched = [torch.stack(last)]  # per step: (2, V)
    for step in range(n_new):
        positions = torch.tensor([[lengths[0] + step], [lengths[1] + step]])  # (2, 1), different per row
        tokens = torch.stack([full[b, lengths[b] + step] for b in range(2)])[:, None]  # (2, 1)
        batched.append(small_model(tokens, positions=positions, cache=cache)[:, -1])
    assert cache.lengths.tolist() == [lengths[0] + n_new, lengths[1] + n_new]
    for b in range(2):
        alone = decode_step_by_step(small_model, full[b:b + 1, :lengths[b] + n_new], lengths[b])[0]  # (T, V)
        expected = alone[lengths[b] - 1:]  # the prompt's last position, then each decode step
        torch.testing.assert_close(torch.stack([step[b] for step in batched]), expected, **F32)


def test_gqa_equals_mha_with_each_kv_head_copied_to_its_group(small_model):
    """Query head h uses kv head h // G: copy each kv head's weights G times and MHA gives the same logits."""
    mha = build_model(SMALL.with_(n_kv_heads=SMALL.n_heads))
    state = small_model.state_dict()
    G = SMALL.n_groups
    for name, weight in state.items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):  # (Hkv * D, d_model) -> (H * D, d_model)
            heads = weight.view(SMALL.n_kv_heads, SMALL.head_dim, SMALL.d_model)
            state[name] = heads.repeat_interleave(G, dim=0).reshape(-1, SMALL.d_model)
    mha.load_state_dict(state)
    ids = random_ids(SMALL.vocab_size, (2, 9))
    torch.testing.assert_close(mha(ids), small_model(ids), **F32)


def test_eager_equals_sdpa(small_model):
    ids = random_ids(SMALL.vocab_size, (2, 9))
    try:
        sdpa = small_model.set_attention_impl("sdpa")(ids)
        eager = small_model.set_attention_impl("eager")(ids)
        cached_eager = decode_step_by_step(small_model, ids, 4)
    finally:
        small_model.set_attention_impl("sdpa")
    torch.testing.assert_close(eager, sdpa, **F32)
    torch.testing.assert_close(cached_eager, sdpa, **F32)


def test_a_fresh_prompt_skips_the_masked_half_and_later_calls_keep_their_mask(small_model, monkeypatch):
    calls, n = sdpa_spy(monkeypatch), SMALL.n_layers
    ids = random_ids(SMALL.vocab_size, (2, 9))
    cache = KVCache(SMALL, 2, 12)
    seen = []
    for chunk in (ids[:, :6], ids[:, 6:8], ids[:, 8:]):  # prefill, a chunk after 6 positions, decode
        small_model(chunk, cache=cache)
        seen.append(calls[:])
        calls.clear()
    small_model(ids)  # no cache, positions 0..8
    assert seen == [CAUSAL * n, [(False, "tensor")] * n, [(False, None)] * n]
    assert calls == CAUSAL * n
    calls.clear()
    small_model(ids, positions=torch.arange(9).flip(0).expand(2, 9))  # not 0..T-1: explicit mask
    assert calls == [(False, "tensor")] * n


def test_attention_output_in_the_gpu_kernels_layout_gives_the_same_logits(small_model, monkeypatch):
    """CUDA's attention kernels return (B, Hkv, G*T, D) laid out as (B, G*T, Hkv, D) in memory: the GQA
    regrouping must not assume a contiguous output (a .view there failed on an H200)."""
    ids = random_ids(SMALL.vocab_size, (2, 9))
    expected = decode_step_by_step(small_model, ids, 4)  # masked calls: chunk after the prompt, decodes
    real = torch.nn.functional.scaled_dot_product_attention

    def gpu_layout(*args, **kwargs):
        out = real(*args, **kwargs)  # (B, Hkv, G*T, D)
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, the kernels' strides

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", gpu_layout)
    torch.testing.assert_close(decode_step_by_step(small_model, ids, 4), expected, **F32)


def test_the_causal_kernel_equals_the_explicit_mask(small_model):
    """A long prompt (many of the kernel's tiles): skipping the masked half changes nothing."""
    attn, T = small_model.model.layers[0].self_attn, 300
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, SMALL.n_heads, T, SMALL.head_dim, generator=gen)  # (B, H, T, D)
    k, v = (torch.randn(2, SMALL.n_kv_heads, T, SMALL.head_dim, generator=gen) for _ in "kv")
    implicit = SquareCausal(T, q.device)
    explicit = implicit.dense()  # (1, 1, T, T): the kernel lays it out for the grouped heads
    assert explicit.shape == (1, 1, T, T) and int(explicit.sum()) == T * (T + 1) // 2
    torch.testing.assert_close(attn.kernel(q, k, v, implicit), attn.kernel(q, k, v, explicit), **F32)
    ids = random_ids(SMALL.vocab_size, (2, SMALL.max_seq_len))
    try:
        eager = small_model.set_attention_impl("eager")(ids)  # explicit scores, mask and softmax
    finally:
        small_model.set_attention_impl("sdpa")
    torch.testing.assert_close(small_model(ids), eager, **F32)


def test_unknown_attention_impl(small_model):
    with pytest.raises(ValueError, match="'flash'.*eager.*sdpa"):
        small_model.set_attention_impl("flash")


def test_rope_rotates_each_pair_by_position_times_frequency():
    """head_dim 4, theta 10000: frequencies 1 and 0.01; rotate-half pairs dimension i with i + 2."""
    rope = RotaryEmbedding(head_dim=4, theta=10000.0)
    torch.testing.assert_close(rope.frequencies("cpu"), torch.tensor([1.0, 0.01]))
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)  # (B, H, T, D)
    cos, sin = rope(torch.tensor([[5]]), torch.float32)  # position 5: angles 5 and 0.05
    a, b = 5.0, 0.05
    expected = torch.tensor([1 * math.cos(a) - 3 * math.sin(a), 2 * math.cos(b) - 4 * math.sin(b),
                             3 * math.cos(a) + 1 * math.sin(a), 4 * math.cos(b) + 2 * math.sin(b)])
    torch.testing.assert_close(apply_rotary(x, cos, sin).flatten(), expected)


def test_the_order_of_the_context_matters(small_model):
    """Without position information attention could not tell "a b c" from "b a c"."""
    ids = torch.tensor([[3, 7, 11, 5]])
    swapped = torch.tensor([[7, 3, 11, 5]])
    assert (small_model(ids)[0, -1] - small_model(swapped)[0, -1]).abs().max() > 1e-3


def test_rope_makes_logits_depend_on_relative_positions_only(small_model):
    ids = random_ids(SMALL.vocab_size, (1, 8))
    shifted = small_model(ids, positions=torch.arange(20, 28)[None, :])
    torch.testing.assert_close(shifted, small_model(ids), rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype, atol", [("bfloat16", 0.25), ("float16", 0.05)])
def test_half_precision_models_give_nearly_the_float32_logits(tiny_model, dtype, atol):
    ids = random_ids(258, (1, 64))
    reference = tiny_model(ids)  # (1, 64, V), logits of order 1
    half = build_model("tiny", dtype=dtype)
    out = half(ids)
    assert out.dtype == getattr(torch, dtype)
    far = torch.tensor([[1000, 2047]])  # where bfloat16 frequencies would turn by a wrong angle
    for exact, rounded in zip(tiny_model.model.rotary_emb(far, torch.float32), half.model.rotary_emb(far, out.dtype)):
        assert torch.equal(rounded, exact.to(out.dtype))  # the angles are float32's, only cos and sin rounded
    torch.testing.assert_close(out.float(), reference, rtol=0, atol=atol)
    agree = (out.argmax(-1) == reference.argmax(-1)).float().mean()
    assert agree >= 0.9


def test_seeded_build_is_reproducible():
    a, b, c = build_model(SMALL, seed=1), build_model(SMALL, seed=1), build_model(SMALL, seed=2)
    ids = random_ids(SMALL.vocab_size, (1, 5))
    assert torch.equal(a(ids), b(ids))
    assert not torch.allclose(a(ids), c(ids))


@pytest.mark.parametrize("make_input, words", [
    (lambda: torch.zeros(1, 0, dtype=torch.long), ["empty", "length 0"]),
    (lambda: torch.tensor([[1, 61]]), ["token id 61", "[0, 61)"]),
    (lambda: torch.tensor([[-1, 3]]), ["token id -1", "[0, 61)"]),
    (lambda: torch.tensor([1, 2, 3]), ["2-D", "(3,)"]),
])
def test_bad_input_ids(small_model, make_input, words):
    with pytest.raises(ValueError) as info:
        small_model(make_input())
    for word in words:
        assert word in str(info.value)


def test_ids_and_positions_must_be_integers(small_model):
    with pytest.raises(TypeError, match="input_ids must hold integers, got dtype torch.float32"):
        small_model(torch.tensor([[1.0, 2.0]]))
    with pytest.raises(TypeError, match="positions must hold integers, got dtype torch.float32"):
        small_model(torch.tensor([[1, 2]]), positions=torch.tensor([[0.0, 1.0]]))


def test_bad_positions(small_model):
    ids = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match=r"\[63, 64\].*max_seq_len=64"):
        small_model(ids, positions=torch.tensor([[63, 64]]))
    with pytest.raises(ValueError, match=r"positions shape \(1, 3\) != input_ids shape \(1, 2\)"):
        small_model(ids, positions=torch.tensor([[0, 1, 2]]))


def test_prompt_longer_than_the_cache(small_model):
    cache = KVCache(SMALL, 1, max_len=4)
    with pytest.raises(ValueError, match=r"position 4 .*max_len=4"):
        small_model(random_ids(SMALL.vocab_size, (1, 5)), cache=cache)
    assert cache.lengths.tolist() == [0]  # nothing was committed


def test_cache_batch_must_match_the_input(small_model):
    with pytest.raises(ValueError, match="1 rows but the cache has batch_size=2"):
        small_model(torch.tensor([[1, 2]]), cache=KVCache(SMALL, 2, 8))
    with pytest.raises(ValueError, match="3 rows but the cache has batch_size=2"):
        small_model(torch.ones(3, 1, dtype=torch.long), positions=torch.zeros(3, 1, dtype=torch.long),
                    cache=KVCache(SMALL, 2, 8))
