"""The grader: a saved notebook scores as the live notebook does (helper cells, magics); its code runs in a
process of its own that cannot change the score, stop the clock or outlive the grading; a function that
loops costs one check's limit; the teacher gets CSV and JSON and can insist on the assigned lab; minillm's
reference code is flagged however it is reached, and nothing raises a false note."""
from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import pathlib
import re
import time

import numpy
import pytest
import torch

from minillm.book.labs import checker, grade, wire
from minillm.book.labs.__main__ import main as labs_cli
from minillm.book.labs.batching import Seq
from minillm.book.labs.cells import lab_cells
from minillm.book.labs.notebooks import NotGraded, grade_notebook

pytestmark = pytest.mark.slow  # grades notebooks in subprocesses

ROOT = pathlib.Path(__file__).resolve().parents[1]
LABS = {p.name[:6]: p for p in (ROOT / "book" / "labs").glob("lab2_*.ipynb")}


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


APPLY = _load(ROOT / "instructor" / "apply_solutions.py", "apply_solutions_grader")


def _solved(lab: str, tmp_path) -> tuple[pathlib.Path, dict]:
    """A solved copy of the lab's notebook, and its JSON."""
    out = tmp_path / LABS[lab].name
    APPLY.apply(LABS[lab], out)
    return out, json.loads(out.read_text(encoding="utf-8"))


def _stubs(lab: str) -> dict:
    return json.loads(LABS[lab].read_text(encoding="utf-8"))


def _save(nb: dict, path: pathlib.Path) -> pathlib.Path:
    path.write_text(json.dumps(nb), encoding="utf-8")
    return path


def _cell(source: str) -> dict:
    return {"cell_type": "code", "metadata": {}, "source": source, "outputs": [], "execution_count": None}


def _index(path, name: str) -> int:
    return next(i for i, source in lab_cells(path) if f"def {name}(" in source)


def _live(nb: dict) -> dict:
    """What a kernel holds after running every code cell of ``nb`` in order (check, score, payoffs
    silenced; only cells of plain Python): the live notebook's namespace."""
    namespace: dict = {}
    with checker.running_notebook():
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                exec("".join(cell["source"]), namespace)
    return namespace


def _score(reports) -> tuple[int, int]:
    return sum(r.points for r in reports), sum(r.max_points for r in reports)


def _full(lab: str) -> int:
    return sum(p.points for t in checker.lab_tasks(lab) for p in t.properties)


def _gone(pid: int) -> bool:
    """True when no process ``pid`` exists (not even a zombie waiting to be reaped)."""
    return not os.path.exists(f"/proc/{pid}")


HELPER_CELL = ("import torch\n\n\ndef visible_mask(positions, S):\n"
               "    return torch.arange(S)[None, None, None, :] <= positions[:, None, :, None]\n")
ATTENTION_WITH_HELPER = (
    "# YOUR CODE: task 2\nimport math\n\nimport torch\n\n\n"
    "def causal_attention(q, k, v, positions):\n"
    "    groups = q.shape[1] // k.shape[1]\n"
    "    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)\n"
    "    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])\n"
    "    scores = scores.masked_fill(~visible_mask(positions, k.shape[2]), float('-inf'))\n"
    "    return torch.softmax(scores, -1) @ v\n")


def test_a_helper_in_its_own_cell_grades_as_in_the_live_notebook(tmp_path):
    path, nb = _solved("lab2_1", tmp_path)
    index = _index(path, "causal_attention")
    nb["cells"][index]["source"] = ATTENTION_WITH_HELPER
    nb["cells"].insert(index + 1, _cell(HELPER_CELL))  # after the function: a kernel has it by check time
    path = _save(nb, path)
    live = _live(nb)
    live_reports = grade(live["apply_rope"], live["causal_attention"], live["next_token_probs"])
    reports, problems = grade_notebook(path)
    assert problems == []
    assert _score(reports) == _score(live_reports) == (_full("2.1"), _full("2.1"))


