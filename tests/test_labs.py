"""The labs: stubs as committed fail every check, the reference solutions pass every one, and the
checker's reports (scores, wrong types, exceptions) read as the learner needs them."""
from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import pathlib
import re

import pytest
import torch

from minillm import ByteTokenizer, build_model
from minillm.book.labs import TASKS, check, function_names, grade, lab2_1, lab2_2, lab2_3, lab2_4, lab2_5, lab2_6
from minillm.book.labs.__main__ import main as labs_cli
from minillm.book.labs.batching import Spec, simulate
from minillm.book.labs.cells import defined_names, functions_from_notebook, lab_cells
from minillm.book.labs.checker import lab_tasks
from minillm.book.labs.notebooks import grade_notebook
from minillm.config import ModelConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
LABS = sorted((ROOT / "book" / "labs").glob("lab*.ipynb"))
IDS = {path: re.match(r"lab(\d)_(\d)_", path.name).expand(r"\1.\2") for path in LABS}


def _load(path: pathlib.Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def solutions(lab: str):
    """The reference solutions of lab "2.N" as {name: function}."""
    module = _load(ROOT / "instructor" / "solutions" / f"lab{lab.replace('.', '_')}.py", f"solution_{lab}")
    return {name: getattr(module, name) for name in function_names(lab)}


APPLY = _load(ROOT / "instructor" / "apply_solutions.py", "apply_solutions")


def test_there_is_one_lab_per_notebook():
    assert {"2.1", "2.2", "2.3", "2.4", "2.5", "2.6"} <= set(IDS.values())
    assert sorted(IDS.values()) == sorted({t.lab for t in TASKS.values()})


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.name)
def test_notebook_holds_the_untouched_stubs(path):
    """Each lab function is defined once, in a stub cell whose body is only `raise NotImplementedError`
    (after its docstring), with the reference solution's signature."""
    lab = IDS[path]
    functions, problems = functions_from_notebook(path)
    assert not problems
    assert sorted(functions) == sorted(function_names(lab))
    reference = solutions(lab)
    defined = [name for _, source in lab_cells(path) for name in defined_names(source)]
    assert sorted(defined) == sorted(function_names(lab)), "each function once, in a cell of its own lab"
    for index, source in lab_cells(path):
        assert source.startswith("# YOUR CODE: task"), f"cell {index} is not marked as a stub"
        for node in (n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)):
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            assert ast.unparse(body[0]) == "raise NotImplementedError" and len(body) == 1, node.name
    for name, stub in functions.items():
        assert inspect.signature(stub) == inspect.signature(reference[name]), name


@pytest.mark.slow  # grades the notebook in a subprocess
@pytest.mark.parametrize("path", LABS, ids=lambda p: p.name)
def test_every_checker_fails_on_the_stubs(path):
    reports, problems = grade_notebook(path)
    assert not problems
    assert [r.task for r in reports] == [t.name for t in lab_tasks(IDS[path])]
    for report in reports:
        assert report.passed == 0 and report.total >= 2, report.task
        assert report.not_written, report.text()


@pytest.mark.parametrize("lab", [pytest.param(lab, marks=pytest.mark.slow) if lab == "2.5" else lab  # SmolLM2
                                 for lab in sorted(set(IDS.values()))])
def test_every_checker_passes_on_the_reference_solutions(lab):
    reports = grade(**solutions(lab))
    assert [r.task for r in reports] == [t.name for t in lab_tasks(lab)]
    failing = [r.text() for r in reports if not r.all_passed]
    assert not failing, "\n".join(failing)


