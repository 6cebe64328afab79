"""Reference solutions of lab 2.3 (book/labs/lab2_3_scheduler.ipynb), for instructors."""
import math


def finished(seq, eos_token_id):
    """Is this sequence done after the token it just got?"""
    if len(seq.output) >= seq.max_tokens:
        return True
    return not seq.ignore_eos and seq.output[-1] == eos_token_id


def admit(waiting, running, free_blocks, block_size, max_batch_size):
    """Who starts this step: a prefix of the waiting queue."""
    chosen = []
    for seq in waiting:
        need = math.ceil(seq.num_tokens / block_size) - len(seq.blocks)
        if len(running) + len(chosen) >= max_batch_size or need > free_blocks:
            break  # first come, first served: no one overtakes the head of the queue
        chosen.append(seq)
        free_blocks -= need
    return chosen


def preempt(running, free_blocks, block_size):
    """Whom to evict (newest first) so that the others can run their next step."""
    def need(seq):
        return math.ceil(seq.num_tokens / block_size) - len(seq.blocks)

    staying, victims = list(running), []
    while staying and sum(need(s) for s in staying) > free_blocks:
        victim = staying.pop()  # the most recently admitted
        free_blocks += len(victim.blocks)
        victims.append(victim)
    return victims


def schedule_tokens(running, token_budget):
    """How many tokens each running sequence computes this step: the decodes first, then the prefills in
    order of admission, each as much of what it has left as the budget allows (chunked prefill)."""
    plan = [0] * len(running)
    left = [seq.num_tokens - seq.computed for seq in running]  # 1 for a decode, more for a prefill
    for i in range(len(running)):
        if left[i] == 1:
            plan[i] = 1
    budget = token_budget - sum(plan)
    for i in range(len(running)):
        if left[i] > 1 and budget > 0:
            plan[i] = min(left[i], budget)
            budget -= plan[i]
    return plan
