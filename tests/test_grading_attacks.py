"""A class that fights back (issue 38): one grading run of 30 submissions, 18 honest students and
12 attackers, each attack a small notebook with notebook 01's cell ids. Every test asserts what the
honest students earned, that no submission file changed, and that nothing of the run is left running.

Marked slow (real kernels; the file about four minutes on 2 cores at load 6-9): ``pytest -n 0 -m slow
tests/test_grading_attacks.py``. The class of 30 takes 134 s, the class of 16 it grew from 101 s (back to
back, old/new/old, load 4-7): the 14 students added are mostly small notebooks.
"""

import contextlib
import csv
import hashlib
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from course.__main__ import main
from course.classroom import grading, sandbox
from test_grading import FULL_BATCH, RIGHT_WEIGHT_GRAD, SOLUTION, STUDENT, WRONG, small, student_01, write

pytestmark = pytest.mark.slow
MARK = "gradingattack"  # every process an attack starts carries it in its command line
SLEEPER = f"import subprocess\nfor _ in range({{n}}):\n    subprocess.Popen(['bash', '-c', 'exec -a {MARK} sleep 600'], start_new_session=True)"
FIND_JUDGE = ("import os, psutil\n"  # as issue 38's forger did: among the kernel's parent's children
              "def command(p):  # a zombie or a process gone meanwhile has none\n"
              "    try:\n"
              "        return ' '.join(p.cmdline())\n"
              "    except psutil.Error:\n"
              "        return ''\n"
              "judges = [p for p in psutil.Process(os.getppid()).children(recursive=True)\n"
              "          if 'course.classroom.judge' in command(p)]\n")
STUB = "def weight_grad(model, x, y):\n    ..."
SEALED = sandbox.probe() is None


def attacks(csv_path, victim, course_file):
    """{student: notebook}: each attacker answers weight_grad wrongly (or not at all), so any
    ``correct`` it gets beyond that is forged."""
    wrong = WRONG["c06"]
    return {
        "forger": small(wrong, "check.weight_grad(weight_grad)", FIND_JUDGE + (
            "import json, os\n"
            "for p in judges:\n"
            "    for fd in os.listdir(f'/proc/{p.pid}/fd'):\n"
            "        try:\n"
            "            with open(f'/proc/{p.pid}/fd/{fd}', 'w') as f:\n"
            "                f.write(json.dumps({'status': 'correct', 'message': 'forged'}) + '\\n' * 3)\n"
            "        except OSError:\n"
            "            pass\n"), ids=["c06", "c07"]),
        "escapee": small(wrong, "check.weight_grad(weight_grad)",
                         "import os, subprocess, sys\n"
                         "env = {k: v for k, v in os.environ.items() if k != 'COURSE_PROCTREE'}\n"
                         f"code = 'import time; time.sleep(3); open({str(csv_path)!r}, \"w\").write(\"forged\")  # {MARK}'\n"
                         "subprocess.Popen([sys.executable, '-c', code], env=env, start_new_session=True)",
                         ids=["c06", "c07"]),
        "vandal": small(f"open({str(victim)!r}, 'w').write('{{}}')", wrong, ids=["c01", "c06"]),
        "judge_killer": small(FIND_JUDGE + "for p in judges:\n    p.kill()",
                              "def weight_grad(model, x, y):\n    import os, signal\n    os.kill(os.getppid(), signal.SIGKILL)",
                              ids=["c01", "c06"]),
        # the course it imports (the grader's copy) and, sandboxed only, the grader's own files
        "course_editor": small(f"import course.checks.nb01 as c\nfor path in [c.__file__, *{[str(course_file)] if SEALED else []!r}]:\n"
                               "    text = open(path).read()\n"
                               "    open(path, 'w').write(text + '\\nwrong = correct\\n')",
                               wrong, ids=["c01", "c06"]),
        "forker": small(SLEEPER.format(n=200), wrong, ids=["c01", "c06"]),
        "hog": small("x = bytearray(3 << 30)", wrong, ids=["c01", "c06"]),
        "talker": small("print('x' * (50 << 20))", wrong, ids=["c01", "c06"]),
        "exits": small(RIGHT_WEIGHT_GRAD, "check.weight_grad(weight_grad)", "import os\nos._exit(1)", FULL_BATCH,
                       ids=["c06", "c07"]),
        "kills_kernel": small(RIGHT_WEIGHT_GRAD, "check.weight_grad(weight_grad)", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
                              ids=["c06", "c07"]),
        "loops": small(RIGHT_WEIGHT_GRAD, "check.weight_grad(weight_grad)", "while True:\n    pass", FULL_BATCH,
                       ids=["c06", "c07"]),
        "late": small(STUB, "check.weight_grad(weight_grad)", "pass", RIGHT_WEIGHT_GRAD.replace("/ y.numel()", "/ y.numel()  # mine"),
                      ids=["c06", "c07"]),
    }


