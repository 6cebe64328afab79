"""Labs: the learner writes the core piece of each chapter, and ``check`` grades it against hidden cases.

    from minillm.book.labs import check, score
    check(causal_attention)            # each property: ok, or FAIL with what was seen and a hint
    check(apply_rope, causal_attention) # also the tasks that need both (inside a real model)
    score(apply_rope, causal_attention, next_token_probs)   # one line per task and the total

``python -m minillm.book.labs grade book/labs/lab2_1_attention.ipynb`` grades a saved notebook.
"""
from . import lab2_1, lab2_2, lab2_3, lab2_4, lab2_5, lab2_6  # noqa: F401 - each registers its tasks
from .checker import TASKS, Report, check, function_names, grade, ready, score

__all__ = ["Report", "TASKS", "check", "function_names", "grade", "ready", "score"]
