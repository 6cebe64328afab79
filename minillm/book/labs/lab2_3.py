"""Lab 2.3: the finishing, admission, preemption and token-budget rules of a continuous-batching scheduler.

The learner writes ``finished``, ``admit``, ``preempt`` and ``schedule_tokens``; the hidden cases call
them on hand-made queues, then run them together in the simulator of :mod:`minillm.book.labs.batching`
(no model, no engine), with and without a token budget (chunked prefill). ``compare_policies`` is the
lab's payoff. Each function's catalogue (:mod:`.diagnosis`) holds the bugs learners write, as code.
"""
from __future__ import annotations

import math
import random

from .batching import EOS, Seq, SimResult, Spec, _members, simulate
from .checker import Mismatch, Property, Task, call, ready, register, wrong_value
from .diagnosis import Bug, Catalogue, named

BLOCK = 4  # tokens per block in the hand-made cases


def _seq(request_id: int, prompt_len: int, output: int = 0, held: int = 0, max_tokens: int = 50,
         ignore_eos: bool = False, last_eos: bool = False, computed: int | None = None) -> Seq:
    """A sequence with ``output`` tokens generated, ``held`` blocks in hand and ``computed`` tokens in its
    cache (default: all but its last token, as after a step)."""
    tokens = [100 + i for i in range(output)]
    if last_eos and tokens:
        tokens[-1] = EOS
    seq = Seq(request_id, prompt_len, max_tokens, ignore_eos=ignore_eos, output=tokens,
              blocks=list(range(1000 * (request_id + 1), 1000 * (request_id + 1) + held)))
    seq.computed = max(seq.num_tokens - 1, 0) if computed is None else computed
    return seq


def _ids(seqs) -> list[int]:
    return [s.request_id for s in seqs]


def _need(seq, block_size):
    return math.ceil(seq.num_tokens / block_size) - len(seq.blocks)


# --- finished --------------------------------------------------------------------------------------------

def _finished_reference(seq, eos_token_id, eos=True, ignore=True, strict=False):
    """The rule, and the usual slips (flags)."""
    if (len(seq.output) > seq.max_tokens) if strict else (len(seq.output) >= seq.max_tokens):
        return True
    return eos and (not ignore or not seq.ignore_eos) and seq.output[-1] == eos_token_id


def _finished_probes():
    return [(_seq(0, 10, output=3, max_tokens=5), EOS), (_seq(1, 10, output=5, max_tokens=5), EOS),
            (_seq(2, 10, output=3, max_tokens=5, last_eos=True), EOS),
            (_seq(3, 10, output=3, max_tokens=5, last_eos=True, ignore_eos=True), EOS),
            (_seq(4, 10, output=1, max_tokens=1), EOS)]


FINISHED_BUGS = Catalogue("finished", _finished_reference, (
    Bug("finished.no_eos", "a rule that never looks at EOS", "A request also ends when its last token is "
        "EOS (unless it ignores EOS).", lambda seq, eos: _finished_reference(seq, eos, eos=False)),
    Bug("finished.ignores_ignore_eos", "a rule that ends at EOS even with ignore_eos", "ignore_eos means "
        "EOS does not end the request: benchmarks use it to get exactly max_tokens tokens.",
        lambda seq, eos: _finished_reference(seq, eos, ignore=False)),
    Bug("finished.one_too_many", "a count that needs one token more than max_tokens",
        "A request with max_tokens tokens is done: compare the count with at least, not more than.",
        lambda seq, eos: _finished_reference(seq, eos, strict=True)),
), _finished_probes)


def _finished(fns, seq) -> bool:
    done = call(fns["finished"], seq, EOS)
    if not isinstance(done, bool):
        raise wrong_value("finished", done, "True or False")
    return done


def _finished_case(expected: bool, what: str, **fields):
    def run(fns):
        seq = _seq(0, 10, **fields)
        done = _finished(fns, seq)
        if done != expected:
            raise Mismatch(f"{what}: finished says {done}; expected {expected}",
                           **FINISHED_BUGS.hint(fns, _seq(0, 10, **fields), EOS))
    return run