def test_a_time_magic_and_other_ipython_lines_grade_as_in_the_live_notebook(tmp_path):
    path, nb = _solved("lab2_4", tmp_path)
    index = _index(path, "ttft")
    live = _live(nb)
    nb["cells"][index]["source"] = "%%time\n" + "".join(nb["cells"][index]["source"])
    other = _index(path, "devices_needed")
    nb["cells"][other]["source"] = ("%matplotlib inline\n!pip install -q nothing-at-all\n%pip list\n"
                                    "%time limit = 3\n" + "".join(nb["cells"][other]["source"]))
    reports, problems = grade_notebook(_save(nb, path))
    assert problems == []
    names = ["ttft", "tpot", "itls", "e2e", "throughput", "goodput", "devices_needed", "knee"]
    assert _score(reports) == _score(grade(*(live[n] for n in names))) == (_full("2.4"), _full("2.4"))


def test_an_error_in_a_magic_cell_names_the_cells_own_line(tmp_path):
    path, nb = _solved("lab2_4", tmp_path)
    nb["cells"].append(_cell("%%time\nx = 1\nraise ValueError('boom')\n"))
    _, problems = grade_notebook(_save(nb, path))
    assert problems == [f"cell {len(nb['cells']) - 1} could not run: ValueError: boom "
                        "(line 3: `raise ValueError('boom')`)"]


LOOPING_ADMIT = (
    "# YOUR CODE: task 2\nimport math\n\n\n"
    "def admit(waiting, running, free_blocks, block_size, max_batch_size):\n"
    "    chosen, i = [], 0\n"
    "    while i < len(waiting):\n"
    "        seq = waiting[i]\n"
    "        need = math.ceil(seq.num_tokens / block_size) - len(seq.blocks)\n"
    "        if len(running) + len(chosen) >= max_batch_size or need > free_blocks:\n"
    "            continue  # meant: break\n"
    "        chosen.append(seq)\n"
    "        free_blocks -= need\n"
    "        i += 1\n"
    "    return chosen\n")
LOOPING_PREEMPT = ("# YOUR CODE: task 3\n\n\ndef preempt(running, free_blocks, block_size):\n"
                   "    victims = []\n    while free_blocks < 1:\n        victims = victims + []\n"
                   "    return victims\n")


def test_a_function_that_loops_costs_one_check_limit_and_its_other_checks_are_not_run(tmp_path, monkeypatch):
    monkeypatch.setattr(checker, "TIME_LIMIT", 2.0)
    path, nb = _solved("lab2_3", tmp_path)
    start = time.monotonic()
    grade_notebook(_save(nb, tmp_path / "clean.ipynb"))
    clean = time.monotonic() - start
    nb["cells"][_index(path, "admit")]["source"] = LOOPING_ADMIT
    nb["cells"][_index(path, "preempt")]["source"] = LOOPING_PREEMPT
    start = time.monotonic()
    reports, problems = grade_notebook(_save(nb, path))
    elapsed = time.monotonic() - start
    by_task = {r.task: r for r in reports}
    assert by_task["finished"].all_passed and by_task["schedule_tokens"].all_passed  # the others are graded
    timed_out = [(r.task, o) for r in reports for o in r.outcomes if o.timed_out]
    assert [task for task, _ in timed_out] == ["admit", "preempt"]  # once per function, not once per check
    stopped = timed_out[0][1]
    assert re.fullmatch(r"did not finish within 2 s \(stopped at line \d+ of cell \d+: `.+`\)", stopped.detail)
    assert stopped.hint == checker.TIMEOUT_HINT
    outcomes = by_task["admit"].outcomes
    later = outcomes[outcomes.index(stopped) + 1:]
    assert later and all(o.not_run and "admit ran out of time in the check" in o.detail for o in later)
    assert all(o.not_run for o in by_task["the three rules in the simulator"].outcomes)
    assert f"admit: the check '{stopped.name}' ran out of time (did not finish within 2 s)" in problems
    # two functions that loop: two limits, and the notebook's process started again after each
    assert elapsed < 2 * 2.0 + 3 * clean + 5, (elapsed, clean)


