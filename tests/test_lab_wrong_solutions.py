"""Wrong solutions students write: each fails its checks, and the first hint it is shown names its bug."""
from __future__ import annotations

import importlib.util
import math
import pathlib

import pytest
import torch
import torch.nn.functional as F

from minillm.book.labs import function_names, grade
from minillm.book.labs import lab2_1 as L1
from minillm.book.labs import lab2_3 as L3

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

CASES = {**{k: ("2.1",) + v for k, v in WRONG_21.items()}, **{k: ("2.3",) + v for k, v in WRONG_23.items()}}


def _first_hint(reports):
    failed = [o for r in reports for o in r.outcomes if not o.passed]
    return failed[0].hint if failed else None


@pytest.mark.parametrize("bug", sorted(CASES))
def test_a_wrong_solution_fails_with_the_hint_for_its_bug(bug):
    lab, name, wrong, hint = CASES[bug]
    fns = _solutions(lab)
    fns[name] = wrong
    wrong.__name__ = name
    reports = grade(**fns)
    assert not all(r.all_passed for r in reports), bug
    assert _first_hint(reports) == hint, (bug, _first_hint(reports))


@pytest.mark.parametrize("bug", sorted(WRONG_23))
def test_the_simulator_catches_each_policy_bug_too(bug):
    _, name, wrong, hint = CASES[bug]
    fns = _solutions("2.3")
    fns[name] = wrong
    wrong.__name__ = name
    sim = next(r for r in grade(**fns) if r.task == "the three rules in the simulator")
    failed = [o for o in sim.outcomes if not o.passed]
    assert failed and failed[0].hint == hint, (bug, failed[0].hint if failed else None)
