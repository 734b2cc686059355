"""Every exercise's verdict, judged by the course's own checks: ``python -m course grade``
(an instructor, a class's notebooks) and ``python -m course progress`` (a student, their own).

A student's notebook is untrusted code, and its printed ✅ proves nothing: a notebook can
redefine ``check``, patch ``course``, edit its stored outputs or delete a check cell, and its
cells can attack the grader. So the grader trusts nothing the notebook says about itself, only
the answers it computes, and seals each submission off:

1. **A copy of the course** is made first (its hash is the version the grade records); the
   judge and every kernel import it, never the files a student could edit.
2. **The judge starts** (``python -m course.classroom.judge NN ...``, :mod:`course.classroom.judge`):
   it imports the checks before any student code runs. Each request carries a fresh token; a
   reply that does not name it is ignored. A judge that dies is started again.
3. **Each notebook runs in a fresh kernel** (:mod:`course.classroom.runner`), in a sandbox of its
   own (:mod:`course.classroom.sandbox`: own PID namespace, no network, read-only but for its
   scratch folder, no view of other submissions or the CSV, limits). Its calls on ``check`` are
   left out; a cell past its limit is interrupted; answers are taken out by value after each
   exercise and kept if the kernel later dies.
4. **The judge judges them**, each exercise in a child forked from the judge, under a time limit.
5. **The report** (:mod:`course.classroom.report`): the CSV, written atomically as each student
   finishes, each student's totals, each correct answer's source, identical answers flagged.

What this cannot stop: an answer is code, and the check runs it. An answer written to attack
the checker (rewriting the check's process when called) can forge its own verdict, no other.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from course.classroom import report, runner, sandbox
from course.classroom.judge import SEALED, Judge
from course.classroom.report import Verdict
from course.classroom.runner import GraderError, Limits, run_notebook
from course.classroom.submissions import exercise_table, find_submissions, identify
from course.runtime import interrupts

# A kernel's sockets are files in its scratch folder (ipc://FOLDER/nN/k-PORT), and a Unix socket's path
# has at most 107 bytes on Linux (103 on macOS): the grader's folder stays at most this long.
SHORT_FOLDER = 64
FINAL_NOTE = " (judged on its final definition, further down the notebook: where the exercise stands it was still the stub)"


def course_hash(folder: Path) -> str:
    """A version of the course package in ``folder``: sha256 of its files' paths and bytes."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def copy_course(dest: Path) -> Path:
    """Copy the course package the grader runs from into ``dest/course``; returns ``dest``."""
    import course

    shutil.copytree(Path(course.__file__).parent, dest / "course", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


class Class:
    """One grading run's setting: the course's copy and its version, the sandbox (or why there
    is none), the environment kernels and the judge get. ``Class(submission paths, hidden)``;
    ``close()`` removes its temporary folder."""

    def __init__(self, paths, hidden=(), sealed=True, resources=sandbox.Resources()):
        self.folder = Path(tempfile.mkdtemp(prefix="course-grade-"))
        try:
            if len(str(self.folder)) > SHORT_FOLDER:  # under a long TMPDIR the kernels' sockets could not be made
                shutil.rmtree(self.folder)
                self.folder = Path(tempfile.mkdtemp(prefix="course-grade-", dir="/tmp"))
            self._set_up(paths, hidden, sealed, resources)
        except BaseException:  # Ctrl-C while it copies the course: no folder left behind
            with interrupts.noted():
                self.close()
            raise

    def _set_up(self, paths, hidden, sealed, resources):
        from course.training.data import data_dir

        self.course = copy_course(self.folder / "course-copy")
        self.version = course_hash(self.course / "course")
        self.why_not = sandbox.probe() if sealed else "turned off (--no-sandbox)"
        self.isolation = "sandboxed" if self.why_not is None else f"NOT ISOLATED: {self.why_not}"
        data = data_dir()
        needed = [Path(sys.base_prefix), Path(sys.prefix), Path(os.path.realpath(sys.executable)).parent, self.course, data]
        hidden = [self.folder, *{Path(p).resolve().parent for p in paths}, *hidden]
        self.sandbox = sandbox.Sandbox(hidden, needed, resources) if self.why_not is None else None
        self.env = {**os.environ, "PYTHONPATH": str(self.course), "COURSE_DATA": str(data), "PYTHONDONTWRITEBYTECODE": "1"}
        self.count, self.lock = 0, threading.Lock()

    def workdir(self) -> Path:
        """A fresh scratch folder for one kernel (the only one it may write)."""
        with self.lock:
            self.count += 1
            folder = self.folder / f"n{self.count}"
        folder.mkdir()
        sandbox.give_to_sandbox(folder)
        return folder

    def kernel_env(self, workdir: Path) -> dict:
        return {**self.env, "HOME": str(workdir), "IPYTHONDIR": str(workdir / ".ipython"), "MPLCONFIGDIR": str(workdir / ".mpl")}

    def judge_command(self, argv):
        return self.sandbox.command(argv, cpu=False) if self.sandbox else argv  # it lives as long as the grader

    def unchanged(self) -> bool:
        """Not sandboxed, a notebook could have edited the course's copy: put it back if so."""
        if self.sandbox is not None or course_hash(self.course / "course") == self.version:
            return True
        shutil.rmtree(self.course / "course")
        copy_course(self.course)
        return False

    def close(self):
        shutil.rmtree(self.folder, ignore_errors=True)


def grade_notebooks(submissions, limits: Limits = Limits(), log=print, jobs: int = 1, hidden=(), sealed=True,
                    on_done=None, resources: sandbox.Resources = sandbox.Resources()) -> list[Verdict]:
    """Every exercise's verdict for each (student, notebook path) in ``submissions``, ``jobs``
    notebooks at a time; a student who handed in no copy of a notebook that others did gets
    "not attempted" rows. ``hidden``: more folders the notebooks must not see (the CSV's);
    ``sealed=False`` runs them without a sandbox, ``resources`` are each sandbox's limits;
    ``on_done(verdicts so far)`` is called as each notebook is graded."""
    table = exercise_table()
    chosen, verdicts = {}, []
    runner.resume()
    setting = Class([p for _, p in submissions], hidden, sealed, resources)
    try:
        if sealed and setting.why_not is not None:
            log(f"WARNING: submissions are NOT ISOLATED ({setting.why_not}): each can read and change your files, "
                "use the network and outlive the grader. Install bubblewrap (apt-get install bubblewrap).")
        for student, path in submissions:
            number, why = identify(path, table)
            if number is None:
                verdicts.append(Verdict(student, "?", "", "", "error", why, str(path), setting.version, setting.isolation))
                continue
            kept = chosen.setdefault((student, number), path)
            if kept != path:  # two copies of one notebook: the one with the course's name, else the first
                if path.name == table[number]["file"]:
                    chosen[student, number], kept, path = path, path, kept
                log(f"{student}: {path} ignored, {kept} is their notebook {number}")
        numbers = sorted({n for _, n in chosen})
        if not numbers:  # no file was a course notebook: nothing to run or judge
            return verdicts
        judge = Judge(numbers, command=setting.judge_command,
                      env={**setting.env, "HOME": "/tmp", SEALED: "1" if setting.sandbox else "0"})
        stop = threading.Event()

        def verdict(student, number, path, check, entry, lost):
            args = (student, number, check, judge.title(number, check))
            tail = (str(path), setting.version, setting.isolation)
            if entry is None:
                return Verdict(*args, "error", lost or "no answer", *tail)
            if "answers" in entry:
                answer, feedback = judge.judge(number, check, entry["answers"], limits.check)
                source = entry.get("source", "")
                final = entry.get("final")
                if answer == "not attempted" and final and not stop.is_set():
                    again, why = judge.judge(number, check, final["answers"], limits.check)
                    if again in ("correct", "wrong"):
                        answer, feedback, source = again, why + FINAL_NOTE, final.get("source", "")
                return Verdict(*args, answer, feedback, *tail, source=source)
            if "missing" in entry:
                missing = ", ".join(f"`{n}`" for n in entry["missing"])
                return Verdict(*args, "error", f"{missing} not defined {entry['where']}" + (f" ({entry['why']})" if entry["why"] else ""), *tail)
            return Verdict(*args, "error", entry.get("error", "no answer"), *tail)

        def grade_one(item):
            (student, number), path = item
            if stop.is_set():
                return []
            start = time.monotonic()
            exercises = table[number]["exercises"]
            for attempt in (1, 2):
                if not setting.unchanged():
                    log("the course's copy was changed by the last notebook (not sandboxed): copied again")
                workdir = setting.workdir()
                try:
                    taken, lost = run_notebook(path, exercises, limits, workdir, setting.kernel_env(workdir), setting.sandbox)
                    break
                except GraderError as e:
                    taken, lost = e.taken, f"the grader failed on this notebook twice, not the notebook's fault: {e}"
                    if stop.is_set():
                        return []
                    if attempt == 1:
                        log(f"{student} {path.name}: the grader failed ({e}), trying again")
                finally:
                    shutil.rmtree(workdir, ignore_errors=True)
            if stop.is_set():  # told to stop while it ran: judge nothing more
                return []
            done = [verdict(student, number, path, x["check"], taken.get(x["check"]), lost) for x in exercises]
            if stop.is_set():
                return []
            solved = sum(v.verdict == "correct" for v in done)
            log(f"{student} {path.name}: {solved} of {len(done)} correct ({time.monotonic() - start:.0f} s)"
                + (f" — {lost}" if lost else ""))
            with setting.lock:
                verdicts.extend(done)
                if on_done:
                    on_done(sorted(verdicts, key=lambda v: (v.student, v.notebook)))
            return done

        pool = ThreadPoolExecutor(max(1, jobs))
        try:
            for future in [pool.submit(grade_one, item) for item in chosen.items()]:
                future.result()
            pool.shutdown(wait=True)
            judge.close()
        except BaseException:
            with interrupts.noted():  # a second Ctrl-C cannot break the cleanup: noted, not raised
                stop.set()  # told to stop (SIGINT, SIGTERM): kill what runs, keep what was graded
                runner.stop_all()
                judge.kill()
                pool.shutdown(wait=True, cancel_futures=True)
            raise
        if judge.ignored:  # someone wrote into the judge's pipe: only possible without the sandbox
            log(f"WARNING: {judge.ignored} lines in the judge's replies answered no request (forged?) and were ignored")
        for student in dict.fromkeys(s for s, _ in chosen):
            for number in numbers:
                if (student, number) not in chosen:
                    verdicts += [Verdict(student, number, check, judge.title(number, check), "not attempted",
                                         f"no notebook {number} in the submission", "", setting.version, setting.isolation)
                                 for check in (x["check"] for x in table[number]["exercises"])]
        return sorted(verdicts, key=lambda v: (v.student, v.notebook))  # stable: exercises stay in the notebook's order
    finally:
        with interrupts.noted() as pressed:  # Ctrl-C while it removes the folder: removed all the same
            setting.close()
        if pressed:
            raise KeyboardInterrupt


def _stop_on_sigterm():
    """SIGTERM (``kill``, a batch system's time limit) stops grading as Ctrl-C does: cleanly."""
    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        return signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread
        return None


def grade(paths, csv_path=None, limits: Limits = Limits(), jobs: int = 1, sealed: bool = True,
          resources: sandbox.Resources = sandbox.Resources()) -> int:
    """``python -m course grade``: every student's verdicts to ``csv_path`` (rewritten as each
    student finishes), their totals to ``NAME-students.csv``, the source of their correct
    answers to ``NAME-answers/STUDENT.py``; the tables printed."""
    submissions = find_submissions(paths)
    if not submissions:
        raise SystemExit("no notebooks found in " + " ".join(map(str, paths)))
    csv_path = Path(csv_path).resolve() if csv_path else None
    if csv_path:
        try:  # now, not after hours of grading
            report.write_csv([], csv_path)
        except OSError as e:
            raise SystemExit(f"--csv {csv_path}: cannot write it ({e.strerror})")
    previous = _stop_on_sigterm()
    try:
        verdicts = grade_notebooks(submissions, limits, log=lambda s: print(s, file=sys.stderr, flush=True), jobs=jobs, sealed=sealed,
                                   resources=resources,
                                   hidden=[csv_path.parent] if csv_path else [],
                                   on_done=(lambda so_far: report.write_csv(so_far, csv_path)) if csv_path else None)
    except KeyboardInterrupt:
        print("grading stopped: " + (f"{csv_path} holds the students graded so far" if csv_path else "nothing written"),
              file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if csv_path:
        report.write_csv(verdicts, csv_path)
        totals = csv_path.with_name(csv_path.stem + "-students.csv")
        answers = csv_path.with_name(csv_path.stem + "-answers")
        report.write_totals(verdicts, totals)
        report.write_answers(verdicts, answers)
        print(f"wrote {len(verdicts)} rows to {csv_path}, each student's totals to {totals}, "
              f"the source of each correct answer to {answers}/", file=sys.stderr)
    isolation = {v.isolation for v in verdicts} or {""}
    version = {v.course for v in verdicts} or {""}
    print(f"course version {'/'.join(version)}; submissions {'/'.join(isolation)}")
    print(report.summary(verdicts))
    print()
    print(report.student_table(verdicts))
    flagged = report.flags(verdicts)
    if flagged:
        print("\nlook at these:\n" + flagged)
    return 0


def progress(paths=(), limits: Limits = Limits(), jobs: int = 1) -> int:
    """``python -m course progress``: the verdicts for your own notebooks (the saved files)."""
    if not paths:
        from course.classroom.notebooks import STUDENT

        paths = [Path("notebooks") if Path("notebooks").is_dir() else STUDENT]
    notebooks = [p for path in map(Path, paths) for p in (sorted(path.glob("[0-9][0-9]_*.ipynb")) if path.is_dir() else [path])]
    if not notebooks:
        raise SystemExit("no notebooks found in " + " ".join(map(str, paths)))
    try:
        verdicts = grade_notebooks([("you", p) for p in notebooks], limits, log=lambda s: print(s, file=sys.stderr, flush=True),
                                   jobs=jobs, sealed=False)  # your own notebooks: no sandbox needed
    except KeyboardInterrupt:  # Ctrl-C: everything it ran is stopped; one line, no traceback
        print("progress stopped (Ctrl-C): no verdicts", file=sys.stderr)
        return 130
    print(report.progress_table(verdicts))
    return 0