def test_a_looping_cell_is_stopped_and_the_rest_still_runs(tmp_path):
    path, nb = _solved("lab2_3", tmp_path)
    nb["cells"].insert(3, _cell("while True:\n    pass\n"))
    reports, problems = grade_notebook(_save(nb, path), cell_seconds=2.0)
    assert _score(reports) == (_full("2.3"), _full("2.3"))
    assert len(problems) == 1 and re.fullmatch(  # the loop is caught on either of its lines
        r"cell 3 did not finish within 2 s \(stopped at line (1 of cell 3: `while True:`|2 of cell 3: `pass`)\): "
        r"it was stopped, the cells after it still ran", problems[0]), problems


FOOLING = {
    "rebinds run_task": ("import sys\n"
                         "from minillm.book.labs.checker import Outcome, Report\n"
                         "nb = sys.modules['minillm.book.labs.notebooks']\n"
                         "nb.run_task = lambda task, fns, run=None: Report(task.name, task.lab, tuple(\n"
                         "    Outcome(p.name, True, points=p.points) for p in task.properties))\n"),
    "patches the checker": ("from minillm.book.labs import checker\n"
                            "for task in checker.TASKS.values():\n"
                            "    for p in task.properties:\n"
                            "        object.__setattr__(p, 'run', lambda fns: None)\n"
                            "checker.Report.passed = property(lambda self: self.total)\n"),
    "prints a fake report": ("import os\nos.write(1, b'MINILLM-GRADE-JSON {\"reports\": [], \"problems\": []}\\n')\n"
                             "import sys\nsys.stdout = sys.__stdout__\n"),
}


@pytest.mark.parametrize("how", sorted(FOOLING))
def test_a_notebook_that_rewrites_the_grader_is_graded_on_what_its_functions_return(tmp_path, how):
    nb = _stubs("lab2_3")
    nb["cells"].append(_cell(FOOLING[how]))
    reports, problems = grade_notebook(_save(nb, tmp_path / "fool.ipynb"))
    assert _score(reports) == (0, _full("2.3")) and all(r.not_written for r in reports)
    assert any(p.startswith(f"cell {len(nb['cells']) - 1} uses ") for p in problems), problems


IGNORES_SIGNALS = ("import signal\nfor s in (signal.SIGALRM, signal.SIGUSR1, signal.SIGINT, signal.SIGTERM):\n"
                   "    signal.signal(s, signal.SIG_IGN)\n")
SLEEPING_FINISHED = ("# YOUR CODE: task 1\nimport time\n\n\ndef finished(seq, eos_token_id):\n"
                     "    time.sleep(3600)\n")


def test_a_notebook_that_ignores_signals_is_graded_within_the_limits(tmp_path, monkeypatch):
    monkeypatch.setattr(checker, "TIME_LIMIT", 2.0)
    path, nb = _solved("lab2_3", tmp_path)
    nb["cells"][_index(path, "finished")]["source"] = SLEEPING_FINISHED
    nb["cells"].insert(2, _cell(IGNORES_SIGNALS))
    start = time.monotonic()
    reports, problems = grade_notebook(_save(nb, path), notebook_seconds=60)
    assert time.monotonic() - start < 30
    finished = next(r for r in reports if r.task == "finished")
    assert finished.outcomes[0].timed_out and finished.outcomes[0].detail == "did not finish within 2 s"
    assert next(r for r in reports if r.task == "admit").all_passed
    assert any(p.startswith("cell 2 uses import signal, signal.signal") for p in problems)