def _finished_types(fns):
    for fields in ({"output": 3}, {"output": 5, "max_tokens": 5}, {"output": 2, "last_eos": True}):
        _finished(fns, _seq(0, 10, **fields))


FINISHED = Task("finished", "2.3", ("finished",), (
    Property("returns True or False",
             "What type does your function return in every branch?", _finished_types),
    Property("not finished while tokens remain and the last one is not EOS",
             "Which of your conditions is true for 3 of 5 tokens, the last not EOS?",
             _finished_case(False, "3 of 5 tokens, the last not EOS", output=3, max_tokens=5)),
    Property("finished once it has max_tokens tokens",
             "How do you count the tokens generated so far, and how do you compare the count with max_tokens?",
             _finished_case(True, "5 of 5 tokens", output=5, max_tokens=5), central=True),
    Property("finished when its last token is EOS",
             "Which token of seq.output does your rule look at, and what does it compare it with?",
             _finished_case(True, "3 of 5 tokens, the last one EOS", output=3, max_tokens=5, last_eos=True)),
    Property("with ignore_eos, EOS does not end it (benchmarks use this)",
             "Where does seq.ignore_eos enter your rule?",
             _finished_case(False, "3 of 5 tokens, the last one EOS, ignore_eos", output=3, max_tokens=5,
                            last_eos=True, ignore_eos=True)),
    Property("max_tokens 1: finished after the prefill's token",
             "The first token comes from the prefill: does your count include it?",
             _finished_case(True, "1 of 1 token", output=1, max_tokens=1)),
))


# --- admit -----------------------------------------------------------------------------------------------

def _admit_reference(waiting, running, free_blocks, block_size, max_batch_size, overtake=False, slots=0,
                     prompt_only=False, ignore_blocks=False, no_subtract=False):
    """The rule (a prefix of the queue that fits), and the usual slips (flags)."""
    chosen = []
    for seq in waiting:
        tokens = seq.prompt_len if prompt_only else seq.num_tokens
        need = math.ceil(tokens / block_size) - len(seq.blocks)
        if len(running) + len(chosen) >= max_batch_size + slots:
            break
        if need > free_blocks and not ignore_blocks:
            if overtake:
                continue
            break
        chosen.append(seq)
        free_blocks -= 0 if no_subtract else need
    return chosen


def _prompts(*lengths):
    return lambda: [_seq(i, n, computed=0) for i, n in enumerate(lengths)]


def _busy(count):
    return lambda: [_seq(10 + i, 8, output=1, held=3) for i in range(count)]


def _resumed():
    return [_seq(0, 6, output=7, max_tokens=20, computed=0), _seq(1, 3, computed=0)]  # 4 blocks; then 1


def _admit_probes():
    return [(_prompts(4, 16, 4)(), [], 3, BLOCK, 8), (_prompts(4, 4, 4)(), _busy(3)(), 20, BLOCK, 4),
            (_resumed(), [], 4, BLOCK, 8), (_prompts(8, 8, 8)(), [], 5, BLOCK, 8),
            (_prompts(8, 4, 3, 1)(), [], 10, BLOCK, 8)]


def _observe_admit(function, waiting, running, free, block_size, max_batch):
    return _ids(function(list(waiting), list(running), free, block_size, max_batch))


def _admit_slip(**slip):
    return lambda w, r, f, b, m: _admit_reference(w, r, f, b, m, **slip)


