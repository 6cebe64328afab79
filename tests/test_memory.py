"""minillm.analysis.arithmetic against hand computations, the real KVCache tensors and a FLOP counter."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from minillm import KVCache, ModelConfig, build_model, get_config
from minillm.analysis.arithmetic import (
    allocation_waste,
    arithmetic_intensity,
    bandwidth_bound_steps_per_s,
    bandwidth_utilisation,
    bytes_per_element,
    decode_bytes,
    decode_flops,
    format_bytes,
    generation_flops,
    kv_bytes_per_token,
    kv_cache_bytes,
    kv_share,
    matmul_params,
    prefill_flops,
    quantized_weight_bytes,
    reserved_slots,
    streamed_weight_bytes,
    weight_bytes,
)
from minillm.analysis.capacity import plan_capacity
from minillm.book.data import A100_MEMORY

SMALL_CONFIGS = [
    get_config("tiny"),                                   # GQA 8:2
    get_config("tiny", n_kv_heads=8),                     # MHA
    get_config("tiny", n_kv_heads=1),                     # MQA
    ModelConfig(vocab_size=50, d_model=48, n_layers=3, n_heads=6, n_kv_heads=3, head_dim=10, d_ff=64,
                max_seq_len=64, tie_embeddings=True),     # head_dim != d_model / n_heads, tied
]


# --- the documents' examples, by hand -------------------------------------------------------------

def test_llama7b_2048_tokens_is_one_gib_not_512_mb():
    assert kv_cache_bytes("llama-7b", 2048) == 2 * 32 * 32 * 2048 * 128 * 2 == 2**30
    assert format_bytes(2**30, "MiB") == "1,024.00 MiB"
    assert format_bytes(2**30, "GB") == "1.07 GB"
    assert kv_cache_bytes("llama-7b", 2048, dtype="fp8") == 512 * 2**20  # 512 MiB: an fp8 cache


def test_llama13b_4096_tokens():
    assert kv_cache_bytes("llama-13b", 4096) == 2 * 40 * 40 * 4096 * 128 * 2 == 3_355_443_200
    assert kv_cache_bytes("llama-13b", 4096, batch_size=64) == 64 * 3_355_443_200


def test_llama2_70b_gqa_bytes_per_token():
    assert kv_bytes_per_token("llama2-70b") == 2 * 80 * 8 * 128 * 2 == 327_680
    assert kv_bytes_per_token("llama2-70b", "float32") == 2 * 327_680


def test_preset_parameter_counts_match_the_published_checkpoints():
    assert get_config("llama-7b").n_params == 6_738_415_616
    assert get_config("llama-13b").n_params == 13_015_864_320
    assert get_config("llama2-70b").n_params == 68_976_648_192
    assert weight_bytes("llama-13b") == 2 * 13_015_864_320  # "about 26 GB"


def test_plan_capacity_reproduces_the_8xa100_llama13b_plan():
    plan = plan_capacity(80 * 10**9, 26 * 10**9, 10 * 10**9, kv_cache_bytes("llama-13b", 4096), 64)
    assert plan.free_bytes == 44 * 10**9
    assert plan.requests_exact == pytest.approx(44e9 / 3_355_443_200)
    assert (plan.requests_per_device, plan.devices_needed) == (13, 5)
    assert plan.total_weight_bytes == 5 * 26 * 10**9


def test_plan_capacity_gqa_4_to_1():
    gqa = get_config("llama-13b", n_kv_heads=10)
    request = kv_cache_bytes(gqa, 4096)
    assert request == 3_355_443_200 // 4 == 838_860_800
    plan = plan_capacity(80 * 10**9, 26 * 10**9, 10 * 10**9, request, 64)  # "80GB" misread as 80e9 B
    assert plan.requests_per_device == 44 * 10**9 // 838_860_800 == 52
    assert plan.devices_needed == 2


# --- an "80GB" A100 holds 80 GiB: the plans of chapter 2.2 ------------------------------------------

def test_an_80gb_a100_holds_80_gib():
    assert A100_MEMORY == 80 * 2**30 == 81_920 * 2**20  # nvidia-smi: 81920 MiB
    assert format_bytes(A100_MEMORY, "GB") == "85.90 GB"


def test_llama7b_requests_on_an_a100():
    request, weights = kv_cache_bytes("llama-7b", 2048), weight_bytes("llama-7b")
    assert plan_capacity(A100_MEMORY, 0, 0, request).requests_per_device == 80
    assert plan_capacity(A100_MEMORY, weights, 0, request).requests_per_device == 67
    # what PyTorch reports as an A100 80GB's total capacity, 79.25 GiB
    usable = int(79.25 * 2**30)
    assert plan_capacity(usable, weights, 0, request).requests_per_device == 66
    # the same card misread as 80e9 bytes
    assert plan_capacity(80 * 10**9, 0, 0, request).requests_per_device == 74
    assert plan_capacity(80 * 10**9, weights, 0, request).requests_per_device == 61


def test_llama13b_plans_on_an_a100():
    mha, gqa = kv_cache_bytes("llama-13b", 4096), kv_cache_bytes(get_config("llama-13b", n_kv_heads=10), 4096)
    plan = plan_capacity(A100_MEMORY, weight_bytes("llama-13b"), 10 * 10**9, mha, 64)
    assert (plan.requests_per_device, plan.devices_needed) == (14, 5)
    plan_gqa = plan_capacity(A100_MEMORY, weight_bytes("llama-13b"), 10 * 10**9, gqa, 64)
    assert (plan_gqa.requests_per_device, plan_gqa.devices_needed) == (59, 2)
    assert plan_capacity(int(79.25 * 2**30), weight_bytes("llama-13b"), 10 * 10**9, gqa).requests_per_device == 58


def test_the_sources_13b_plan_read_in_binary_units_is_consistent_and_conservative():
    """Its "3.2GB" and "0.8GB" are 3.125 GiB and 0.78125 GiB rounded up; 80 - 26 - 10 = 44 GiB free."""
    mha, gqa = kv_cache_bytes("llama-13b", 4096), kv_cache_bytes(get_config("llama-13b", n_kv_heads=10), 4096)
    assert (mha, gqa) == (3.125 * 2**30, 0.78125 * 2**30)
    assert round(mha / 2**30, 1) == 3.1 and 3.2 > mha / 2**30 and 0.8 > gqa / 2**30
    free = plan_capacity(80 * 2**30, 26 * 2**30, 10 * 2**30, mha)
    assert free.free_bytes == 44 * 2**30 and free.requests_per_device == 14 >= 13  # the source: 13
    assert plan_capacity(80 * 2**30, 26 * 2**30, 10 * 2**30, gqa).requests_per_device == 56 >= 55


# --- against the real tensors ---------------------------------------------------------------------

@pytest.mark.parametrize("config", SMALL_CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch_size,max_len", [(1, 1), (3, 17), (2, 64)])
def test_kv_cache_bytes_equals_allocated_kvcache(config, dtype, batch_size, max_len):
    cache = KVCache(config, batch_size, max_len, dtype=dtype)
    name = str(dtype).removeprefix("torch.")
    assert kv_cache_bytes(config, max_len, batch_size, name) == cache.nbytes
    assert kv_cache_bytes(config, max_len, batch_size, dtype) == cache.nbytes
    assert kv_bytes_per_token(config, dtype) * max_len * batch_size == cache.nbytes


@pytest.mark.parametrize("config", SMALL_CONFIGS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weight_bytes_equals_model_parameters(config, dtype):
    model = build_model(config, dtype=dtype)
    assert weight_bytes(config, dtype) == sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("config", SMALL_CONFIGS)
def test_matmul_params_equals_linear_weights(config):
    model = build_model(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_params(config) == linear


@pytest.mark.parametrize("config", SMALL_CONFIGS)
@pytest.mark.parametrize("context_len", [1, 5, 33])
def test_decode_flops_equals_counted_flops_of_a_real_decode_step(config, context_len):
    model = build_model(config).set_attention_impl("eager")
    cache = KVCache(config, 1, 40)
    with torch.inference_mode():
        if context_len > 1:
            model(torch.arange(context_len - 1)[None] % config.vocab_size, cache=cache)
        with FlopCounterMode(display=False) as counter:
            model(torch.tensor([[1]]), cache=cache)
    assert counter.get_total_flops() == decode_flops(config, context_len)


@pytest.mark.parametrize("config", SMALL_CONFIGS)
def test_prefill_flops_vs_a_dense_eager_forward(config):
    """The eager path computes all T x T scores; the formula counts the T(T+1)/2 causal ones."""
    t = 9
    model = build_model(config).set_attention_impl("eager")
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model(torch.arange(t)[None])
    masked_pairs = t * t - t * (t + 1) // 2
    masked_flops = 4 * config.n_layers * config.n_heads * config.head_dim * masked_pairs
    assert counter.get_total_flops() == prefill_flops(config, t) + masked_flops


def test_flops_by_hand_for_llama7b():
    c = get_config("llama-7b")
    p = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008) + 32000 * 4096
    assert matmul_params(c) == p
    assert decode_flops(c, 2048) == 2 * p + 4 * 32 * 32 * 128 * 2048
    assert prefill_flops(c, 3) == 2 * p * 3 + 4 * 32 * 32 * 128 * (1 + 2 + 3)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(SMALL_CONFIGS + [get_config("llama2-70b")]), st.integers(1, 300))
def test_prefill_is_the_sum_of_decode_steps(config, t):
    assert prefill_flops(config, t) == sum(decode_flops(config, s) for s in range(1, t + 1))


def test_generation_flops_naive_vs_cached():
    c = get_config("tiny")
    p, h = matmul_params(c), 4 * c.n_layers * c.n_heads * c.head_dim
    # prompt 2, 3 new tokens. Cached: prefill(2) + decode(3) + decode(4).
    cached = 2 * p * 2 + h * (1 + 2) + (2 * p + h * 3) + (2 * p + h * 4)
    # Naive: forwards over 2, 3 and 4 tokens.
    naive = sum(2 * p * t + h * t * (t + 1) // 2 for t in (2, 3, 4))
    assert generation_flops(c, 2, 3) == cached
    assert generation_flops(c, 2, 3, use_cache=False) == naive
    assert generation_flops(c, 5, 1) == generation_flops(c, 5, 1, use_cache=False) == prefill_flops(c, 5)


def test_decode_bytes_and_intensity():
    c = get_config("llama-7b")
    weights = (c.n_params - 32000 * 4096) * 2  # every weight but the (untied) embedding table
    assert streamed_weight_bytes(c) == weights
    assert decode_bytes(c, 2048, batch_size=4) == weights + 4 * 2**30
    tied = SMALL_CONFIGS[3]
    assert streamed_weight_bytes(tied, "float32") == weight_bytes(tied, "float32")
    assert arithmetic_intensity(decode_flops(c, 1), decode_bytes(c, 1)) == pytest.approx(1.0, rel=0.02)
    assert arithmetic_intensity(10, 4) == 2.5


# --- what-if calculators --------------------------------------------------------------------------

def test_dtypes_and_window():
    assert [bytes_per_element(d) for d in ("float32", "bfloat16", "float16", "fp8", "int8")] == [4, 2, 2, 1, 1]
    assert bytes_per_element(torch.float8_e4m3fn) == 1
    assert kv_cache_bytes("llama-7b", 4096, window=1024) == kv_cache_bytes("llama-7b", 1024)
    assert kv_cache_bytes("llama-7b", 512, window=1024) == kv_cache_bytes("llama-7b", 512)


def test_kv_share():
    kv, w = 2**30, weight_bytes("llama-7b")
    assert kv_share("llama-7b", 2048) == pytest.approx(kv / (kv + w))
    assert kv_share("llama-7b", 2048, batch_size=64) > 0.8


def test_reserved_slots_and_waste():
    lengths = [1, 16, 17]
    assert reserved_slots(lengths, block_size=16) == 16 + 16 + 32
    assert reserved_slots(lengths, max_len=32) == 96
    assert allocation_waste(lengths, block_size=16) == pytest.approx(1 - 34 / 64)
    assert allocation_waste(lengths, max_len=32) == pytest.approx(1 - 34 / 96)
    assert allocation_waste([16, 32], block_size=16) == 0


def test_format_bytes_units_never_mix():
    assert format_bytes(3_355_443_200, "GB") == "3.36 GB"
    assert format_bytes(3_355_443_200, "GiB", 3) == "3.125 GiB"
    assert format_bytes(1536, "KiB", 1) == "1.5 KiB"
    assert format_bytes(1536, "kB", 3) == "1.536 kB"


# --- bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize("call,match", [
    (lambda: kv_cache_bytes("tiny", 0), "seq_len=0"),
    (lambda: kv_cache_bytes("tiny", 8, batch_size=0), "batch_size=0"),
    (lambda: kv_cache_bytes("tiny", 8, window=0), "window=0"),
    (lambda: kv_bytes_per_token("tiny", "fp4"), "fp4"),
    (lambda: kv_bytes_per_token("gpt-9"), "gpt-9"),
    (lambda: decode_flops("tiny", 0), "context_len=0"),
    (lambda: prefill_flops("tiny", -1), "prompt_len=-1"),
    (lambda: format_bytes(10, "Gb"), "Gb"),
    (lambda: arithmetic_intensity(1, 0), "bytes_moved=0"),
    (lambda: plan_capacity(80, 60, 30, 1), "no room"),
    (lambda: plan_capacity(100, 10, 10, 81, 4), "target_concurrency=4"),
    (lambda: reserved_slots([10], max_len=8), "max_len=8"),
    (lambda: reserved_slots([10]), "exactly one"),
    (lambda: reserved_slots([10], max_len=16, block_size=16), "exactly one"),
    (lambda: reserved_slots([], block_size=16), "empty"),
])
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("call,match", [
    (lambda: kv_cache_bytes("tiny", 8.0), "seq_len=8.0"),
    (lambda: kv_cache_bytes("tiny", True), "seq_len=True"),
    (lambda: kv_bytes_per_token(42), "int"),
    (lambda: bytes_per_element(2), "dtype=2"),
    (lambda: format_bytes("1", "GB"), "n_bytes"),
    (lambda: format_bytes(math.inf, "GB"), "n_bytes"),
])
def test_bad_types_raise_type_error(call, match):
    with pytest.raises(TypeError, match=match):
        call()


def test_kv_share_counts_the_weights_in_their_own_dtype():
    """The cache and the weights may differ: a float16 cache beside float32 or int8 weights."""
    kv = kv_cache_bytes("llama-7b", 2048)  # float16 cache, 1 GiB
    params = get_config("llama-7b").n_params
    assert kv_share("llama-7b", 2048, weight_dtype="float32") == pytest.approx(kv / (kv + 4 * params))
    assert kv_share("llama-7b", 2048, weight_dtype="int8") == pytest.approx(kv / (kv + params))
    assert kv_share("llama-7b", 2048, dtype="fp8", weight_dtype="float32") == pytest.approx(
        kv / 2 / (kv / 2 + 4 * params))


def test_bandwidth_bound_and_utilisation():
    """LLaMA-7B in float16 on 2,039 GB/s: about 154 steps/s at most; gpt-fast's 107 tok/s is 69% of it."""
    weights = streamed_weight_bytes("llama-7b", "float16")
    bound = bandwidth_bound_steps_per_s(weights, 2039e9)
    assert bound == pytest.approx(2039e9 / weights) and 150 < bound < 160
    assert bandwidth_utilisation(weights, 107, 2039e9) == pytest.approx(107 / bound)
    assert bandwidth_utilisation(weights, 0, 2039e9) == 0


@pytest.mark.parametrize("call,match", [
    (lambda: bandwidth_bound_steps_per_s(0, 1e9), "bytes_per_step=0"),
    (lambda: bandwidth_bound_steps_per_s(1e6, math.inf), "bandwidth=inf"),
    (lambda: bandwidth_utilisation(1e6, -1, 1e9), "steps_per_s=-1"),
    (lambda: quantized_weight_bytes("tiny", 5), "bits=5"),
    (lambda: quantized_weight_bytes("tiny", 4, group_size=0), "group_size=0"),
])
def test_bandwidth_and_quantized_bytes_reject_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
