"""Wrong solutions students write: each fails its checks, and the first hint it is shown names its bug."""
from __future__ import annotations

import importlib.util
import math
import pathlib
import statistics

import pytest
import torch
import torch.nn.functional as F

from minillm.book.labs import function_names, grade
from minillm.book.labs import lab2_1 as L1
from minillm.book.labs import lab2_2 as L2
from minillm.book.labs import lab2_3 as L3
from minillm.book.labs import lab2_4 as L4
from minillm.book.labs import lab2_5 as L5

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _solutions(lab):
    path = ROOT / "instructor" / "solutions" / f"lab{lab.replace('.', '_')}.py"
    spec = importlib.util.spec_from_file_location(f"wrong_solutions_{lab}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {name: getattr(module, name) for name in function_names(lab)}


# --- lab 2.1 ------------------------------------------------------------------------------------------

def _attention(q, k, v, positions, **bug):
    return L1._attention_bug(q, k, v, positions, **bug)


def attention_tril(q, k, v, positions):
    T, S = q.shape[2], k.shape[2]
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.tril(torch.ones(T, S)) == 0, float("-inf"))
    return torch.softmax(scores, -1) @ v


def attention_sdpa_is_causal(q, k, v, positions):
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True)


def rope_interleaved(x, positions, theta):
    return L1._rope_bug(x, positions, theta, layout="interleaved")


def rope_exponent(x, positions, theta):
    return L1._rope_bug(x, positions, theta, exponent=1.0)


def rope_backwards(x, positions, theta):
    return L1._rope_bug(x, positions, theta, sign=-1.0)


def _sampling(logits, temperature, top_k, top_p, softmax=torch.softmax, keep="before", renormalize=True,
              temperature_on="logits"):
    """The reference filter with one of the usual slips."""
    if temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits.float() / (temperature if temperature_on == "logits" else 1.0)
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = softmax(logits, dim=-1)
    if temperature_on == "probs":
        probs = probs / temperature
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass = sorted_probs.cumsum(-1) - (sorted_probs if keep == "before" else 0)
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, mass >= top_p)
        probs = probs.masked_fill(drop, 0.0)
        if renormalize:
            probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _exp_over_sum(logits, dim):
    e = logits.exp()
    return e / e.sum(dim, keepdim=True)


WRONG_21 = {
    "mask tril(ones(T, S))": ("causal_attention", attention_tril, L1.TRIL_HINT),
    "sdpa is_causal=True": ("causal_attention", attention_sdpa_is_causal, L1.TRIL_HINT),
    "no 1/sqrt(D) scale": ("causal_attention", lambda q, k, v, p: _attention(q, k, v, p, scale=0.0), L1.SCALE_HINT),
    "scale 1/D": ("causal_attention", lambda q, k, v, p: _attention(q, k, v, p, scale=1.0), L1.SCALE_D_HINT),
    "softmax over queries": ("causal_attention", lambda q, k, v, p: _attention(q, k, v, p, softmax_dim=-2),
                             L1.SOFTMAX_DIM_HINT),
    "mask j < p": ("causal_attention", lambda q, k, v, p: _attention(q, k, v, p, mask="strict"), L1.OWN_KEY_HINT),
    "mask from positions[0]": ("causal_attention", lambda q, k, v, p: _attention(q, k, v, p, mask="row0"),
                               L1.ROW0_MASK_HINT),
    "hidden scores set to 0": ("causal_attention", lambda q, k, v, p: _attention(q, k, v, p, fill=0.0),
                               L1.ZERO_FILL_HINT),
    "repeat, not repeat_interleave": ("causal_attention", lambda q, k, v, p: _attention(q, k, v, p,
                                                                                      heads="repeat"),
                                      L1.REPEAT_HINT),
    "rope interleaved pairs": ("apply_rope", rope_interleaved, L1.INTERLEAVED_HINT),
    "rope exponent -i/D": ("apply_rope", rope_exponent, L1.FREQUENCY_HINT),
    "rope turns backwards": ("apply_rope", rope_backwards, L1.DIRECTION_HINT),
    "softmax without the max subtraction": ("next_token_probs", lambda lg, t, k, p: _sampling(
        lg, t, k, p, softmax=_exp_over_sum), L1.MAX_SUB_HINT),
    "top-p drops the token that crosses p": ("next_token_probs", lambda lg, t, k, p: _sampling(
        lg, t, k, p, keep="after"), L1.TOP_P_HINT),
    "top-p without renormalizing": ("next_token_probs", lambda lg, t, k, p: _sampling(
        lg, t, k, p, renormalize=False), L1.RENORM_HINT),
    "temperature divides the probabilities": ("next_token_probs", lambda lg, t, k, p: _sampling(
        lg, t, k, p, temperature_on="probs"), L1.TEMPERATURE_HINT),
}