ADMIT_BUGS = Catalogue("admit", _admit_slip(), (
    Bug("admit.overtake", "a rule that lets a later, smaller sequence overtake the head of the queue",
        "First come, first served: stop at the first sequence that does not fit.", _admit_slip(overtake=True)),
    Bug("admit.one_slot_too_many", "a batch limit one too loose", "The slots left are the limit minus the "
        "sequences already running: count them again for a batch that is one short of its limit.",
        _admit_slip(slots=1)),
    Bug("admit.prompt_only", "a block count from the prompt alone", "A preempted sequence is recomputed: "
        "its prompt and its output so far both need blocks.", _admit_slip(prompt_only=True)),
    Bug("admit.no_blocks", "a rule that never looks at the free blocks", "Each sequence you admit needs "
        "blocks for its tokens, and only the free ones can be given.", _admit_slip(ignore_blocks=True)),
    Bug("admit.no_subtract", "a free count that does not shrink as sequences are admitted",
        "Each sequence you admit takes its blocks out of the free count before the next is considered.",
        _admit_slip(no_subtract=True)),
), _admit_probes, observe=_observe_admit)


def _admit(fns, waiting, running, free, max_batch):
    return _members("admit", call(fns["admit"], list(waiting), list(running), free, BLOCK, max_batch),
                    waiting)


def _admit_case(waiting, running, free, max_batch, expected, what):
    def run(fns):
        chosen = _admit(fns, waiting(), running(), free, max_batch)
        if _ids(chosen) != expected:
            raise Mismatch(f"{what}: admit chose requests {_ids(chosen)}; expected {expected}",
                           **ADMIT_BUGS.hint(fns, waiting(), running(), free, BLOCK, max_batch))
    return run


ADMIT_HINT = ("Count by hand for this case: the free slots, the blocks each waiting sequence needs, and where "
              "you must stop. Then print what your loop decides at each sequence.")
ADMIT = Task("admit", "2.3", ("admit",), (
    Property("returns a list of sequences taken from waiting",
             "Return a list (possibly empty) of the sequence objects of waiting.",
             _admit_case(_prompts(8, 4), _busy(0), 10, 4, [0, 1], "room for both")),
    Property("admits everyone when the slots and the blocks allow", ADMIT_HINT,
             _admit_case(_prompts(8, 4, 3, 1), _busy(0), 10, 8, [0, 1, 2, 3], "4 prompts needing 5 blocks, "
                         "10 free, 8 slots")),
    Property("never lets running + admitted exceed max_batch_size", ADMIT_HINT,
             _admit_case(_prompts(4, 4, 4), _busy(3), 20, 4, [0], "3 running, limit 4"), central=True),
    Property("admits only what the free blocks hold", ADMIT_HINT,
             _admit_case(_prompts(8, 8, 8), _busy(0), 5, 8, [0, 1], "3 prompts of 2 blocks, 5 free"),
             central=True),
    Property("first come, first served: no one overtakes the head of the queue",
             "What does your loop do at a sequence that does not fit: stop, or go on to the next?",
             _admit_case(_prompts(4, 16, 4), _busy(0), 3, 8, [0], "prompts of 1, 4, 1 blocks, 3 free")),
    Property("a resumed sequence needs blocks for its prompt and its output so far",
             "Which of a sequence's tokens must be in the cache before its next step?",
             _admit_case(_resumed, _busy(0), 4, 8, [0], "a resumed 6 + 7-token sequence, then a 3-token "
                         "prompt, 4 free")),
))


# --- preempt ---------------------------------------------------------------------------------------------

def _preempt_reference(running, free_blocks, block_size, oldest=False, everyone=False, forget=False):
    """The rule (newest first, as few as needed), and the usual slips (flags)."""
    staying, victims = list(running), []
    while staying and sum(_need(s, block_size) for s in staying) > free_blocks:
        group = list(reversed(staying)) if everyone else [staying[0] if oldest else staying[-1]]
        for victim in group:
            staying.remove(victim)
            free_blocks += 0 if forget else len(victim.blocks)
            victims.append(victim)
    return victims


def _at_block_edge(*held):
    """Running sequences (oldest first), each holding ``held[i]`` full blocks and needing one more."""
    return lambda: [_seq(i, 2, output=BLOCK * h - 1, held=h) for i, h in enumerate(held)]


def _preempt_probes():
    return [(_at_block_edge(3, 3, 3)(), 2, BLOCK), (_at_block_edge(1, 1, 1, 1)(), 0, BLOCK),
            (_at_block_edge(1, 1, 5)(), 0, BLOCK), (_at_block_edge(2, 1, 1, 2)(), 1, BLOCK)]


