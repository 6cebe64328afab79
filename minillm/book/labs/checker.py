"""The labs' checker: hidden cases run against a learner's functions, one line per property.

A lab registers ``Task``s; each task needs one or more of the learner's functions (by name) and holds
``Property``s. A property calls the learner's code only through :func:`call`, so an exception raised
there, or a value of the wrong type, becomes one readable sentence (with the learner's own line), not a
traceback from deep inside the library. A property scores one point; a central one (the idea working:
the round trip inside a model, the simulator, the measured prediction) scores ``CENTRAL_POINTS``, and a
task whose central property fails scores at most half its points.

The functions may be the learner's own (``check`` in a live notebook) or stand-ins that call them in
another process (the grader, :mod:`.sandbox`); either way each function gets one time limit: once it
runs out of time, its remaining properties are not run.
"""
from __future__ import annotations

import functools
import linecache
import numbers
import os
import signal
import sys
import sysconfig
import textwrap
import threading
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..notebook import WIDTH

NOT_WRITTEN = "not written yet: it still raises NotImplementedError"
TIMEOUT_HINT = ("Look for a loop that never ends: a while whose condition never changes, or a `continue` "
                "where the loop should stop.")
ENDED_HINT = ("Your function ended the process it ran in (os._exit, a crash in native code, or memory "
              "running out): run it on a small case in your notebook.")
CENTRAL_POINTS = 3  # what a central property scores; every other property scores 1


def _default_seconds() -> float:
    try:
        return float(os.environ.get("MINILLM_CHECK_TIMEOUT", "20"))
    except ValueError:
        return 20.0


# Each property must finish within this many seconds (0: no limit). ``set_time_limit`` changes it; the
# environment variable MINILLM_CHECK_TIMEOUT sets its default.
TIME_LIMIT = _default_seconds()


def set_time_limit(seconds: float) -> None:
    """Give every property at most ``seconds`` (0 or less: no limit)."""
    global TIME_LIMIT
    TIME_LIMIT = float(seconds)


class Mismatch(AssertionError):
    """A property does not hold; the message says what was seen and what was expected. ``hint``, when
    given, replaces the property's own; ``bug`` names the known bug that hint is about (see
    :mod:`.diagnosis`: only once the outcome matched that bug on every case that tells it apart)."""

    def __init__(self, message: str, hint: str | None = None, bug: str | None = None):
        super().__init__(message)
        self.hint, self.bug = hint, bug


class LearnerError(Exception):
    """The learner's function raised, or returned something unusable; the message is for the learner."""

    def __init__(self, message: str, not_written: bool = False):
        super().__init__(message)
        self.not_written = not_written


@dataclass(frozen=True)
class Property:
    """One checked behaviour: ``run(functions)`` returns when it holds and raises Mismatch when not.
    ``central``: the property that shows the task's idea works; it scores CENTRAL_POINTS, and when it
    fails the task scores at most half its points."""

    name: str
    hint: str
    run: Callable[[dict], None]
    seconds: float | None = None  # a slow property's own time limit (the larger of it and TIME_LIMIT)
    central: bool = False

    @property
    def points(self) -> int:
        return CENTRAL_POINTS if self.central else 1


@dataclass(frozen=True)
class Task:
    """The properties checked for one function of a lab, or for several working together."""

    name: str
    lab: str  # "2.1"
    needs: tuple[str, ...]  # the learner's function names this task calls
    properties: tuple[Property, ...]


@dataclass(frozen=True)
class Outcome:
    """What one property gave on the learner's code."""

    name: str
    passed: bool
    detail: str = ""  # what went wrong, when it failed
    hint: str = ""
    not_written: bool = False
    timed_out: bool = False
    not_run: bool = False  # skipped: a function it needs ran out of time (or ended its process) before
    points: int = 1
    central: bool = False
    bug: str | None = None  # the known bug the hint names, if it names one


