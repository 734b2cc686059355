"""The grader's pure logic, quickly (no kernels): which replies count, which files are notebooks,
the instructor's tables and CSVs, the sandbox's command. The attacks themselves, in real
kernels, are in tests/test_grading_attacks.py (marked slow)."""

import csv
import json
import subprocess
import sys

from pathlib import Path

import nbformat
import pytest

from course.classroom import judge, report, sandbox, submissions
from course.classroom.notebooks import ROOT
from course.classroom.report import Verdict


def test_a_reply_counts_only_if_it_names_its_request():
    right = json.dumps({"id": "abc", "status": "correct", "message": "ok"})
    assert judge.match(right, "abc") == {"id": "abc", "status": "correct", "message": "ok"}
    assert judge.match(right, "abd") is None  # another request's (a stale or forged one)
    for forged in ('{"status": "correct"}', '{"status": "correct", "message": "x"}', "not json", "[]", "",
                   json.dumps({"id": "abc", "status": "perfect", "message": "x"}),
                   json.dumps({"id": "abc", "status": "correct", "message": 3})):
        assert judge.match(forged, "abc") is None


FAKE_JUDGE = r"""
import json, sys
print(json.dumps({"titles": {"01": {"weight_grad": "Exercise 1"}}, "broken": {}}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    if request["check"] == "dies":
        sys.exit(1)
    if request["check"] == "hangs":
        import time
        time.sleep(600)
    for _ in range(3):  # forged lines first: what a student who reached the pipe would write
        print(json.dumps({"status": "correct", "message": "forged"}), flush=True)
        print(json.dumps({"id": "0" * 32, "status": "correct", "message": "forged"}), flush=True)
    print(json.dumps({"id": request["id"], "status": "wrong", "message": request["check"]}), flush=True)
"""


def test_the_judge_ignores_forged_replies_and_is_started_again_when_it_dies():
    fake = lambda argv: [sys.executable, "-c", FAKE_JUDGE]  # noqa: E731
    j = judge.Judge(["01"], command=fake)
    try:
        assert j.judge("01", "weight_grad", "", 10) == ("wrong", "weight_grad")
        assert j.judge("01", "chunk_loss", "", 10) == ("wrong", "chunk_loss")  # not the other's reply, nor a forged one
        assert j.ignored == 12
        verdict, feedback = j.judge("01", "dies", "", 10)
        assert verdict == "error" and "judge stopped" in feedback
        assert j.judge("01", "weight_grad", "", 10) == ("wrong", "weight_grad")  # a new judge
        assert j.restarts == 1
        j.kill()  # grading was stopped (Ctrl-C): no judge is started again for the answers left
        assert j.judge("01", "weight_grad", "", 10) == ("error", "grading was stopped before this answer was judged")
        assert j.restarts == 1 and j.process.poll() is not None
    finally:
        j.close()
    assert j.process.poll() is not None


def test_a_judge_killed_while_judging_answers_at_once_and_judges_nothing_more():
    """The grader told to stop (Ctrl-C, SIGTERM) kills the judge: a check it runs ends now, not
    after its time limit, and no judge is started again for the exercises left."""
    import threading
    import time

    j = judge.Judge(["01"], command=lambda argv: [sys.executable, "-c", FAKE_JUDGE])
    replies = []
    waiting = threading.Thread(target=lambda: replies.append(j.judge("01", "hangs", "", 600)))
    waiting.start()
    time.sleep(0.5)
    start = time.monotonic()
    j.kill()
    waiting.join(30)
    assert not waiting.is_alive() and time.monotonic() - start < 30
    assert replies[0][0] == "error" and "judge stopped" in replies[0][1]
    assert j.judge("01", "weight_grad", "", 10) == ("error", "grading was stopped before this answer was judged")
    assert j.restarts == 0 and j.process.poll() is not None
    j.close()