@pytest.mark.slow  # grades the notebook in a subprocess
@pytest.mark.parametrize("path", LABS, ids=lambda p: p.name)
def test_solved_copy_of_the_notebook_scores_full_marks(path, tmp_path):
    out = tmp_path / path.name
    assert APPLY.apply(path, out) == len(lab_cells(path))
    reports, problems = grade_notebook(out)
    assert not problems
    assert sum(r.points for r in reports) == sum(r.max_points for r in reports) == sum(
        p.points for t in lab_tasks(IDS[path]) for p in t.properties)
    committed = json.loads(path.read_text(encoding="utf-8"))["cells"]
    solved = json.loads(out.read_text(encoding="utf-8"))["cells"]
    stubs = {index for index, _ in lab_cells(path)}
    assert [c["source"] for i, c in enumerate(solved) if i not in stubs] == [
        c["source"] for i, c in enumerate(committed) if i not in stubs], "only the stub cells change"


# --- what the learner reads ---------------------------------------------------------------------------

def _learner_code(source: str, name: str):
    """Define a function from source compiled as a notebook cell (so its lines are 'your cell')."""
    import linecache

    filename = "<learner cell>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"torch": torch}
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]


def test_a_wrong_type_is_one_readable_sentence(capsys):
    def next_token_probs(logits, temperature, top_k, top_p):
        return logits.tolist()

    report = grade(next_token_probs)[0]
    assert report.passed == 0
    assert report.outcomes[1].detail == ("next_token_probs returned a list of length 2; expected a "
                                         "torch.Tensor of shape (2, 50)")
    check(next_token_probs)
    printed = capsys.readouterr().out
    assert "Traceback" not in printed and "FAIL" in printed and "hint: " in printed
    assert max(len(line) for line in printed.splitlines()) <= 90


def test_a_missing_return_says_so():
    def finished(seq, eos_token_id):
        len(seq.output) >= seq.max_tokens  # noqa: B015 - the learner's bug under test: no return

    detail = grade(finished)[0].outcomes[0].detail
    assert detail == "finished returned None; expected True or False (is a return statement missing?)"


def test_an_exception_names_the_learners_own_line():
    source = ("def ttft(request):\n"
              "    first = request.token_times[0]\n"
              "    return first / 0\n")
    report = grade(_learner_code(source, "ttft"))[0]
    assert report.outcomes[0].detail == ("ttft raised ZeroDivisionError: float division by zero "
                                         "(line 3 of your cell: `return first / 0`)")


def test_an_exception_inside_torch_points_at_the_learners_line_not_torch():
    source = ("def causal_attention(q, k, v, positions):\n"
              "    scores = q @ k  # forgot the transpose\n"
              "    return scores @ v\n")
    report = grade(_learner_code(source, "causal_attention"))[0]
    detail = report.outcomes[0].detail
    assert detail.startswith("causal_attention raised RuntimeError: ")
    assert detail.endswith("(line 2 of your cell: `scores = q @ k  # forgot the transpose`)")


