"""Roofline arithmetic and the machine probes (arithmetic checked with a fake clock, never timed)."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minillm import KVCache, build_model, get_config
from minillm.analysis import roofline as roofline_module
from minillm.analysis.arithmetic import kv_bytes_per_token, prefill_bytes, streamed_weight_bytes
from minillm.analysis.roofline import (
    LLC_FACTOR,
    MIN_PROBE_BYTES,
    UNKNOWN_LLC_PROBE_BYTES,
    RooflinePoint,
    default_probe_bytes,
    last_level_cache,
    llc_from_lscpu,
    llc_from_sysfs,
    matmul_flops,
    measure_bandwidth,
    measure_matmul_flops,
    median_time,
    parse_size,
    prefill_share,
    read_probe_bytes,
    ridge_point,
    roofline,
    roofline_time,
    time_decode_step,
    time_prefill,
)
from minillm.book.instruments import mixed_step_calls
from minillm.config import ModelConfig


def fake_clock(readings):
    """A clock that returns the given readings in order, whatever the device."""
    it = iter(readings)
    return lambda device: next(it)


# Three timed calls lasting 1.0 s, 2.0 s and 0.5 s: the median is 1.0 s.
READINGS = [0.0, 1.0, 10.0, 12.0, 20.0, 20.5]


def test_median_time_uses_the_clock_and_counts_calls():
    calls = []
    seconds = median_time(lambda: calls.append(1), repeats=3, warmup=2, clock=fake_clock(READINGS))
    assert seconds == 1.0
    assert len(calls) == 5  # 2 warm-up + 3 timed


def test_matmul_flops_formula():
    assert matmul_flops(1) == 2
    assert matmul_flops(512) == 2 * 512 ** 3


def test_measure_matmul_flops_divides_flops_by_median_time():
    flops = measure_matmul_flops(n=8, repeats=3, clock=fake_clock(READINGS))
    assert flops == 2 * 8 ** 3 / 1.0


def test_measure_bandwidth_counts_each_byte_read_once():
    """A read probe: n bytes summed in 1.0 s (the median of the fake clock) is n bytes/s, not 2n (a copy)."""
    bw = measure_bandwidth(n_bytes=4096, repeats=3, clock=fake_clock(READINGS))
    assert bw == 4096 / 1.0


LSCPU = """Architecture:                            x86_64
L1d cache:                               64 KiB (2 instances)
L1i cache:                               64 KiB (2 instances)
L2 cache:                                2 MiB (2 instances)
L3 cache:                                480 MiB (1 instance)
"""


@pytest.mark.parametrize("text, expected", [("32768K", 32 * 2**20), ("480 MiB (1 instance)", 480 * 2**20),
                                            ("1.5 MiB", 3 * 2**19), ("512 KB", 512 * 2**10), ("64", 64)])
def test_cache_sizes_read_in_binary_units(text, expected):
    assert parse_size(text) == expected


def write_cache(root, index, level, kind, size):
    folder = root / f"index{index}"
    folder.mkdir(parents=True)
    for name, value in {"level": f"{level}\n", "type": f"{kind}\n", "size": f"{size}\n"}.items():
        (folder / name).write_text(value)


def test_sysfs_gives_the_highest_level_that_is_not_instructions(tmp_path):
    write_cache(tmp_path, 0, 1, "Data", "32K")
    write_cache(tmp_path, 1, 1, "Instruction", "32K")
    write_cache(tmp_path, 2, 2, "Unified", "1024K")
    write_cache(tmp_path, 3, 3, "Unified", "491520K")
    size, text = llc_from_sysfs(tmp_path)
    assert size == 480 * 2**20 and text.startswith("L3 480 MiB")
    assert llc_from_sysfs(tmp_path / "absent") is None


def test_lscpu_gives_the_last_level_total():
    size, text = llc_from_lscpu(LSCPU)
    assert size == 480 * 2**20 and "L3" in text and "lscpu" in text
    assert llc_from_lscpu("Architecture: x86_64\n") is None


@pytest.mark.parametrize("llc", [32 * 2**20, 480 * 2**20, 2**20])
def test_the_read_probe_is_larger_than_the_last_level_cache(llc):
    """A machine that reports a 480 MiB L3: a 256 MiB probe would have measured the cache."""
    n = read_probe_bytes(llc)
    assert n >= LLC_FACTOR * llc and n >= MIN_PROBE_BYTES
    assert read_probe_bytes(480 * 2**20) == 1920 * 2**20


def test_an_unknown_cache_gets_the_large_fallback(monkeypatch):
    def no_lscpu(*args, **kwargs):
        raise OSError("no lscpu")

    monkeypatch.setattr(roofline_module, "llc_from_sysfs", lambda: None)
    monkeypatch.setattr(roofline_module.subprocess, "run", no_lscpu)
    last_level_cache.cache_clear()
    try:
        size, text = last_level_cache()
        assert size is None and text.startswith("unknown")
        assert default_probe_bytes("cpu") == UNKNOWN_LLC_PROBE_BYTES == 2**30
    finally:
        last_level_cache.cache_clear()


def test_lscpu_is_read_when_sysfs_says_nothing(monkeypatch):
    class Done:
        stdout = LSCPU

    monkeypatch.setattr(roofline_module, "llc_from_sysfs", lambda: None)
    monkeypatch.setattr(roofline_module.subprocess, "run", lambda *a, **k: Done())
    last_level_cache.cache_clear()
    try:
        assert last_level_cache()[0] == 480 * 2**20
        assert default_probe_bytes("cpu") == 4 * 480 * 2**20
    finally:
        last_level_cache.cache_clear()


def test_the_default_probe_reads_more_than_this_machine_s_reported_cache():
    size, text = last_level_cache()
    assert (size is None) == text.startswith("unknown")
    assert default_probe_bytes("cpu") > (size or 0)
    # measure_bandwidth() with its defaults reads that working set: 5 timed sums of 2 s each
    assert measure_bandwidth(clock=fake_clock([0.0, 2.0] * 5)) == default_probe_bytes("cpu") / 2.0


def test_probes_return_positive_finite_numbers():
    flops = measure_matmul_flops(n=64, repeats=3)
    bw = measure_bandwidth(n_bytes=2 ** 20, repeats=3)
    for value in (flops, bw):
        assert math.isfinite(value) and value > 0


def test_roofline_two_regimes_and_ridge():
    peak_flops, peak_bw = 100e9, 20e9  # ridge at 5 FLOP/byte
    assert ridge_point(peak_flops, peak_bw) == 5.0
    assert roofline(0.5, peak_flops, peak_bw) == 10e9  # memory-bound: 0.5 x 20e9
    assert roofline(5.0, peak_flops, peak_bw) == 100e9  # exactly at the ridge
    assert roofline(50.0, peak_flops, peak_bw) == 100e9  # compute-bound: flat at the peak
    assert roofline(0, peak_flops, peak_bw) == 0.0
    curve = roofline(np.array([1.0, 2.0, 10.0]), peak_flops, peak_bw)
    np.testing.assert_array_equal(curve, [20e9, 40e9, 100e9])


@given(st.floats(0, 1e6), st.floats(1e3, 1e18), st.floats(1e3, 1e15))
def test_roofline_never_exceeds_either_roof(intensity, peak_flops, peak_bw):
    attainable = roofline(intensity, peak_flops, peak_bw)
    assert attainable <= peak_flops
    assert attainable <= intensity * peak_bw * (1 + 1e-12)
    assert attainable == pytest.approx(min(peak_flops, intensity * peak_bw))


@pytest.mark.parametrize("bad, kind", [(0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                                       (float("inf"), ValueError), (True, TypeError)])
def test_roofline_rejects_bad_peaks(bad, kind):
    with pytest.raises(kind, match="peak_flops"):
        roofline(1.0, bad, 1e9)
    with pytest.raises(kind, match="peak_bw"):
        ridge_point(1e9, bad)


def test_roofline_rejects_negative_intensity():
    with pytest.raises(ValueError, match="intensity"):
        roofline(np.array([1.0, -2.0]), 1e9, 1e9)


@pytest.mark.parametrize("kwargs, kind, name", [({"n": 0}, ValueError, "n="), ({"n": 2.5}, TypeError, "n="),
                                                ({"repeats": 0}, ValueError, "repeats=")])
def test_matmul_probe_rejects_bad_sizes(kwargs, kind, name):
    with pytest.raises(kind, match=name):
        measure_matmul_flops(**kwargs)


def test_bandwidth_probe_rejects_tiny_buffers():
    with pytest.raises(ValueError, match="n_bytes=2"):
        measure_bandwidth(n_bytes=2)


class RecordingModel:
    """Wraps a model and records the shape and positions of every call."""

    def __init__(self, model):
        self.model, self.config, self.device, self.dtype = model, model.config, model.device, model.dtype
        self.calls = []

    def __call__(self, ids, positions=None, cache=None):
        self.calls.append((tuple(ids.shape), None if positions is None else positions.tolist()))
        return self.model(ids, positions=positions, cache=cache)


@pytest.fixture(scope="module")
def tiny():
    return build_model("tiny")


def test_time_prefill_runs_whole_prompts(tiny):
    model = RecordingModel(tiny)
    seconds = time_prefill(model, prompt_len=12, batch_size=2, repeats=3, clock=fake_clock(READINGS))
    assert seconds == 1.0
    assert model.calls == [((2, 12), None)] * 4  # 1 warm-up + 3 timed, each the whole prompt


def test_time_decode_step_attends_context_len_positions(tiny):
    model = RecordingModel(tiny)
    seconds = time_decode_step(model, context_len=10, batch_size=3, repeats=3, clock=fake_clock(READINGS))
    assert seconds == 1.0
    # 1 warm-up + 3 timed calls, each one token per row at position 9 (the 10th), no prefill
    assert model.calls == [((3, 1), [[9]] * 3)] * 4


def test_time_decode_step_does_the_work_of_a_real_step(tiny):
    """A step over a zero-filled cache costs what a step after a real prefill costs: same shapes."""
    context = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    cache = KVCache(tiny.config, 2, 8)
    tiny(context, cache=cache)  # a real prefill of 7 positions
    recorder = RecordingModel(tiny)
    recorder(torch.zeros(2, 1, dtype=torch.long), positions=cache.lengths[:, None], cache=cache)  # 8th token
    time_decode_step(recorder, context_len=8, batch_size=2, repeats=1, clock=fake_clock([0.0, 1.0]))
    assert recorder.calls[1] == recorder.calls[0] == ((2, 1), [[7], [7]])


def test_model_timers_return_positive_finite_seconds(tiny):
    for seconds in (time_prefill(tiny, 16, repeats=2), time_decode_step(tiny, 16, batch_size=2, repeats=2)):
        assert math.isfinite(seconds) and seconds > 0


@pytest.mark.parametrize("kwargs, name", [({"context_len": 0}, "context_len=0"),
                                          ({"context_len": 4, "batch_size": 0}, "batch_size=0")])
def test_time_decode_step_rejects_bad_sizes(tiny, kwargs, name):
    with pytest.raises(ValueError, match=name):
        time_decode_step(tiny, **kwargs)


def test_roofline_time_takes_the_slower_of_compute_and_memory():
    peak_flops, peak_bw = 100e9, 20e9
    assert roofline_time(1e9, 1e6, peak_flops, peak_bw) == 1e9 / 100e9  # compute-bound: 10 ms
    assert roofline_time(1e6, 1e9, peak_flops, peak_bw) == 1e9 / 20e9  # memory-bound: 50 ms
    flops, nbytes = 3e9, 2e8  # consistent with the roofline: flops / attainable FLOP/s
    assert roofline_time(flops, nbytes, peak_flops, peak_bw) == pytest.approx(
        flops / roofline(flops / nbytes, peak_flops, peak_bw))
    with pytest.raises(ValueError, match="bytes_moved"):
        roofline_time(1.0, -1.0, peak_flops, peak_bw)


def test_prefill_bytes_is_weights_plus_the_kv_written():
    config = ModelConfig(vocab_size=10, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=16)
    # weights read (embedding table excluded, lm_head included): 2 layers x (attention 8*8*2 + 8*4*2
    # + mlp 3*8*16 + norms 2*8) + final norm 8 + lm_head 10*8 = 2 x 592 + 8 + 80 = 1272 parameters
    weights = 1272 * 2
    kv = 2 * 2 * 1 * 4 * 2 * 5 * 3  # K and V x layers x kv heads x head_dim x bytes x 5 tokens x 3 rows
    assert prefill_bytes(config, 5, batch_size=3, dtype="float16") == weights + kv


def test_roofline_point_places_a_measured_call():
    peak_flops, peak_bw = 100e9, 20e9  # ridge at 5 FLOP/byte
    compute = RooflinePoint(flops=1e9, bytes_moved=1e8, seconds=0.05, peak_flops=peak_flops,
                            peak_bw=peak_bw)
    assert compute.intensity == 10.0 and compute.bound == "compute"
    assert compute.roofline_time == pytest.approx(0.01)  # 1e9 FLOP at 100 GFLOP/s
    assert compute.slowdown == pytest.approx(5.0)
    assert compute.mfu == pytest.approx(0.2)  # 20 GFLOP/s of 100
    assert compute.mbu == pytest.approx(0.1)  # 2 GB/s of 20
    memory = RooflinePoint(1e6, 1e9, 0.1, peak_flops, peak_bw)
    assert memory.bound == "memory" and memory.roofline_time == pytest.approx(0.05)
    assert memory.mbu == pytest.approx(0.5)


@pytest.mark.parametrize("field, value", [("seconds", 0.0), ("bytes_moved", -1.0),
                                          ("flops", float("nan")), ("peak_bw", 0)])
def test_roofline_point_rejects_bad_numbers(field, value):
    args = dict(flops=1e9, bytes_moved=1e8, seconds=0.05, peak_flops=1e11, peak_bw=2e10)
    with pytest.raises(ValueError, match=f"{field}="):
        RooflinePoint(**{**args, field: value})


SHARE_CONFIG = ModelConfig(vocab_size=10, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=16)


@pytest.mark.parametrize("batch", [1, 4])
def test_prefill_share_on_a_pure_bandwidth_machine(batch):
    """With unlimited FLOP/s every call costs its bytes: weights W + KV bytes k per token."""
    P, N, bw = 5, 4, 1e9
    W, k = streamed_weight_bytes(SHARE_CONFIG, "float16"), kv_bytes_per_token(SHARE_CONFIG, "float16")
    prefill = W + k * P
    decode = sum(W + k * (P + j) * batch for j in range(1, N)) / batch  # steps shared by the batch
    share = prefill_share(SHARE_CONFIG, P, N, peak_flops=1e30, peak_bw=bw, batch_size=batch)
    assert share == pytest.approx(prefill / (prefill + decode))


def test_prefill_share_grows_with_the_prompt_and_the_batch():
    llama = get_config("llama-7b")
    a100 = dict(peak_flops=312e12, peak_bw=2.039e12)
    shares = [prefill_share(llama, p, 500, **a100) for p in (200, 2048, 16384)]
    assert 0 < shares[0] < shares[1] < shares[2] < 1
    assert prefill_share(llama, 200, 500, batch_size=64, **a100) > 10 * shares[0]
    assert prefill_share(llama, 200, 1, **a100) == 1.0  # no decode step at all
    with pytest.raises(ValueError, match="batch_size=0"):
        prefill_share(llama, 200, 500, batch_size=0, **a100)


def test_mixed_step_calls_feed_the_decode_rows_and_the_chunk(tiny):
    model = RecordingModel(tiny)
    calls = mixed_step_calls(model, decode_rows=3, context_len=10, chunk_lens=[5], block_size=4)
    assert list(calls) == ["decode", "chunk 5", "fused 5"]
    vocab = tiny.config.vocab_size
    assert [tuple(calls[name]().shape) for name in calls] == [(3, vocab), (5, vocab), (8, vocab)]
    assert model.calls == [((3, 1), [[9]] * 3),  # one token a row, at the 10th position
                           ((1, 5), [[0, 1, 2, 3, 4]]),  # the chunk starts its prompt
                           ((1, 8), [[9, 9, 9, 0, 1, 2, 3, 4]])]  # decode tokens, then the chunk


def test_the_fused_call_computes_the_logits_of_its_parts(tiny):
    calls = mixed_step_calls(tiny, decode_rows=2, context_len=7, chunk_lens=[5, 20], block_size=4)
    for C in (5, 20):
        parts = torch.cat([calls["decode"](), calls[f"chunk {C}"]()])  # (2 + C, vocab)
        assert torch.allclose(calls[f"fused {C}"](), parts, rtol=1e-5, atol=1e-5)
    assert torch.equal(calls["chunk 5"](), calls["chunk 5"]())  # every call repeats the same work
    assert not torch.allclose(calls["chunk 5"](), calls["chunk 20"]()[:5])  # other random tokens


@pytest.mark.parametrize("kwargs, message", [({"decode_rows": 0}, "decode_rows=0"),
                                             ({"chunk_lens": []}, "chunk_lens=\\[\\]"),
                                             ({"chunk_lens": [4, 0]}, "chunk_lens\\[1\\]=0"),
                                             ({"context_len": 0}, "context_len=0")])
def test_mixed_step_calls_reject_bad_sizes(tiny, kwargs, message):
    args = dict(decode_rows=2, context_len=8, chunk_lens=[4]) | kwargs
    with pytest.raises(ValueError, match=message):
        mixed_step_calls(tiny, **args)