def _preempt_slip(**slip):
    return lambda r, f, b: _preempt_reference(r, f, b, **slip)


PREEMPT_BUGS = Catalogue("preempt", _preempt_slip(), (
    Bug("preempt.oldest", "evicting the oldest sequence first", "running is in order of admission, the newest "
        "last: the newest has done the least work, and is the one to evict.", _preempt_slip(oldest=True)),
    Bug("preempt.everyone", "evicting every running sequence", "Evict one sequence at a time, newest first, "
        "and stop as soon as the others fit.", _preempt_slip(everyone=True)),
    Bug("preempt.forgets_freed", "a free count that ignores what each victim gives back",
        "A victim's blocks return to the pool: count them before asking whether the others fit.",
        _preempt_slip(forget=True)),
), _preempt_probes, observe=lambda f, running, free, block_size: _ids(f(list(running), free, block_size)))


def _preempt_case(running, free, expected, what):
    def run(fns):
        seqs = running()
        victims = _members("preempt", call(fns["preempt"], list(seqs), free, BLOCK), seqs)
        if _ids(victims) != expected:
            raise Mismatch(f"{what}: preempt chose requests {_ids(victims)}; expected {expected}",
                           **PREEMPT_BUGS.hint(fns, running(), free, BLOCK))
    return run


PREEMPT_HINT = ("For this case, count the blocks each sequence needs and the free ones, then evict by hand, "
                "newest first, until the others fit. Which step does your loop do differently?")
PREEMPT = Task("preempt", "2.3", ("preempt",), (
    Property("returns an empty list when every running sequence fits",
             "How many blocks does each running sequence still need, and how many are free?",
             _preempt_case(_at_block_edge(3, 3), 2, [], "2 needed, 2 free")),
    Property("evicts the most recently admitted sequence first",
             "In which order is running kept, and which end is the newest?",
             _preempt_case(_at_block_edge(3, 3, 3), 2, [2], "3 sequences needing 1 block each, 2 free")),
    Property("evicts as many as needed, newest first, and no more", PREEMPT_HINT,
             _preempt_case(_at_block_edge(1, 1, 1, 1), 0, [3, 2], "4 sequences holding 1 block and needing 1 "
                           "more, 0 free"), central=True),
    Property("counts the blocks a victim frees", PREEMPT_HINT,
             _preempt_case(_at_block_edge(1, 1, 5), 0, [2], "the newest holds 5 blocks, 3 needed, 0 free")),
))


# --- schedule_tokens: a token budget and chunked prefill ------------------------------------------------

def _schedule_reference(running, token_budget, prefill_first=False, whole=False, shortest=False,
                        one_prefill=False, prompt_only=False):
    """Decodes first (1 token each), then the budget left to the prefills in order of admission, each
    as much of what it has left as fits; and the usual slips (flags)."""
    def left(s):
        return s.prompt_len - s.computed if prompt_only and s.computed < s.prompt_len else s.to_compute

    plan, budget = [0] * len(running), token_budget
    decodes = [i for i, s in enumerate(running) if left(s) == 1]
    prefills = [i for i, s in enumerate(running) if left(s) > 1]
    if shortest:
        prefills.sort(key=lambda i: left(running[i]))
    order = prefills + decodes if prefill_first else decodes + prefills
    for i in order:
        want = left(running[i])
        give = min(want, budget)
        if whole and give < want:
            continue
        plan[i], budget = give, budget - give
        if one_prefill and give and i in prefills:
            break
    return plan


def _decoding(request_id, prompt_len, output):
    return _seq(request_id, prompt_len, output=output)


def _prefilling(request_id, prompt_len, computed=0, output=0):
    return _seq(request_id, prompt_len, output=output, computed=computed)


