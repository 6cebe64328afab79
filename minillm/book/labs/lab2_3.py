"""Lab 2.3: the finishing, admission and preemption rules of a continuous-batching scheduler.

The learner writes ``finished``, ``admit`` and ``preempt``; the hidden cases call them on hand-made
queues, then run them together in the simulator of :mod:`minillm.book.labs.batching` (no model, no engine).
``compare_policies`` is the lab's payoff.
"""
from __future__ import annotations

import random
import re

from .batching import EOS, Seq, SimResult, Spec, _judge_eviction, _members, simulate
from .checker import Mismatch, Property, Task, call, ready, register, wrong_value

BLOCK = 4  # tokens per block in the hand-made cases


def _seq(request_id: int, prompt_len: int, output: int = 0, held: int = 0, max_tokens: int = 50,
         ignore_eos: bool = False, last_eos: bool = False) -> Seq:
    """A sequence with ``output`` tokens generated and ``held`` blocks in hand."""
    tokens = [100 + i for i in range(output)]
    if last_eos and tokens:
        tokens[-1] = EOS
    return Seq(request_id, prompt_len, max_tokens, ignore_eos=ignore_eos, output=tokens,
               blocks=list(range(1000 * (request_id + 1), 1000 * (request_id + 1) + held)))


def _ids(seqs) -> list[int]:
    return [s.request_id for s in seqs]


FCFS_HINT = ("Walk waiting from the front and stop at the first sequence that does not fit: a later, "
             "smaller one must not overtake it (first come, first served).")
OLDEST_HINT = "running is in order of admission, the newest last: take victims from its end, not its front."
EVERYONE_HINT = ("Evicting everyone throws away work that could have run: evict one sequence at a time, "
                 "newest first, and stop as soon as the others fit.")
FREED_HINT = ("Each victim gives its blocks back: add len(victim.blocks) to the free count before asking "
              "whether the others fit.")
EVICTION_HINTS = {"oldest": OLDEST_HINT, "too many": EVERYONE_HINT}


# --- finished --------------------------------------------------------------------------------------------

def _finished(fns, seq) -> bool:
    done = call(fns["finished"], seq, EOS)
    if not isinstance(done, bool):
        raise wrong_value("finished", done, "True or False")
    return done


def _finished_case(expected: bool, what: str, **fields):
    def run(fns):
        done = _finished(fns, _seq(0, 10, **fields))
        if done != expected:
            raise Mismatch(f"{what}: finished says {done}")
    return run


def _finished_types(fns):
    for fields in ({"output": 3}, {"output": 5, "max_tokens": 5}, {"output": 2, "last_eos": True}):
        _finished(fns, _seq(0, 10, **fields))


FINISHED = Task("finished", "2.3", ("finished",), (
    Property("returns True or False",
             "Return a bool: the result of a comparison is one.", _finished_types),
    Property("not finished while tokens remain and the last one is not EOS",
             "Compare how many tokens it has generated with its max_tokens.",
             _finished_case(False, "3 of 5 tokens, the last not EOS", output=3, max_tokens=5)),
    Property("finished once it has max_tokens tokens",
             "len(seq.output) counts the tokens generated so far.",
             _finished_case(True, "5 of 5 tokens", output=5, max_tokens=5)),
    Property("finished when its last token is EOS",
             "Look at the last token of seq.output and compare it with eos_token_id.",
             _finished_case(True, "3 of 5 tokens, the last one EOS", output=3, max_tokens=5, last_eos=True)),
    Property("with ignore_eos, EOS does not end it (benchmarks use this)",
             "EOS ends a request only when seq.ignore_eos is False.",
             _finished_case(False, "3 of 5 tokens, the last one EOS, ignore_eos", output=3, max_tokens=5,
                            last_eos=True, ignore_eos=True)),
    Property("max_tokens 1: finished after the prefill's token",
             "The first token comes from the prefill; it counts like any other.",
             _finished_case(True, "1 of 1 token", output=1, max_tokens=1)),
))


# --- admit -----------------------------------------------------------------------------------------------

def _admit(fns, waiting, running, free, max_batch):
    return _members("admit", call(fns["admit"], list(waiting), list(running), free, BLOCK, max_batch),
                    waiting)


def _admit_case(waiting, running, free, max_batch, expected, what):
    def run(fns):
        chosen = _admit(fns, waiting(), running(), free, max_batch)
        if _ids(chosen) != expected:
            raise Mismatch(f"{what}: admit chose requests {_ids(chosen)}")
    return run


def _prompts(*lengths):
    return lambda: [_seq(i, n) for i, n in enumerate(lengths)]


def _busy(count):
    return lambda: [_seq(10 + i, 8, output=1, held=3) for i in range(count)]


