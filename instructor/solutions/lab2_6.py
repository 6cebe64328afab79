"""Reference solutions of lab 2.6 (book/labs/lab2_6_speculative.ipynb), for instructors."""
import torch


def accept_greedy(draft_tokens, target_logits):
    """The tokens a greedy round emits: the guesses while the target agrees, then its own token."""
    best = target_logits.argmax(-1).tolist()  # (k + 1,): the target's choice after each prefix
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == best[n]:
        n += 1
    return list(draft_tokens[:n]) + [best[n]]  # the correction, or the bonus after k kept guesses


def accept_sampled(draft_tokens, draft_probs, target_probs, generator):
    """The tokens a sampled round emits, distributed as the target samples them one by one."""
    for i, token in enumerate(draft_tokens):
        p, q = target_probs[i], draft_probs[i]  # (V,), (V,)
        if torch.rand((), generator=generator) * q[token] < p[token]:  # kept with probability min(1, p / q)
            continue
        residual = (p - q).clamp(min=0)  # the mass the draft gave too little
        return list(draft_tokens[:i]) + [int(torch.multinomial(residual, 1, generator=generator))]
    return list(draft_tokens) + [int(torch.multinomial(target_probs[-1], 1, generator=generator))]