def _schedule_probes():
    return [([_decoding(0, 8, 3), _prefilling(1, 30), _decoding(2, 4, 1), _prefilling(3, 6)], 16),
            ([_prefilling(0, 20, computed=12), _prefilling(1, 5), _decoding(2, 9, 2)], 10),
            ([_prefilling(0, 12), _prefilling(1, 3), _prefilling(2, 2)], 8),
            ([_prefilling(0, 6, output=5), _decoding(1, 3, 1)], 16),
            ([_decoding(0, 3, 2), _decoding(1, 5, 4)], 4)]


def _schedule_slip(**slip):
    return lambda running, budget: _schedule_reference(running, budget, **slip)


def _observe_schedule(function, running, budget):
    plan = function(list(running), budget)
    return list(plan) if isinstance(plan, (list, tuple)) else plan


SCHEDULE_BUGS = Catalogue("schedule_tokens", _schedule_slip(), (
    Bug("schedule.prefill_first", "prefills served before the decodes", "A decode costs one token and a user "
        "is waiting for it: serve every decode first, then give the budget left to the prefills.",
        _schedule_slip(prefill_first=True)),
    Bug("schedule.whole_prompts", "a prompt that runs only when it fits whole", "Chunked prefill gives a "
        "prompt the budget that is left, even when that is only part of it.", _schedule_slip(whole=True)),
    Bug("schedule.shortest_first", "the prefills served shortest first", "The prefills share the budget in "
        "order of admission, the order of running: first come, first served.", _schedule_slip(shortest=True)),
    Bug("schedule.one_prefill", "one prefill a step", "A prompt that finishes within the budget leaves the "
        "rest of it to the next prefill in line.", _schedule_slip(one_prefill=True)),
    Bug("schedule.prompt_only", "a prefill that counts only its prompt", "A preempted sequence recomputes its "
        "prompt and its output so far: what it has left is num_tokens - computed.",
        _schedule_slip(prompt_only=True)),
), _schedule_probes, observe=_observe_schedule)


def _schedule(fns, running, budget) -> list[int]:
    plan = call(fns["schedule_tokens"], list(running), budget)
    if not isinstance(plan, (list, tuple)) or len(plan) != len(running) or not all(
            isinstance(n, int) and not isinstance(n, bool) for n in plan):
        raise wrong_value("schedule_tokens", plan, f"a list of {len(running)} ints (one per running sequence)")
    return list(plan)


def _schedule_case(make, budget, what):
    def run(fns):
        plan, expected = _schedule(fns, make(), budget), _schedule_reference(make(), budget)
        if plan != expected:
            raise Mismatch(f"{what}: schedule_tokens planned {plan}; expected {expected}",
                           **SCHEDULE_BUGS.hint(fns, make(), budget))
    return run


def _schedule_limits(fns):
    for make, budget in ((lambda: [_decoding(0, 8, 3), _prefilling(1, 30), _prefilling(2, 40)], 12),
                         (lambda: [_prefilling(0, 7, computed=4)], 50)):
        running = make()
        plan = _schedule(fns, running, budget)
        over = [(s.request_id, n, s.to_compute) for s, n in zip(running, plan) if not 0 <= n <= s.to_compute]
        if sum(plan) > budget or over:
            raise Mismatch(f"a budget of {budget}: schedule_tokens planned {plan} ({sum(plan)} tokens); expected "
                           f"at most {budget} in all and, for each sequence, at most what it has left "
                           f"({[s.to_compute for s in running]})", **SCHEDULE_BUGS.hint(fns, make(), budget))


SCHEDULE_HINT = ("For this case, write down what each sequence has left to compute (num_tokens - computed), "
                 "serve the decodes, then share what is left of the budget in order.")