def test_every_process_a_notebook_starts_is_gone_when_its_grade_is_written(tmp_path):
    pids = tmp_path / "pids"
    leak = (f"import os, subprocess, sys, time\nfound = []\n"
            "found.append(subprocess.Popen(['sleep', '300']).pid)  # in the group\n"
            "found.append(subprocess.Popen(['sleep', '301'], start_new_session=True).pid)  # out of it\n"
            "child = os.fork()\n"
            "if child == 0:  # a daemon: a new session, then a grandchild whose parent exits\n"
            "    os.setsid()\n    grandchild = os.fork()\n"
            "    if grandchild == 0:\n        time.sleep(300)\n        os._exit(0)\n"
            f"    open({str(pids / 'daemon')!r}, 'w').write(str(grandchild))\n    os._exit(0)\n"
            "os.waitpid(child, 0)\n"
            f"open({str(pids / 'direct')!r}, 'w').write(' '.join(map(str, found)))\n")
    pids.mkdir()
    nb = _stubs("lab2_3")
    nb["cells"].append(_cell(leak))
    reports, problems = grade_notebook(_save(nb, tmp_path / "leak.ipynb"))
    started = [int(p) for p in (pids / "direct").read_text().split()] + [int((pids / "daemon").read_text())]
    assert len(started) == 3 and all(_gone(pid) for pid in started), [p for p in started if not _gone(p)]
    assert _score(reports) == (0, _full("2.3"))
    assert any("os.fork" in p or "fork" in p for p in problems)


def test_a_cell_that_ends_its_process_is_skipped_and_a_function_that_does_ends_only_itself(tmp_path):
    path, nb = _solved("lab2_3", tmp_path)
    nb["cells"].insert(3, _cell("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"))
    index = _index(_save(nb, path), "preempt")
    nb["cells"][index]["source"] = ("# YOUR CODE: task 3\nimport os\n\n\n"
                                    "def preempt(running, free_blocks, block_size):\n    os._exit(7)\n")
    reports, problems = grade_notebook(_save(nb, path))
    assert problems[0] == "cell 3 ended the notebook's process (exit code -9): the cells after it still ran"
    preempt = next(r for r in reports if r.task == "preempt")
    assert preempt.outcomes[0].detail == "preempt ended the notebook's process (exit code 7)"
    assert all(o.not_run for o in preempt.outcomes[1:])
    assert next(r for r in reports if r.task == "admit").all_passed


def test_one_submission_cannot_stop_the_grading_of_the_others(tmp_path, capsys):
    good, nb = _solved("lab2_3", tmp_path)
    looping = dict(nb, cells=nb["cells"] + [_cell("while True:\n    pass\n")])
    crashing = dict(nb, cells=nb["cells"] + [_cell("import os\nos._exit(3)\n")])
    checks = dict(nb)
    checks["cells"] = [dict(c) for c in nb["cells"]]
    checks["cells"][_index(good, "admit")]["source"] = LOOPING_ADMIT
    slow = dict(nb, cells=nb["cells"] + [_cell("import time\ntime.sleep(1.5)\n") for _ in range(8)])
    paths = [_save(looping, tmp_path / "a_loops.ipynb"), _save(crashing, tmp_path / "b_crashes.ipynb"),
             _save(checks, tmp_path / "c_admit_loops.ipynb"), _save(slow, tmp_path / "d_slow.ipynb"), good]
    status = labs_cli(["grade", *map(str, paths), "--timeout", "1", "--cell-timeout", "3",
                       "--notebook-timeout", "10"])
    out = capsys.readouterr().out
    assert status == 1
    full = _full("2.3")
    assert re.search(rf"a_loops.ipynb\n(.*\n)*?  total\s+{full} / {full}\s+points", out)
    assert re.search(r"note: cell \d+ did not finish within 3 s \(stopped at line \d of cell \d+: `", out)
    assert re.search(rf"b_crashes.ipynb\n(.*\n)*?  total\s+{full} / {full}\s+points", out)
    assert "ended the notebook's process (exit code 3)" in out
    assert re.search(r"c_admit_loops.ipynb\n  finished\s+8 / 8\s+points", out)
    assert "admit: the check 'never lets running + admitted exceed max_batch_size' ran out of time" in out
    assert "d_slow.ipynb: NOT GRADED: its time ran out (the notebook limit)" in out
    assert re.search(rf"{re.escape(str(good))}\n(.*\n)*?  total\s+{full} / {full}\s+points  \(100%\)", out)


