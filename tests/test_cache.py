"""KVCache: exact byte count, fixed memory, writes by position, rolling rows back, bad arguments."""
import pytest
import torch
from conftest import SMALL, random_ids, write_kv
from hypothesis import given
from hypothesis import strategies as st

from minillm import KVCache, ModelConfig, build_model, generate, get_config

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # per element, by hand


def formula_bytes(config: ModelConfig, batch: int, length: int, dtype: str) -> int:
    """2 (K and V) x layers x batch x kv_heads x length x head_dim x bytes per element."""
    return 2 * config.n_layers * batch * config.n_kv_heads * length * config.head_dim * BYTES[dtype]


@pytest.mark.parametrize("config", [get_config("tiny"), SMALL, SMALL.with_(n_kv_heads=1),
                                    SMALL.with_(n_kv_heads=6, n_layers=3)], ids=["tiny", "gqa", "mqa", "mha"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("batch, length", [(1, 1), (3, 17)])
def test_nbytes_equals_the_formula(config, dtype, batch, length):
    cache = KVCache(config, batch, length, dtype=getattr(torch, dtype))
    assert cache.nbytes == formula_bytes(config, batch, length, dtype)
    assert cache.k[0].shape == (batch, config.n_kv_heads, length, config.head_dim)
    assert cache.k[0].dtype == getattr(torch, dtype) and len(cache.k) == len(cache.v) == config.n_layers


def test_known_values():
    # tiny: 2 x 4 layers x 2 kv heads x 32 x 4 bytes = 2048 bytes a token in float32.
    assert KVCache(get_config("tiny"), 1, 1).nbytes == 2048
    assert KVCache(get_config("tiny"), 2, 1024, dtype=torch.bfloat16).nbytes == 2 * 1024 * 1024
    # GQA 6:2 stores a third of what MHA with the same heads stores.
    assert 3 * KVCache(SMALL, 1, 8).nbytes == KVCache(SMALL.with_(n_kv_heads=6), 1, 8).nbytes


def test_default_max_len_is_the_context():
    assert KVCache(SMALL, 1).max_len == SMALL.max_seq_len


def test_generation_never_reallocates_the_cache(small_model):
    cache = KVCache(SMALL, 1, 40)
    pointers = [t.data_ptr() for t in cache.k + cache.v]
    nbytes = cache.nbytes
    prompt = random_ids(SMALL.vocab_size, (12,)).tolist()
    tokens = generate(small_model, prompt, 20, cache=cache)
    assert [t.data_ptr() for t in cache.k + cache.v] == pointers
    assert cache.nbytes == nbytes
    assert cache.lengths.tolist() == [12 + 20 - 1]  # the last token is sampled, never fed back
    assert tokens == generate(small_model, prompt, 20, use_cache=False)
    # The cache is reset and reused: a second run gives the same tokens in the same memory.
    assert generate(small_model, prompt, 20, cache=cache) == tokens
    assert [t.data_ptr() for t in cache.k + cache.v] == pointers


def test_a_call_writes_by_position_and_end_sets_lengths():
    config = SMALL.with_(n_layers=1)
    cache = KVCache(config, 2, 6)
    k = torch.arange(2 * 2 * 2 * 10, dtype=torch.float32).view(2, 2, 2, 10)  # (B, Hkv, T=2, D)
    positions = torch.tensor([[0, 1], [3, 4]])  # row 1 writes at positions 3 and 4
    K, V = write_kv(cache, 0, k, -k, positions)  # begin, attend, end
    assert K.shape == V.shape == (2, 2, 5, 10)  # S = 1 + the largest position written
    torch.testing.assert_close(K[0, :, 0:2], k[0])
    torch.testing.assert_close(K[1, :, 3:5], k[1])
    torch.testing.assert_close(V[1, :, 3:5], -k[1])
    assert (cache.k[0][1, :, :3] == 0).all() and (cache.k[0][:, :, 5:] == 0).all()  # nothing else written
    assert cache.lengths.tolist() == [2, 5]
    cache.reset()
    assert cache.lengths.tolist() == [0, 0]


def test_check_room():
    cache = KVCache(SMALL, 1, 8)
    cache.check_room(torch.tensor([[7]]))
    with pytest.raises(ValueError, match=r"position 8 does not fit in the cache \(max_len=8\)"):
        cache.check_room(torch.tensor([[6, 7, 8]]))


@pytest.mark.parametrize("batch, max_len, kind, words", [
    (0, 8, ValueError, ["batch_size=0", ">= 1"]),
    (1.5, 8, TypeError, ["batch_size=1.5", "integer"]),
    (1, 0, ValueError, ["max_len=0", ">= 1"]),
    (1, 65, ValueError, ["max_len=65", "max_seq_len=64"]),
    (1, 8.0, TypeError, ["max_len=8.0", "integer"]),
])
def test_bad_cache_arguments(batch, max_len, kind, words):
    with pytest.raises(kind) as info:
        KVCache(SMALL, batch, max_len)
    for word in words:
        assert word in str(info.value)


def test_truncate_forgets_the_later_tokens_exactly(small_model):
    """Prompt, three draft tokens, roll back to the prompt, then other tokens: the logits and every key held
    equal those of a cache that never saw the draft, bit for bit."""
    ids = random_ids(SMALL.vocab_size, (2, 12), seed=9)  # a prompt of 6, a draft of 3, then 3 other tokens
    rolled, fresh = KVCache(SMALL, 2, 16), KVCache(SMALL, 2, 16)
    small_model(ids[:, :6], cache=rolled)
    small_model(ids[:, :6], cache=fresh)
    small_model(ids[:, 6:9], cache=rolled)  # the draft
    rolled.truncate(6)
    assert rolled.lengths.tolist() == [6, 6]
    for t in range(9, 12):  # one decode step at a time, from position 6 on
        assert torch.equal(small_model(ids[:, t:t + 1], cache=rolled), small_model(ids[:, t:t + 1], cache=fresh))
    held = int(fresh.lengths[0])
    for a, b in zip(rolled.k + rolled.v, fresh.k + fresh.v):
        assert torch.equal(a[:, :, :held], b[:, :, :held])


@given(seed=st.integers(0, 2**16), prompt=st.integers(1, 6), draft=st.integers(1, 5), keep=st.data())
def test_rows_roll_back_to_their_own_lengths(seed, prompt, draft, keep):
    """Each row keeps its own number of draft tokens; the next token's logits equal, per row, those of a cache
    that saw the prompt and the kept tokens only."""
    model = build_model(SMALL, seed=seed)
    ids = random_ids(SMALL.vocab_size, (2, prompt + draft + 1), seed)
    kept = [keep.draw(st.integers(0, draft)) for _ in range(2)]
    cache = KVCache(SMALL, 2, 16)
    model(ids[:, :prompt + draft], cache=cache)
    cache.truncate(torch.tensor([prompt + n for n in kept]))
    nxt = torch.stack([ids[b, prompt + kept[b]] for b in range(2)])[:, None]  # (2, 1): each row's next token
    got = model(nxt, cache=cache)[:, 0]  # (2, V)
    for b in range(2):
        alone = model(torch.cat([ids[b:b + 1, :prompt + kept[b]], nxt[b:b + 1]], 1))[0, -1]  # no cache
        torch.testing.assert_close(got[b], alone, rtol=0, atol=1e-5)
    assert cache.lengths.tolist() == [prompt + n + 1 for n in kept]


@pytest.mark.parametrize("length, kind, words", [
    (7, ValueError, ["row 0 to 7", "holds 6", "[0, 6]"]),
    (-1, ValueError, ["length=-1", ">= 0"]),
    (2.0, TypeError, ["length=2.0", "integer"]),
    (torch.tensor([1, 7]), ValueError, ["row 1 to 7", "holds 6"]),
    (torch.tensor([1]), ValueError, ["shape (1,)", "(2,)"]),
    (torch.tensor([1.0, 2.0]), TypeError, ["length must hold integers"]),
])
def test_truncate_refuses_lengths_a_row_does_not_hold(small_model, length, kind, words):
    cache = KVCache(SMALL, 2, 8)
    small_model(random_ids(SMALL.vocab_size, (2, 6)), cache=cache)
    with pytest.raises(kind) as info:
        cache.truncate(length)
    for word in words:
        assert word in str(info.value)
    assert cache.lengths.tolist() == [6, 6]  # nothing changed