SCHEDULE = Task("schedule_tokens", "2.3", ("schedule_tokens",), (
    Property("returns one int per running sequence",
             "Return a list as long as running: how many tokens each computes this step.",
             lambda fns: _schedule(fns, [_decoding(0, 8, 3), _prefilling(1, 10)], 16)),
    Property("with room for everyone, each sequence computes all it has left",
             "What does a prefilling sequence have left, and a decoding one?",
             _schedule_case(lambda: [_decoding(0, 8, 3), _prefilling(1, 10), _prefilling(2, 6, computed=2)],
                            32, "a decode, a 10-token prompt and a prompt with 4 left, budget 32")),
    Property("every decode gets its token before any prefill", SCHEDULE_HINT,
             _schedule_case(lambda: [_prefilling(0, 30), _decoding(1, 4, 2), _decoding(2, 6, 1)], 8,
                            "a 30-token prompt admitted before two decodes, budget 8"), central=True),
    Property("a prompt longer than the budget left gets a chunk of it", SCHEDULE_HINT,
             _schedule_case(lambda: [_decoding(0, 8, 3), _prefilling(1, 30)], 16,
                            "a decode and a 30-token prompt, budget 16"), central=True),
    Property("the prefills share the budget in order of admission", SCHEDULE_HINT,
             _schedule_case(lambda: [_prefilling(0, 12), _prefilling(1, 3), _prefilling(2, 2)], 8,
                            "prompts of 12, 3 and 2 tokens, budget 8")),
    Property("a resumed sequence prefills its prompt and its output so far",
             "What has a preempted sequence, now back with an empty cache, left to compute?",
             _schedule_case(lambda: [_prefilling(0, 6, output=5), _decoding(1, 3, 1)], 16,
                            "a resumed 6 + 5-token sequence and a decode, budget 16")),
    Property("never plans more than the budget, nor more than a sequence has left",
             "Do you subtract each sequence's share from the budget, and cap it at what it has left?",
             _schedule_limits),
))


# --- all four in the simulator ---------------------------------------------------------------------------

def mixed_workload(n: int = 16, seed: int = 0, arrivals: bool = True) -> list[Spec]:
    """Short and long requests (output 2..48 tokens, some ending early with EOS), arriving over ~20 steps."""
    rng = random.Random(seed)
    specs = []
    for _ in range(n):
        max_tokens = rng.choice([2, 3, 4, 6, 8, 12, 16, 24, 32, 48])
        eos_at = rng.randint(1, max_tokens) if rng.random() < 0.25 else None
        specs.append(Spec(rng.randint(4, 40), max_tokens, eos_at, ignore_eos=rng.random() < 0.1,
                          arrival_step=rng.randint(0, 20) if arrivals else 0))
    return specs


ROOMY = {"num_blocks": 64, "block_size": 8, "max_batch_size": 4}
TIGHT = {"num_blocks": 14, "block_size": 8, "max_batch_size": 6}
BUDGET = 16  # tokens a step in the chunked runs: prompts of up to 40 tokens take up to 3 steps


def _run(fns, specs, limits, policy="continuous", budget: int | None = None) -> SimResult:
    return simulate(specs, fns["admit"], fns["finished"], fns["preempt"], policy=policy, token_budget=budget,
                    schedule_tokens=fns.get("schedule_tokens"), **limits)


def _lost(result: SimResult) -> str:
    if result.violations:
        return result.violations[0]
    wrong = [s for s in result.seqs if len(s.output) != s.expected_tokens or s.finish_step is None]
    s = wrong[0]
    return (f"{len(wrong)} of {len(result.seqs)} requests did not get their tokens; request {s.request_id} "
            f"got {len(s.output)} of {s.expected_tokens}")


def _suspects(fns, *catalogues: tuple[Catalogue, tuple[str, ...] | None]) -> dict:
    """The hint of a bug that the learner's rules show on every probe, among ``catalogues``."""
    return named(*(catalogue.identify(fns, among) for catalogue, among in catalogues
                   if catalogue.function in fns))


SAFETY = ((FINISHED_BUGS, None), (ADMIT_BUGS, None), (PREEMPT_BUGS, None), (SCHEDULE_BUGS, None))


def _complete(fns, result: SimResult, what: str) -> None:
    if not result.complete:
        raise Mismatch(f"{what}: {_lost(result)}; expected every request to get its tokens within the limits",
                       **_suspects(fns, *SAFETY))


