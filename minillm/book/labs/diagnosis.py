"""Naming the bug behind a wrong outcome, only when the evidence says so.

Each lab function has a ``Catalogue``: the bugs learners write, each as code that has the bug (the
learner's signature), and a few probe cases on which the right answer and every catalogued bug each give
a different outcome. When a check fails, ``Catalogue.explain`` looks for a catalogued bug that gives the
learner's outcome on the failing case, and names it only if the learner's function also gives that bug's
outcome on every probe. A function with another bug, or with two, matches no bug everywhere: its check
then says what was expected, what came back, and what to check, and names nothing.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import checker
from .checker import LearnerError


@dataclass(frozen=True)
class Bug:
    """A known bug: ``code`` is the learner's function as someone with this bug writes it; ``what``
    names the bug in a few words ("a mask built from T alone"); ``hint`` says what to change, without
    the code."""

    key: str
    what: str
    hint: str
    code: Callable

    @property
    def text(self) -> str:
        """The hint a check shows once the learner's outcomes match this bug everywhere."""
        return (f"Your outcomes are those of {self.what}, on every case that tells it apart from the others. "
                f"{self.hint}")


RAISED = ("raised",)  # the outcome of a function that raised


def same_tensors(a, b, atol: float = 1e-4) -> bool:
    """Two outcomes made of tensors, numbers and sequences are equal (tensors within ``atol``, NaN
    equal to NaN)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and bool(torch.allclose(a.detach().float(), b.detach().float(), atol=atol, rtol=atol,
                                        equal_nan=True)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_tensors(x, y, atol) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, (int, float)) or isinstance(b, float) and isinstance(a, (int, float)):
        return a == b or abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1e-12) or (a != a and b != b)
    return type(a) is type(b) and a == b


@dataclass
class Catalogue:
    """The known bugs of one lab function and the probes that tell them apart.

    ``observe(function, *case)`` runs a function on a case and returns what the checks compare (its
    value, or the tensor it wrote into); ``probes()`` returns the probe cases (argument tuples);
    ``same(a, b)`` compares two outcomes; ``reference`` is the right code.
    """

    function: str
    reference: Callable
    bugs: tuple[Bug, ...]
    probes: Callable[[], list[tuple]]
    observe: Callable = field(default=lambda f, *case: f(*case))
    same: Callable = field(default=same_tensors)

    def __post_init__(self) -> None:
        self._bug_outcomes: dict[str, list] = {}

    def bug(self, key: str) -> Bug:
        return next(b for b in self.bugs if b.key == key)

    def outcome(self, function: Callable, case: tuple):
        """What ``function`` gives on ``case`` (RAISED if it raises)."""
        try:
            return self.observe(function, *case)
        except LearnerError:
            return RAISED
        except Exception:  # a bug's own code that cannot run on this case (the learner's raises LearnerError)
            return RAISED

    def _learner(self, fns: dict) -> list:
        """The learner's outcomes on the probes, once per grading run."""
        cache = checker.run_cache()
        key = ("probes", self.function, id(fns.get(self.function)))
        if key not in cache:
            learner = _as_learner(fns[self.function])
            cache[key] = [self.outcome(learner, case) for case in self.probes()]
        return cache[key]

    def _of_bug(self, bug: Bug) -> list:
        if bug.key not in self._bug_outcomes:
            self._bug_outcomes[bug.key] = [self.outcome(bug.code, case) for case in self.probes()]
        return self._bug_outcomes[bug.key]

    def explain(self, fns: dict, *case, among: tuple[str, ...] | None = None) -> Bug | None:
        """The catalogued bug (of ``among``, by key; default all) whose outcome equals the learner's on
        ``case`` and on every probe; None when no bug, or more than one, does."""
        got = self.outcome(_as_learner(fns[self.function]), case)
        if got is RAISED:
            return None
        candidates = [b for b in self.bugs if (among is None or b.key in among)
                      and self.same(self.outcome(b.code, case), got)]
        if not candidates:
            return None
        learner = self._learner(fns)
        confirmed = [b for b in candidates if all(
            self.same(x, y) for x, y in zip(learner, self._of_bug(b)))]
        return confirmed[0] if len(confirmed) == 1 else None

    def identify(self, fns: dict, among: tuple[str, ...] | None = None) -> Bug | None:
        """The catalogued bug (of ``among``) whose outcomes equal the learner's on every probe, if one
        does (for a check whose own case is a whole run, such as a simulation)."""
        learner = self._learner(fns)
        found = [b for b in self.bugs if (among is None or b.key in among)
                 and all(self.same(x, y) for x, y in zip(learner, self._of_bug(b)))]
        return found[0] if len(found) == 1 else None

    def hint(self, fns: dict, *case, among: tuple[str, ...] | None = None) -> dict:
        """``{"hint": ..., "bug": ...}`` for a Mismatch on ``case``: the confirmed bug's, or nothing."""
        bug = self.explain(fns, *case, among=among)
        return {"hint": bug.text, "bug": bug.key} if bug is not None else {}


def named(*bugs: Bug | None) -> dict:
    """``{"hint": ..., "bug": ...}`` of the first bug given, or nothing (for Mismatch)."""
    bug = next((b for b in bugs if b is not None), None)
    return {"hint": bug.text, "bug": bug.key} if bug is not None else {}


def _as_learner(function: Callable) -> Callable:
    """The learner's function, called through ``checker.call`` (errors become LearnerError)."""
    return lambda *args: checker.call(function, *args)


def separates(catalogue: Catalogue) -> list[str]:
    """What keeps the probes from telling the catalogue's bugs apart: pairs (or a bug and the right
    code) with the same outcome on every probe. Empty when every bug can be named (tests check it)."""
    cases = catalogue.probes()
    outcomes = {b.key: [catalogue.outcome(b.code, c) for c in cases] for b in catalogue.bugs}
    outcomes["reference"] = [catalogue.outcome(catalogue.reference, c) for c in cases]
    keys, clashes = list(outcomes), []
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            if all(catalogue.same(x, y) for x, y in zip(outcomes[a], outcomes[b])):
                clashes.append(f"{a} = {b}")
    return clashes
