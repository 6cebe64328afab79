"""The grader is the notebook: the score of a saved notebook equals the live notebook's (helper cells,
magics), a looping check is stopped and reported, one bad submission cannot stop the others, minillm's
reference code is flagged however it is reached, and nothing raises a false note."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import re

import pytest

from minillm.book.labs import checker, grade
from minillm.book.labs.__main__ import main as labs_cli
from minillm.book.labs.notebooks import grade_notebook, lab_cells

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
    return sum(r.passed for r in reports), sum(r.total for r in reports)


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
    assert _score(reports) == _score(live_reports) == (27, 27)


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
    assert _score(reports) == _score(grade(*(live[n] for n in names))) == (27, 27)


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


def test_a_check_that_never_ends_is_stopped_and_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(checker, "TIME_LIMIT", 2.0)
    path, nb = _solved("lab2_3", tmp_path)
    nb["cells"][_index(path, "admit")]["source"] = LOOPING_ADMIT
    reports, problems = grade_notebook(_save(nb, path))
    by_task = {r.task: r for r in reports}
    assert by_task["finished"].all_passed and by_task["preempt"].all_passed  # the others are graded
    admit = by_task["admit"]
    assert admit.timed_out and not admit.all_passed
    stopped = next(o for o in admit.outcomes if o.timed_out)
    assert stopped.detail.startswith("did not finish within 2 s (stopped at line ")
    assert "`" in stopped.detail and stopped.hint == checker.TIMEOUT_HINT
    assert f"admit: the check '{stopped.name}' ran out of time (did not finish within 2 s)" in problems


def test_one_submission_cannot_stop_the_grading_of_the_others(tmp_path, capsys):
    good, nb = _solved("lab2_3", tmp_path)
    looping = dict(nb, cells=nb["cells"] + [_cell("while True:\n    pass\n")])
    crashing = dict(nb, cells=nb["cells"] + [_cell("import os\nos._exit(3)\n")])
    checks = dict(nb)
    checks["cells"] = [dict(c) for c in nb["cells"]]
    checks["cells"][_index(good, "admit")]["source"] = LOOPING_ADMIT
    paths = [_save(looping, tmp_path / "a_loops.ipynb"), _save(crashing, tmp_path / "b_crashes.ipynb"),
             _save(checks, tmp_path / "c_admit_loops.ipynb"), good]
    status = labs_cli(["grade", *map(str, paths), "--timeout", "1", "--cell-timeout", "60",
                       "--notebook-timeout", "30"])
    out = capsys.readouterr().out
    assert status == 1
    assert re.search(r"a_loops.ipynb: NOT GRADED: grading stopped after 30 s", out)
    assert "b_crashes.ipynb: NOT GRADED: the grading process ended with exit code 3" in out
    assert re.search(r"c_admit_loops.ipynb\n  finished\s+6 / 6\n(.*\n)*?  preempt\s+4 / 4\n", out)
    assert ("admit: the check 'admits only what the free blocks hold' ran out of time (did not finish within "
            "1 s)") in out
    assert re.search(rf"{re.escape(str(good))}\n(.*\n)*?  total\s+22 / 22  \(100%\)", out)


def test_a_looping_cell_is_stopped_and_the_rest_still_runs(tmp_path):
    path, nb = _solved("lab2_3", tmp_path)
    nb["cells"].insert(3, _cell("while True:\n    pass\n"))
    reports, problems = grade_notebook(_save(nb, path), cell_seconds=2.0)
    assert _score(reports) == (22, 22)
    assert len(problems) == 1 and problems[0].startswith("cell 3 did not finish within 2 s (stopped at line")


REFERENCE_CELLS = {
    "importlib": ("import importlib\nsampling = importlib.import_module('mini' + 'llm.sampling')\n\n\n"
                  "def next_token_probs(logits, temperature, top_k, top_p):\n"
                  "    params = sampling.SamplingParams(temperature, top_k, top_p)\n"
                  "    return sampling.filtered_probs(logits, params)\n"),
    "__import__": ("def next_token_probs(logits, temperature, top_k, top_p):\n"
                   "    s = __import__('minillm.sampling', fromlist=['x'])\n"
                   "    return s.filtered_probs(logits, s.SamplingParams(temperature, top_k, top_p))\n"),
    "sys.modules": ("import sys\nimport minillm.sampling  # noqa\n\n\n"
                    "def next_token_probs(logits, temperature, top_k, top_p):\n"
                    "    s = sys.modules['minillm.sampling']\n"
                    "    return s.filtered_probs(logits, s.SamplingParams(temperature, top_k, top_p))\n"),
}


@pytest.mark.parametrize("how", sorted(REFERENCE_CELLS))
def test_reference_code_is_flagged_however_it_is_reached(tmp_path, how):
    path, nb = _solved("lab2_1", tmp_path)
    nb["cells"][_index(path, "next_token_probs")]["source"] = "# YOUR CODE: task 4\n" + REFERENCE_CELLS[how]
    reports, problems = grade_notebook(_save(nb, path))
    assert _score(reports) == (27, 27)
    assert problems == ["next_token_probs called minillm.sampling.filtered_probs: the checks compare with "
                        "minillm, so these points prove nothing; read the cell"]


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
    assert "e2e: 2 of 2 checks pass." in out and "well done" not in out
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
    assert problems == [] and _score(reports) == (23, 23)
    assert capsys.readouterr().out == ""


def test_a_cell_tagged_skip_grading_does_not_run(tmp_path):
    path, nb = _solved("lab2_3", tmp_path)
    nb["cells"].append(dict(_cell("raise RuntimeError('not for the grader')"), metadata={"tags": ["skip-grading"]}))
    _, problems = grade_notebook(_save(nb, path))
    assert problems == []
