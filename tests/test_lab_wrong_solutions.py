"""Wrong solutions students write: each fails its checks, and a hint names a bug only when the solution has it.

Three sets. The catalogue's own bugs (the code each lab keeps to recognise them) are each named by their
first FAIL and by no other. Wrong solutions written here, independently of the catalogues, are named by
the bug they have. Bugs outside the catalogues fail without any FAIL naming a bug: their hints say what was
expected and what to check. Last, whole submissions of the kinds a class hands in: what each is named for
and what it scores.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import pathlib
import statistics

import numpy
import pytest
import torch
import torch.nn.functional as F

from minillm.book.labs import TASKS, function_names, grade, lab2_1, lab2_4
from minillm.book.labs.diagnosis import Catalogue, separates

ROOT = pathlib.Path(__file__).resolve().parents[1]
LABS = ("2.1", "2.2", "2.3", "2.4", "2.5", "2.6")
ALONE = {"2.5"}  # labs whose wrong functions are graded alone: their joint task times SmolLM2


def _solutions(lab):
    path = ROOT / "instructor" / "solutions" / f"lab{lab.replace('.', '_')}.py"
    spec = importlib.util.spec_from_file_location(f"wrong_solutions_{lab}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {name: getattr(module, name) for name in function_names(lab)}


def _named(name, function):
    """``function`` under the lab's name (a lambda or a catalogue's code cannot be renamed in place)."""
    def learner(*args, **kwargs):
        return function(*args, **kwargs)
    learner.__name__ = name
    return learner


def _failures(lab, wrong: dict) -> list:
    """The failing outcomes of the tasks that need one of the ``wrong`` functions, in order."""
    fns = {} if lab in ALONE else _solutions(lab)
    fns.update({name: _named(name, f) for name, f in wrong.items()})
    reports = [r for r in grade(**fns) if set(TASKS[r.task].needs) & set(wrong)]
    return [o for r in reports for o in r.outcomes if not o.passed]


def _catalogues():
    found = []
    for lab in LABS:
        module = importlib.import_module(f"minillm.book.labs.lab{lab.replace('.', '_')}")
        found += [(lab, c) for c in vars(module).values() if isinstance(c, Catalogue)]
    return found


CATALOGUES = _catalogues()
CATALOGUED = {bug.key: (lab, catalogue.function, bug) for lab, catalogue in CATALOGUES for bug in catalogue.bugs}


@pytest.mark.parametrize("function", [c.function for _, c in CATALOGUES])
def test_the_probes_tell_every_catalogued_bug_apart(function):
    catalogue = next(c for _, c in CATALOGUES if c.function == function)
    assert separates(catalogue) == []


@pytest.mark.parametrize("key", sorted(CATALOGUED))
def test_a_catalogued_bug_is_named_by_its_first_fail_and_no_other(key):
    lab, function, bug = CATALOGUED[key]
    failed = _failures(lab, {function: bug.code})
    assert failed, key
    assert failed[0].bug == key and failed[0].hint == bug.text
    assert {o.bug for o in failed} <= {key, None}


# --- wrong solutions written here, each with the bug it should be named for ---------------------------------

def _attention(q, k, v, positions, **bug):
    return lab2_1._attention_bug(q, k, v, positions, **bug)


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


def _sampling(logits, temperature, top_k, top_p, softmax=torch.softmax, keep="before", renormalize=True,
              temperature_on="logits", order="k then p"):
    """The reference filter with one of the usual slips."""
    if temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits.float() / (temperature if temperature_on == "logits" else 1.0)

    def cut_k(x):
        if 0 < top_k < x.shape[-1]:
            return x.masked_fill(x < x.topk(top_k, dim=-1).values[..., -1:], float("-inf"))
        return x

    def cut_p(probs):
        if top_p >= 1.0:
            return probs
        ordered, index = probs.sort(dim=-1, descending=True)
        mass = ordered.cumsum(-1) - (ordered if keep == "before" else 0)
        probs = probs.masked_fill(torch.zeros_like(probs, dtype=torch.bool).scatter(-1, index, mass >= top_p), 0.0)
        return probs / probs.sum(-1, keepdim=True) if renormalize else probs

    if order == "p then k":
        probs = cut_p(softmax(logits, dim=-1))
        return torch.softmax(cut_k(probs.log()), -1)
    probs = softmax(cut_k(logits), dim=-1)
    if temperature_on == "probs":
        probs = probs / temperature
    return cut_p(probs)


def _exp_over_sum(logits, dim):
    e = logits.exp()
    return e / e.sum(dim, keepdim=True)


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


def _paged(pool, block_table, new, positions, blocks_of=None, slots_of=None, rows_of=None):
    block_size = pool.shape[2]
    rows = torch.arange(positions.shape[0])[:, None] if rows_of is None else rows_of
    blocks = block_table[rows, positions // block_size] if blocks_of is None else blocks_of(block_table, positions)
    slots = positions % block_size if slots_of is None else slots_of(positions, block_size)
    pool[blocks, :, slots] = new.transpose(1, 2)


def paged_block_of_the_first_position(pool, block_table, new, positions):
    rows = torch.arange(positions.shape[0])[:, None]
    _paged(pool, block_table, new, positions,
           blocks_of=lambda table, p: table[rows, p[:, :1] // pool.shape[2]].expand_as(p))


def paged_block_and_slot_swapped(pool, block_table, new, positions):
    rows = torch.arange(positions.shape[0])[:, None]
    _paged(pool, block_table, new, positions, blocks_of=lambda table, p: table[rows, p % pool.shape[2]],
           slots_of=lambda p, size: p // size)


def paged_returns_a_copy(pool, block_table, new, positions):
    copy = pool.clone()
    _paged(copy, block_table, new, positions)
    return copy


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


def tpot_over_n(request):
    n = len(request.token_times)
    return None if n < 2 else (request.token_times[-1] - request.token_times[0]) / n


def tpot_from_arrival(request):
    n = len(request.token_times)
    return None if n < 2 else (request.token_times[-1] - request.arrival_time) / (n - 1)


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


def _int8(weight, dim=1, divisor=127, signed_max=False, rounding=torch.round, guard=True, per_tensor=False):
    amax = (weight.amax(dim=dim) if signed_max else weight.abs().amax(dim=dim))
    if per_tensor:
        amax = weight.abs().max().expand(weight.shape[0])
    scales = torch.where(amax > 0, amax / divisor, torch.ones_like(amax)) if guard else amax / divisor
    scale = scales[:, None] if dim == 1 else scales[None, :]
    return rounding(weight / scale).clamp(-127, 127).to(torch.int8), scales


def _int4(weight, axis="row", levels=15, rounding=torch.round, guard=True, signed=False, group=32):
    out, width = weight.shape
    groups = weight.t().reshape(width, out // group, group) if axis == "column" else \
        weight.reshape(out, width // group, group)
    if signed:
        scales = groups.abs().amax(-1) / 7
        q = torch.round(groups / scales[..., None]).clamp(-8, 7)
        q = q.reshape(out, width) if axis == "row" else q.reshape(width, out).t()
        return q.to(torch.int8), scales, torch.zeros_like(scales)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = torch.where(high > low, (high - low) / levels, torch.ones_like(low)) if guard else (high - low) / levels
    q = rounding((groups - low[..., None]) / scales[..., None]).clamp(0, 15)
    if axis == "column":
        return q.reshape(width, out).t().to(torch.uint8), scales.t(), low.t()
    return q.reshape(out, width).to(torch.uint8), scales, low


def _int4_per_row(weight):
    low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    scales = (high - low) / 15
    return torch.round((weight - low) / scales).to(torch.uint8), scales, low


def _bytes(model, context_len, embed="skip-untied", dedupe=True, element=True, tensors="state_dict", kv=True,
           kv_heads="kv", kv_bytes=None, unit=1):
    table = model.model.embed_tokens.weight
    tied = any(t.data_ptr() == table.data_ptr() for t in model.lm_head.state_dict().values())
    listed = list(model.parameters()) if tensors == "parameters" else list(model.state_dict().values())
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
    total += (2 * c.n_layers * heads * c.head_dim * context_len * per) if kv else 0
    return total if unit == 1 else total / unit


def _bytes_twice_when_tied(model, context_len):
    tied = model.config.tie_embeddings
    total = sum(t.numel() * t.element_size() for name, t in model.state_dict().items()
                if tied or name != "model.embed_tokens.weight")
    return total + _bytes(model, context_len) - _bytes(model, context_len, kv=False)


def _rate(start, times, how="median"):
    gaps = [b - a for a, b in zip(times, times[1:])]
    if how == "whole run":
        return len(times) / (times[-1] - start)
    if how == "mean":
        return 1 / statistics.fmean(gaps)
    if how == "n over span":
        return len(times) / (times[-1] - times[0])
    return statistics.median(gaps)  # "seconds"


def greedy_without_the_bonus(draft_tokens, target_logits):
    best = target_logits.argmax(-1).tolist()
    for i, guess in enumerate(draft_tokens):
        if guess != best[i]:
            return list(draft_tokens[:i]) + [best[i]]
    return list(draft_tokens)  # every guess kept: the round forgets the target's last row


def greedy_one_row_late(draft_tokens, target_logits):
    best = target_logits.argmax(-1).tolist()
    kept = 0
    while kept < len(draft_tokens) and kept + 1 < len(best) and draft_tokens[kept] == best[kept + 1]:
        kept += 1
    return list(draft_tokens[:kept]) + [best[min(kept + 1, len(best) - 1)]]


def sampled_correction_from_p(draft_tokens, draft_probs, target_probs, generator):
    for i, token in enumerate(draft_tokens):
        p, q = target_probs[i], draft_probs[i]
        if torch.rand((), generator=generator) * q[token] >= p[token]:
            return list(draft_tokens[:i]) + [int(torch.multinomial(p, 1, generator=generator))]
    return list(draft_tokens) + [int(torch.multinomial(target_probs[-1], 1, generator=generator))]


# (lab, function, the wrong code, the bug its checks name; None: a fact about the output names no bug)
WRITTEN = {
    "mask tril(ones(T, S))": ("2.1", "causal_attention", attention_tril, "attention.tril"),
    "sdpa is_causal=True": ("2.1", "causal_attention", attention_sdpa_is_causal, "attention.tril"),
    "no 1/sqrt(D) scale": ("2.1", "causal_attention", lambda q, k, v, p: _attention(q, k, v, p, scale=0.0),
                           "attention.no_scale"),
    "mask j < p": ("2.1", "causal_attention", lambda q, k, v, p: _attention(q, k, v, p, mask="strict"),
                   "attention.strict"),
    "repeat, not repeat_interleave": ("2.1", "causal_attention",
                                      lambda q, k, v, p: _attention(q, k, v, p, heads="repeat"), "attention.repeat"),
    "softmax without the max subtraction": ("2.1", "next_token_probs", lambda lg, t, k, p: _sampling(
        lg, t, k, p, softmax=_exp_over_sum), "sampling.overflow"),
    "top-p drops the token that crosses p": ("2.1", "next_token_probs", lambda lg, t, k, p: _sampling(
        lg, t, k, p, keep="after"), "sampling.crossing"),
    "top-p without renormalizing": ("2.1", "next_token_probs", lambda lg, t, k, p: _sampling(
        lg, t, k, p, renormalize=False), "sampling.no_renormalize"),
    "temperature divides the probabilities": ("2.1", "next_token_probs", lambda lg, t, k, p: _sampling(
        lg, t, k, p, temperature_on="probs"), "sampling.temperature_on_probs"),
    "write_paged takes the first position's block": ("2.2", "write_paged", paged_block_of_the_first_position,
                                                     "write_paged.first_block"),
    "write_paged block and slot swapped": ("2.2", "write_paged", paged_block_and_slot_swapped, "write_paged.swapped"),
    "write_paged returns a copy": ("2.2", "write_paged", paged_returns_a_copy, "write_paged.copy"),
    "write_kv ignores positions": ("2.2", "write_kv", write_kv_from_zero, "write_kv.order"),
    "write_kv at position + 1": ("2.2", "write_kv", write_kv_one_past, "write_kv.shift"),
    "write_kv returns a copy": ("2.2", "write_kv", write_kv_returns_a_copy, "write_kv.copy"),
    "read_kv valid with <=": ("2.2", "read_kv", read_kv_valid_le, "read_kv.valid_le"),
    "admit out of queue order": ("2.3", "admit", admit_skips_the_head, "admit.overtake"),
    "preempt oldest first": ("2.3", "preempt", preempt_oldest, "preempt.oldest"),
    "preempt everyone": ("2.3", "preempt", preempt_everyone, "preempt.everyone"),
    "preempt forgets freed blocks": ("2.3", "preempt", preempt_forgets_freed_blocks, "preempt.forgets_freed"),
    "knee with >": ("2.4", "knee", lambda s, k=0.9: _knee_walk(s, k, strict=True), "knee.strict"),
    "knee without sorting": ("2.4", "knee", lambda s, k=0.9: _knee_walk(s, k, order=list), "knee.unsorted"),
    "knee 0 instead of None": ("2.4", "knee", lambda s, k=0.9: _knee_walk(s, k) or 0.0, "knee.zero"),
    "tpot divides by n": ("2.4", "tpot", tpot_over_n, "tpot.over_n"),
    "tpot from the arrival": ("2.4", "tpot", tpot_from_arrival, "tpot.from_arrival"),
    "throughput counts failed requests": ("2.4", "throughput", throughput_counts_failures,
                                          "throughput.failed_requests"),
    "devices rounded down": ("2.4", "devices_needed", devices_floor, "devices.floor"),
    "devices ignore memory": ("2.4", "devices_needed", devices_ignore_memory, "devices.no_memory"),
    "int8 scales per column": ("2.5", "quantize_int8", lambda w: _int8(w, dim=0), None),
    "int8 one scale for the matrix": ("2.5", "quantize_int8", lambda w: _int8(w, per_tensor=True), "int8.per_tensor"),
    "int8 max / 128": ("2.5", "quantize_int8", lambda w: _int8(w, divisor=128), "int8.over_128"),
    "int8 max, not max |w|": ("2.5", "quantize_int8", lambda w: _int8(w, signed_max=True), "int8.signed_max"),
    "int8 truncates": ("2.5", "quantize_int8", lambda w: _int8(w, rounding=torch.trunc), "int8.truncate"),
    "int8 zero row divides by 0": ("2.5", "quantize_int8", lambda w: _int8(w, guard=False), "int8.zero_row"),
    "int4 groups down the columns": ("2.5", "quantize_int4", lambda w: _int4(w, axis="column"), None),
    "int4 one group per row": ("2.5", "quantize_int4", _int4_per_row, None),
    "int4 (max - min) / 16": ("2.5", "quantize_int4", lambda w: _int4(w, levels=16), "int4.over_16"),
    "int4 floor": ("2.5", "quantize_int4", lambda w: _int4(w, rounding=torch.floor), "int4.floor"),
    "int4 signed around 0": ("2.5", "quantize_int4", lambda w: _int4(w, signed=True), None),
    "int4 constant group divides by 0": ("2.5", "quantize_int4", lambda w: _int4(w, guard=False),
                                         "int4.constant_group"),
    "bytes count the untied table": ("2.5", "bytes_per_step", lambda m, c: _bytes(m, c, embed="count"),
                                     "bytes.untied_table"),
    "bytes count a tied table twice": ("2.5", "bytes_per_step", _bytes_twice_when_tied, "bytes.tied_twice"),
    "bytes count elements": ("2.5", "bytes_per_step", lambda m, c: _bytes(m, c, element=False, kv_bytes=1),
                             "bytes.elements"),
    "bytes from parameters only": ("2.5", "bytes_per_step", lambda m, c: _bytes(m, c, tensors="parameters"),
                                   "bytes.parameters"),
    "bytes without the KV cache": ("2.5", "bytes_per_step", lambda m, c: _bytes(m, c, kv=False), "bytes.no_kv"),
    "KV bytes of the query heads": ("2.5", "bytes_per_step", lambda m, c: _bytes(m, c, kv_heads="q"),
                                    "bytes.kv_query_heads"),
    "KV bytes always float32": ("2.5", "bytes_per_step", lambda m, c: _bytes(m, c, kv_bytes=4), "bytes.kv_float32"),
    "bytes in MB": ("2.5", "bytes_per_step", lambda m, c: _bytes(m, c, unit=10**6), "bytes.megabytes"),
    "bandwidth in GiB": ("2.5", "predict_tokens_per_s", lambda b, gb: gb * 2**30 / b, "predict.gib"),
    "seconds per token predicted": ("2.5", "predict_tokens_per_s", lambda b, gb: b / (gb * 1e9), "predict.inverted"),
    "rate of the whole run": ("2.5", "decode_tokens_per_s", lambda s, t: _rate(s, t, "whole run"), "rate.whole_run"),
    "rate from the mean gap": ("2.5", "decode_tokens_per_s", lambda s, t: _rate(s, t, "mean"), "rate.mean"),
    "n tokens over n - 1 gaps": ("2.5", "decode_tokens_per_s", lambda s, t: _rate(s, t, "n over span"),
                                 "rate.n_over_span"),
    "seconds per token measured": ("2.5", "decode_tokens_per_s", lambda s, t: _rate(s, t, "seconds"),
                                   "rate.seconds"),
    "greedy round without the bonus": ("2.6", "accept_greedy", greedy_without_the_bonus, "greedy.no_bonus"),
    "greedy round judged one row late": ("2.6", "accept_greedy", greedy_one_row_late, None),
    "sampled correction drawn from p": ("2.6", "accept_sampled", sampled_correction_from_p,
                                        "sampled.residual_from_p"),
}


@pytest.mark.parametrize("bug", sorted(WRITTEN))
def test_a_wrong_solution_is_named_for_the_bug_it_has(bug):
    lab, name, wrong, key = WRITTEN[bug]
    failed = _failures(lab, {name: wrong})
    assert failed, bug
    assert failed[0].bug == key, (bug, failed[0].bug, failed[0].hint)
    assert {o.bug for o in failed} <= {key, None}


# --- bugs outside the catalogues: they fail, and no FAIL names a bug -------------------------------------------

def rope_first_half_only(x, positions, theta):
    D = x.shape[-1]
    out = lab2_1._rope_bug(x, positions, theta)
    return torch.cat((out[..., : D // 2], x[..., D // 2:]), -1)  # the second half never turns


def rope_in_degrees(x, positions, theta):
    return lab2_1._rope_bug(x, positions.float() * math.pi / 180, theta)


def attention_softmax_then_mask(q, k, v, positions):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1)
    visible = torch.arange(k.shape[2])[None, None, None, :] <= positions[:, None, :, None]
    return (weights * visible) @ v  # masked after the softmax, not renormalized


def attention_scale_by_heads(q, k, v, positions):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[1])
    visible = torch.arange(k.shape[2])[None, None, None, :] <= positions[:, None, :, None]
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v


def write_kv_first_row_only(cache, new, positions):
    cache[0, :, positions[0]] = new[0].transpose(0, 1)


def read_kv_whole_cache(cache, lengths):
    valid = torch.arange(cache.shape[2])[None, :] < lengths[:, None]
    return cache, valid


def kv_bytes_in_bits(n_layers, n_kv_heads, head_dim, seq_len, batch_size, bytes_per_element):
    return 2 * n_layers * n_kv_heads * head_dim * seq_len * batch_size * bytes_per_element * 8


def write_paged_first_token_only(pool, block_table, new, positions):
    size = pool.shape[2]
    for b in range(new.shape[0]):
        p = int(positions[b, 0])
        pool[int(block_table[b, p // size]), :, p % size] = new[b, :, 0]


def read_paged_all_blocks(pool, block_table, lengths):
    blocks = pool[block_table]  # (B, W, H, size, D)
    B, W, H, size, D = blocks.shape
    kv = blocks.permute(0, 2, 1, 3, 4).reshape(B, H, W * size, D)
    return kv, torch.arange(W * size)[None, :] < lengths[:, None]


def make_room_evicts_idle_rows(block_tables, lengths, new_tokens, free_blocks, block_size):
    def need(b):
        return max(0, math.ceil((lengths[b] + new_tokens[b]) / block_size) - len(block_tables[b]))
    rows, evicted = list(range(len(block_tables))), []
    while rows and sum(need(b) for b in rows) > len(free_blocks):
        victim = rows.pop()  # the last row, running or not
        free_blocks.extend(block_tables[victim])
        block_tables[victim].clear()
        evicted.append(victim)
    for b in rows:
        for _ in range(need(b)):
            block_tables[b].append(free_blocks.pop(0))
    return evicted


def make_room_returns_blocks_to_the_front(block_tables, lengths, new_tokens, free_blocks, block_size):
    def need(b):
        return max(0, math.ceil((lengths[b] + new_tokens[b]) / block_size) - len(block_tables[b]))
    running, evicted = [b for b in range(len(block_tables)) if new_tokens[b] > 0], []
    while running and sum(need(b) for b in running) > len(free_blocks):
        victim = running.pop()
        free_blocks[:0] = block_tables[victim]  # back at the front
        block_tables[victim].clear()
        evicted.append(victim)
    for b in running:
        for _ in range(need(b)):
            block_tables[b].append(free_blocks.pop(0))
    return evicted


def finished_counts_the_prompt(seq, eos_token_id):
    if seq.prompt_len + len(seq.output) >= seq.max_tokens:
        return True
    return not seq.ignore_eos and seq.output[-1] == eos_token_id


def admit_shortest_first(waiting, running, free_blocks, block_size, max_batch_size):
    chosen = []
    for seq in sorted(waiting, key=lambda s: s.num_tokens):
        need = _need(seq, block_size)
        if len(running) + len(chosen) >= max_batch_size or need > free_blocks:
            break
        chosen.append(seq)
        free_blocks -= need
    return chosen


def preempt_longest(running, free_blocks, block_size):
    """The sequence with the most tokens goes first: it "frees the most blocks"."""
    staying, victims = list(running), []
    while staying and sum(_need(s, block_size) for s in staying) > free_blocks:
        victim = max(staying, key=lambda s: s.num_tokens)
        staying.remove(victim)
        free_blocks += len(victim.blocks)
        victims.append(victim)
    return victims


def schedule_equal_shares(running, token_budget):
    left = [s.num_tokens - s.computed for s in running]
    plan = [1 if n == 1 else 0 for n in left]
    prefills = [i for i, n in enumerate(left) if n > 1]
    share = (token_budget - sum(plan)) // max(len(prefills), 1)
    for i in prefills:
        plan[i] = min(left[i], share)
    return plan


def tpot_median_gap(request):
    times = request.token_times
    return None if len(times) < 2 else statistics.median(b - a for a, b in zip(times, times[1:]))


def ttft_in_milliseconds(request):
    return 1e3 * (request.token_times[0] - request.arrival_time)


def throughput_skips_first_tokens(requests, duration):
    done = [r for r in requests if r.token_times]
    return len(done) / duration, sum(len(r.token_times) - 1 for r in done) / duration


def goodput_on_the_runs_mean_tpot(requests, duration, ttft_slo, tpot_slo):
    """Every request judged by the run's mean TPOT (an aggregate, not its own)."""
    tpots = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1)
             for r in requests if len(r.token_times) > 1]
    mean = sum(tpots) / len(tpots) if tpots else 0.0
    good = sum(1 for r in requests if r.token_times and r.token_times[0] - r.arrival_time <= ttft_slo
               and mean <= tpot_slo)
    return good / duration