@dataclass(frozen=True)
class Report:
    """The outcome of every property of one task."""

    task: str
    lab: str
    outcomes: tuple[Outcome, ...]
    # minillm functions the learner's code called while these properties ran ("causal_attention called
    # minillm.cache.causal_mask"): the checks compare with minillm, so such a pass proves nothing
    reference_uses: tuple[str, ...] = field(default=())

    @property
    def timed_out(self) -> list[str]:
        """The names of the properties that ran out of time."""
        return [o.name for o in self.outcomes if o.timed_out]

    @property
    def passed(self) -> int:
        """How many properties hold."""
        return sum(o.passed for o in self.outcomes)

    @property
    def total(self) -> int:
        return len(self.outcomes)

    @property
    def max_points(self) -> int:
        return sum(o.points for o in self.outcomes)

    @property
    def capped(self) -> bool:
        """A central property fails: the task scores at most half its points."""
        return any(o.central and not o.passed for o in self.outcomes)

    @property
    def points(self) -> int:
        earned = sum(o.points for o in self.outcomes if o.passed)
        return min(earned, self.max_points // 2) if self.capped else earned

    @property
    def all_passed(self) -> bool:
        return self.passed == self.total

    @property
    def not_written(self) -> bool:
        return all(o.not_written for o in self.outcomes)

    def text(self, brief: bool = False) -> str:
        """The report as the learner reads it, at most ``WIDTH`` characters a line. ``brief``: one line
        for a task that passes or is not written yet."""
        head = f"{self.task}: {self.passed} of {self.total} checks pass, {self.points} of {self.max_points} points"
        if self.not_written:
            reason = self.outcomes[0].detail.replace(f"{self.task} is not written", "not written")
            lines = [_wrap(f"{head} ({reason}).", "", "  ")]
            if not brief:
                lines.append("  It will be checked for:")
                lines += [_wrap(o.name + (f" [{o.points} points]" if o.central else ""), "    - ", "      ")
                          for o in self.outcomes]
            return "\n".join(lines)
        uses = [_wrap(f"{use}: the checks compare with minillm, so this proves nothing; write it yourself",
                      "  note: ", " " * 8) for use in self.reference_uses]
        done = " -- well done." if self.all_passed and not uses else "."
        lines = [head + done]
        if brief and self.all_passed and not uses:
            return lines[0]
        failed = [o for o in self.outcomes if not o.passed]
        for o in self.outcomes:
            mark = "  ok    " if o.passed else "  ----  " if o.not_run else "  FAIL  "
            lines.append(_wrap(o.name + (f" [{o.points} points]" if o.central else ""), mark, " " * 8))
            if o.not_run:
                lines.append(_wrap(o.detail, " " * 8, " " * 8))
            elif not o.passed:
                lines.append(_wrap(o.detail, "        seen: ", " " * 14))
                lines.append(_wrap(o.hint, "        hint: ", " " * 14))
        if self.capped:
            lines.append(_wrap("A central check fails, so this task scores at most half its points.", "  ", "  "))
        if sum(not o.not_run for o in failed) > 1:
            lines.append(_wrap("Fix the first FAIL first: the later ones often follow from it.", "  ", "  "))
        return "\n".join(lines + uses)


def _wrap(text: str, first: str, rest: str) -> str:
    return textwrap.fill(text, WIDTH, initial_indent=first, subsequent_indent=rest,
                         break_long_words=True, break_on_hyphens=False)


# --- calling the learner's code -------------------------------------------------------------------

_LIBRARY_DIRS = tuple(os.path.realpath(p) for p in {
    sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),  # minillm itself
})


def _is_learner_frame(filename: str) -> bool:
    if filename.startswith("<") and filename not in linecache.cache:  # <frozen ...>, <string>: generated
        return False
    path = os.path.realpath(filename) if not filename.startswith("<") else filename
    return not path.startswith(_LIBRARY_DIRS)


