"""``python -m course grade`` and ``progress`` on real student notebooks: each gets exactly the
verdicts it earned, whatever it says about itself.

Three groups, each graded by one call (one judge, one kernel per notebook):

* notebook 01 as a student hands it in (built from notebooks/ and solutions/): solved,
  untouched, wrong answers, and two that tamper (``check`` redefined and stored outputs
  edited; ``course`` patched and the check cells deleted);
* notebook 15 (Part III, ranks in its checks): a student copy with one exercise solved, two
  wrong, and ``course`` patched so that every check says ✅ (✅ outputs stored too);
* small notebooks with 01's answers, graded with a 3 s cell limit, two at a time: one that hangs (interrupted,
  the rest still graded), one that hangs and ignores the interrupt, one whose kernel dies, one
  whose answer attacks the checker when the check calls it.

Marked slow (1-4 minutes of kernels and time limits on 2 cores): ``pytest`` leaves them
out, ``.ci/run`` runs them after it; run them with ``pytest -m slow tests/test_grading.py``.
The fast tests at the end run in ``pytest``.
"""

import contextlib
import csv
import io
import re
import signal
import sys
from pathlib import Path

import nbformat
import pytest

from course.classroom import grading, report, runner, sandbox, submissions
from course.__main__ import main
from course.classroom.notebooks import ROOT

STUDENT = nbformat.read(ROOT / "notebooks" / "01_single_device.ipynb", as_version=4)
SOLUTION = nbformat.read(ROOT / "solutions" / "01_single_device.ipynb", as_version=4)
EXERCISES = ["weight_grad", "chunk_mean_grad", "chunk_loss"]

# 01's exercises, answered wrongly in ways its checks name
WRONG = {
    "c06": "def weight_grad(model, x, y):\n    return 2 * (model(x) - y).T @ x / len(x)",  # forgets the outputs
    "c09": "def chunk_mean_grad(model, x, y, n_chunks):\n"
           "    grads = []\n"
           "    for xc, yc in zip(x.chunk(n_chunks), y.chunk(n_chunks)):\n"
           "        model.zero_grad()\n"
           "        loss_fn(model(xc), yc).backward()\n"
           "        grads.append(model.weight.grad.clone())\n"
           "    return sum(grads)",  # the sum, not the mean
}
RIGHT_WEIGHT_GRAD = "def weight_grad(model, x, y):\n    return 2 * (model(x) - y).T @ x / y.numel()"
FULL_BATCH = "def chunk_mean_grad(model, x, y, n_chunks):\n    return 2 * (model(x) - y).T @ x / y.numel()"


def student_copy(student, answers=None, before=None, drop=(), outputs=None):
    """A student notebook as handed in: ``answers`` {cell id: source} replace cells, ``before``
    {cell id: source} inserts a cell before one, ``drop`` deletes cells, ``outputs`` {cell id:
    text} stores an output (as an edited notebook would)."""
    nb = nbformat.from_dict(student)
    cells = []
    for cell in nb.cells:
        if cell.get("id") in (before or {}):
            cells.append(nbformat.v4.new_code_cell(before[cell.id]))
        if cell.get("id") in drop:
            continue
        if cell.get("id") in (answers or {}):
            cell.source = answers[cell.id]
        if cell.get("id") in (outputs or {}):
            cell.outputs = [nbformat.v4.new_output("execute_result", {"text/plain": outputs[cell.id]}, execution_count=1)]
        cells.append(cell)
    nb.cells = cells
    return nb


def student_01(answers=None, before=None, drop=(), outputs=None):
    """Notebook 01 as handed in: see ``student_copy``."""
    return student_copy(STUDENT, answers, before, drop, outputs)