def test_the_timeout_flag_holds_for_its_own_call_only(capsys):
    """The command line called in a process (as these tests do) leaves the checker's limit as it found it."""
    before = checker.TIME_LIMIT
    assert labs_cli(["grade", "any.ipynb", "--timeout", str(before + 7), "--lab", "9.9"]) == 2
    assert "--lab 9.9: no such lab" in capsys.readouterr().err
    assert checker.TIME_LIMIT == before


def test_csv_and_json_give_each_notebook_its_points_tasks_and_notes(tmp_path, capsys):
    good, nb = _solved("lab2_4", tmp_path)
    broken = dict(nb, cells=nb["cells"] + [_cell("raise RuntimeError('oops')")])
    paths = [str(good), str(_save(broken, tmp_path / "broken.ipynb")), str(LABS["lab2_4"])]
    assert labs_cli(["grade", *paths, "--csv", str(tmp_path / "class.csv"), "--json", str(tmp_path / "class.json"),
                     "--lab", "2.4"]) == 0
    rows = list(csv.DictReader(io.StringIO((tmp_path / "class.csv").read_text())))
    full = _full("2.4")
    assert [(r["notebook"], r["status"], int(r["points"]), int(r["max_points"])) for r in rows] == [
        (paths[0], "graded", full, full), (paths[1], "graded", full, full), (paths[2], "graded", 0, full)]
    assert rows[0]["goodput"] == str(sum(p.points for p in checker.TASKS["goodput"].properties))
    assert rows[1]["notes"].startswith(f"cell {len(nb['cells'])} could not run: RuntimeError: oops")
    data = json.loads((tmp_path / "class.json").read_text())
    assert [d["points"] for d in data] == [full, full, 0]
    assert data[2]["reports"][0]["outcomes"][0]["not_written"] is True
    assert "total" in capsys.readouterr().out


def test_lab_grades_the_assigned_lab_and_names_the_one_submitted(tmp_path, capsys):
    path, _ = _solved("lab2_1", tmp_path)
    reports, problems = grade_notebook(path, lab="2.3")
    assert [r.task for r in reports] == [t.name for t in checker.lab_tasks("2.3")]
    assert all(o.detail.endswith("not found in the notebook") for r in reports for o in r.outcomes)
    assert problems == ["it also defines functions of lab 2.1, not graded (--lab 2.3)"]
    assert labs_cli(["grade", str(path), "--lab", "9.9"]) == 2
    assert "no such lab" in capsys.readouterr().err


REFERENCE_CELLS = {
    "importlib": ("import importlib\nsampling = importlib.import_module('mini' + 'llm.sampling')\n\n\n"
                  "def next_token_probs(logits, temperature, top_k, top_p):\n"
                  "    params = sampling.SamplingParams(temperature, top_k, top_p)\n"
                  "    return sampling.filtered_probs(logits, params)\n", "import importlib"),
    "__import__": ("def next_token_probs(logits, temperature, top_k, top_p):\n"
                   "    s = __import__('minillm.sampling', fromlist=['x'])\n"
                   "    return s.filtered_probs(logits, s.SamplingParams(temperature, top_k, top_p))\n",
                   "__import__()"),
    "sys.modules": ("import sys\nimport minillm.sampling  # noqa\n\n\n"
                    "def next_token_probs(logits, temperature, top_k, top_p):\n"
                    "    s = sys.modules['minillm.sampling']\n"
                    "    return s.filtered_probs(logits, s.SamplingParams(temperature, top_k, top_p))\n",
                    "sys.modules"),
}