def _where(exc: BaseException) -> str:
    """' (line N of your cell: `code`)' for the deepest frame of the learner's own code, or ''."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_learner_frame(f.filename)]
    if not frames:
        return ""
    frame = frames[-1]
    line = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
    name = frame.filename
    place = "your cell" if "ipykernel" in name or name.startswith("<") else os.path.basename(name)
    code = f": `{line}`" if line else ""
    return f" (line {frame.lineno} of {place}{code})"


# --- minillm's own code reached from the learner's ---------------------------------------------------

_MINILLM_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # minillm/
_LABS_DIR = os.path.dirname(os.path.abspath(__file__))  # the labs' own helpers (Seq, ...) are the learner's to use
_uses: list[str] | None = None  # where run_task collects them


@functools.lru_cache(maxsize=4096)
def _minillm_module(filename: str) -> str | None:
    """'minillm.cache' for a file of minillm outside the labs; else None."""
    if filename.startswith("<"):
        return None
    path = os.path.abspath(filename)
    if not path.startswith(_MINILLM_DIR + os.sep) or path.startswith(_LABS_DIR + os.sep):
        return None
    return os.path.relpath(path, os.path.dirname(_MINILLM_DIR))[:-3].replace(os.sep, ".").removesuffix(
        ".__init__")


def _minillm_name(code) -> str | None:
    """'minillm.cache.causal_mask' for a function of minillm outside the labs; else None."""
    module = _minillm_module(code.co_filename)
    return None if module is None else f"{module}.{getattr(code, 'co_qualname', code.co_name)}"


_ALLOWED: set[str] = set()  # minillm functions a learner may call: attributes, not the code under test
_REFERENCES: dict = {}  # the labs' own reference code (code object -> name), flagged like minillm's


def allow_uses(*names: str) -> None:
    """Let the learner's code call these minillm functions unflagged ("minillm.model.CausalLM.dtype")."""
    _ALLOWED.update(names)


def reference(function: Callable) -> Callable:
    """Mark a lab's own reference function: a learner's call to it is flagged like a call to minillm."""
    _REFERENCES[function.__code__] = f"{function.__module__}.{function.__qualname__}"
    return function


def _reference_name(code) -> str | None:
    """The name of minillm's code or a lab's reference that ``code`` belongs to, unless allowed; else None."""
    name = _REFERENCES.get(code) or _minillm_name(code)
    return None if name in _ALLOWED else name


def _record(name: str, use: str) -> None:
    message = f"{name} {use}"
    if _uses is not None and message not in _uses:
        _uses.append(message)


def start_recording() -> None:
    """Collect the minillm code that the learner's functions reach from now on (see ``stop_recording``)."""
    global _uses
    _uses = []


def stop_recording() -> list[str]:
    """What the learner's functions reached since ``start_recording`` ("ttft called minillm...")."""
    global _uses
    found, _uses = _uses or [], None
    return found


def record_uses(uses: list[str]) -> None:
    """Add uses seen in another process (the grader's sandbox) to the task now running."""
    for use in uses:
        if _uses is not None and use not in _uses:
            _uses.append(use)


@contextmanager
def _watch_for_minillm(name: str):
    """Record every minillm function that the learner's code calls, however it was reached (an import,
    importlib, __import__, sys.modules): a call whose nearest caller outside the standard library and
    torch is the learner's own code."""
    if _uses is None:
        yield
        return
    previous = sys.getprofile()

    def profile(frame, event, arg):
        if event == "call":
            reached = _reference_name(frame.f_code)
            if reached is not None and not frame.f_code.co_name.startswith("__"):  # not __init__ & co.
                caller = frame.f_back
                while caller is not None and not _is_learner_frame(caller.f_code.co_filename) \
                        and _minillm_name(caller.f_code) is None and not _is_lab_frame(caller.f_code):
                    caller = caller.f_back
                if caller is not None and _is_learner_frame(caller.f_code.co_filename):
                    _record(name, f"called {reached}")
        if previous is not None:
            previous(frame, event, arg)

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(previous)


def _is_lab_frame(code) -> bool:
    return not code.co_filename.startswith("<") and os.path.abspath(code.co_filename).startswith(
        _LABS_DIR + os.sep)