def devices_looser_limit(concurrency, tpot_slo, decode_tokens_per_s, kv_bytes_per_request, kv_bytes_per_device):
    """The looser of the two limits decides."""
    by_memory = kv_bytes_per_device // kv_bytes_per_request
    if by_memory == 0:
        raise ValueError("no request fits")
    return math.ceil(concurrency / max(decode_tokens_per_s * tpot_slo, by_memory))


def knee_index(sweep, keep_up=0.9):
    ordered, best = sorted(sweep), None
    for i, (offered, completed) in enumerate(ordered):
        if completed < keep_up * offered:
            break
        best = i
    return best


def int8_mean_scale(weight):
    scales = weight.abs().mean(1) * 3 / 127
    return torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def int4_row_minimum(weight):
    out, width = weight.shape
    groups = weight.reshape(out, width // 32, 32)
    low = weight.amin(1, keepdim=True).expand(out, width // 32)  # the whole row's minimum for every group
    scales = (groups.amax(-1) - low) / 15
    q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15)
    return q.reshape(out, width).to(torch.uint8), scales, low.contiguous()


def bytes_with_table_and_no_kv(model, context_len):
    """Two catalogued bugs at once (the untied table counted, the KV cache left out): neither is named."""
    return _bytes(model, context_len, embed="count", kv=False)


def rate_of_the_slowest_gap(start, token_times):
    gaps = [b - a for a, b in zip(token_times, token_times[1:])]
    if not gaps:
        raise ValueError("too few tokens")
    return 1 / max(gaps)


def predict_in_bits(step_bytes, bandwidth_gb_s):
    return bandwidth_gb_s * 1e9 / (8 * step_bytes)


def rope_as_complex_numbers(x, positions, theta):
    """Correct but unusual: the pairs as complex numbers, turned by torch.polar."""
    D = x.shape[-1]
    freqs = theta ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)  # (D/2,)
    angles = positions[:, None, :, None].float() * freqs  # (B, 1, T, D/2)
    z = torch.complex(x[..., : D // 2].float(), x[..., D // 2:].float()) * torch.polar(torch.ones_like(angles),
                                                                                         angles)
    return torch.cat((z.real, z.imag), -1).to(x.dtype)


def attention_mask_reversed(q, k, v, positions):
    """The mask comparison reversed (keys >= positions)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    keys = torch.arange(k.shape[2])
    scores = scores.masked_fill(~(keys[None, None, None, :] >= positions[:, None, :, None]), float("-inf"))
    return torch.softmax(scores, -1) @ v


def admit_one_slot_loose(waiting, running, free_blocks, block_size, max_batch_size):
    """The batch limit checked with > instead of >=."""
    chosen = []
    for seq in waiting:
        need = _need(seq, block_size)
        if len(running) + len(chosen) > max_batch_size or need > free_blocks:
            break
        chosen.append(seq)
        free_blocks -= need
    return chosen


def int8_bfloat16_scales(weight):
    """q from float32 scales, the scales returned in bfloat16 (as chapter 2.5's Int8Linear keeps them)."""
    amax = weight.abs().amax(1)
    scales = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(weight / scales[:, None]).to(torch.int8), scales.to(torch.bfloat16)


def int4_strided_groups(weight):
    """Groups from reshape(out, 32, in // 32): every (in // 32)-th weight."""
    out, width = weight.shape
    groups = weight.reshape(out, 32, width // 32)  # (out, 32, G): a group is a column of it
    low, high = groups.amin(1), groups.amax(1)  # (out, G)
    scales = torch.where(high > low, (high - low) / 15, torch.ones_like(low))
    q = torch.round((groups - low[:, None]) / scales[:, None]).clamp(0, 15)
    return q.reshape(out, width).to(torch.uint8), scales, low


def int4_symmetric_zero_point(weight):
    """A signed grid with zero point 8 (scale max |w| / 7): chapter 2.5's exercise 5's symmetric scheme."""
    out, width = weight.shape
    groups = weight.reshape(out, width // 32, 32)
    scales = groups.abs().amax(-1) / 7
    q = torch.round(groups / scales[..., None]).clamp(-8, 7) + 8
    return q.reshape(out, width).to(torch.uint8), scales, -8 * scales


def greedy_by_the_guess_logit(draft_tokens, target_logits):
    """A guess kept while the target gives it a positive logit, not while it is the target's choice."""
    kept = 0
    while kept < len(draft_tokens) and target_logits[kept, draft_tokens[kept]] > 0:
        kept += 1
    return list(draft_tokens[:kept]) + [int(target_logits[kept].argmax())]


def sampled_unclamped_residual(draft_tokens, draft_probs, target_probs, generator):
    """The correction drawn from p - q with its negative part (torch refuses negative weights)."""
    for i, token in enumerate(draft_tokens):
        p, q = target_probs[i], draft_probs[i]
        if torch.rand((), generator=generator) * q[token] >= p[token]:
            return list(draft_tokens[:i]) + [int(torch.multinomial(p - q, 1, generator=generator))]
    return list(draft_tokens) + [int(torch.multinomial(target_probs[-1], 1, generator=generator))]


def sampled_reversed_residual(draft_tokens, draft_probs, target_probs, generator):
    """The correction drawn from max(0, q - p): where the draft gave too much."""
    for i, token in enumerate(draft_tokens):
        p, q = target_probs[i], draft_probs[i]
        if torch.rand((), generator=generator) * q[token] >= p[token]:
            residual = (q - p).clamp(min=0)
            return list(draft_tokens[:i]) + [int(torch.multinomial(residual, 1, generator=generator))]
    return list(draft_tokens) + [int(torch.multinomial(target_probs[-1], 1, generator=generator))]


OUTSIDE = {  # (lab, function, the wrong code): bugs no catalogue holds
    "rope turns only the first half": ("2.1", "apply_rope", rope_first_half_only),
    "rope angles in degrees": ("2.1", "apply_rope", rope_in_degrees),
    "attention masks after the softmax": ("2.1", "causal_attention", attention_softmax_then_mask),
    "attention scaled by sqrt(H)": ("2.1", "causal_attention", attention_scale_by_heads),
    "attention with the mask reversed": ("2.1", "causal_attention", attention_mask_reversed),
    "top-p before top-k": ("2.1", "next_token_probs", lambda lg, t, k, p: _sampling(lg, t, k, p, order="p then k")),
    "write_kv writes row 0 only": ("2.2", "write_kv", write_kv_first_row_only),
    "read_kv returns the whole cache": ("2.2", "read_kv", read_kv_whole_cache),
    "kv_cache_bytes in bits": ("2.2", "kv_cache_bytes", kv_bytes_in_bits),
    "write_paged writes the first token only": ("2.2", "write_paged", write_paged_first_token_only),
    "read_paged reads every block of the table": ("2.2", "read_paged", read_paged_all_blocks),
    "make_room evicts rows that do not run": ("2.2", "make_room", make_room_evicts_idle_rows),
    "make_room returns blocks to the front": ("2.2", "make_room", make_room_returns_blocks_to_the_front),
    "finished counts the prompt": ("2.3", "finished", finished_counts_the_prompt),
    "admit shortest first": ("2.3", "admit", admit_shortest_first),
    "preempt the longest": ("2.3", "preempt", preempt_longest),
    "schedule_tokens equal shares": ("2.3", "schedule_tokens", schedule_equal_shares),
    "tpot from the median gap": ("2.4", "tpot", tpot_median_gap),
    "ttft in milliseconds": ("2.4", "ttft", ttft_in_milliseconds),
    "throughput without first tokens": ("2.4", "throughput", throughput_skips_first_tokens),
    "goodput on the run's mean TPOT": ("2.4", "goodput", goodput_on_the_runs_mean_tpot),
    "devices by the looser limit": ("2.4", "devices_needed", devices_looser_limit),
    "knee returns an index": ("2.4", "knee", knee_index),
    "int8 scale from the mean": ("2.5", "quantize_int8", int8_mean_scale),
    "int4 minimum of the row": ("2.5", "quantize_int4", int4_row_minimum),
    "bytes: two bugs at once": ("2.5", "bytes_per_step", bytes_with_table_and_no_kv),
    "decode rate of the slowest gap": ("2.5", "decode_tokens_per_s", rate_of_the_slowest_gap),
    "prediction in bits": ("2.5", "predict_tokens_per_s", predict_in_bits),
    "greedy by a positive logit": ("2.6", "accept_greedy", greedy_by_the_guess_logit),
    "sampled correction from p - q unclipped": ("2.6", "accept_sampled", sampled_unclamped_residual),
    "sampled correction from max(0, q - p)": ("2.6", "accept_sampled", sampled_reversed_residual),
}


@pytest.mark.parametrize("bug", sorted(OUTSIDE))
def test_a_bug_outside_the_catalogues_fails_and_no_hint_names_a_bug(bug):
    lab, name, wrong = OUTSIDE[bug]
    failed = _failures(lab, {name: wrong})
    assert failed, bug
    assert [o.bug for o in failed] == [None] * len(failed), (bug, [o.bug for o in failed])
    assert all("expected" in o.detail or " returned " in o.detail or "raised" in o.detail for o in failed), bug


def test_the_suite_is_large_covers_every_lab_and_the_guide_quotes_its_size():
    assert len(WRITTEN) + len(OUTSIDE) + len(CATALOGUED) >= 150
    assert len(OUTSIDE) >= 26
    assert {lab for lab, *_ in OUTSIDE.values()} == set(LABS) == {lab for lab, *_ in WRITTEN.values()}
    guide = " ".join((ROOT / "book" / "instructor_guide.md").read_text(encoding="utf-8").split())
    assert (f"holds {len(CATALOGUED)} catalogued bugs" in guide and f"{len(WRITTEN)} wrong solutions written"
            in guide and f"{len(OUTSIDE)} bugs outside the catalogues" in guide)


# --- whole submissions: what each is named for and what it scores -------------------------------

def _report(reports, task):
    return next(r for r in reports if r.task == task)


def test_an_unusual_rope_scores_full_and_a_reversed_mask_names_no_bug():
    reports = grade(apply_rope=rope_as_complex_numbers,
                    causal_attention=_named("causal_attention", attention_mask_reversed))
    assert _report(reports, "apply_rope").all_passed
    attention = _report(reports, "causal_attention")
    assert attention.capped and attention.points <= attention.max_points // 2
    assert all(o.bug is None for r in reports for o in r.outcomes)
    repeat = next(o for o in attention.outcomes if o.name.startswith("grouped heads"))
    assert not repeat.passed and "repeat" not in repeat.hint


def test_a_loose_batch_limit_is_named_and_evicting_the_longest_is_not():
    fns = _solutions("2.3")
    fns.update(admit=_named("admit", admit_one_slot_loose), preempt=_named("preempt", preempt_longest))
    reports = grade(**fns)
    named = {o.bug for r in reports for o in r.outcomes if not o.passed}
    assert named <= {"admit.one_slot_too_many", None} and "admit.one_slot_too_many" in named
    for task in ("admit", "preempt", "the three rules in the simulator"):
        assert _report(reports, task).capped, task
    score = sum(r.points for r in reports) / sum(r.max_points for r in reports)
    assert score < 0.6  # 73% when each check scored a point


def test_bfloat16_scales_and_strided_groups_are_named_and_cost_half_or_more():
    reports = grade(quantize_int8=_named("quantize_int8", int8_bfloat16_scales),
                    quantize_int4=_named("quantize_int4", int4_strided_groups))
    int8, int4 = _report(reports, "quantize_int8"), _report(reports, "quantize_int4")
    assert {o.bug for o in int8.outcomes if not o.passed} == {"int8.bf16_scales"}
    assert {o.bug for o in int4.outcomes if not o.passed} == {"int4.strided"}
    assert int4.capped and int4.points <= int4.max_points // 2  # a 51% error: the real layer fails


def test_a_symmetric_int4_scheme_is_named():
    int4 = _report(grade(quantize_int4=_named("quantize_int4", int4_symmetric_zero_point)), "quantize_int4")
    assert {o.bug for o in int4.outcomes if not o.passed} == {"int4.zero_point"}
    assert int4.capped and int4.points <= int4.max_points // 2  # the grid does not span the group: central


def _safe_scale(amax, divisor):
    return torch.where(amax > 0, amax / divisor, torch.ones_like(amax))


def unusual_quantize_int8(weight):
    low, high = torch.aminmax(weight, dim=1)
    scales = _safe_scale(torch.maximum(low.abs(), high.abs()), 127)
    return (weight / scales[:, None]).round_().to(torch.int8), scales


def unusual_quantize_int4(weight):
    groups = weight.unfold(1, 32, 32)  # (out, in / 32, 32)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = torch.where(high > low, (high - low) / 15, torch.ones_like(low))
    q = ((groups - low[..., None]) / scales[..., None]).round_().clamp_(0, 15)
    return q.reshape(weight.shape).to(torch.uint8), scales, low


def unusual_bytes_per_step(model, context_len):
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}
    table = model.model.embed_tokens.weight
    if all(t.data_ptr() != table.data_ptr() for t in model.lm_head.state_dict().values()):
        tensors.pop(table.data_ptr())
    c = model.config
    kv = 2 * c.n_layers * c.n_kv_heads * c.head_dim * context_len * model.dtype.itemsize
    return sum(t.numel() * t.element_size() for t in tensors.values()) + kv


def unusual_decode_tokens_per_s(start, token_times):
    if len(token_times) < 2:
        raise ValueError("one token has no gap")
    return float(1 / numpy.median(numpy.diff(token_times)))


def test_correct_but_unusual_code_scores_full_marks():
    reports = grade(quantize_int8=unusual_quantize_int8, quantize_int4=unusual_quantize_int4,
                    bytes_per_step=unusual_bytes_per_step, decode_tokens_per_s=unusual_decode_tokens_per_s)
    assert all(r.all_passed for r in reports), [r.text() for r in reports if not r.all_passed]


def test_an_aggregate_goodput_and_a_loose_plan_are_told_what_was_expected_not_a_wrong_bug():
    goodput = _report(grade(goodput=_named("goodput", goodput_on_the_runs_mean_tpot)), "goodput")
    first = next(o for o in goodput.outcomes if not o.passed)
    assert first.bug is None and "expected" in first.detail and "<" not in first.hint
    plan = _report(grade(devices_needed=_named("devices_needed", devices_looser_limit)), "devices_needed")
    assert all(o.bug is None for o in plan.outcomes)
    assert plan.capped and all("ceil" not in o.hint.lower() for o in plan.outcomes)
    assert lab2_4.PLAN_BUGS.identify({"devices_needed": devices_looser_limit}) is None
