"""A step-by-step simulator of a batching scheduler over a paged KV block pool (lab 2.3).

No model runs. Each step, every running sequence computes the tokens it has not computed yet (a
sequence admitted this step its whole prompt, its prefill), and one whose every token is then computed
gets its next token. The simulator keeps the books an engine keeps: a waiting queue, the running batch
in order of admission, and a pool of KV blocks of ``block_size`` tokens. Three rules decide who runs;
they come from the caller (the learner):

* ``finished(seq, eos_token_id) -> bool``: is this sequence done after the token it just got?
* ``admit(waiting, running, free_blocks, block_size, max_batch_size) -> list``: who starts this step;
* ``preempt(running, free_blocks, block_size) -> list``: whom to evict when the running sequences need
  more blocks than are free (evicted ones free their blocks and wait at the front of the queue; when
  they are admitted again, their prompt and output so far are recomputed).

With a ``token_budget`` (chunked prefill, as vLLM and Sarathi-Serve run it), a fourth rule,
``schedule_tokens(running, token_budget) -> list``, says how many tokens each running sequence computes
this step, at most ``token_budget`` in all: a long prompt is then prefilled a chunk at a time over
several steps, and emits its first token in the step that computes its last prompt token.

To run its next step a sequence must hold ``ceil(seq.num_tokens / block_size)`` blocks. The simulator
never trusts a rule: whatever breaks the budget, the batch limit or a request's length is recorded
as a violation (and a run that breaks the budget stops there).

One rule is the engine's own: whether a step may admit at all (static: only into an empty batch;
continuous: every step, but not right after a preemption while others run) is
``minillm.engine.scheduler.may_admit``, which the engine's ``Scheduler`` asks too. The rest is kept
model-free on purpose, and leaves out what the engine adds: time in steps instead of seconds; blocks
for a sequence's whole prompt at admission, even when it is prefilled in chunks; no prefix caching; no
rejection of requests that can never fit (the workloads fit); static padding rows cost nothing; and
preemption asks the learner's rule for every victim at once before the step, where the engine
preempts the newest running sequence while an older one cannot grow.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from ...engine import blocks_for
from ...engine.scheduler import may_admit
from . import wire
from .checker import LearnerError, call, wrong_value

EOS = 2  # the end-of-sequence token id of the simulated model


@wire.register_class
@dataclass
class Seq:
    """One request inside the simulator. Rules read these fields; they must not change them."""

    request_id: int
    prompt_len: int
    max_tokens: int
    eos_at: int | None = None  # the model's eos_at-th output token is EOS (None: the model never says EOS)
    ignore_eos: bool = False
    arrival_step: int = 0
    output: list[int] = field(default_factory=list)  # token ids generated so far
    blocks: list[int] = field(default_factory=list)  # ids of the KV blocks it holds
    token_steps: list[int] = field(default_factory=list)  # the step of each output token
    finish_step: int | None = None
    computed: int = 0  # tokens (prompt, then output) whose keys and values are in the cache

    @property
    def to_compute(self) -> int:
        """Tokens it must compute before its next token: its prompt (or what is left of it) when it is
        prefilling, 1 (its last token) when it decodes."""
        return self.num_tokens - self.computed

    @property
    def num_tokens(self) -> int:
        """Prompt + output so far: the tokens whose keys and values its next step needs in the cache."""
        return self.prompt_len + len(self.output)

    @property
    def expected_tokens(self) -> int:
        """How many tokens a correct scheduler gives it: up to its EOS, or max_tokens."""
        if self.eos_at is not None and not self.ignore_eos:
            return min(self.eos_at, self.max_tokens)
        return self.max_tokens

    def __repr__(self) -> str:
        return (f"Seq(id={self.request_id}, prompt={self.prompt_len}, output={len(self.output)}, "
                f"max_tokens={self.max_tokens}, blocks={len(self.blocks)})")


@wire.register_class
@dataclass(frozen=True)
class Spec:
    """A request of a workload (the simulator makes a fresh Seq of it for each run)."""

    prompt_len: int
    max_tokens: int
    eos_at: int | None = None
    ignore_eos: bool = False
    arrival_step: int = 0


@dataclass
class SimResult:
    policy: str
    steps: int  # steps until the last request finished (idle steps included)
    seqs: list[Seq]
    violations: list[str]
    peak_blocks: int = 0
    peak_batch: int = 0
    preemptions: int = 0
    running_per_step: list[int] = field(default_factory=list)
    # departures from the policy (not from safety): ("overtake", ...) when admit starts a request ahead
    # of one that waited longer; ("oldest", ...) when preempt evicts an older sequence and keeps a newer
    # one; ("too many", ...) when it evicts more than the others need
    policy_breaks: list[tuple[str, str]] = field(default_factory=list)
    tokens_per_step: list[int] = field(default_factory=list)  # tokens computed in each step
    decode_waits: int = 0  # times a decoding sequence computed nothing in a step (a stall)
    idle_budget: int = 0  # steps that left part of the token budget unused while a running sequence waited

    def largest_gap(self) -> int:
        """The most steps between two consecutive tokens of one request (1: a token every step)."""
        return max((b - a for s in self.seqs for a, b in zip(s.token_steps, s.token_steps[1:])), default=0)

    @property
    def complete(self) -> bool:
        """Every request finished with exactly the tokens it should have, and nothing broke a limit."""
        return not self.violations and all(
            s.finish_step is not None and len(s.output) == s.expected_tokens for s in self.seqs)

    def mean_wait(self) -> float:
        """Mean steps from arrival to first token (TTFT counted in steps)."""
        waits = [s.token_steps[0] - s.arrival_step for s in self.seqs if s.token_steps]
        return sum(waits) / len(waits) if waits else math.nan


def _need(seq: Seq, block_size: int) -> int:
    return max(0, blocks_for(seq.num_tokens, block_size) - len(seq.blocks))


def _members(name: str, chosen, pool: list[Seq]) -> list[Seq]:
    """The rule's answer as a list of distinct sequences of ``pool``; else a LearnerError."""
    if not isinstance(chosen, (list, tuple)):
        raise wrong_value(name, chosen, "a list of sequences")
    ids = {id(s) for s in pool}
    for s in chosen:
        if id(s) not in ids:
            raise LearnerError(f"{name} returned {s!r}, which is not one of the sequences it was given")
    if len({id(s) for s in chosen}) != len(chosen):
        raise LearnerError(f"{name} returned the same sequence twice")
    return list(chosen)