def call(function: Callable, *args, **kwargs):
    """Call a learner's function; whatever it raises becomes a LearnerError with a readable message.
    A function that runs in the grader's sandbox reports those errors (and what it reached) itself."""
    if getattr(function, "in_sandbox", False):
        return function(*args, **kwargs)
    name = getattr(function, "__name__", "your function")
    code = getattr(function, "__code__", None)
    own = _reference_name(code) if code is not None else None
    if own is not None:
        _record(name, f"is {own} itself")
    try:
        with _watch_for_minillm(name):
            return function(*args, **kwargs)
    except NotImplementedError as exc:
        raise LearnerError(f"{name} is {NOT_WRITTEN}", not_written=True) from exc
    except LearnerError:
        raise
    except Exception as exc:  # any error of the learner's code is reported, not raised
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if len(message) > 160:
            message = message[:157] + "..."
        raise LearnerError(f"{name} raised {type(exc).__name__}"
                           f"{': ' + message if message else ''}{_where(exc)}") from exc


def describe(value) -> str:
    """A short description of a value's type (and shape), for messages."""
    described = getattr(value, "described_as", None)  # a value the grader's wire did not carry
    if isinstance(described, str):
        return described
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    if value is None:
        return "None"
    kind = type(value)
    module = "" if kind.__module__ == "builtins" else kind.__module__.split(".")[0] + "."
    name = module + kind.__name__
    article = "an" if name[0] in "aeiou" else "a"
    return f"{article} {name}" + (f" of length {len(value)}" if isinstance(value, (list, tuple)) else "")


def wrong_value(name: str, value, expected: str, what: str = "returned") -> LearnerError:
    """The error for a value of the wrong kind: '<name> returned None; expected ... (is ... missing?)'."""
    missing = " (is a return statement missing?)" if value is None and what == "returned" else ""
    return LearnerError(f"{name} {what} {describe(value)}; expected {expected}{missing}")


def expect_tensor(name: str, value, shape: tuple[int, ...], floating: bool = True, what: str = "returned"):
    """``value`` if it is a tensor of ``shape``; else a LearnerError saying what was expected."""
    if not isinstance(value, torch.Tensor):
        raise wrong_value(name, value, f"a torch.Tensor of shape {shape}", what)
    if tuple(value.shape) != tuple(shape):
        raise LearnerError(f"{name} {what} a tensor of shape {tuple(value.shape)}; expected {tuple(shape)}")
    if floating and not value.is_floating_point():
        raise LearnerError(f"{name} {what} a {str(value.dtype).removeprefix('torch.')} tensor; expected "
                           "floating-point values")
    return value