SAMPLER = "03_distributed_sampler.ipynb"
SAMPLER_EXERCISES = ["rank_indices", "batch_arithmetic", "evaluate"]
NA, ERR = "not attempted", "error"


def honest_class(solved):
    """{student: (notebook, file name, the verdicts it earned)}: honest students whose answers
    vary (right, wrong, untouched, solved further down, a few exercises only, notebook 03). None
    hands in the solution's weight_grad (only aaron and zoe share it); the small notebooks import
    what their answers use. Small notebooks keep the class cheap: notebook 01 run whole costs most."""
    chunk_loss, loss_of = solved["20e8e459"], "20e8e459"
    plain_mean = "def chunk_loss(model, x_chunk, y_chunk, batch_size, n_chunks):\n    return nn.functional.mse_loss(model(x_chunk), y_chunk)"
    imports = "import torch\nfrom torch import nn\nloss_fn = nn.functional.mse_loss"
    late = student_01({"c09": solved["c09"], loss_of: chunk_loss})
    late.cells.append(small(RIGHT_WEIGHT_GRAD + "  # done at last").cells[0])
    one = "01_single_device.ipynb"
    return {
        "blank": (STUDENT, one, [NA, NA, NA]),
        "mixed": (student_01({"c06": WRONG["c06"], "c09": solved["c09"], loss_of: chunk_loss}), one, ["wrong", "correct", "correct"]),
        "wrong_loss": (student_01({"c06": RIGHT_WEIGHT_GRAD, "c09": solved["c09"], loss_of: plain_mean}), one,
                       ["correct", "correct", "wrong"]),
        "late_full": (late, one, ["correct", "correct", "correct"]),  # weight_grad judged on the cell appended at the end
        "first_only": (small(RIGHT_WEIGHT_GRAD, "check.weight_grad(weight_grad)", ids=["c06", "c07"]), one, ["correct", ERR, ERR]),
        "first_wrong": (small(WRONG["c06"], ids=["c06"]), one, ["wrong", ERR, ERR]),
        "first_stub": (small(STUB, ids=["c06"]), one, [NA, ERR, ERR]),
        "first_late": (small(STUB, "check.weight_grad(weight_grad)", RIGHT_WEIGHT_GRAD + "  # later", ids=["c06", "c07"]), one,
                       ["correct", ERR, ERR]),
        "chunks": (small(imports, solved["c09"], chunk_loss, ids=["c01", "c09", loss_of]), one, [ERR, "correct", "correct"]),
        "chunk_sum": (small(imports, WRONG["c09"], ids=["c01", "c09"]), one, [ERR, "wrong", ERR]),
        "loss_mean": (small(imports, plain_mean, ids=["c01", loss_of]), one, [ERR, ERR, "wrong"]),
        "sampler": (small("rank3_padded = [3, 7, 11, 1]\nrank3_dropped = [3, 7, 11]", "global_batch = 128\nsteps_per_epoch = 390",
                          ids=["c12", "c23"]), SAMPLER, ["correct", "wrong", ERR]),
        "sampler_b": (small("rank3_padded = [3, 7, 11, 3]\nrank3_dropped = [3, 7, 11]", "global_batch = 128\nsteps_per_epoch = 391",
                            ids=["c12", "c23"]), SAMPLER, ["wrong", "correct", ERR]),
        "sampler_blank": (small("rank3_padded = ...  # ✏️ your answer\nrank3_dropped = ...  # ✏️ your answer", ids=["c12"]), SAMPLER,
                          [NA, ERR, ERR]),
    }


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def leftovers():
    found = []
    for p in psutil.process_iter():
        try:
            if MARK in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            pass
    return found


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    if not SEALED:  # then the vandal and the escapee succeed, as README says: .ci/run installs bubblewrap
        pytest.skip(f"no sandbox here ({sandbox.probe()}): install bubblewrap")
    folder = tmp_path_factory.mktemp("hostile")
    out = tmp_path_factory.mktemp("out") / "grades.csv"
    solved = {c.id: c.source for c in SOLUTION.cells if c.get("id") in {s.id for s in STUDENT.cells if "✏️ your" in s.source}}
    paths = {"aaron": write(folder, "aaron", student_01(solved))}  # graded first: before any attack
    victim = folder / "zoe" / "01_single_device.ipynb"
    course_file = sandbox.Path(grading.__file__).parents[1] / "checks" / "nb01.py"
    course_before = digest(course_file)
    paths.update((s, write(folder, s, nb)) for s, nb in attacks(out, victim, course_file).items())
    honest = honest_class(solved)
    paths.update((s, write(folder, s, nb, name)) for s, (nb, name, _) in honest.items())
    paths["yann"] = write(folder, "yann", small(RIGHT_WEIGHT_GRAD, FULL_BATCH, ids=["c06", "c09"]))
    paths["zoe"] = write(folder, "zoe", student_01(solved))  # graded last: after every attack
    paths["wrong"] = write(folder, "wrong", student_01(WRONG))
    before = {s: digest(p) for s, p in paths.items()}
    limits = ["--cell-timeout", "60", "--notebook-timeout", "300", "--check-timeout", "60", "--jobs", "2"]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert main(["grade", *(str(folder / s) for s in paths), "--csv", str(out), *limits]) == 0
    time.sleep(5)  # the escapee's delay: had it survived, it would have written by now
    with open(out, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return {"rows": rows, "paths": paths, "before": before, "after": {s: digest(p) for s, p in paths.items()},
            "printed": printed.getvalue(), "left": leftovers(), "course": (course_before, digest(course_file)), "out": out,
            "honest": {s: ("03", dict(zip(SAMPLER_EXERCISES, v))) if name == SAMPLER else ("01", dict(zip(ALL, v)))
                       for s, (_, name, v) in honest.items()}}


def verdicts(graded, student, notebook="01"):
    return {r["exercise"]: r["verdict"] for r in graded["rows"] if r["student"] == student and r["notebook"] == notebook}


def feedback(graded, student, exercise):
    return next(r["feedback"] for r in graded["rows"] if r["student"] == student and r["exercise"] == exercise)


ALL = dict.fromkeys(["weight_grad", "chunk_mean_grad", "chunk_loss"], "correct")


def test_honest_students_get_exactly_what_they_earned(graded):
    assert verdicts(graded, "aaron") == verdicts(graded, "zoe") == ALL
    assert verdicts(graded, "yann") == {"weight_grad": "correct", "chunk_mean_grad": "wrong", "chunk_loss": "error"}
    assert verdicts(graded, "wrong") == {"weight_grad": "wrong", "chunk_mean_grad": "wrong", "chunk_loss": "not attempted"}
    assert len(graded["paths"]) == 30  # the class of issue 38's "done when"
    assert {s: verdicts(graded, s, number) for s, (number, _) in graded["honest"].items()} == {
        s: earned for s, (_, earned) in graded["honest"].items()}


@pytest.mark.parametrize("attacker", ["forger", "escapee", "vandal", "judge_killer", "course_editor", "forker", "hog", "talker"])
def test_an_attacker_gets_no_verdict_it_did_not_earn(graded, attacker):
    mine = verdicts(graded, attacker)
    assert mine["weight_grad"] in ("wrong", "error") and "correct" not in mine.values(), mine
    if attacker == "course_editor":
        assert mine["weight_grad"] == "wrong"  # judged by the course as copied before any notebook ran


def test_every_submission_file_and_the_course_are_unchanged(graded):
    assert graded["after"] == graded["before"]
    assert graded["course"][0] == graded["course"][1]


def test_nothing_of_the_run_is_left_running_and_the_csv_is_the_graders(graded):
    assert graded["left"] == []
    text = graded["out"].read_text(encoding="utf-8")
    assert text.startswith(",".join(grading.report.COLUMNS)) and "forged" not in text
    assert len(graded["rows"]) == 2 * 3 * len(graded["paths"])  # each student: the exercises of 01 and of 03
    handed_in = {s: "03" if s.startswith("sampler") else "01" for s in graded["paths"]}
    assert {r["verdict"] for r in graded["rows"] if r["notebook"] != handed_in[r["student"]]} == {NA}


def test_verdicts_earned_before_a_crash_or_hang_are_kept(graded):
    for student in ("exits", "kills_kernel"):
        assert verdicts(graded, student)["weight_grad"] == "correct"
        assert "the kernel died while running cell 3" in feedback(graded, student, "chunk_mean_grad")
    assert verdicts(graded, "loops") == {"weight_grad": "correct", "chunk_mean_grad": "wrong", "chunk_loss": "error"}


def test_the_final_definition_counts_when_the_stub_stayed_in_place(graded):
    for student in ("late", "late_full", "first_late"):  # an attacker, honest students (notebook 01 whole, a small one)
        assert verdicts(graded, student)["weight_grad"] == "correct"
        assert feedback(graded, student, "weight_grad").endswith(grading.FINAL_NOTE)


def test_the_report_says_whether_submissions_were_isolated(graded):
    first = graded["printed"].splitlines()[0]
    assert first.startswith("course version ") and first.endswith("sandboxed" if SEALED else "")
    assert len({r["isolation"] for r in graded["rows"]}) == 1 and (graded["rows"][0]["isolation"] == "sandboxed") == SEALED
    assert len({r["course"] for r in graded["rows"]}) == 1
    assert "identical answers to notebook 01's weight_grad: aaron, zoe" in graded["printed"]
    answers = graded["out"].with_name("grades-answers")
    assert "def weight_grad" in (answers / "aaron.py").read_text() and (answers / "hog.py").read_text() == ""


@pytest.mark.skipif(not SEALED, reason="no sandbox here")
def test_a_sandboxed_judge_killer_loses_only_its_own_exercise(graded):
    assert "judge stopped" in feedback(graded, "judge_killer", "weight_grad")


def test_a_grader_told_to_stop_keeps_what_it_graded_and_leaves_no_temp_folder(tmp_path):
    folder, tmp = tmp_path / "class", Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # short: not moved to /tmp
    write(folder, "a", small(RIGHT_WEIGHT_GRAD, ids=["c06"]))
    write(folder, "b", small(RIGHT_WEIGHT_GRAD, SLEEPER.format(n=3) + "\nimport time\ntime.sleep(600)", ids=["c06"]))
    out = tmp_path / "grades.csv"
    grader = subprocess.Popen([sys.executable, "-m", "course", "grade", str(folder / "a"), str(folder / "b"), "--csv", str(out)],
                              env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and (not out.exists() or out.read_text().count("\n") < 4):  # a's three rows
            time.sleep(0.5)
        while time.monotonic() < deadline and len(leftovers()) < 3:  # b's kernel is in its endless cell
            time.sleep(0.5)
        time.sleep(1)
        grader.send_signal(signal.SIGTERM)
        try:
            code = grader.wait(120)
        except subprocess.TimeoutExpired:
            code = "still running 120 s after SIGTERM"
    finally:
        grader.kill()
        grader.wait()  # reaped: no zombie left among this process's children (the forger test looks at them)
    printed = grader.stderr.read()
    assert code == 130 and "grading stopped" in printed, (code, printed)
    with open(out, newline="", encoding="utf-8") as f:
        assert [(r["student"], r["verdict"]) for r in csv.DictReader(f)][:1] == [("a", "correct")]
    assert [p.name for p in tmp.iterdir() if p.name.startswith("course-grade-")] == []  # (torch's own caches may be there)
    shutil.rmtree(tmp, ignore_errors=True)
    time.sleep(1)
    assert leftovers() == []


def test_without_a_sandbox_forged_replies_still_earn_nothing(tmp_path):
    """Not isolated (``--no-sandbox``), the forger reaches the judge's pipes, as issue 38 found: its
    lines name no request, so they are ignored, and the next student gets her own verdicts."""
    forger = attacks(tmp_path / "grades.csv", tmp_path / "none", tmp_path / "none")["forger"]
    paths = [("forger", write(tmp_path, "forger", forger)), ("next", write(tmp_path, "next", small(RIGHT_WEIGHT_GRAD, FULL_BATCH,
                                                                                                      ids=["c06", "c09"])))]
    logged = []
    rows = [v.row() for v in grading.grade_notebooks(paths, grading.Limits(cell=60), log=logged.append, sealed=False)]
    assert any(line.endswith("answered no request (forged?) and were ignored") for line in logged), logged  # they were written
    assert {r["exercise"]: r["verdict"] for r in rows if r["student"] == "forger"} == {
        "weight_grad": "wrong", "chunk_mean_grad": "error", "chunk_loss": "error"}
    assert {r["exercise"]: r["verdict"] for r in rows if r["student"] == "next"} == {
        "weight_grad": "correct", "chunk_mean_grad": "wrong", "chunk_loss": "error"}
    assert {r["isolation"] for r in rows} == {"NOT ISOLATED: turned off (--no-sandbox)"}


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """A class graded under a 10 s CPU-time limit and a 256-process limit (2048 sleeps took over a
    minute to start at load 15): a fork bomb of 5,000 sleeps (stopped at the limit while an honest
    student's sandbox runs beside it), a busy child left running by a cell, a kernel that burns
    CPU until its limit."""
    if not SEALED:
        pytest.skip(f"no sandbox here ({sandbox.probe()}): install bubblewrap")
    folder = tmp_path_factory.mktemp("limited")
    spin = ("import subprocess, sys\n"
            f"child = subprocess.Popen([sys.executable, '-c', 'while True: pass  # {MARK}'], start_new_session=True)")
    paths = {
        "bomber": write(folder, "bomber", small(SLEEPER.format(n=5000).replace(", start_new_session=True", ""),
                                                "import time\ntime.sleep(10)", RIGHT_WEIGHT_GRAD, "check.weight_grad(weight_grad)",
                                                ids=["c01", "c02", "c06", "c07"])),
        "honest": write(folder, "honest", small(RIGHT_WEIGHT_GRAD, FULL_BATCH, ids=["c06", "c09"])),
        "spinner": write(folder, "spinner", small(spin, "import signal\nassert child.wait(60) == -signal.SIGXCPU\n"
                                                  + RIGHT_WEIGHT_GRAD, ids=["c01", "c06"])),  # defined if the child died of it
        "burner": write(folder, "burner", small(RIGHT_WEIGHT_GRAD, "check.weight_grad(weight_grad)", "while True:\n    pass",
                                                FULL_BATCH, ids=["c06", "c07"])),
    }
    before = {s: digest(p) for s, p in paths.items()}
    rows = [v.row() for v in grading.grade_notebooks(list(paths.items()), grading.Limits(cell=60, notebook=300, check=60),
                                                     log=lambda line: None, jobs=2, resources=sandbox.Resources(processes=256, cpu=10))]
    return {"rows": rows, "changed": [s for s, p in paths.items() if digest(p) != before[s]], "left": leftovers()}


def test_a_fork_bomb_stops_at_its_sandboxs_process_limit_and_the_grader_goes_on(limited):
    assert verdicts(limited, "honest") == {"weight_grad": "correct", "chunk_mean_grad": "wrong", "chunk_loss": "error"}
    assert verdicts(limited, "bomber")["weight_grad"] == "correct"  # its cells after the bomb ran
    assert "raised BlockingIOError: [Errno 11] Resource temporarily unavailable" in feedback(limited, "bomber", "chunk_mean_grad")
    assert limited["changed"] == [] and limited["left"] == []


def test_the_cpu_time_limit_stops_a_busy_child_and_a_busy_kernel(limited):
    assert verdicts(limited, "spinner")["weight_grad"] == "correct"  # its child died of SIGXCPU
    assert verdicts(limited, "burner")["weight_grad"] == "correct"  # taken before the kernel died
    assert feedback(limited, "burner", "chunk_mean_grad") == ("the kernel ran out of CPU time (its limit: 10 s) "
                                                               "while running cell 3 (`while True:`)")