def _resumed():
    return [_seq(0, 6, output=7, max_tokens=20), _seq(1, 3)]  # 13 tokens: 4 blocks; then 1 block


ADMIT = Task("admit", "2.3", ("admit",), (
    Property("returns a list of sequences taken from waiting",
             "Return a list (possibly empty) of the sequence objects of waiting.",
             _admit_case(_prompts(8, 4), _busy(0), 10, 4, [0, 1], "room for both")),
    Property("admits everyone when the slots and the blocks allow",
             "Walk the queue from the front while there is room.",
             _admit_case(_prompts(8, 4, 3, 1), _busy(0), 10, 8, [0, 1, 2, 3], "4 prompts needing 5 blocks, "
                         "10 free, 8 slots")),
    Property("never lets running + admitted exceed max_batch_size",
             "The slots left are max_batch_size - len(running).",
             _admit_case(_prompts(4, 4, 4), _busy(3), 20, 4, [0], "3 running, limit 4")),
    Property("admits only what the free blocks hold",
             "A waiting sequence needs ceil(seq.num_tokens / block_size) blocks; subtract them from the "
             "free count as you admit.",
             _admit_case(_prompts(8, 8, 8), _busy(0), 5, 8, [0, 1], "3 prompts of 2 blocks, 5 free")),
    Property("first come, first served: no one overtakes the head of the queue", FCFS_HINT,
             _admit_case(_prompts(4, 16, 4), _busy(0), 3, 8, [0], "prompts of 1, 4, 1 blocks, 3 free")),
    Property("a resumed sequence needs blocks for its prompt and its output so far",
             "A preempted sequence is recomputed: count seq.num_tokens, not seq.prompt_len.",
             _admit_case(_resumed, _busy(0), 4, 8, [0], "a resumed 6 + 7-token sequence, then a 3-token "
                         "prompt, 4 free")),
))


# --- preempt ---------------------------------------------------------------------------------------------



def _preempt_case(running, free, expected, what, diagnose=True):
    def run(fns):
        seqs = running()
        victims = _members("preempt", call(fns["preempt"], list(seqs), free, BLOCK), seqs)
        if _ids(victims) != expected:
            breaks: list = []
            _judge_eviction(0, seqs, victims, free, BLOCK, breaks)
            hint = EVICTION_HINTS.get(breaks[0][0]) if breaks and diagnose else None
            if hint is EVERYONE_HINT and len(victims) < len(seqs):
                hint = None  # more than needed, not everyone: the property's own hint
            raise Mismatch(f"{what}: preempt chose requests {_ids(victims)}", hint)
    return run


def _at_block_edge(*held):
    """Running sequences (oldest first), each holding ``held[i]`` full blocks and needing one more."""
    return lambda: [_seq(i, 2, output=BLOCK * h - 1, held=h) for i, h in enumerate(held)]


PREEMPT = Task("preempt", "2.3", ("preempt",), (
    Property("returns an empty list when every running sequence fits",
             "A running sequence needs ceil(seq.num_tokens / block_size) - len(seq.blocks) more blocks; "
             "compare their sum with free_blocks.", _preempt_case(_at_block_edge(3, 3), 2, [], "2 needed, 2 free")),
    Property("evicts the most recently admitted sequence first",
             "running is in order of admission: the newest is the last.",
             _preempt_case(_at_block_edge(3, 3, 3), 2, [2], "3 sequences needing 1 block each, 2 free")),
    Property("evicts as many as needed, newest first, and no more", FREED_HINT,
             _preempt_case(_at_block_edge(1, 1, 1, 1), 0, [3, 2], "4 sequences holding 1 block and needing 1 more, "
                           "0 free", diagnose=False)),
    Property("counts the blocks a victim frees", FREED_HINT,
             _preempt_case(_at_block_edge(1, 1, 5), 0, [2], "the newest holds 5 blocks, 3 needed, 0 free",
                           diagnose=False)),
))


# --- all three in the simulator --------------------------------------------------------------------------

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


def _run(fns, specs, limits, policy="continuous") -> SimResult:
    return simulate(specs, fns["admit"], fns["finished"], fns["preempt"], policy=policy, **limits)


def _lost(result: SimResult) -> str:
    if result.violations:
        return result.violations[0]
    wrong = [s for s in result.seqs if len(s.output) != s.expected_tokens or s.finish_step is None]
    s = wrong[0]
    return (f"{len(wrong)} of {len(result.seqs)} requests did not get their tokens; request {s.request_id} "
            f"got {len(s.output)} of {s.expected_tokens}")


def _sim_roomy(fns):
    result = _run(fns, mixed_workload(seed=1), ROOMY)
    if not result.complete:
        raise Mismatch(_lost(result))