PRESSES_WHILE_JUDGING = r"""
import os, signal, sys, threading, time
import psutil
from course.classroom.judge import _in_child

def slow():  # until killed: a press not acted on ends in the test's timeout; gone with its parent
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.05)
    return {"status": "correct", "message": "finished"}

seen = []
for delay in [0, 0.0002, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.02, 0.1]:
    press = threading.Timer(delay, os.killpg, (0, signal.SIGINT))  # Ctrl-C: this whole process group
    try:
        press.start()
        _in_child(slow, 60)
        seen.append("finished")
    except KeyboardInterrupt as e:
        seen.append(str(e) or "before")
    press.join()
    left = psutil.Process().children(recursive=True)
    assert left == [], (delay, left)  # the child and its group killed and reaped: no zombie
quick = _in_child(lambda: {"status": "correct", "message": "ok"}, 60)
print(sorted(set(seen)), quick)
"""


def test_ctrl_c_while_the_judge_forks_a_check_stops_it_and_leaves_no_process():
    """Ctrl-C (SIGINT to the process group) at several instants of ``_in_child``'s fork and wait:
    a KeyboardInterrupt each time, the child (and its group) killed and reaped, nothing printed
    ("Exception ignored" would be a press lost in a fork), and the next judging works."""
    result = subprocess.run([sys.executable, "-c", PRESSES_WHILE_JUDGING], capture_output=True, text=True,
                            timeout=120, start_new_session=True, cwd=ROOT)  # a group of its own to press in
    assert result.returncode == 0 and result.stderr == "", result.stderr
    seen, quick = result.stdout.rsplit("] ", 1)
    assert set(eval(seen + "]")) <= {"before", "interrupted while judging: the check's process was stopped"}, seen
    assert "interrupted while judging" in seen
    assert quick == "{'status': 'correct', 'message': 'ok'}\n"


def test_ctrl_c_in_course_progress_ends_in_one_line(monkeypatch, tmp_path, capsys):
    from course.classroom import grading

    def pressed(*args, **kwargs):
        raise KeyboardInterrupt  # grade_notebooks stops what it ran, then lets it through

    monkeypatch.setattr(grading, "grade_notebooks", pressed)
    (tmp_path / "01_single_device.ipynb").write_text("{}")
    assert grading.progress([tmp_path]) == 130
    assert capsys.readouterr() == ("", "progress stopped (Ctrl-C): no verdicts\n")


def test_which_files_are_course_notebooks(tmp_path):
    table = submissions.exercise_table()
    empty = tmp_path / "01_single_device.ipynb"
    empty.write_text("")
    assert submissions.identify(empty, table) == (None, "an empty file, not a notebook: hand in the .ipynb file Jupyter saved")
    text = tmp_path / "alice.ipynb"
    text.write_text("my answers are in the email")
    assert submissions.identify(text, table)[1].startswith("not a notebook (not Jupyter's JSON)")
    other = tmp_path / "01_single_device_bob.ipynb"  # notebook 03, handed in under 01's name
    nbformat.write(nbformat.read(ROOT / "notebooks" / "03_distributed_sampler.ipynb", as_version=4), other)
    assert submissions.identify(other, table) == (None, "handed in as notebook 01 (its file name) but it is notebook 03 "
                                                        "(its Colab badge): hand in 01_single_device.ipynb")
    right = tmp_path / "homework.ipynb"
    nbformat.write(nbformat.read(ROOT / "notebooks" / "01_single_device.ipynb", as_version=4), right)
    assert submissions.identify(right, table) == ("01", None)
    nbformat.write(nbformat.v4.new_notebook(), right)
    assert submissions.identify(right, table)[1].startswith("cannot tell which course notebook")


def verdicts():
    def v(student, notebook, exercise, verdict, source=""):
        return Verdict(student, notebook, exercise, exercise, verdict, "", f"{student}.ipynb", "c0ffee", "sandboxed", source)

    same = "def weight_grad(model, x, y):\n    return 2 * (model(x) - y).T @ x / y.numel()\n"
    return [v("ann", "01", "weight_grad", "correct", same), v("ann", "01", "chunk_loss", "wrong", "def chunk_loss(): 1"),
            v("ann", "03", "rank_indices", "correct", "def rank_indices(): pass"),
            v("bob", "01", "weight_grad", "correct", same), v("bob", "01", "chunk_loss", "not attempted"),
            v("bob", "03", "rank_indices", "error"),
            v("cy", "01", "weight_grad", "correct", same + " "), v("cy", "01", "chunk_loss", "wrong", "def chunk_loss(): 2"),
            Verdict("cy", "?", "", "", "error", "an empty file, not a notebook", "cy.ipynb")]


