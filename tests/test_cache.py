"""KVCache: exact byte count, fixed memory, writes by position, bad arguments."""
import pytest
import torch
from conftest import SMALL, random_ids

from minillm import KVCache, ModelConfig, generate, get_config

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


def test_update_writes_by_position_and_end_sets_lengths():
    config = SMALL.with_(n_layers=1)
    cache = KVCache(config, 2, 6)
    k = torch.arange(2 * 2 * 2 * 10, dtype=torch.float32).view(2, 2, 2, 10)  # (B, Hkv, T=2, D)
    positions = torch.tensor([[0, 1], [3, 4]])  # row 1 writes at positions 3 and 4
    cache.begin(positions)  # the protocol: plan the call's writes first
    K, V = cache.update(0, k, -k, positions)
    assert K.shape == V.shape == (2, 2, 5, 10)  # S = 1 + the largest position written
    torch.testing.assert_close(K[0, :, 0:2], k[0])
    torch.testing.assert_close(K[1, :, 3:5], k[1])
    torch.testing.assert_close(V[1, :, 3:5], -k[1])
    assert (cache.k[0][1, :, :3] == 0).all() and (cache.k[0][:, :, 5:] == 0).all()  # nothing else written
    cache.end(positions)
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
    (1, 0, ValueError, ["max_len=0", "max_seq_len=64"]),
    (1, 65, ValueError, ["max_len=65", "max_seq_len=64"]),
])
def test_bad_cache_arguments(batch, max_len, kind, words):
    with pytest.raises(kind) as info:
        KVCache(SMALL, batch, max_len)
    for word in words:
        assert word in str(info.value)