def _sim_tight(fns):
    result = _run(fns, mixed_workload(seed=2), TIGHT)
    if not result.complete:
        raise Mismatch(_lost(result))
    if result.peak_blocks > TIGHT["num_blocks"] or result.peak_batch > TIGHT["max_batch_size"]:
        raise Mismatch(f"peak use {result.peak_blocks} blocks, {result.peak_batch} sequences")


def _sim_preempted(fns):
    result = _run(fns, mixed_workload(seed=3, arrivals=False), TIGHT)
    if not result.complete:
        raise Mismatch(_lost(result))
    if result.preemptions == 0:
        raise Mismatch("no request was preempted on a pool this tight: does admit hold back more blocks "
                       "than a prompt needs?")


def _sim_fcfs(fns):
    for seed in (2, 6):
        result = _run(fns, mixed_workload(seed=seed), TIGHT)
        overtakes = [text for kind, text in result.policy_breaks if kind == "overtake"]
        if overtakes:
            raise Mismatch(f"{overtakes[0]} ({len(overtakes)} time(s) in the run)", FCFS_HINT)


def _sim_eviction(fns):
    result = _run(fns, mixed_workload(seed=3, arrivals=False), TIGHT)
    if result.policy_breaks and any(kind != "overtake" for kind, _ in result.policy_breaks):
        kind, text = next((k, t) for k, t in result.policy_breaks if k != "overtake")
        everyone = kind == "too many" and re.search(r"evicted (\d+) of \1 ", text)
        hint = EVICTION_HINTS[kind] if kind == "oldest" or everyone else FREED_HINT
        count = sum(k == kind for k, _ in result.policy_breaks)
        raise Mismatch(f"{text} ({count} time(s) in the run)", hint)
    if result.preemptions == 0:
        raise Mismatch("no request was preempted on a pool this tight")


def _sim_faster(fns):
    specs = mixed_workload(seed=4, arrivals=False)
    static, continuous = _run(fns, specs, ROOMY, "static"), _run(fns, specs, ROOMY)
    for result in (static, continuous):
        if not result.complete:
            raise Mismatch(f"{result.policy}: {_lost(result)}")
    if not continuous.steps < static.steps:
        raise Mismatch(f"continuous batching took {continuous.steps} steps, static batching {static.steps}")


SCHEDULER = Task("the three rules in the simulator", "2.3", ("finished", "admit", "preempt"), (
    Property("16 mixed requests, a roomy pool: every request gets exactly its tokens",
             "Pass the checks of finished, admit and preempt first.", _sim_roomy),
    Property("a tight pool: the block budget and the batch limit hold, and no request is lost",
             "admit must count the free blocks; preempt must free enough for the sequences that stay.",
             _sim_tight),
    Property("a tight pool, all arriving at once: preempted requests resume and finish",
             "A preempted request goes back to the queue with its output so far; admit counts it all.",
             _sim_preempted),
    Property("a tight pool: no request starts before one that waited longer (first come, first served)",
             FCFS_HINT, _sim_fcfs),
    Property("a tight pool: preemption evicts the newest first, and no more than the others need",
             EVERYONE_HINT, _sim_eviction),
    Property("continuous batching needs fewer steps than static batching on a mixed workload",
             "Continuous batching admits a waiting request in the step after one finishes.", _sim_faster),
))

register(FINISHED, ADMIT, PREEMPT, SCHEDULER)


# --- the payoff ----------------------------------------------------------------------------------------------

def compare_policies(admit, finished, preempt, n: int = 24, seed: int = 5) -> dict[str, SimResult] | None:
    """Static against continuous batching with the learner's rules, on a roomy and on a tight pool.

    Prints one line per run and returns the runs by name (None until the rules pass their checks).
    """
    if not ready(finished, admit, preempt):
        return None
    fns = {"admit": admit, "finished": finished, "preempt": preempt}
    specs = mixed_workload(n, seed, arrivals=False)
    runs = {f"{policy}, {name}": _run(fns, specs, limits, policy)
            for name, limits in (("roomy", ROOMY), ("tight", TIGHT))
            for policy in ("static", "continuous")}
    print(f"{n} requests at step 0, outputs of {min(s.max_tokens for s in specs)} to "
          f"{max(s.max_tokens for s in specs)} tokens; block size 8")
    print(f"roomy: {ROOMY['num_blocks']} blocks, batch {ROOMY['max_batch_size']}; "
          f"tight: {TIGHT['num_blocks']} blocks, batch {TIGHT['max_batch_size']}")
    print(f"{'run':<20}{'steps':>7}{'all done':>10}{'preempted':>11}{'peak blocks':>13}"
          f"{'mean wait':>11}")
    for name, r in runs.items():
        print(f"{name:<20}{r.steps:>7}{str(r.complete):>10}{r.preemptions:>11}{r.peak_blocks:>13}"
              f"{r.mean_wait():>11.1f}")
    return runs