@pytest.mark.parametrize("how", sorted(REFERENCE_CELLS))
def test_reference_code_is_flagged_however_it_is_reached(tmp_path, how):
    path, nb = _solved("lab2_1", tmp_path)
    source, reach = REFERENCE_CELLS[how]
    index = _index(path, "next_token_probs")
    nb["cells"][index]["source"] = "# YOUR CODE: task 4\n" + source
    reports, problems = grade_notebook(_save(nb, path))
    assert _score(reports) == (_full("2.1"), _full("2.1"))
    assert problems[0] == ("next_token_probs called minillm.sampling.filtered_probs: the checks compare with "
                           "minillm, so these points prove nothing; read the cell")
    assert problems[1].startswith(f"cell {index} uses {reach}")


def test_reference_code_hidden_from_the_watch_is_flagged_by_the_grader_itself(tmp_path):
    path, nb = _solved("lab2_1", tmp_path)
    index = _index(path, "next_token_probs")
    nb["cells"][index]["source"] = (
        "# YOUR CODE: task 4\nimport sys\nfrom minillm.sampling import SamplingParams, filtered_probs\n\n\n"
        "def next_token_probs(logits, temperature, top_k, top_p):\n"
        "    watch = sys.getprofile()\n    sys.setprofile(None)  # the watch cannot see what follows\n"
        "    try:\n        return filtered_probs(logits, SamplingParams(temperature, top_k, top_p))\n"
        "    finally:\n        sys.setprofile(watch)\n")
    _, problems = grade_notebook(_save(nb, path))
    assert problems == [f"cell {index} uses sys.setprofile: such code can hide what a function calls or outlive "
                        "the cells; the grade is computed outside the notebook, but read the cell"]


def test_a_reference_function_itself_is_flagged(tmp_path):
    path, nb = _solved("lab2_4", tmp_path)
    index = _index(path, "ttft")
    nb["cells"][index]["source"] += "\n\nfrom minillm.analysis.metrics import ttft  # noqa\n"
    _, problems = grade_notebook(_save(nb, path))
    assert problems == ["ttft is minillm.analysis.metrics.ttft itself: the checks compare with minillm, so "
                        "these points prove nothing; read the cell",
                        "goodput called minillm.analysis.metrics.ttft: the checks compare with minillm, so "
                        "these points prove nothing; read the cell"]  # goodput calls the ttft it sees


def test_check_tells_the_learner_in_the_live_notebook(capsys):
    from minillm.analysis.metrics import e2e_latency

    def e2e(request):
        return e2e_latency(request)

    checker.check(e2e)
    out = capsys.readouterr().out
    assert "e2e: 2 of 2 checks pass" in out and "well done" not in out
    assert "note: e2e called minillm.analysis.metrics.e2e_latency: the checks compare with minillm" in out


def test_the_labs_own_objects_are_not_reference_code():
    from minillm.book.labs.lab2_3 import _seq

    def finished(seq, eos_token_id):  # seq.num_tokens is a property of the lab's Seq
        return seq.num_tokens - seq.prompt_len >= seq.max_tokens or (
            not seq.ignore_eos and seq.output[-1] == eos_token_id)

    assert finished(_seq(0, 3, output=1, max_tokens=1), 2)
    reports = grade(finished)
    assert reports[0].all_passed and reports[0].reference_uses == ()


def test_checks_and_scores_left_in_cells_raise_no_note_and_print_nothing(tmp_path, capsys):
    path, nb = _solved("lab2_2", tmp_path)
    index = _index(path, "write_kv")
    nb["cells"][index]["source"] += ("\n\nfrom minillm.book.labs import check, score\n"
                                     "check(write_kv)\nscore(write_kv)\nprint('debugging')\n")
    reports, problems = grade_notebook(_save(nb, path))
    assert problems == [] and _score(reports) == (_full("2.2"), _full("2.2"))
    assert capsys.readouterr().out == ""