def small(*sources, ids=()):
    """A notebook of these code cells; ``ids`` gives the first ones notebook 01's cell ids."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    for cell, id in zip(nb.cells, ids):
        cell.id = id
    return nb


def write(folder, student, nb, name="01_single_device.ipynb"):
    path = folder / student / name
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def verdicts_of(rows, student):
    return {r["exercise"]: (r["verdict"], r["feedback"]) for r in rows if r["student"] == student}


@pytest.fixture(scope="module")
def graded_01(tmp_path_factory):
    folder = tmp_path_factory.mktemp("class")
    solved = {c.id: c.source for c in SOLUTION.cells if c.get("id") in {s.id for s in STUDENT.cells if "✏️ your" in s.source}}
    assert set(solved) == {"c06", "c09", "20e8e459"}
    fake_check = ("class AlwaysRight:\n    def __getattr__(self, name):\n        return lambda *answers: '✅ correct!'\n\n"
                  "check = AlwaysRight()")
    patch_course = ("import course.classroom.exercises, course.checks.nb01\n"
                    "course.classroom.exercises.Exercise.__call__ = lambda self, *a, **k: course.classroom.exercises.correct()\n"
                    "course.classroom.exercises.is_stub = lambda answer: False\n"
                    "course.checks.nb01.wrong = course.checks.nb01.correct")
    write(folder, "solved", student_01(solved))
    write(folder, "untouched", STUDENT)
    write(folder, "wrong", student_01(WRONG))
    write(folder, "fake_check", student_01(
        {**WRONG, "c07": f"from course.checks import nb01 as check\n{fake_check}\ncheck.weight_grad(weight_grad)"},
        outputs={"c07": "✅ Exercise 1 (weight_grad): matches autograd.",
                 "c10": "✅ Exercise 2 (chunk_mean_grad): correct!", "55a48994": "✅ Exercise 3 (chunk_loss): correct!"}))
    write(folder, "patched_course", student_01(WRONG, before={"c02": patch_course}, drop={"c07", "c10", "55a48994"}))
    write(folder, "borrows", student_01({"c06": "from course.checks.nb01 import _autograd_weight_grad as weight_grad"}))
    out = folder / "grades.csv"
    assert main(["grade", *sorted(str(p) for p in folder.iterdir()), "--csv", str(out)]) == 0
    with open(out, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_the_csv_has_one_row_per_student_and_exercise(graded_01):
    assert list(graded_01[0]) == report.COLUMNS
    assert sorted((r["student"], r["exercise"]) for r in graded_01) == sorted(
        (s, e) for s in ["solved", "untouched", "wrong", "fake_check", "patched_course", "borrows"] for e in EXERCISES)
    assert {r["notebook"] for r in graded_01} == {"01"}
    assert {r["title"] for r in graded_01} == {"Exercise 1 (weight_grad)", "Exercise 2 (chunk_mean_grad)", "Exercise 3 (chunk_loss)"}
    assert all(r["file"].endswith("01_single_device.ipynb") for r in graded_01)


@pytest.mark.slow
def test_solved_untouched_and_wrong_notebooks_get_what_they_earned(graded_01):
    assert {e: v for e, (v, _) in verdicts_of(graded_01, "solved").items()} == dict.fromkeys(EXERCISES, "correct")
    untouched = verdicts_of(graded_01, "untouched")
    assert {e: v for e, (v, _) in untouched.items()} == dict.fromkeys(EXERCISES, "not attempted")
    assert all("not attempted yet" in f for _, f in untouched.values())
    wrong = verdicts_of(graded_01, "wrong")
    assert wrong["weight_grad"][0] == "wrong" and "averages over every element" in wrong["weight_grad"][1]
    assert wrong["chunk_mean_grad"][0] == "wrong" and "you summed" in wrong["chunk_mean_grad"][1]
    assert wrong["chunk_loss"][0] == "not attempted"


@pytest.mark.slow
@pytest.mark.parametrize("student", ["fake_check", "patched_course"])
def test_tampering_earns_nothing(graded_01, student):
    """A redefined ``check`` with edited ✅ outputs, or ``course`` patched to say correct with
    the check cells deleted: the grader judges the same wrong answers as wrong."""
    assert verdicts_of(graded_01, student) == verdicts_of(graded_01, "wrong")


# A Part III notebook (15, the quickest of them to grade): a real student copy with one exercise
# solved (its code from course/checks/solutions.json), two answered wrongly as tests/test_checks_nb15.py
# proves its checks reject, and a tamper: `course` patched so that every check says ✅, with ✅ outputs
# stored. Notebook 15 has three exercises, so none is left untouched (01's copies cover that).
PART_III = "15_context_parallel.ipynb"
WRONG_15 = {
    "c19": "def ring_forward(q, k, v, layout, causal=False):\n"  # the next chunk sent only after this one is computed
           "    rank, n = dist.get_rank(), dist.get_world_size()\n"
           "    kv, out, lse = torch.stack([k, v]), None, None\n"
           "    for step in range(n):\n"
           "        src = (rank - step) % n\n"
           "        o, l = attend(q, kv[0], kv[1], layout[rank], layout[src], causal)\n"
           "        out, lse = (o, l) if out is None else merge(out, lse, o, l)\n"
           "        if step < n - 1:\n"
           "            kv, requests = start_pass(kv, (2, *k.shape[:-2], len(layout[(src - 1) % n]), k.shape[-1]))\n"
           "            for request in requests:\n"
           "                request.wait()\n"
           "    return out, lse",
    "c30": "def zigzag_layout(seq_len, world_size):\n"  # slice r paired with r + N, not 2N - 1 - r
           "    slices = torch.arange(seq_len).tensor_split(2 * world_size)\n"
           "    return [torch.cat([slices[r], slices[r + world_size]]) for r in range(world_size)]",
}
TAMPER_15 = ("import dataclasses, course.classroom.exercises\n"  # in Jupyter, every check cell below then prints ✅
             "course.classroom.exercises.Exercise.__call__ = lambda self, *answers, **options: "
             "dataclasses.replace(course.classroom.exercises.correct(), exercise=self.name)")


@pytest.fixture(scope="module")
def graded_15(tmp_path_factory):
    from course.classroom.doctor import PART_II_TORCH, torch_at_least
    from course.classroom.exercises import solutions

    if not torch_at_least(PART_II_TORCH):
        pytest.skip(f"notebook 15 needs torch >= {PART_II_TORCH}")
    student = nbformat.read(ROOT / "notebooks" / PART_III, as_version=4)
    nb = student_copy(student, {"c12": solutions()["15"]["merge"], **WRONG_15}, before={"c12": TAMPER_15},
                      outputs={"c13": "✅ Exercise 1 (merge): correct!", "c20": "✅ Exercise 2 (ring_forward): correct!",
                               "c31": "✅ Exercise 3 (zigzag_layout): correct!"})
    folder = tmp_path_factory.mktemp("part3")
    path = write(folder, "mixed", nb, name=PART_III)
    out = folder / "grades.csv"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert main(["grade", str(folder / "mixed"), "--csv", str(out)]) == 0
    with open(out, newline="", encoding="utf-8") as f:
        return path, list(csv.DictReader(f)), printed.getvalue()


@pytest.mark.slow
def test_a_part_iii_notebook_gets_each_exercises_own_verdict_whatever_it_claims(graded_15):
    path, rows, _ = graded_15
    assert [list(r) for r in rows] == [report.COLUMNS] * 3
    assert [(r["student"], r["notebook"], r["exercise"], r["title"], r["verdict"], r["file"]) for r in rows] == [
        ("mixed", "15", "merge", "Exercise 1 (merge)", "correct", str(path)),
        ("mixed", "15", "ring_forward", "Exercise 2 (ring_forward)", "wrong", str(path)),
        ("mixed", "15", "zigzag_layout", "Exercise 3 (zigzag_layout)", "wrong", str(path)),
    ]
    merge, ring, zigzag = (r["feedback"] for r in rows)
    assert merge.startswith("equals attention over all keys, with large scores and empty partials")
    assert "between posting each irecv and waiting for it the check saw no matrix product" in ring
    assert "not balanced" in zigzag


@pytest.mark.slow
def test_a_part_iii_notebooks_summary(graded_15):
    lines = graded_15[2].splitlines()
    isolation = "sandboxed" if sandbox.probe() is None else "NOT ISOLATED"
    assert lines[0].startswith("course version ") and f"; submissions {isolation}" in lines[0]
    assert [line.split() for line in lines[1:5]] == [
        ["notebook", "exercise", "solved", "wrong", "not", "attempted", "error"],
        ["15", "Exercise", "1", "(merge)", "1/1", "0", "0", "0"],
        ["15", "Exercise", "2", "(ring_forward)", "0/1", "1", "0", "0"],
        ["15", "Exercise", "3", "(zigzag_layout)", "0/1", "1", "0", "0"],
    ]
    assert [line.split() for line in lines[6:]] == [["student", "15", "total"], ["mixed", "1/3", "1/3"]]


def test_summary_counts_each_exercise():
    rows = [report.Verdict(s, "01", "weight_grad", "Exercise 1 (weight_grad)", v, "", "")
            for s, v in [("a", "correct"), ("b", "correct"), ("c", "wrong"), ("d", "error"), ("e", "not attempted")]]
    lines = report.summary(rows).splitlines()
    assert lines[0].split() == ["notebook", "exercise", "solved", "wrong", "not", "attempted", "error"]
    assert lines[1].split() == ["01", "Exercise", "1", "(weight_grad)", "2/5", "1", "1", "1"]


@pytest.fixture(scope="module")
def graded_small(tmp_path_factory):
    folder = tmp_path_factory.mktemp("small")
    attack = ("def weight_grad(model, x, y):\n"
              "    import torch, course.checks.nb01 as checks\n"
              "    torch.allclose = lambda *a, **k: True  # in the judge's process, when the check calls it\n"
              "    return 0 * model.weight")
    paths = {
        "hangs": write(folder, "hangs", small(RIGHT_WEIGHT_GRAD, "import time\ntime.sleep(600)", FULL_BATCH)),
        "ignores_interrupt": write(folder, "ignores_interrupt", small(
            RIGHT_WEIGHT_GRAD, "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass")),
        "crashes": write(folder, "crashes", small(RIGHT_WEIGHT_GRAD, "import os\nos._exit(3)")),
        "attacks": write(folder, "attacks", small(attack, FULL_BATCH)),
    }
    limits = grading.Limits(cell=3, notebook=60, check=60, interrupt=3)
    return paths, grading.grade_notebooks([(s, p) for s, p in paths.items()], limits, log=lambda s: None, jobs=2)


@pytest.mark.slow
def test_a_hanging_cell_is_interrupted_and_the_rest_graded(graded_small):
    rows = [v.row() for v in graded_small[1]]
    hangs = verdicts_of(rows, "hangs")
    assert hangs["weight_grad"][0] == "correct"
    assert hangs["chunk_mean_grad"][0] == "wrong" and "gradient of the whole batch" in hangs["chunk_mean_grad"][1]
    assert hangs["chunk_loss"] == ("error", "`chunk_loss` not defined when the notebook ended "
                                            "(cell 2 (`import time`) ran past its 3 s limit and was interrupted)")


@pytest.mark.slow
def test_a_cell_past_its_limit_leaves_no_task_of_nbclients_behind(tmp_path):
    """nbclient leaves the task reading a timed-out cell's outputs running; the grader cancels it
    (else "Task was destroyed but it is pending!" or "Task exception was never retrieved" is
    printed when the grader exits: both seen)."""
    import subprocess

    write(tmp_path, "a", small(RIGHT_WEIGHT_GRAD, "import time\ntime.sleep(600)", ids=["c06"]))
    done = subprocess.run([sys.executable, "-m", "course", "grade", str(tmp_path / "a"), "--cell-timeout", "3"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "a 01_single_device.ipynb: 1 of 3 correct" in done.stderr, done.stderr
    assert "Task" not in done.stderr, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("student, reason", [
    ("ignores_interrupt", "cell 2 (`import signal`) ran past its time limit and did not stop when interrupted"),
    ("crashes", "the kernel died while running cell 2 (`import os`) (it crashed, exited, was killed or ran out of memory)"),
])
def test_a_notebook_that_hangs_or_dies_costs_only_its_own_exercises(graded_small, student, reason):
    rows = [v.row() for v in graded_small[1]]
    assert verdicts_of(rows, student) == dict.fromkeys(EXERCISES, ("error", reason))
    assert verdicts_of(rows, "hangs")["weight_grad"][0] == "correct"  # graded before and after them


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="the judge forks a child per exercise on Linux only")
def test_an_answer_that_attacks_the_checker_forges_only_its_own_verdict(graded_small):
    """The README's limit: an answer is code the check runs. Its patch (torch.allclose always
    True) dies with the child that judged it: the next exercise is judged by a clean one."""
    attacks = verdicts_of([v.row() for v in graded_small[1]], "attacks")
    assert attacks["weight_grad"][0] == "correct"  # forged
    assert attacks["chunk_mean_grad"][0] == "wrong"


@pytest.mark.slow
def test_the_courses_own_function_is_no_answer(graded_01):
    borrows = verdicts_of(graded_01, "borrows")
    assert borrows["weight_grad"] == ("error", "the answer is the course's own course.checks.nb01._autograd_weight_grad, "
                                               "not one written in the notebook")


@pytest.mark.slow
def test_exercises_past_the_notebooks_limit_are_not_reached(tmp_path):
    nb = small(RIGHT_WEIGHT_GRAD, "import time\ntime.sleep(600)", FULL_BATCH, ids=["c06"])
    path = write(tmp_path, "slow", nb)
    limits = grading.Limits(cell=60, notebook=4, check=60, interrupt=3)
    verdicts = {v.exercise: (v.verdict, v.feedback) for v in grading.grade_notebooks([("slow", path)], limits, log=lambda s: None)}
    assert verdicts["weight_grad"][0] == "correct"  # taken after its cell, c06
    reason = "not reached: the notebook ran past its 4 s limit at cell 2 (`import time`)"
    assert verdicts["chunk_mean_grad"] == verdicts["chunk_loss"] == ("error", reason)


@pytest.mark.slow
def test_a_missing_answer_is_explained_by_its_own_cell_never_by_another_exercises(tmp_path):
    """Why an answer is not defined: its own cell's failure; no other exercise's, and never a cell
    that ran after its answers were taken (the grader used to name the notebook's first failure)."""
    nb = small("weight_grad = undefined_helper()", "check.weight_grad(weight_grad)",
               "pass  # chunk_mean_grad deleted", "check.chunk_mean_grad(chunk_mean_grad)",
               "raise RuntimeError('a later cell')", ids=["c06", "c07", "c09", "c10"])
    path = write(tmp_path, "me", nb)
    verdicts = {v.exercise: (v.verdict, v.feedback) for v in grading.grade_notebooks([("me", path)], log=lambda s: None)}
    assert verdicts == {
        "weight_grad": ("error", "`weight_grad` not defined after cell 2 (`check.weight_grad(weight_grad)`) (cell 1 "
                                 "(`weight_grad = undefined_helper()`) raised NameError: name 'undefined_helper' is not defined)"),
        "chunk_mean_grad": ("error", "`chunk_mean_grad` not defined after cell 4 (`check.chunk_mean_grad(chunk_mean_grad)`)"),
        "chunk_loss": ("error", "`chunk_loss` not defined when the notebook ended "  # its cells are not in the notebook
                                "(cell 5 (`raise RuntimeError('a later cell')`) raised RuntimeError: a later cell)"),
    }


@pytest.mark.slow
def test_progress_prints_a_table_of_the_saved_notebooks(tmp_path, capsys):
    path = write(tmp_path, "me", small(RIGHT_WEIGHT_GRAD, FULL_BATCH), name="01_mine.ipynb")
    assert main(["progress", str(path), "--cell-timeout", "30"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["notebook", "exercise", "verdict", "feedback"]
    assert lines[1].split()[:5] == ["01_mine", "Exercise", "1", "(weight_grad)", "✅"]
    assert lines[2].split()[4:6] == ["❌", "wrong"]
    assert lines[3].split()[4:6] == ["💥", "error"] and "`chunk_loss` not defined" in lines[3]
    assert lines[-1] == "1 of 3 exercises solved."


def _press_ctrl_c(command, folder, when):
    """Run ``python -m course COMMAND`` on a notebook whose second cell never ends and press Ctrl-C
    (SIGINT to its process group, as a terminal does) ``when``: "early" (as soon as the package
    ``course`` has begun to import: its first lines install the one-line handler; ~0.05-0.1 s in on a
    quiet machine; a press before, in Python's own start-up, is Python's traceback), "starting" (1.5 s
    in: importing torch, copying the course),
    "judge" (the judge process has appeared: it and the kernel are starting) or "cell" (the kernel
    runs the endless cell; pressed twice, the second during the cleanup). Returns (exit code,
    stderr, processes it started still alive, temporary folders left)."""
    import os
    import shutil
    import subprocess
    import tempfile
    import threading
    import time

    import psutil

    tmp = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # short: the grader's folder is made in it
    path = write(folder, "me", small(RIGHT_WEIGHT_GRAD, "import time\nopen('cell-started', 'w').close()\ntime.sleep(600)",
                                     ids=["c06"]), name="01_mine.ipynb")  # in its scratch folder: the one it may write
    argv = [str(path), "--csv", str(folder / "grades.csv")] if command == "grade" else [str(path)]
    timing = ["-X", "importtime"] if when == "early" else []  # each import's line on stderr as it ends
    grader = subprocess.Popen([sys.executable, *timing, "-m", "course", command, *argv, "--cell-timeout", "600"],
                              env={**os.environ, "TMPDIR": str(tmp)}, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    started, seen, stderr = time.monotonic(), {}, []  # seen: pid: (create_time, command line) of every process under it
    reader = threading.Thread(target=lambda: stderr.extend(grader.stderr), daemon=True)
    reader.start()

    def look():
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(grader.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    seen.setdefault(p.pid, (p.create_time(), " ".join(p.cmdline())))

    try:
        ready = {"early": lambda: any(line.split("|")[-1].strip() == "course.runtime" for line in stderr),  # the second
                 # thing course/__init__.py imports, course.runtime.launcher, has begun: the handler is in place
                 "starting": lambda: time.monotonic() - started > 1.5,
                 "judge": lambda: any("course.classroom.judge" in c for _, c in seen.values()),
                 "cell": lambda: any(tmp.rglob("cell-started"))}[when]
        while not ready() and grader.poll() is None and time.monotonic() - started < 300:
            look()
            time.sleep(0.02)
        assert grader.poll() is None, f"the grader ended before the press ({when}): {grader.stderr.read()}"
        os.killpg(grader.pid, signal.SIGINT)
        if when == "cell":
            time.sleep(0.05)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(grader.pid, signal.SIGINT)
        while grader.poll() is None and time.monotonic() - started < 420:
            look()
            time.sleep(0.05)
    finally:
        grader.kill()
        grader.wait()
    left = []
    for pid, (created, cmdline) in seen.items():
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).create_time() == created:
                left.append(cmdline)
    folders = [p.name for p in tmp.iterdir() if p.name.startswith("course-grade-")]
    shutil.rmtree(tmp, ignore_errors=True)  # (torch's own caches may be there)
    for pid in seen:  # not to disturb the next test
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()
    reader.join(timeout=10)
    return grader.returncode, "".join(line for line in stderr if not line.startswith("import time:")), left, folders


@pytest.mark.slow
@pytest.mark.parametrize("command, when", [("progress", "early"), ("progress", "starting"), ("progress", "judge"),
                                           ("progress", "cell"), ("grade", "cell")])
def test_ctrl_c_stops_progress_and_grade_in_one_line_and_leaves_nothing_running(tmp_path, command, when):
    """Ctrl-C at several instants of ``course progress`` / ``course grade`` (a second press during
    the cleanup too): exit code 130, one line on stderr (no traceback), no process it started
    (judge, kernel, sandbox) left running, no temporary folder left."""
    code, printed, left, folders = _press_ctrl_c(command, tmp_path, when)
    stopped = {"progress": r"progress stopped \(Ctrl-C\)(: no verdicts| before it began: nothing done)",
               "grade": rf"grading stopped: {re.escape(str(tmp_path / 'grades.csv'))} holds the students graded so far"
                        r"|grade stopped \(Ctrl-C\) before it began: nothing done"}[command]
    assert code == 130 and len(printed.splitlines()) == 1, (code, printed)
    assert "before it began" in printed or when != "early", printed  # the course's first handler answered
    assert re.fullmatch(stopped, printed.strip()), printed
    assert left == [] and folders == [], (left, folders)


def test_which_notebook_a_file_is():
    table = submissions.exercise_table()
    nb = nbformat.v4.new_notebook()
    assert submissions.notebook_number(Path("alice_03_distributed_sampler.ipynb"), nb, table) == "03"
    assert submissions.notebook_number(Path("10_mine.ipynb"), nb, table) == "10"
    assert submissions.notebook_number(Path("homework.ipynb"), STUDENT, table) == "01"  # its Colab badge
    assert submissions.notebook_number(Path("homework.ipynb"), nb, table) is None


def test_answers_json_is_what_the_build_writes_and_names_every_exercise():
    import importlib

    from course.classroom.exercises import Exercise
    from course.classroom.notebooks import all_exercise_answers

    table = submissions.exercise_table()
    assert table == all_exercise_answers(), "course/checks/answers.json is stale: run `python -m course build --no-execute`"
    for number, entry in table.items():
        module = importlib.import_module(f"course.checks.nb{number}")
        exercises = {name for name, x in vars(module).items() if isinstance(x, Exercise)}
        checks = [x["check"] for x in entry["exercises"]]
        assert checks and set(checks) == exercises, number
        assert all(x["check_cell"] and x["answer_cells"] for x in entry["exercises"]), number


def test_answers_are_taken_after_the_exercise_not_at_the_end():
    """Notebook 11 binds ``zero1_step`` to the course's version after its exercise: an untouched
    notebook's answer is taken before that, as the student's check saw it."""
    nb = nbformat.read(ROOT / "notebooks" / "11_zero_and_fsdp.ipynb", as_version=4)
    points = runner.extraction_points(nb, submissions.exercise_table()["11"]["exercises"])
    at = next(i for i, due in points.items() if [x["check"] for x in due] == ["zero1_step"])
    assert "\ncheck.zero1_step(zero1_step)" in nb.cells[at].source
    later = [i for i, c in enumerate(nb.cells) if "from course.parallel.zero import zero1_step" in c.source]
    assert later and at < later[0]
    nb.cells = [c for c in nb.cells if "check.zero1_step(" not in c.source]  # deleted: after its answer cell
    points = runner.extraction_points(nb, submissions.exercise_table()["11"]["exercises"])
    at = next(i for i, due in points.items() if [x["check"] for x in due] == ["zero1_step"])
    assert "def zero1_step(" in nb.cells[at].source


def test_calls_on_check_are_left_out():
    assert runner.without_checks("check.weight_grad(weight_grad)\ncheck.weight_grad.hint()") == ""
    assert runner.without_checks("from course.checks import nb01 as check\n\ncheck.weight_grad(\n    weight_grad)\nx = 1") == \
        "from course.checks import nb01 as check\n\nx = 1"
    for kept in ("x = check.weight_grad(weight_grad)", "print(check.exercise_model())", "x = 1; check.w(x)", "%time check.x(y)"):
        assert runner.without_checks(kept) == kept


def test_a_check_call_must_pass_its_answers_by_name():
    from course.classroom.notebooks import exercise_answers

    nb = small("check.weight_grad(weight_grad)", "check.chunk_loss(lambda *a: 0)")
    with pytest.raises(ValueError, match="pass the answers by name only"):
        exercise_answers(nb)
    nb.cells.pop()
    assert exercise_answers(nb) == [{"check": "weight_grad", "answers": ["weight_grad"], "check_cell": nb.cells[0].id, "answer_cells": []}]


def test_an_unwritable_csv_is_refused_before_grading(tmp_path):
    path = write(tmp_path, "me", small("x = 1"))
    with pytest.raises(SystemExit, match="cannot write it"):
        main(["grade", str(path), "--csv", str(tmp_path / "no" / "such" / "folder.csv")])