def _sim_roomy(fns):
    _complete(fns, _run(fns, mixed_workload(seed=1), ROOMY), "a roomy pool")


def _sim_tight(fns):
    result = _run(fns, mixed_workload(seed=2), TIGHT)
    _complete(fns, result, "a tight pool")
    if result.peak_blocks > TIGHT["num_blocks"] or result.peak_batch > TIGHT["max_batch_size"]:
        raise Mismatch(f"peak use {result.peak_blocks} blocks, {result.peak_batch} sequences; expected at most "
                       f"{TIGHT['num_blocks']} and {TIGHT['max_batch_size']}", **_suspects(fns, *SAFETY))


def _sim_preempted(fns):
    result = _run(fns, mixed_workload(seed=3, arrivals=False), TIGHT)
    _complete(fns, result, "a tight pool, all at once")
    if result.preemptions == 0:
        raise Mismatch("no request was preempted on a pool this tight; expected some (does admit hold back "
                       "more blocks than a prompt needs?)", **_suspects(fns, (ADMIT_BUGS, None)))


def _sim_fcfs(fns):
    for seed in (2, 6):
        result = _run(fns, mixed_workload(seed=seed), TIGHT)
        overtakes = [text for kind, text in result.policy_breaks if kind == "overtake"]
        if overtakes:
            raise Mismatch(f"{overtakes[0]} ({len(overtakes)} time(s) in the run); expected no overtaking",
                           **_suspects(fns, (ADMIT_BUGS, None)))


def _sim_eviction(fns):
    result = _run(fns, mixed_workload(seed=3, arrivals=False), TIGHT)
    breaks = [(k, t) for k, t in result.policy_breaks if k != "overtake"]
    if breaks:
        kind, text = breaks[0]
        count = sum(k == kind for k, _ in breaks)
        raise Mismatch(f"{text} ({count} time(s) in the run); expected the newest evicted first, and only as "
                       "many as needed", **_suspects(fns, (PREEMPT_BUGS, None)))
    if result.preemptions == 0:
        raise Mismatch("no request was preempted on a pool this tight; expected some")


def _sim_faster(fns):
    specs = mixed_workload(seed=4, arrivals=False)
    static, continuous = _run(fns, specs, ROOMY, "static"), _run(fns, specs, ROOMY)
    for result in (static, continuous):
        _complete(fns, result, result.policy)
    if not continuous.steps < static.steps:
        raise Mismatch(f"continuous batching took {continuous.steps} steps, static batching {static.steps}; "
                       "expected fewer for continuous")


SIM_HINT = ("Run the simulator yourself on a small workload (the payoff cell does) and print each step's "
            "waiting, running and free blocks: where does your rule first do something you did not expect?")
SCHEDULER = Task("the three rules in the simulator", "2.3", ("finished", "admit", "preempt"), (
    Property("16 mixed requests, a roomy pool: every request gets exactly its tokens",
             "Pass the checks of finished, admit and preempt first.", _sim_roomy, central=True),
    Property("a tight pool: the block budget and the batch limit hold, and no request is lost", SIM_HINT,
             _sim_tight, central=True),
    Property("a tight pool, all arriving at once: preempted requests resume and finish", SIM_HINT,
             _sim_preempted),
    Property("a tight pool: no request starts before one that waited longer (first come, first served)",
             SIM_HINT, _sim_fcfs),
    Property("a tight pool: preemption evicts the newest first, and no more than the others need", SIM_HINT,
             _sim_eviction),
    Property("continuous batching needs fewer steps than static batching on a mixed workload",
             "In which steps does your admit let a waiting request in?", _sim_faster),
))


def _chunked(fns, seed, arrivals=True) -> SimResult:
    result = _run(fns, mixed_workload(n=12, seed=seed, arrivals=arrivals), ROOMY, budget=BUDGET)
    _complete(fns, result, f"a budget of {BUDGET} tokens a step")
    return result