def test_a_cell_tagged_skip_grading_does_not_run(tmp_path):
    path, nb = _solved("lab2_3", tmp_path)
    nb["cells"].append(dict(_cell("raise RuntimeError('not for the grader')"), metadata={"tags": ["skip-grading"]}))
    _, problems = grade_notebook(_save(nb, path))
    assert problems == []


def test_a_notebook_whose_time_runs_out_is_not_graded_and_leaves_nothing_behind(tmp_path):
    nb = _stubs("lab2_3")
    nb["cells"].append(_cell("import subprocess, time\nsubprocess.Popen(['sleep', '300'])\ntime.sleep(300)\n"))
    before = {p for p in os.listdir("/proc") if p.isdigit()}
    with pytest.raises(NotGraded, match="its time ran out"):
        grade_notebook(_save(nb, tmp_path / "slow.ipynb"), cell_seconds=60, notebook_seconds=4)
    sleepers = [p for p in set(os.listdir("/proc")) - before if p.isdigit() and _cmdline(p).startswith("sleep")]
    assert sleepers == []


def _cmdline(pid: str) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


# --- the wire: what travels between the grader and the notebook's process ------------------------------------

def _round_trip(value, mutate=lambda v: None, result=lambda v: None):
    """``value`` sent, changed by ``mutate`` on the other side, sent back with ``result``: what the sender
    then holds (its own objects, updated in place) and the result it decodes."""
    encoder = wire.Encoder(checker.describe)
    data = encoder.encode(value)
    blobs = encoder.blobs
    theirs = wire.Decoder(blobs)
    copy = theirs.decode(data)
    mutate(copy)
    back = wire.Encoder(checker.describe, theirs.received)
    reply = back.encode((result(copy), copy))
    return wire.Decoder(back.blobs, dict(enumerate(encoder.objects))).decode(reply)


def test_the_wire_updates_the_senders_own_objects_in_place():
    cache = torch.zeros(2, 3)
    seqs = [Seq(0, 5, 10), Seq(1, 7, 10)]
    args = [cache, list(seqs)]

    def mutate(copy):
        copy[0][1, 2] = 5.0  # write_kv writes into the cache it was given
        copy[1][0].output.append(9)  # a rule changes a sequence

    result, back = _round_trip(args, mutate, result=lambda copy: [copy[1][1]])  # admit returns a sequence
    assert back is args and cache[1, 2] == 5.0 and seqs[0].output == [9]
    assert result[0] is seqs[1]  # the grader's own object, so identity checks hold


def test_the_wire_carries_numbers_and_describes_what_it_does_not_carry():
    value = [1, 2.5, float("nan"), True, None, "x", (3, 4), {"a": [1]}, numpy.int64(3), numpy.float32(0.5),
             torch.tensor([1, 2], dtype=torch.bfloat16), object()]
    _, back = _round_trip(value)
    assert back[:2] == [1, 2.5] and back[2] != back[2] and back[3:8] == [True, None, "x", (3, 4), {"a": [1]}]
    assert type(back[8]) is numpy.int64 and type(back[9]) is numpy.float32
    assert back[10].dtype == torch.bfloat16 and back[10].tolist() == [1.0, 2.0]
    assert checker.describe(back[11]) == "an object" and isinstance(back[11], wire.Opaque)


def test_the_wire_refuses_unknown_classes_and_oversized_messages():
    with pytest.raises(wire.WireError, match="unknown class"):
        wire.Decoder([]).decode({"id": 0, "kind": "object", "object": "os.system", "fields": {}})
    with pytest.raises(wire.WireError, match="not sent"):
        wire.Decoder([], {}).decode({"id": 0, "kind": "list", "list": [], "theirs": 3})
    import socket
    import struct
    a, b = socket.socketpair()
    a.sendall(struct.pack("!QI", wire.MAX_BYTES + 1, 0))
    with pytest.raises(wire.WireError, match="limit"):
        wire.receive(b, time.monotonic() + 5)