def test_scores_count_the_properties_that_hold_and_the_central_ones_weigh_more():
    def finished(seq, eos_token_id):
        return len(seq.output) >= seq.max_tokens  # forgets EOS

    report = grade(finished)[0]
    assert (report.passed, report.total) == (5, 6) and (report.points, report.max_points) == (7, 8)
    assert [o.name for o in report.outcomes if not o.passed] == ["finished when its last token is EOS"]
    assert report.outcomes[3].detail == "3 of 5 tokens, the last one EOS: finished says False; expected True"
    assert report.outcomes[3].bug == "finished.no_eos"

    def admit(waiting, running, free_blocks, block_size, max_batch_size):  # one slot too many: a central check
        chosen = []
        for seq in waiting:
            need = -(-seq.num_tokens // block_size) - len(seq.blocks)
            if len(running) + len(chosen) > max_batch_size or need > free_blocks:
                break
            chosen.append(seq)
            free_blocks -= need
        return chosen

    loose = grade(admit)[0]
    earned = sum(o.points for o in loose.outcomes if o.passed)
    assert loose.capped and (earned, loose.points, loose.max_points) == (7, 5, 10)
    assert "A central check fails, so this task scores at most half its points." in loose.text()

    solved = solutions("2.1")

    def causal_attention(q, k, v, positions):  # forgets the 1 / sqrt(D) scale
        return solved["causal_attention"](q * q.shape[-1] ** 0.5, k, v, positions)

    reports = grade(solved["apply_rope"], causal_attention)
    by_task = {r.task: [o.passed for o in r.outcomes] for r in reports}
    assert by_task["apply_rope"] == [True] * 7
    assert by_task["causal_attention"] == [True, True, False, True, False, False, False, False]
    assert by_task["attention inside the tiny model"] == [False] * 3
    assert {o.bug for r in reports for o in r.outcomes if not o.passed} <= {"attention.no_scale", None}


def test_score_prints_one_line_per_task_and_the_total(capsys):
    from minillm.book.labs import score

    fns = solutions("2.3")

    def preempt(running, free_blocks, block_size):
        return []

    score(fns["finished"], fns["admit"], preempt)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Lab 2.3 score"
    assert [line.split()[0] for line in lines[1:]] == ["finished", "admit", "preempt", "the", "total"]
    # only "an empty list when every sequence fits" holds: 1 of 6 points, not capped below that
    assert re.search(r"preempt\s+1 / 6\s+points  \(1 of 4 checks\)$", lines[3])
    # roomy pool (central), FCFS order and continuous < static hold; the tight pool (central) fails, so
    # the task scores at most half of its 10 points, and does: 3 + 1 + 1
    assert re.search(r"the three rules in the simulator\s+5 / 10\s+points  \(3 of 6 checks\)$", lines[4])
    assert re.search(r"total\s+24 / 34\s+points  \(71%\)$", lines[-1])


def test_misuse_of_check_is_a_message_not_an_exception(capsys):
    check(42)
    check(lambda x: x)
    printed = capsys.readouterr().out
    assert "check takes your lab functions" in printed and "got an int" in printed
    assert "no lab has a function named '<lambda>'" in printed


# --- the simulator and the payoffs -------------------------------------------------------------------

def test_the_simulator_does_not_trust_the_rules():
    fns = solutions("2.3")
    specs = [Spec(30, 20) for _ in range(6)]
    limits = {"num_blocks": 12, "block_size": 8, "max_batch_size": 4}

    def admit(waiting, running, free_blocks, block_size, max_batch_size):
        return list(waiting)  # everyone, whatever fits

    greedy = simulate(specs, admit, fns["finished"], fns["preempt"], **limits)
    assert greedy.violations == ["step 0: admit let the batch grow to 6 sequences (limit 4)"]

    def never_evict(running, free_blocks, block_size):
        return []

    stuck = simulate(specs, fns["admit"], fns["finished"], never_evict, **limits)
    assert len(stuck.violations) == 1 and "after preempt, the running sequences still need" in stuck.violations[0]
    good = simulate(specs, fns["admit"], fns["finished"], fns["preempt"], **limits)
    assert good.complete and good.preemptions > 0 and good.peak_blocks <= 12


def test_payoffs_wait_for_the_checks_then_run(capsys):
    fns = solutions("2.3")

    def finished(seq, eos_token_id):
        raise NotImplementedError

    assert lab2_3.compare_policies(fns["admit"], finished, fns["preempt"]) is None
    assert capsys.readouterr().out.startswith("Not yet: this cell runs once finished, admit, preempt pass")
    runs = lab2_3.compare_policies(fns["admit"], fns["finished"], fns["preempt"])
    assert all(r.complete for r in runs.values())
    assert runs["continuous, roomy"].steps < runs["static, roomy"].steps
    assert runs["continuous, tight"].preemptions > 0


def test_payoffs_with_the_reference_solutions_on_the_tiny_model(capsys):
    model, tok = build_model("tiny"), ByteTokenizer()
    one, two, four = solutions("2.1"), solutions("2.2"), solutions("2.4")
    lab2_1.write_text(model, tok, *one.values(), "Hello", max_new_tokens=8)
    lab2_2.compare_generation(model, tok, two["write_kv"], two["read_kv"], two["kv_cache_bytes"],
                              ["Hi", "A longer prompt", "Mid"], max_new_tokens=6)
    lab2_2.formula_table(two["kv_cache_bytes"])
    out = capsys.readouterr().out
    assert "the two agree on 8 of 8 tokens" in out
    assert out.count("equal to naive generation") == 3
    allocated = re.search(r"allocated: ([\d,]+) B; your formula: ([\d,]+) B; "
                          r"minillm.analysis.arithmetic: ([\d,]+) B", out)
    assert len(set(allocated.groups())) == 1
    assert re.search(r"LLaMA-7B\s+2048\s+2\s+1,073,741,824\s+1\.074\s+1\.000", out)

    from minillm.analysis.workload import random_requests
    from minillm.engine import Engine, EngineConfig

    run = Engine(model, EngineConfig(max_batch_size=4, num_blocks=32, block_size=8)).run(
        random_requests(6, (4, 12), (1, 6), seed=0))
    metric_fns = {k: v for k, v in four.items() if k not in ("devices_needed", "knee")}
    measured = lab2_4.compare_metrics(run.requests, run.wall_time, 1.0, 0.5, **metric_fns)
    assert "your metrics agree with minillm.analysis.metrics" in capsys.readouterr().out
    assert lab2_4.compare_plan(four["devices_needed"], 100, 0.2, measured["output tokens / s"],
                               46080 * 1024, 8 * 10**9) == lab2_4._reference_devices(
        100, 0.2, measured["output tokens / s"], 46080 * 1024, 8 * 10**9)


def test_lab_2_2_pool_map_shows_each_row_in_its_blocks_in_table_order(capsys):
    lab2_2.pool_map(solutions("2.2")["write_paged"])
    out = capsys.readouterr().out
    assert "physical block 7: 0:0  0:1  0:2  0:3" in out  # row 0's first block
    assert "physical block 2: 0:4  0:5    .    ." in out  # its second, 2 slots free
    assert "physical block 0: 1:8    .    .    ." in out and "physical block 5: 2:0  2:1  2:2    ." in out
    assert out.count("physical block") == 10 and "physical block 1:   .    .    .    ." in out


def test_lab_2_2_paged_payoff_evicts_rows_and_still_matches_naive_generation(capsys):
    two = solutions("2.2")
    lab2_2.compare_paged(build_model("tiny"), ByteTokenizer(), two["write_paged"], two["read_paged"],
                         two["make_room"], ["Hi there", "A cache", "Once upon a time"], num_blocks=12)
    out = capsys.readouterr().out
    evictions = int(re.search(r"a pool of 12 blocks; (\d+) eviction", out).group(1))
    assert evictions > 0 and out.count("equal to naive generation") == 3


def test_lab_2_3_payoff_adds_a_chunked_run_once_schedule_tokens_passes(capsys):
    fns = solutions("2.3")
    runs = lab2_3.compare_policies(fns["admit"], fns["finished"], fns["preempt"], fns["schedule_tokens"])
    chunked = runs[f"chunked {lab2_3.BUDGET}, roomy"]
    assert chunked.complete and max(chunked.tokens_per_step) == lab2_3.BUDGET and chunked.decode_waits == 0
    assert max(runs["continuous, roomy"].tokens_per_step) > lab2_3.BUDGET  # whole prompts in one step
    assert f"chunked {lab2_3.BUDGET}, roomy" in capsys.readouterr().out


def test_lab_2_6_payoffs_speculate_with_the_learners_rules(capsys):
    six = solutions("2.6")
    lab2_6.speculate(build_model("tiny"), ByteTokenizer(), six["accept_greedy"], "abcabcabcabcabcab", k=4,
                     max_new_tokens=12)
    lab2_6.sampled_rounds(six["accept_sampled"], rounds=1000)
    out = capsys.readouterr().out
    assert "12 tokens, the same tokens as plain greedy decoding" in out
    assert float(re.search(r"chi-square p-value of your rounds against p: ([\d.e-]+)", out).group(1)) > 1e-4


def test_lab_2_4_knee_of_a_measured_sweep(capsys):
    capacity, sweep = lab2_4.rate_sweep(build_model("tiny"), loads=(0.25, 0.5, 2.0), n=32)
    assert capacity > 0 and len(sweep) == 3 and all(o > 0 and c > 0 for o, c in sweep)
    knee = lab2_4.compare_knee(solutions("2.4")["knee"], capacity, sweep)
    assert knee == lab2_4._reference_knee(sweep) and "(same)" in capsys.readouterr().out


def test_lab_2_5_payoff_runs_the_learners_weights_in_minillms_kernels(capsys):
    """The learner's quantized weights go into Int8Linear and Int4Linear; the bytes of each model are the
    learner's count, the bound and the rate the learner's functions."""
    model, tok = build_model(ModelConfig(d_ff=512)), ByteTokenizer()  # int4 groups need widths of 32k
    five = solutions("2.5")
    models = lab2_5.quantized_models(model, five["quantize_int8"], five["quantize_int4"])
    ids = torch.arange(24)[None]  # (1, 24)
    with torch.inference_mode():
        reference = model(ids).float()
        for name in ("int8 (yours)", "int4 (yours)"):
            error = (models[name](ids).float() - reference).norm() / reference.norm()
            assert error < (0.05 if "int8" in name else 0.25), (name, float(error))
    lab2_5.compare_quality(models, tok, "A short passage of text to score.", prompt="Hi", n=4)
    speeds = lab2_5.compare_speed(models, tok, five["bytes_per_step"], five["predict_tokens_per_s"],
                                  five["decode_tokens_per_s"], bandwidth=10e9, n=5, prompt="Hi")
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines() if line.split()[0] in ("float32", "int8", "int4")] \
        == ["float32", "int8", "int4"] * 2
    for name, m in models.items():
        bound, measured = speeds[name]
        assert bound == 10e9 / lab2_5.expected_bytes(m, len(tok.encode("Hi")) + 5 // 2) and measured > 0


@pytest.mark.slow  # grades the notebooks in subprocesses
def test_grading_a_saved_notebook_from_the_command_line(capsys, tmp_path):
    path = LABS[0]
    solved = tmp_path / path.name
    APPLY.apply(path, solved)
    assert labs_cli(["grade", str(path), str(solved)]) == 0
    out = capsys.readouterr().out
    full = sum(p.points for t in lab_tasks("2.1") for p in t.properties)
    assert re.search(rf"total\s+0 / {full}\s+points  \(0%\)", out)
    assert re.search(rf"total\s+{full} / {full}\s+points  \(100%\)", out)


@pytest.mark.slow  # grades the notebook in a subprocess
def test_grader_notes_a_lab_cell_that_calls_minillm(tmp_path):
    path = next(p for p in LABS if p.name.startswith("lab2_1"))
    nb = json.loads(path.read_text(encoding="utf-8"))
    index = next(i for i, _ in lab_cells(path) if "def next_token_probs" in _)
    nb["cells"][index]["source"] = (
        "# YOUR CODE: task 4\nfrom minillm.sampling import SamplingParams, filtered_probs\n\n\n"
        "def next_token_probs(logits, temperature, top_k, top_p):\n"
        "    return filtered_probs(logits, SamplingParams(temperature, top_k, top_p))\n")
    copied = tmp_path / path.name
    copied.write_text(json.dumps(nb), encoding="utf-8")
    reports, notes = grade_notebook(copied)
    assert notes == ["next_token_probs called minillm.sampling.filtered_probs: the checks compare with minillm, "
                     "so these points prove nothing; read the cell"]
    assert next(r for r in reports if r.task == "next_token_probs").all_passed


def test_the_instructor_guide_gives_each_labs_points():
    guide = (ROOT / "book" / "instructor_guide.md").read_text(encoding="utf-8")
    for path, lab in IDS.items():
        row = re.search(rf"^\| \[Lab {re.escape(lab)}\]\(labs/{path.stem}\.ipynb\) \| [^|]+ \| (\d+) \|$", guide,
                        flags=re.M)
        assert row, f"no points row for lab {lab}"
        assert int(row.group(1)) == sum(p.points for t in lab_tasks(lab) for p in t.properties)