def test_each_students_totals():
    assert report.student_table(verdicts()).splitlines() == [
        "student  01   03   total",
        "ann      1/2  1/1  2/3",
        "bob      1/2  0/1  1/3",
        "cy       1/2  0/0  1/2",
    ]
    rows = report.totals(verdicts())
    assert rows[2] == {"student": "cy", "01": "1/2", "03": "0/0", "total": "1/2", "identical answers with": "",
                       "not graded": "cy.ipynb: an empty file, not a notebook"}


def test_byte_identical_answers_are_flagged_and_nothing_else():
    assert report.identical_answers(verdicts()) == {("01", "weight_grad"): [["ann", "bob"]]}  # cy's differs by a space
    assert report.flags(verdicts()) == "identical answers to notebook 01's weight_grad: ann, bob"
    assert [r["identical answers with"] for r in report.totals(verdicts())] == ["bob", "ann", ""]


def test_the_csvs_and_answer_files(tmp_path):
    path = tmp_path / "grades.csv"
    report.write_csv(verdicts(), path)
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == report.COLUMNS and rows[0]["course"] == "c0ffee" and rows[0]["isolation"] == "sandboxed"
    assert len(rows) == len(verdicts())
    report.write_totals(verdicts(), tmp_path / "grades-students.csv")
    with open(tmp_path / "grades-students.csv", newline="", encoding="utf-8") as f:
        assert [r["total"] for r in csv.DictReader(f)] == ["2/3", "1/3", "1/2"]
    report.write_answers(verdicts(), tmp_path / "answers")
    ann = (tmp_path / "answers" / "ann.py").read_text()
    assert "# notebook 01, weight_grad: correct" in ann and "def rank_indices(): pass" in ann and "chunk_loss" not in ann
    assert (tmp_path / "answers" / "bob.py").read_text().count("# notebook") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["answers", "grades-students.csv", "grades.csv"]  # no temp file left


def test_the_sandbox_hides_folders_and_binds_back_what_is_needed(tmp_path):
    hidden, needed = tmp_path / "class", tmp_path / "class" / "venv" / "lib"
    needed.mkdir(parents=True)
    limits = sandbox.Resources(processes=7, memory=1 << 30, file_size=1 << 20, cpu=5)
    box = sandbox.Sandbox([hidden], [needed, needed / "python3"], limits)
    args = box.command(["python", "-c", "1"], scratch=tmp_path / "scratch")
    assert args[args.index("bwrap"):][:2] == ["bwrap", "--unshare-pid" if sandbox.os.geteuid() == 0 else "--unshare-all"]
    assert "--unshare-net" in args or "--unshare-all" in args
    text = " ".join(args)
    assert f"--tmpfs {hidden}" in text and f"--ro-bind {needed} {needed}" in text
    assert f"--perms 0755 --dir {hidden / 'venv'}" in text
    assert text.count("--ro-bind") == 2  # "/" and the one needed folder (python3 lies inside it)
    assert f"--bind {tmp_path / 'scratch'} {tmp_path / 'scratch'}" in text
    assert args[-9:] == ["prlimit", "--nproc=7", f"--as={1 << 30}", f"--fsize={1 << 20}", "--cpu=5:15", "--", "python", "-c", "1"]
    assert "--cpu=5:15" not in box.command(["python"], cpu=False)  # the judge: it lives as long as the grader
    assert text.index(f"--tmpfs {hidden}") < text.index(f"--ro-bind {needed}")  # hidden first, then bound back