# --- lab 2.2 ------------------------------------------------------------------------------------------

def write_kv_from_zero(cache, new, positions):
    cache[:, :, :new.shape[2]] = new  # ignores positions


def write_kv_one_past(cache, new, positions):
    rows = torch.arange(cache.shape[0])[:, None]
    cache[rows, :, positions + 1] = new.transpose(1, 2)


def write_kv_returns_a_copy(cache, new, positions):
    out = cache.clone()
    out[torch.arange(cache.shape[0])[:, None], :, positions] = new.transpose(1, 2)
    return out


def read_kv_valid_le(cache, lengths):
    S = int(lengths.max())
    return cache[:, :, :S], torch.arange(S)[None, :] <= lengths[:, None]


def kv_bytes_without_two(n_layers, n_kv_heads, head_dim, seq_len, batch_size, bytes_per_element):
    return n_layers * n_kv_heads * head_dim * seq_len * batch_size * bytes_per_element


def kv_elements(n_layers, n_kv_heads, head_dim, seq_len, batch_size, bytes_per_element):
    return 2 * n_layers * n_kv_heads * head_dim * seq_len * batch_size


def _paged(pool, block_table, new, positions, blocks_of=None, slots_of=None, rows_of=None):
    block_size = pool.shape[2]
    rows = torch.arange(positions.shape[0])[:, None] if rows_of is None else rows_of
    blocks = block_table[rows, positions // block_size] if blocks_of is None else blocks_of(block_table, positions)
    slots = positions % block_size if slots_of is None else slots_of(positions, block_size)
    pool[blocks, :, slots] = new.transpose(1, 2)


def paged_ignores_the_table(pool, block_table, new, positions):
    _paged(pool, block_table, new, positions, blocks_of=lambda table, p: p // pool.shape[2])


def paged_row_0_s_table(pool, block_table, new, positions):
    _paged(pool, block_table, new, positions, rows_of=0)


def paged_block_of_the_first_position(pool, block_table, new, positions):
    rows = torch.arange(positions.shape[0])[:, None]
    _paged(pool, block_table, new, positions,
           blocks_of=lambda table, p: table[rows, p[:, :1] // pool.shape[2]].expand_as(p))


def paged_slot_without_modulo(pool, block_table, new, positions):
    _paged(pool, block_table, new, positions, slots_of=lambda p, size: p)


def paged_block_and_slot_swapped(pool, block_table, new, positions):
    rows = torch.arange(positions.shape[0])[:, None]
    _paged(pool, block_table, new, positions, blocks_of=lambda table, p: table[rows, p % pool.shape[2]],
           slots_of=lambda p, size: p // size)


def paged_returns_a_copy(pool, block_table, new, positions):
    copy = pool.clone()
    _paged(copy, block_table, new, positions)
    return copy


WRONG_22 = {
    "write_paged ignores the block table": ("write_paged", paged_ignores_the_table, L2.PAGED_TABLE_HINT),
    "write_paged uses row 0's table": ("write_paged", paged_row_0_s_table, L2.PAGED_ROW_HINT),
    "write_paged takes the first position's block": ("write_paged", paged_block_of_the_first_position,
                                                     L2.PAGED_CROSS_HINT),
    "write_paged slot without modulo": ("write_paged", paged_slot_without_modulo, L2.PAGED_SLOT_HINT),
    "write_paged block and slot swapped": ("write_paged", paged_block_and_slot_swapped, L2.PAGED_SLOT_HINT),
    "write_paged returns a copy": ("write_paged", paged_returns_a_copy, L2.PAGED_INPLACE_HINT),
    "write_kv ignores positions": ("write_kv", write_kv_from_zero, L2.ORDER_HINT),
    "write_kv at position + 1": ("write_kv", write_kv_one_past, L2.SHIFT_HINT),
    "write_kv returns a copy": ("write_kv", write_kv_returns_a_copy, L2.INPLACE_HINT),
    "read_kv valid with <=": ("read_kv", read_kv_valid_le, L2.VALID_LE_HINT),
    "kv_cache_bytes without K and V": ("kv_cache_bytes", kv_bytes_without_two, L2.KV_TWO_HINT),
    "kv_cache_bytes counts elements": ("kv_cache_bytes", kv_elements, L2.PER_ELEMENT_HINT),
}


# --- lab 2.3 ------------------------------------------------------------------------------------------

def _need(s, b):
    return math.ceil(s.num_tokens / b) - len(s.blocks)


def admit_skips_the_head(waiting, running, free_blocks, block_size, max_batch_size):
    chosen = []
    for seq in waiting:
        if len(running) + len(chosen) >= max_batch_size:
            break
        if _need(seq, block_size) > free_blocks:
            continue  # a later, smaller one overtakes
        chosen.append(seq)
        free_blocks -= _need(seq, block_size)
    return chosen


def preempt_oldest(running, free_blocks, block_size):
    staying, victims = list(running), []
    while staying and sum(_need(s, block_size) for s in staying) > free_blocks:
        victim = staying.pop(0)
        free_blocks += len(victim.blocks)
        victims.append(victim)
    return victims


def preempt_everyone(running, free_blocks, block_size):
    return list(reversed(running)) if sum(_need(s, block_size) for s in running) > free_blocks else []


def preempt_forgets_freed_blocks(running, free_blocks, block_size):
    staying, victims = list(running), []
    while staying and sum(_need(s, block_size) for s in staying) > free_blocks:
        victims.append(staying.pop())
    return victims


WRONG_23 = {
    "admit out of queue order": ("admit", admit_skips_the_head, L3.FCFS_HINT),
    "preempt oldest first": ("preempt", preempt_oldest, L3.OLDEST_HINT),
    "preempt everyone": ("preempt", preempt_everyone, L3.EVERYONE_HINT),
    "preempt forgets freed blocks": ("preempt", preempt_forgets_freed_blocks, L3.FREED_HINT),
}

# --- lab 2.4 ------------------------------------------------------------------------------------------

def tpot_over_n(request):
    n = len(request.token_times)
    return None if n < 2 else (request.token_times[-1] - request.token_times[0]) / n


def tpot_from_arrival(request):
    n = len(request.token_times)
    return None if n < 2 else (request.token_times[-1] - request.arrival_time) / (n - 1)


def _goodput(strict=False, slowest=False):
    def goodput(requests, duration, ttft_slo, tpot_slo):
        return L4._goodput_variant(requests, duration, ttft_slo, tpot_slo, strict=strict, slowest=slowest)
    return goodput


def throughput_counts_failures(requests, duration):
    return len(requests) / duration, sum(len(r.token_times) for r in requests) / duration


def devices_floor(concurrency, tpot_slo, decode_tokens_per_s, kv_bytes_per_request, kv_bytes_per_device):
    by_memory = kv_bytes_per_device // kv_bytes_per_request
    if by_memory == 0:
        raise ValueError("no request fits")
    return int(concurrency / min(decode_tokens_per_s * tpot_slo, by_memory))


def devices_ignore_memory(concurrency, tpot_slo, decode_tokens_per_s, kv_bytes_per_request, kv_bytes_per_device):
    if kv_bytes_per_device < kv_bytes_per_request:
        raise ValueError("no request fits")
    return math.ceil(concurrency / (decode_tokens_per_s * tpot_slo))


def _knee_walk(sweep, keep_up=0.9, strict=False, order=sorted):
    best = None
    for offered, completed in order(sweep):
        if completed < keep_up * offered or (strict and completed <= keep_up * offered):
            break
        best = offered
    return best


def knee_strict(sweep, keep_up=0.9):
    return _knee_walk(sweep, keep_up, strict=True)


def knee_unsorted(sweep, keep_up=0.9):
    return _knee_walk(sweep, keep_up, order=list)


def knee_any_rate_kept(sweep, keep_up=0.9):
    return max((offered for offered, completed in sweep if completed >= keep_up * offered), default=None)


def knee_first_fall(sweep, keep_up=0.9):
    return next((offered for offered, completed in sorted(sweep) if completed < keep_up * offered), None)


def knee_returns_completed(sweep, keep_up=0.9):
    return dict(sweep).get(_knee_walk(sweep, keep_up))


def knee_fixed_fraction(sweep, keep_up=0.9):
    return _knee_walk(sweep, 0.9)


def knee_zero_for_none(sweep, keep_up=0.9):
    return _knee_walk(sweep, keep_up) or 0.0


WRONG_24 = {
    "knee with >": ("knee", knee_strict, L4.KNEE_STRICT_HINT),
    "knee without sorting": ("knee", knee_unsorted, L4.KNEE_SORT_HINT),
    "knee at any rate kept": ("knee", knee_any_rate_kept, L4.KNEE_FIRST_FALL_HINT),
    "knee at the first fall": ("knee", knee_first_fall, L4.KNEE_FALLING_HINT),
    "knee returns the completion rate": ("knee", knee_returns_completed, L4.KNEE_OFFERED_HINT),
    "knee ignores keep_up": ("knee", knee_fixed_fraction, L4.KNEE_ARG_HINT),
    "knee 0 instead of None": ("knee", knee_zero_for_none, L4.KNEE_NONE_HINT),
    "tpot divides by n": ("tpot", tpot_over_n, L4.N_GAPS_HINT),
    "tpot from the arrival": ("tpot", tpot_from_arrival, L4.ARRIVAL_HINT),
    "goodput with <": ("goodput", _goodput(strict=True), L4.STRICT_HINT),
    "goodput on the slowest gap": ("goodput", _goodput(slowest=True), L4.SLOWEST_GAP_HINT),
    "throughput counts failed requests": ("throughput", throughput_counts_failures,
                                          L4.THROUGHPUT.properties[1].hint),
    "devices rounded down": ("devices_needed", devices_floor, L4.CEIL_HINT),
    "devices ignore memory": ("devices_needed", devices_ignore_memory, L4.MEMORY_HINT),
}


# --- lab 2.5 ------------------------------------------------------------------------------------------

def _int8(weight, dim=1, divisor=127, signed_max=False, rounding=torch.round, guard=True, per_tensor=False):
    amax = (weight.amax(dim=dim) if signed_max else weight.abs().amax(dim=dim))
    if per_tensor:
        amax = weight.abs().max().expand(weight.shape[0])
    scales = torch.where(amax > 0, amax / divisor, torch.ones_like(amax)) if guard else amax / divisor
    scale = scales[:, None] if dim == 1 else scales[None, :]
    return rounding(weight / scale).clamp(-127, 127).to(torch.int8), scales


def _int4(weight, axis="row", levels=15, rounding=torch.round, guard=True, signed=False, group=32):
    out, width = weight.shape
    if axis == "column":
        groups = weight.t().reshape(width, out // group, group)
    else:
        groups = weight.reshape(out, width // group, group)
    if signed:
        scales = groups.abs().amax(-1) / 7
        q = torch.round(groups / scales[..., None]).clamp(-8, 7)
        q = q.reshape(out, width) if axis == "row" else q.reshape(width, out).t()
        return q.to(torch.int8), scales, torch.zeros_like(scales)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = torch.where(high > low, (high - low) / levels, torch.ones_like(low)) if guard else (high - low) / levels
    q = rounding((groups - low[..., None]) / scales[..., None]).clamp(0, 15)
    q = q.reshape(out, width) if axis == "row" else q.reshape(width, out).t()
    if axis == "column":
        return q.to(torch.uint8), scales.t(), low.t()
    return q.to(torch.uint8), scales, low


def _int4_per_row(weight):
    low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    scales = (high - low) / 15
    return torch.round((weight - low) / scales).to(torch.uint8), scales, low


def _bytes(model, context_len, embed="skip-untied", dedupe=True, element=True, tensors="state_dict", kv=True,
           kv_two=True, kv_heads="kv", kv_bytes=None, unit=1):
    table = model.model.embed_tokens.weight
    tied = any(t.data_ptr() == table.data_ptr() for t in model.lm_head.state_dict().values())
    listed = list(model.parameters()) if tensors == "parameters" else list(model.state_dict().values())
    if tensors == "buffers too":
        listed += list(model.buffers())
    seen, total = set(), 0
    for t in listed:
        if (dedupe and t.data_ptr() in seen) or (embed == "skip-untied" and t.data_ptr() == table.data_ptr()
                                                 and not tied):
            continue
        seen.add(t.data_ptr())
        total += t.numel() * (t.element_size() if element else 1)
    c = model.config
    heads = c.n_kv_heads if kv_heads == "kv" else c.n_heads
    per = kv_bytes or model.dtype.itemsize
    cache = (2 if kv_two else 1) * c.n_layers * heads * c.head_dim * context_len * per
    total += cache if kv else 0
    return total if unit == 1 else total / unit


def _bytes_twice_when_tied(model, context_len):
    table = model.model.embed_tokens.weight
    tied = model.config.tie_embeddings
    total = sum(t.numel() * t.element_size() for name, t in model.state_dict().items()
                if tied or name != "model.embed_tokens.weight")
    return total + _bytes(model, context_len) - _bytes(model, context_len, kv=False) + 0 * table.numel()


def _rate(start, times, how="median"):
    gaps = [b - a for a, b in zip(times, times[1:])]
    if how == "whole run":
        return len(times) / (times[-1] - start)
    if how == "mean":
        return 1 / statistics.fmean(gaps)
    if how == "n over span":
        return len(times) / (times[-1] - times[0])
    return statistics.median(gaps)  # "seconds"


WRONG_25 = {
    "int8 scales per column": ("quantize_int8", lambda w: _int8(w, dim=0), L5.INT8_COLUMNS_HINT),
    "int8 one scale for the matrix": ("quantize_int8", lambda w: _int8(w, per_tensor=True), L5.INT8_TENSOR_HINT),
    "int8 max / 128": ("quantize_int8", lambda w: _int8(w, divisor=128), L5.INT8_128_HINT),
    "int8 max, not max |w|": ("quantize_int8", lambda w: _int8(w, signed_max=True), L5.INT8_ABS_HINT),
    "int8 truncates": ("quantize_int8", lambda w: _int8(w, rounding=torch.trunc), L5.ROUND_HINT),
    "int8 zero row divides by 0": ("quantize_int8", lambda w: _int8(w, guard=False), L5.ZERO_ROW_HINT),
    "int4 groups down the columns": ("quantize_int4", lambda w: _int4(w, axis="column"), L5.INT4_AXIS_HINT),
    "int4 one group per row": ("quantize_int4", _int4_per_row, L5.INT4_ROW_HINT),
    "int4 (max - min) / 16": ("quantize_int4", lambda w: _int4(w, levels=16), L5.INT4_16_HINT),
    "int4 floor": ("quantize_int4", lambda w: _int4(w, rounding=torch.floor), L5.ROUND_HINT),
    "int4 signed around 0": ("quantize_int4", lambda w: _int4(w, signed=True), L5.INT4_SIGNED_HINT),
    "int4 constant group divides by 0": ("quantize_int4", lambda w: _int4(w, guard=False), L5.INT4_CONSTANT_HINT),
    "bytes count the untied table": ("bytes_per_step", lambda m, c: _bytes(m, c, embed="count"), L5.EMBED_HINT),
    "bytes count a tied table twice": ("bytes_per_step", _bytes_twice_when_tied, L5.TIED_TWICE_HINT),
    "bytes count elements": ("bytes_per_step", lambda m, c: _bytes(m, c, element=False, kv_bytes=1),
                             L5.ELEMENT_HINT),
    "bytes from parameters only": ("bytes_per_step", lambda m, c: _bytes(m, c, tensors="parameters"),
                                   L5.BUFFER_HINT),
    "bytes of every buffer": ("bytes_per_step", lambda m, c: _bytes(m, c, tensors="buffers too"), L5.ROTARY_HINT),
    "bytes without the KV cache": ("bytes_per_step", lambda m, c: _bytes(m, c, kv=False), L5.KV_HINT),
    "KV bytes of the query heads": ("bytes_per_step", lambda m, c: _bytes(m, c, kv_heads="q"), L5.KV_HEADS_HINT),
    "KV bytes always float32": ("bytes_per_step", lambda m, c: _bytes(m, c, kv_bytes=4), L5.KV_DTYPE_HINT),
    "bytes in MB": ("bytes_per_step", lambda m, c: _bytes(m, c, unit=10**6), L5.UNIT_HINT),
    "bandwidth in GiB": ("predict_tokens_per_s", lambda b, gb: gb * 2**30 / b, L5.GIB_HINT),
    "seconds per token predicted": ("predict_tokens_per_s", lambda b, gb: b / (gb * 1e9), L5.INVERTED_HINT),
    "rate of the whole run": ("decode_tokens_per_s", lambda s, t: _rate(s, t, "whole run"), L5.WHOLE_RUN_HINT),
    "rate from the mean gap": ("decode_tokens_per_s", lambda s, t: _rate(s, t, "mean"), L5.MEAN_HINT),
    "n tokens over n - 1 gaps": ("decode_tokens_per_s", lambda s, t: _rate(s, t, "n over span"), L5.GAPS_HINT),
    "seconds per token measured": ("decode_tokens_per_s", lambda s, t: _rate(s, t, "seconds"), L5.SECONDS_HINT),
}

ALONE = {"2.5"}  # labs whose wrong functions are graded alone: their joint task times SmolLM2
CASES = {f"{lab} {bug}": (lab,) + case for lab, wrong in
         (("2.1", WRONG_21), ("2.2", WRONG_22), ("2.3", WRONG_23), ("2.4", WRONG_24), ("2.5", WRONG_25))
         for bug, case in wrong.items()}


def test_the_suite_has_at_least_40_wrong_solutions_in_every_lab():
    assert len(CASES) >= 40
    assert {case[0] for case in CASES.values()} == {"2.1", "2.2", "2.3", "2.4", "2.5"}


def _first_hint(reports):
    failed = [o for r in reports for o in r.outcomes if not o.passed]
    return failed[0].hint if failed else None


@pytest.mark.parametrize("bug", sorted(CASES))
def test_a_wrong_solution_fails_with_the_hint_for_its_bug(bug):
    lab, name, wrong, hint = CASES[bug]
    fns = {} if lab in ALONE else _solutions(lab)
    fns[name] = wrong
    wrong.__name__ = name
    reports = grade(**fns)
    assert not all(r.all_passed for r in reports), bug
    assert _first_hint(reports) == hint, (bug, _first_hint(reports))


@pytest.mark.parametrize("bug", sorted(WRONG_23))
def test_the_simulator_catches_each_policy_bug_too(bug):
    _, name, wrong, hint = CASES[f"2.3 {bug}"]
    fns = _solutions("2.3")
    fns[name] = wrong
    wrong.__name__ = name
    sim = next(r for r in grade(**fns) if r.task == "the three rules in the simulator")
    failed = [o for o in sim.outcomes if not o.passed]
    assert failed and failed[0].hint == hint, (bug, failed[0].hint if failed else None)