def expect_number(name: str, value, integer: bool = False):
    """``value`` as a float (or int) if it is a plain number (a 0-d tensor is accepted)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise wrong_value(name, value, "an integer" if integer else "a number")
    if integer and not float(value).is_integer():
        raise LearnerError(f"{name} returned {value!r}; expected a whole number")
    return int(value) if integer else float(value)


# --- the registry and the entry points -------------------------------------------------------------

TASKS: dict[str, Task] = {}


def register(*tasks: Task) -> None:
    for task in tasks:
        TASKS[task.name] = task


def lab_tasks(lab: str) -> list[Task]:
    return [t for t in TASKS.values() if t.lab == lab]


def function_names(lab: str | None = None) -> list[str]:
    """The names of the functions learners write (in one lab, or in all of them)."""
    names = []
    for task in TASKS.values():
        if lab is None or task.lab == lab:
            names += [n for n in task.needs if n not in names]
    return names


@contextmanager
def _one_thread():
    """The hidden cases use small tensors: one thread is faster than several, and far steadier on a
    shared machine (intra-op threads wait for each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class OutOfTime(BaseException):
    """A property ran past its time limit (a BaseException, so that the learner's ``except Exception``
    does not swallow it)."""


class FunctionStopped(BaseException):
    """A learner's function in the grader's sandbox did not answer: ``timed_out`` when it ran out of
    time, else it ended its process. ``detail`` says so, with where it was stopped."""

    def __init__(self, name: str, detail: str, timed_out: bool):
        super().__init__(detail)
        self.name, self.detail, self.timed_out = name, detail, timed_out


@contextmanager
def time_limit(seconds: float):
    """Raise OutOfTime in the block after ``seconds`` (and every half second after, should the learner's
    code catch it), on the main thread of a system with SIGALRM; elsewhere no limit. For ``check`` in a
    live notebook; the grader keeps its own clock (:mod:`.sandbox`)."""
    usable = (seconds and seconds > 0 and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return

    def ring(signum, frame):
        raise OutOfTime

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds, 0.5)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_budget: list[float] | None = None  # [seconds left, the limit] of the property now running (sandboxed calls)


def seconds_left() -> float:
    """What the property now running may still spend in the learner's code (sandboxed calls)."""
    return _budget[0] if _budget is not None else (TIME_LIMIT if TIME_LIMIT > 0 else 1e9)


def property_seconds() -> float:
    """The time limit of the property now running."""
    return _budget[1] if _budget is not None else TIME_LIMIT


def spend(seconds: float) -> None:
    """Charge a sandboxed call's time to the property now running."""
    if _budget is not None:
        _budget[0] -= seconds


@contextmanager
def _property_limit(seconds: float, sandboxed: bool):
    """The property's time limit: a budget that the sandboxed calls spend (the grader stops a call
    that overruns it), or, for the learner's own functions, ``time_limit``."""
    global _budget
    if not sandboxed:
        with time_limit(seconds):
            yield
        return
    outer, _budget = _budget, [seconds if seconds > 0 else 1e9, seconds]
    try:
        yield
    finally:
        _budget = outer


@dataclass
class Run:
    """What one grading remembers across tasks: the functions that stopped answering (and why), and
    what the diagnosis learned of each function (its outcomes on the probes)."""

    stopped: dict[str, str] = field(default_factory=dict)
    cache: dict = field(default_factory=dict)


_run: Run | None = None  # the grading run now going on


def run_cache() -> dict:
    """A dict that lives as long as the grading run now going on (a fresh one outside a run)."""
    return _run.cache if _run is not None else {}


def run_task(task: Task, functions: dict, run: Run | None = None) -> Report:
    global _uses, _run
    outer, _uses = _uses, []
    outer_run, _run = _run, run or Run()
    try:
        with _one_thread():
            report = _run_task(task, functions, _run)
        return Report(report.task, report.lab, report.outcomes, tuple(_uses))
    finally:
        _uses, _run = outer, outer_run


def _run_task(task: Task, functions: dict, run: Run) -> Report:
    outcomes = []
    sandboxed = any(getattr(functions.get(n), "in_sandbox", False) for n in task.needs)
    for prop in task.properties:
        scored = {"points": prop.points, "central": prop.central}
        blocked = next((n for n in task.needs if n in run.stopped), None)
        if blocked is not None:
            outcomes.append(Outcome(prop.name, False, f"not run: {run.stopped[blocked]}", "", not_run=True,
                                    **scored))
            continue
        limit = max(TIME_LIMIT, prop.seconds or 0) if TIME_LIMIT > 0 else 0
        try:
            with _property_limit(limit, sandboxed):
                prop.run(functions)
        except FunctionStopped as exc:
            why = "ran out of time" if exc.timed_out else "ended its process"
            run.stopped[exc.name] = f"{exc.name} {why} in the check '{prop.name}'"
            outcomes.append(Outcome(prop.name, False, exc.detail, TIMEOUT_HINT if exc.timed_out else ENDED_HINT,
                                    timed_out=exc.timed_out, **scored))
        except OutOfTime as exc:
            where = _where(exc).replace(" (line", " (stopped at line", 1)
            for name in task.needs:
                run.stopped.setdefault(name, f"{name} ran out of time in the check '{prop.name}'")
            outcomes.append(Outcome(prop.name, False, f"did not finish within {limit:g} s{where}",
                                    TIMEOUT_HINT, timed_out=True, **scored))
        except Mismatch as exc:
            outcomes.append(Outcome(prop.name, False, str(exc), exc.hint or prop.hint, bug=exc.bug, **scored))
        except LearnerError as exc:
            outcomes.append(Outcome(prop.name, False, str(exc), prop.hint, exc.not_written, **scored))
        else:
            outcomes.append(Outcome(prop.name, True, **scored))
    return Report(task.name, task.lab, tuple(outcomes))


def _collect(args: tuple, kwargs: dict) -> dict:
    """{name: function} from check's arguments; a ValueError (read by the learner) for anything else."""
    functions = {}
    known = function_names()
    for f in args:
        name = getattr(f, "__name__", None)
        if not callable(f) or name is None:
            raise ValueError(f"check takes your lab functions, e.g. check(causal_attention); got {describe(f)}")
        if name not in known:
            raise ValueError(f"no lab has a function named {name!r}; define it with its lab name "
                             f"(def causal_attention...) or pass it by that name, e.g. "
                             f"check(causal_attention=my_function). Lab functions: {', '.join(known)}")
        functions[name] = f
    for name, f in kwargs.items():
        if name not in known:
            raise ValueError(f"no lab has a function named {name!r}. Lab functions: {', '.join(known)}")
        if not callable(f):
            raise ValueError(f"{name} must be a function; got {describe(f)}")
        functions[name] = f
    if not functions:
        raise ValueError("give check at least one of your functions, e.g. check(causal_attention)")
    return functions


_in_grader = False  # True while the grader runs a notebook's cells: check, score and ready stay silent


@contextmanager
def running_notebook():
    """While the grader runs a notebook's cells, ``check`` and ``score`` do nothing and ``ready`` says
    False (so the payoff cells wait): the grader runs the checks once, itself."""
    global _in_grader
    outer, _in_grader = _in_grader, True
    try:
        yield
    finally:
        _in_grader = outer


def grade(*functions: Callable, **named: Callable) -> list[Report]:
    """Run every task whose functions are all given; the reports, in registration order."""
    given, run = _collect(functions, named), Run()
    return [run_task(t, given, run) for t in TASKS.values() if set(t.needs) <= set(given)]


def check(*functions: Callable, **named: Callable) -> None:
    """Check your functions against the hidden cases and print what passes, what fails and a hint."""
    if _in_grader:
        return
    try:
        reports = grade(*functions, **named)
    except ValueError as exc:
        print(_wrap(str(exc), "check: ", "       "))
        return
    # With a task that needs several functions, the single-function tasks (each with its own check cell)
    # shrink to one line when they pass or are not written yet.
    joint = any(len(TASKS[r.task].needs) > 1 for r in reports)
    print("\n\n".join(r.text(brief=joint and len(TASKS[r.task].needs) == 1) for r in reports))


def score_table(reports: list[Report], title: str) -> str:
    """One line per task (its points, and how many of its checks pass), and the total points."""
    width = max([len(r.task) for r in reports] + [5]) + 2
    lines = [title]
    for r in reports:
        capped = ", capped at half" if r.capped and r.points < sum(o.points for o in r.outcomes if o.passed) else ""
        lines.append(f"  {r.task:<{width}}{r.points:>3} / {r.max_points:<3} points  ({r.passed} of {r.total} "
                     f"checks{capped})")
    earned, most = sum(r.points for r in reports), sum(r.max_points for r in reports)
    lines.append(f"  {'total':<{width}}{earned:>3} / {most:<3} points  ({100 * earned / max(most, 1):.0f}%)")
    return "\n".join(lines)


def score(*functions: Callable, **named: Callable) -> None:
    """Print the score of every task the given functions complete (one line each) and the total."""
    if _in_grader:
        return
    try:
        reports = grade(*functions, **named)
    except ValueError as exc:
        print(_wrap(str(exc), "score: ", "       "))
        return
    labs = sorted({r.lab for r in reports})
    print(score_table(reports, f"Lab {', '.join(labs)} score"))


def ready(*functions: Callable) -> bool:
    """True when every task of these functions passes; otherwise say so (for the labs' payoff cells)."""
    if _in_grader:
        return False
    reports = grade(*functions)
    passed, total = sum(r.passed for r in reports), sum(r.total for r in reports)
    if passed == total:
        return True
    names = ", ".join(getattr(f, "__name__", "?") for f in functions)
    verb = "passes" if len(functions) == 1 else "pass"
    print(_wrap(f"Not yet: this cell runs once {names} {verb} every check (now {passed} of {total}). "
                "The check cells above say what is missing.", "", ""))
    return False