@pytest.mark.skipif(sandbox.probe() is not None, reason=f"no sandbox here: {sandbox.probe()}")
def test_a_sandboxed_command_sees_nothing_it_should_not(tmp_path):
    import subprocess

    secret = tmp_path / "class" / "bob.ipynb"
    secret.parent.mkdir()
    secret.write_text("bob's answers")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    sandbox.give_to_sandbox(scratch)
    box = sandbox.Sandbox([secret.parent], [sys.base_prefix, sys.prefix])
    probe = ("import os, socket, sys\n"
             f"print(os.listdir({str(secret.parent)!r}))\n"
             "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit())[:2])\n"
             "for path in [sys.prefix + '/x', '/etc/x']:\n"
             "    try:\n        open(path, 'w')\n    except OSError as e:\n        print(e.errno)\n"
             f"open({str(scratch / 'mine')!r}, 'w').write('ok')\n"
             "try:\n    socket.create_connection(('pypi.org', 443), timeout=5)\nexcept OSError as e:\n    print('no network')\n")
    done = subprocess.run(box.command([sys.executable, "-c", probe], scratch), capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines() == ["[]", "[1, 2]", "30", "30", "no network"], done.stderr
    assert (scratch / "mine").read_text() == "ok"


BOMB = ("import subprocess, sys, time\n"
        "procs = []\n"
        "try:\n"
        "    for _ in range(5000):\n"
        "        procs.append(subprocess.Popen(['sleep', '60']))\n"
        "except OSError as e:\n"
        "    print(len(procs), e.errno, flush=True)\n"
        "time.sleep(float(sys.argv[1]))\n")
SPIN = ("import signal, subprocess, sys\n"  # a busy child, in a session of its own, that nobody waits for
        "child = subprocess.Popen([sys.executable, '-c', 'while True: pass'], start_new_session=True)\n"
        "print(child.wait(60) == -signal.SIGXCPU)\n")


@pytest.mark.skipif(sandbox.probe() is not None, reason=f"no sandbox here: {sandbox.probe()}")
def test_each_sandbox_has_its_own_process_count_and_cpu_time(tmp_path):
    """RLIMIT_NPROC counts a uid's processes: each sandbox runs as a user of its own (as root) or
    in a user namespace of its own, so a fork bomb stops at its own limit and no other sandbox's
    forks fail; RLIMIT_CPU stops a busy child the command left running."""
    import subprocess

    box = sandbox.Sandbox([], [sys.base_prefix, sys.prefix], sandbox.Resources(processes=30, cpu=1))
    scratch = []
    for name in ("a", "b"):
        scratch.append(tmp_path / name)
        scratch[-1].mkdir()
        sandbox.give_to_sandbox(scratch[-1])
    bomb = subprocess.Popen(box.command([sys.executable, "-c", BOMB, "5"], scratch[0]), stdout=subprocess.PIPE, text=True)
    started = bomb.stdout.readline().split()  # the bomb has stopped, and holds its processes
    other = subprocess.run(box.command([sys.executable, "-c", SPIN + BOMB, "0"], scratch[1]), capture_output=True, text=True,
                           timeout=60)
    bomb.kill()
    bomb.wait()
    assert 20 < int(started[0]) < 30 and started[1] == "11", started  # EAGAIN
    assert other.stdout.split() == ["True", *started[:2]], other.stderr
    if sandbox.os.geteuid() == 0:
        assert scratch[0].stat().st_uid != scratch[1].stat().st_uid and scratch[0].stat().st_uid >= sandbox.FIRST_USER


def test_without_bubblewrap_grading_runs_and_says_loudly_it_is_not_isolated(tmp_path, monkeypatch):
    from course.classroom import grading

    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it (the judge's python is named by its full path)
    assert sandbox.probe() == "`bwrap` not found (install the `bubblewrap` package)"
    empty = tmp_path / "ann" / "01_single_device.ipynb"
    empty.parent.mkdir()
    empty.write_text("")
    logged = []
    rows = grading.grade_notebooks([("ann", empty)], log=logged.append)
    assert logged[0].startswith("WARNING: submissions are NOT ISOLATED (`bwrap` not found")
    assert [(r.student, r.verdict, r.isolation) for r in rows] == [
        ("ann", "error", "NOT ISOLATED: `bwrap` not found (install the `bubblewrap` package)")]


def test_under_a_long_tmpdir_the_graders_folder_stays_short_enough_for_sockets(tmp_path, monkeypatch):
    """A kernel's sockets are files in the grader's folder, and a Unix socket's path has at most
    107 bytes: under a long TMPDIR (CI's pytest folders) the kernel could not start ("ZMQError:
    File name too long"); the grader then makes its folder in /tmp."""
    import tempfile

    from course.classroom import grading

    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    setting = grading.Class([], sealed=False)
    try:
        socket = setting.workdir() / "k-65535"
        assert setting.folder.parent == Path("/tmp") and len(str(socket)) < 100, socket
    finally:
        setting.close()
    assert not setting.folder.exists()