def _chunked_budget(fns):
    result = _chunked(fns, 7)
    if max(result.tokens_per_step) > BUDGET:
        raise Mismatch(f"a step computed {max(result.tokens_per_step)} tokens; expected at most {BUDGET}")


def _chunked_no_stall(fns):
    result = _chunked(fns, 8, arrivals=True)
    if result.decode_waits:
        raise Mismatch(f"a decoding request computed nothing in a step {result.decode_waits} time(s); the "
                       f"largest gap between two tokens of a request is {result.largest_gap()} steps; expected "
                       "a token every step", **_suspects(fns, (SCHEDULE_BUGS, None)))


def _chunked_budget_used(fns):
    chunked = _run(fns, mixed_workload(n=12, seed=9, arrivals=False), ROOMY, budget=BUDGET)
    _complete(fns, chunked, f"a budget of {BUDGET} tokens a step")
    if chunked.idle_budget:
        raise Mismatch(f"{chunked.idle_budget} of {chunked.steps} steps left part of the budget unused while a "
                       "prompt still had tokens to prefill; expected none", **_suspects(fns, (SCHEDULE_BUGS, None)))


CHUNKED = Task("a token budget in the simulator", "2.3", ("finished", "admit", "preempt", "schedule_tokens"), (
    Property(f"12 mixed requests, {BUDGET} tokens a step: every request gets its tokens, and no step computes "
             "more than the budget", "Pass the checks of the four rules first.", _chunked_budget, central=True),
    Property("prompts of up to 40 tokens are prefilled in chunks while every decode gets a token each step",
             "Print each step's plan for a run where a long prompt arrives while others decode.",
             _chunked_no_stall, central=True),
    Property("no step leaves part of the budget unused while a prompt waits to be prefilled",
             "After the decodes, where does the rest of the budget go?", _chunked_budget_used),
))

register(FINISHED, ADMIT, PREEMPT, SCHEDULE, SCHEDULER, CHUNKED)


# --- the payoff ----------------------------------------------------------------------------------------------

def compare_policies(admit, finished, preempt, schedule_tokens=None, n: int = 24,
                     seed: int = 5) -> dict[str, SimResult] | None:
    """Static against continuous batching with the learner's rules, on a roomy and on a tight pool, and,
    once ``schedule_tokens`` passes, continuous batching with a token budget (chunked prefill).

    Prints one line per run and returns the runs by name (None until the rules pass their checks).
    """
    if not ready(finished, admit, preempt):
        return None
    fns = {"admit": admit, "finished": finished, "preempt": preempt, "schedule_tokens": schedule_tokens}
    specs = mixed_workload(n, seed, arrivals=False)
    runs = {f"{policy}, {name}": _run(fns, specs, limits, policy)
            for name, limits in (("roomy", ROOMY), ("tight", TIGHT))
            for policy in ("static", "continuous")}
    if schedule_tokens is not None and ready(schedule_tokens):
        runs[f"chunked {BUDGET}, roomy"] = _run(fns, specs, ROOMY, budget=BUDGET)
    print(f"{n} requests at step 0, prompts of {min(s.prompt_len for s in specs)} to "
          f"{max(s.prompt_len for s in specs)} tokens, outputs of {min(s.max_tokens for s in specs)} to "
          f"{max(s.max_tokens for s in specs)}; block size 8")
    print(f"roomy: {ROOMY['num_blocks']} blocks, batch {ROOMY['max_batch_size']}; "
          f"tight: {TIGHT['num_blocks']} blocks, batch {TIGHT['max_batch_size']}")
    print(f"{'run':<20}{'steps':>6}{'all done':>9}{'preempted':>10}{'peak blocks':>12}"
          f"{'mean wait':>10}{'most tokens':>12}")
    for name, r in runs.items():
        print(f"{name:<20}{r.steps:>6}{str(r.complete):>9}{r.preemptions:>10}{r.peak_blocks:>12}"
              f"{r.mean_wait():>10.1f}{max(r.tokens_per_step, default=0):>12}")
    print("(mean wait: steps from arrival to the first token; most tokens: the largest step)")
    return runs