def _judge_eviction(step: int, running: list[Seq], victims: list[Seq], free: int, block_size: int,
                    breaks: list[tuple[str, str]]) -> None:
    """Record how ``victims`` depart from newest-first eviction of as few sequences as the others need."""
    n, k = len(running), len(victims)
    newest = running[n - k:] if k else []
    if {id(v) for v in victims} != {id(s) for s in newest}:
        older = next(v for v in victims if all(v is not s for s in newest))
        kept = next(s for s in newest if all(s is not v for v in victims))
        breaks.append(("oldest", f"step {step}: preempt evicted request {older.request_id} and kept request "
                                 f"{kept.request_id}, admitted after it"))
        return
    enough = next(m for m in range(n + 1) if sum(_need(s, block_size) for s in running[:n - m])
                  <= free + sum(len(s.blocks) for s in running[n - m:]))
    if k > enough:
        breaks.append(("too many", f"step {step}: preempt evicted {k} of {n} running sequences; evicting "
                                   f"the newest {enough} was enough"))


def _planned(schedule_tokens, running: list[Seq], token_budget: int, step: int, result: SimResult) -> list[int]:
    """The learner's tokens for each running sequence this step, checked; None after a violation."""
    plan = call(schedule_tokens, list(running), token_budget)
    if not isinstance(plan, (list, tuple)) or len(plan) != len(running) or not all(
            isinstance(n, int) and not isinstance(n, bool) for n in plan):
        raise wrong_value("schedule_tokens", plan, f"a list of {len(running)} ints (one per running sequence)")
    over = next((s for s, n in zip(running, plan) if not 0 <= n <= s.to_compute), None)
    if over is not None:
        n = plan[running.index(over)]
        result.violations.append(f"step {step}: schedule_tokens gave request {over.request_id} {n} tokens; it "
                                 f"has {over.to_compute} to compute")
        return None
    if sum(plan) > token_budget:
        result.violations.append(f"step {step}: schedule_tokens planned {sum(plan)} tokens with a budget of "
                                 f"{token_budget}")
        return None
    return list(plan)


def simulate(specs: list[Spec], admit, finished, preempt, num_blocks: int, block_size: int,
             max_batch_size: int, policy: str = "continuous", max_steps: int = 5000,
             token_budget: int | None = None, schedule_tokens=None) -> SimResult:
    """Run ``specs`` to the end under the three rules; ``policy`` "continuous" or "static".

    continuous: admission every step (except a step that had to preempt while others still run), and a
    finished sequence frees its blocks at once. static: a batch is admitted only when nothing runs, and
    its finished sequences keep their blocks until the whole batch is done. ``token_budget`` and
    ``schedule_tokens``: at most that many tokens a step, shared out by the learner's rule.
    """
    if policy not in ("continuous", "static"):
        raise ValueError(f"policy={policy!r} must be 'continuous' or 'static'")
    seqs = [Seq(i, s.prompt_len, s.max_tokens, s.eos_at, s.ignore_eos, s.arrival_step) for i, s in enumerate(specs)]
    pending = deque(sorted(seqs, key=lambda s: s.arrival_step))
    waiting: deque[Seq] = deque()
    running: list[Seq] = []
    held_back: list[Seq] = []  # static: finished, still holding their blocks
    free = deque(range(num_blocks))
    result = SimResult(policy, 0, seqs, [])

    def release(seq: Seq) -> None:
        free.extend(seq.blocks)
        seq.blocks = []

    def grow(seq: Seq) -> None:
        for _ in range(_need(seq, block_size)):
            seq.blocks.append(free.popleft())

    step = 0
    while pending or waiting or running:
        if step >= max_steps:
            result.violations.append(f"the run did not end within {max_steps} steps")
            break
        while pending and pending[0].arrival_step <= step:
            waiting.append(pending.popleft())
        preempted = False
        if sum(_need(s, block_size) for s in running) > len(free):
            victims = _members("preempt", call(preempt, list(running), len(free), block_size), running)
            _judge_eviction(step, running, victims, len(free), block_size, result.policy_breaks)
            for victim in victims:  # newest first: the oldest victim ends up at the front of the queue
                running.remove(victim)
                release(victim)
                victim.computed = 0  # its cache is gone: recomputed when it runs again
                waiting.appendleft(victim)
            preempted, result.preemptions = bool(victims), result.preemptions + len(victims)
            short = sum(_need(s, block_size) for s in running) - len(free)
            if short > 0:
                result.violations.append(f"step {step}: after preempt, the running sequences still need "
                                         f"{short} more block(s) than are free")
                break
        for s in running:
            grow(s)
        if waiting and may_admit(policy, preempted, busy=bool(running or held_back)):
            chosen = _members("admit", call(admit, list(waiting), list(running), len(free), block_size,
                                            max_batch_size), list(waiting))
            need = sum(_need(s, block_size) for s in chosen)
            ahead = list(waiting)[:len(chosen)]
            if {id(s) for s in chosen} != {id(s) for s in ahead}:
                jumper = next(s for s in chosen if all(s is not a for a in ahead))
                skipped = next(s for s in ahead if all(s is not c for c in chosen))
                result.policy_breaks.append(("overtake", f"step {step}: admit started request "
                                             f"{jumper.request_id} while request {skipped.request_id}, ahead "
                                             "of it in the queue, kept waiting"))
            if len(running) + len(chosen) > max_batch_size:
                result.violations.append(f"step {step}: admit let the batch grow to "
                                         f"{len(running) + len(chosen)} sequences (limit {max_batch_size})")
                break
            if need > len(free):
                result.violations.append(f"step {step}: admit chose sequences that need {need} blocks "
                                         f"with only {len(free)} free")
                break
            for s in chosen:
                waiting.remove(s)
                grow(s)
                running.append(s)
        if waiting and not running and not held_back:
            result.violations.append(f"step {step}: nothing runs and admit starts no one, although the "
                                     "first waiting request fits the empty pool")
            break
        result.peak_blocks = max(result.peak_blocks, num_blocks - len(free))
        result.peak_batch = max(result.peak_batch, len(running))
        result.running_per_step.append(len(running))
        if token_budget is None:
            plan = [s.to_compute for s in running]
        else:
            plan = _planned(schedule_tokens, running, token_budget, step, result)
            if plan is None:
                break
        result.tokens_per_step.append(sum(plan))
        if token_budget is not None and sum(plan) < token_budget and any(
                n < s.to_compute for s, n in zip(running, plan)):
            result.idle_budget += 1
        emitted = []
        for s, n in zip(running, plan):
            result.decode_waits += n == 0 and s.to_compute == 1
            s.computed += n
            if s.computed == s.num_tokens:  # every token computed: the step samples its next one
                s.output.append(EOS if s.eos_at == len(s.output) + 1 else 100 + len(s.output))
                s.token_steps.append(step)
                emitted.append(s)
        for s in emitted:
            done = call(finished, s, EOS)
            if not isinstance(done, bool):
                raise wrong_value("finished", done, "True or False")
            if not done and len(s.output) >= s.max_tokens:
                result.violations.append(f"request {s.request_id} was not finished after its "
                                         f"max_tokens={s.max_tokens} tokens")
                done = True  # the simulator stops it, so that the run ends
            if done:
                running.remove(s)
                s.finish_step = step
                if policy == "static":
                    held_back.append(s)
                else:
                    release(s)
        if not running:
            for s in held_back:
                release(s)
            held_back.clear()
        step += 1
    result.steps = step
    return result
