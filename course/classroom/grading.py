"""Every exercise's verdict, judged by the course's own checks: ``python -m course grade``
(an instructor, a class's notebooks) and ``python -m course progress`` (a student, their own).

A student's notebook is untrusted code, and its printed ✅ proves nothing: a notebook can
redefine ``check``, patch ``course``, edit its stored outputs or delete a check cell. So the
grader trusts nothing the notebook says about itself, only the answers it computes:

1. **The judge starts first** (``python -m course.classroom.grading judge NN ...``, a process of its own):
   it imports the course's checks before any student code runs, so what it judges with is
   the course as installed.
2. **Each notebook runs in a fresh kernel** (nbclient), in a temporary folder, never in the
   grader's process, with a time limit per cell and per notebook. Its calls on ``check``
   are left out: their verdict would not count. A cell past its limit is
   interrupted and the notebook goes on, as in Jupyter. A kernel that dies or ignores the
   interrupt costs that notebook's exercises (marked ``error``, with the reason), nothing else.
3. **The answers are taken out by value**: after each exercise's check cell (or, if it was
   deleted, its answer cells), a cell of the grader's pickles with cloudpickle the names that
   exercise's ``check.NAME(...)`` call passes in the solution notebook
   (``course/checks/answers.json``, written by ``python -m course build``) into a file. Not
   at the end: some notebooks bind an answer's name to the course's own version after the
   exercise. The kernel is then shut down; nothing else of it is kept.
4. **The judge judges them**: each exercise in a child process forked from the judge (on
   Linux), which loads that exercise's answers and calls the real check, under a time limit.
   Whatever an answer does when the check calls it dies with that child. An answer that is
   the course's own function (imported, not written) is no answer.

What this cannot stop: an answer is code, and the check runs it. An answer written to attack
the checker (rewriting the check's process when called, or the course's files on disk while
its notebook runs) could forge its own verdict; run the grader in a container (README).
"""

from __future__ import annotations

import ast
import base64
import csv
import importlib
import json
import math
import os
import queue
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ANSWERS_FILE = Path(__file__).parents[1] / "checks" / "answers.json"
VERDICTS = {"correct": "correct", "wrong": "wrong", "todo": "not attempted", "error": "error"}
ICONS = {"correct": "✅", "wrong": "❌", "not attempted": "✏️", "error": "💥"}
COLUMNS = ["student", "notebook", "exercise", "title", "verdict", "feedback", "file"]
MAX_ANSWER_BYTES = 64 << 20  # one exercise's answers, pickled


@dataclass(frozen=True)
class Limits:
    """Time limits, in seconds."""

    cell: float = 120  # one cell of the student's notebook
    notebook: float = 900  # all its cells together
    check: float = 180  # judging one exercise
    interrupt: float = 10  # a kernel interrupted at a cell's limit, to answer again


@dataclass
class Verdict:
    student: str
    notebook: str  # "03"
    exercise: str  # the check's name: rank_indices
    title: str  # "Exercise 1 (rank_indices)"
    verdict: str  # correct, wrong, not attempted or error
    feedback: str
    file: str

    def row(self) -> dict:
        return {c: getattr(self, c) for c in COLUMNS}


def exercise_table() -> dict:
    """{"03": {"file": "03_distributed_sampler.ipynb", "exercises": [{"check": ..., "answers": [names],
    "check_cell": id, "answer_cells": [ids]}, ...]}}: see ``course.classroom.notebooks.exercise_answers``."""
    return json.loads(ANSWERS_FILE.read_text(encoding="utf-8"))


# --------------------------------------------------------------------------- which notebooks


def notebook_number(path: Path, nb, table: dict) -> str | None:
    """Which course notebook ``path`` is: by its file name (``03_distributed_sampler.ipynb``,
    ``alice_03_distributed_sampler.ipynb``, ``03_x.ipynb``), else by its "Open in Colab" badge."""
    for number, entry in table.items():
        if Path(entry["file"]).stem in path.stem:
            return number
    match = re.search(r"(?<![0-9])([0-9]{2})_", path.name)
    if match and match[1] in table:
        return match[1]
    for cell in nb.cells[:1]:
        match = re.search(r"/(?:notebooks|solutions)/([0-9]{2})_\w+\.ipynb", cell.source)
        if match and match[1] in table:
            return match[1]
    return None


def find_submissions(paths) -> list[tuple[str, Path]]:
    """(student, notebook) for each submission: a folder is one student's (named for the
    folder; its notebooks, in subfolders too); a notebook given alone belongs to its folder's
    student if it has a course notebook's name (``alice/03_distributed_sampler.ipynb``),
    else to the student it is named for (``alice.ipynb``)."""
    table = exercise_table()
    course_names = {entry["file"] for entry in table.values()}
    found = []
    for path in map(Path, paths):
        if path.is_dir():
            student = path.resolve().name
            found += [(student, p) for p in sorted(path.rglob("*.ipynb")) if ".ipynb_checkpoints" not in p.parts]
        elif path.is_file() and path.suffix == ".ipynb":
            found.append((path.resolve().parent.name if path.name in course_names else path.stem, path))
        else:
            raise SystemExit(f"{path}: not a notebook (.ipynb) or a folder of them")
    return found


# --------------------------------------------------------------------------- running a notebook

_EXTRACT = """\
def _course_grade_extract(exercises, path):
    import base64, json, cloudpickle
    namespace, out = get_ipython().user_ns, {}
    for check, names in exercises:
        missing = [name for name in names if name not in namespace]
        try:
            if missing:
                out[check] = {"missing": missing}
            else:
                data = cloudpickle.dumps(tuple(namespace[name] for name in names))
                out[check] = {"answers": base64.b64encode(data).decode("ascii")}
        except Exception as e:
            out[check] = {"error": f"{type(e).__name__}: {e}"}
    with open(path, "w") as f:
        json.dump(out, f)
"""


def without_checks(source: str) -> str:
    """A cell's source without its calls on ``check`` (``check.x(x)``, ``check.x.hint()``): their
    verdict would not count, and running them costs time. Unchanged if the cell is not plain
    Python (IPython syntax) or such a call shares a line with other code."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source

    def on_check(node):
        while isinstance(node, (ast.Attribute, ast.Call)):
            node = node.func if isinstance(node, ast.Call) else node.value
        return isinstance(node, ast.Name) and node.id == "check"

    drop, keep = set(), set()
    for statement in tree.body:
        lines = range(statement.lineno - 1, statement.end_lineno)
        is_check = isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call) and on_check(statement.value)
        (drop if is_check else keep).update(lines)
    if drop & keep:
        return source
    return "".join(line for i, line in enumerate(source.splitlines(keepends=True)) if i not in drop)


def _describe(index, source: str) -> str:
    first = next((line.strip() for line in source.splitlines() if line.strip()), "")
    return f"cell {index + 1} (`{first[:40]}{'…' if len(first) > 40 else ''}`)"


def extraction_points(nb, exercises: list) -> dict:
    """{cell index: the exercises whose answers are taken out after that cell}: after the
    exercise's check cell, else after the last of its answer cells (found by cell id), else at
    the end (index None). Not simply at the end: some notebooks rebind an answer's name to the
    course's own version after the exercise (``from course.parallel.zero import zero1_step``)."""
    ids = {cell.get("id"): index for index, cell in enumerate(nb.cells)}
    points = {}
    for exercise in exercises:
        answer_cells = [ids[a] for a in exercise["answer_cells"] if a in ids]
        at = ids.get(exercise["check_cell"], max(answer_cells, default=None))
        points.setdefault(at, []).append(exercise)
    return points


class _Lost(Exception):
    """Every exercise of the notebook is lost; the message says why."""


def run_notebook(path: Path, exercises: list, limits: Limits) -> tuple[dict, str | None]:
    """Run one student notebook in a fresh kernel and take out each exercise's answers.

    Returns ``(taken, lost)``: ``taken`` maps each exercise to ``{"answers": base64 pickle}``,
    ``{"missing": [names], "where": ..., "why": ...}`` or ``{"error": why}``; ``lost`` says why
    every exercise is lost (the kernel died or would not stop), else None. ``why`` is the
    failure (a cell that raised or ran past its limit) of one of the exercise's own answer
    cells, or, if none of them is in the notebook, the last failure before the answers were
    taken; else None: never another exercise's failure, never a later cell's."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    from nbclient.util import run_sync

    from course.runtime import proctree

    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as e:  # not JSON, not a notebook
        return {}, f"cannot read the notebook: {type(e).__name__}: {e}"
    points = extraction_points(nb, exercises)
    ids = {cell.get("id") for cell in nb.cells}
    token = uuid.uuid4().hex
    notes, taken = [], {}  # notes: (cell id, what went wrong in that cell)
    with tempfile.TemporaryDirectory(prefix="course-grade-") as tmp:
        nbformat.write(nb, Path(tmp) / path.name)  # the copy the kernel runs beside; the submission is never touched
        client = NotebookClient(nb, kernel_name="python3", allow_errors=True, shutdown_kernel="immediate",
                                resources={"metadata": {"path": tmp}})

        def run(cell, index, limit):
            client.timeout = max(1, math.ceil(limit))
            client.execute_cell(cell, index)

        def run_own(source, limit):  # a cell of the grader's
            nb.cells.append(nbformat.v4.new_code_cell(source))
            run(nb.cells[-1], len(nb.cells) - 1, limit)

        def run_students(index, cell, left) -> bool:
            """One of the notebook's cells, without its calls on ``check``; False if it
            ran into the notebook's limit."""
            source, cell.source = cell.source, without_checks(cell.source)
            try:
                if cell.source.strip():
                    run(cell, index, min(limits.cell, left))
            except CellTimeoutError:
                run_sync(client.km.interrupt_kernel)()
                try:
                    run_own("pass", limits.interrupt)
                except CellTimeoutError:
                    raise _Lost(f"{_describe(index, source)} ran past its time limit and did not stop when interrupted") from None
                if left < limits.cell:
                    return False
                notes.append((cell.get("id"), f"{_describe(index, source)} ran past its {limits.cell:g} s limit and was interrupted"))
                return True
            finally:
                cell.source = source
            errors = [o for o in cell.get("outputs", []) if o.output_type == "error"]
            if errors:
                notes.append((cell.get("id"), f"{_describe(index, source)} raised {errors[0].ename}: {errors[0].evalue}"))
            return True

        def why_missing(exercise):
            own = [note for id, note in notes if id in exercise["answer_cells"]]
            if own or any(id in ids for id in exercise["answer_cells"]):
                return own[-1] if own else None
            return notes[-1][1] if notes else None

        def take(due, where):
            out = Path(tmp) / f"answers-{token}-{len(taken)}.json"
            names = [[x["check"], x["answers"]] for x in due]
            try:
                run_own(f"{_EXTRACT}_course_grade_extract({names!r}, {str(out)!r})\ndel _course_grade_extract\n", limits.cell)
            except CellTimeoutError:
                raise _Lost("taking the answers out of the kernel ran past its time limit") from None
            found = _read_taken(out, [x["check"] for x in due])
            if isinstance(found, str):
                raise _Lost(found)
            for exercise in due:
                entry = found[exercise["check"]]
                taken[exercise["check"]] = {**entry, "where": where, "why": why_missing(exercise)} if "missing" in entry else entry

        index = None
        try:
            with client.setup_kernel(env={**os.environ, proctree.MARK: token},
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL):
                deadline = time.monotonic() + limits.notebook
                for index, cell in enumerate(list(nb.cells)):
                    left = deadline - time.monotonic()
                    if left <= 0 or (cell.cell_type == "code" and not run_students(index, cell, left)):
                        break
                    if index in points:
                        take(points.pop(index), f"after {_describe(index, cell.source)}")
                else:
                    if None in points:
                        take(points.pop(None), "when the notebook ended")
                for due in points.values():  # not reached
                    stopped = f"not reached: the notebook ran past its {limits.notebook:g} s limit at {_describe(index, nb.cells[index].source)}"
                    taken.update((x["check"], {"error": stopped}) for x in due)
        except _Lost as e:
            return {}, str(e)
        except DeadKernelError:
            where = _describe(index, nb.cells[index].source) if index is not None else "start-up"
            return {}, f"the kernel died while running {where} (it crashed, exited or ran out of memory)"
        except Exception as e:  # the kernel would not start, ...: this notebook's exercises only
            return {}, f"grading this notebook failed: {type(e).__name__}: {e}"
        finally:
            for process in proctree.marked(token).values():  # whatever the notebook started and left running
                try:
                    process.kill()
                except Exception:
                    pass
    return taken, None


def _read_taken(out: Path, checks: list):
    """One extraction file, checked (the kernel wrote it: it is data, never trusted code); a
    string says why it cannot be used."""
    if not out.is_file():
        return "the grader's cell wrote no answers (the notebook changed the kernel too much)"
    if out.stat().st_size > MAX_ANSWER_BYTES * len(checks) * 2:
        return "the answers are too large to judge"
    try:
        taken = json.loads(out.read_text(encoding="utf-8"))
    except ValueError as e:
        return f"the answers could not be read: {e}"
    if not isinstance(taken, dict):
        return "the answers could not be read"
    clean = {}
    for check in checks:
        entry = taken.get(check)
        if isinstance(entry, dict) and len(entry) == 1:
            (kind, value), = entry.items()
            if kind == "answers" and isinstance(value, str) and len(value) <= MAX_ANSWER_BYTES * 4 // 3 + 4:
                clean[check] = entry
                continue
            if kind == "missing" and isinstance(value, list) and all(isinstance(v, str) for v in value):
                clean[check] = entry
                continue
            if kind == "error" and isinstance(value, str):
                clean[check] = {"error": f"could not copy the answer out of the notebook: {value[:500]}"}
                continue
        clean[check] = {"error": "the answer could not be taken out of the notebook (too large, or changed by the notebook)"}
    return clean


# --------------------------------------------------------------------------- the judge


class Judge:
    """The judge process, seen from the grader: ``Judge(["01", "03"])`` imports those
    notebooks' checks in a new process; ``judge("01", "weight_grad", answers, timeout)``."""

    def __init__(self, numbers):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "course.classroom.grading", "judge", *numbers],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
        )
        self.lines, self.lock = queue.Queue(), threading.Lock()  # one request at a time
        threading.Thread(target=self._read, daemon=True).start()
        hello = self._reply(600)
        if hello is None:
            raise RuntimeError("the judge process did not start: run `python -m course doctor`")
        self.titles, self.broken = hello.get("titles", {}), hello.get("broken", {})

    def _read(self):
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _reply(self, timeout):
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return None
        try:
            return json.loads(line) if line else None
        except ValueError:
            return None

    def title(self, number, check) -> str:
        return self.titles.get(number, {}).get(check, check)

    def judge(self, number, check, answers: str, timeout: float) -> tuple[str, str]:
        """(verdict, feedback) for one exercise's answers (base64 cloudpickle of a tuple)."""
        if number in self.broken:
            return "error", f"the checks of notebook {number} cannot be imported here: {self.broken[number]}"
        if self.process.poll() is not None:
            return "error", "the judge process has stopped"
        with self.lock:
            self.process.stdin.write(json.dumps({"notebook": number, "check": check, "answers": answers, "timeout": timeout}) + "\n")
            self.process.stdin.flush()
            reply = self._reply(timeout + 60)
        if not isinstance(reply, dict) or reply.get("status") not in VERDICTS or not isinstance(reply.get("message"), str):
            return "error", "the judge gave no verdict"
        return VERDICTS[reply["status"]], reply["message"]

    def close(self):
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _judge_one(exercise, answers: str) -> dict:
    """Inside the judge's child: load one exercise's answers, call the real check."""
    import cloudpickle

    try:
        loaded = cloudpickle.loads(base64.b64decode(answers))
        if not isinstance(loaded, tuple):
            raise TypeError(f"expected a tuple of answers, got {type(loaded).__name__}")
    except BaseException as e:
        return {"status": "error", "message": f"the answer could not be loaded for judging: {type(e).__name__}: {e}"}
    for answer in loaded:  # e.g. the notebook's own `from course.parallel.zero import zero1_step`, after the exercise
        module = getattr(answer, "__module__", None)
        if callable(answer) and isinstance(module, str) and module.split(".")[0] == "course":
            return {"status": "error", "message": f"the answer is the course's own {module}.{getattr(answer, '__qualname__', '')}, "
                                                  "not one written in the notebook"}
    try:
        feedback = exercise(*loaded)
    except BaseException as e:  # what the student sees in the notebook: a traceback, not a verdict
        return {"status": "error", "message": f"the check raised {type(e).__name__}: {e}"}
    return {"status": feedback.status, "message": feedback.message}


def _in_child(fn, timeout: float, keep_closed=()) -> dict:
    """``fn()`` (a dict) in a forked child of its own process group, killed after ``timeout`` s."""
    sys.stdout.flush()
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no way back to the grader but its pipe
        code = 1
        try:
            os.close(read_end)
            for fd in keep_closed:
                os.close(fd)
            os.setpgid(0, 0)
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            data = json.dumps(fn()).encode()
            with os.fdopen(write_end, "wb") as pipe:
                pipe.write(data)
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    chunks, deadline, late = [], time.monotonic() + timeout, False
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([pipe], [], [], left)[0]:
                late = True
                break
            data = pipe.read(1 << 16)
            if not data:
                break
            chunks.append(data)
    try:
        os.killpg(pid, signal.SIGKILL)  # the check's ranks, if any are left
    except OSError:
        pass
    _, status = os.waitpid(pid, 0)
    if late:
        return {"status": "error", "message": f"the check ran past its {timeout:g} s limit"}
    try:
        return json.loads(b"".join(chunks))
    except ValueError:
        how = f"signal {-os.waitstatus_to_exitcode(status)}" if os.WIFSIGNALED(status) else f"exit code {os.waitstatus_to_exitcode(status)}"
        return {"status": "error", "message": f"the check's process died ({how})"}


def serve(numbers) -> int:
    """The judge (``python -m course.classroom.grading judge NN ...``): imports those notebooks' checks,
    says hello (their titles) on stdout, then answers one JSON request per line of stdin."""
    from course.classroom.exercises import Exercise

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to stderr, never into the replies
    modules, titles, broken = {}, {}, {}
    for number in numbers:
        try:
            modules[number] = importlib.import_module(f"course.checks.nb{number}")
        except Exception as e:
            broken[number] = f"{type(e).__name__}: {e}"
            continue
        titles[number] = {name: x.name for name, x in vars(modules[number]).items() if isinstance(x, Exercise)}
    proto.write(json.dumps({"titles": titles, "broken": broken}) + "\n")
    isolate = sys.platform == "linux"  # fork each exercise; elsewhere judge in this process
    for line in sys.stdin:
        request = json.loads(line)
        exercise = getattr(modules.get(request["notebook"]), request["check"], None)
        if not isinstance(exercise, Exercise):
            reply = {"status": "error", "message": f"notebook {request['notebook']} has no exercise {request['check']}"}
        elif isolate:
            reply = _in_child(lambda: _judge_one(exercise, request["answers"]), request["timeout"],
                              keep_closed=(proto.fileno(), sys.stdin.fileno()))
        else:
            reply = _judge_one(exercise, request["answers"])
        proto.write(json.dumps(reply) + "\n")
    return 0


# --------------------------------------------------------------------------- grading


def grade_notebooks(submissions, limits: Limits = Limits(), log=print, jobs: int = 1) -> list[Verdict]:
    """Every exercise's verdict for each (student, notebook path) in ``submissions``, ``jobs``
    notebooks at a time; a student who handed in no copy of a notebook that others did gets
    "not attempted" rows."""
    from concurrent.futures import ThreadPoolExecutor

    import nbformat

    table = exercise_table()
    chosen, verdicts = {}, []
    for student, path in submissions:
        try:
            number = notebook_number(path, nbformat.read(path, as_version=4), table)
        except Exception:
            number = None
        if number is None:
            verdicts.append(Verdict(student, "?", "", "", "error", "cannot tell which course notebook this is: "
                                    "keep the course's file name (03_distributed_sampler.ipynb)", str(path)))
            continue
        kept = chosen.setdefault((student, number), path)
        if kept != path:  # two copies of one notebook: the one with the course's name, else the first
            if path.name == table[number]["file"]:
                chosen[student, number], kept, path = path, path, kept
            log(f"{student}: {path} ignored, {kept} is their notebook {number}")
    numbers = sorted({n for _, n in chosen})
    judge = Judge(numbers)

    def grade_one(item):
        (student, number), path = item
        start = time.monotonic()
        exercises = table[number]["exercises"]
        taken, lost = run_notebook(path, exercises, limits)
        done = []
        for check in (x["check"] for x in exercises):
            entry = taken.get(check, {})
            if lost:
                verdict, feedback = "error", lost
            elif "answers" in entry:
                verdict, feedback = judge.judge(number, check, entry["answers"], limits.check)
            elif "missing" in entry:
                missing = ", ".join(f"`{n}`" for n in entry["missing"])
                verdict, feedback = "error", f"{missing} not defined {entry['where']}" + (f" ({entry['why']})" if entry["why"] else "")
            else:
                verdict, feedback = "error", entry.get("error", "no answer")
            done.append(Verdict(student, number, check, judge.title(number, check), verdict, feedback, str(path)))
        solved = sum(v.verdict == "correct" for v in done)
        log(f"{student} {path.name}: {solved} of {len(done)} correct ({time.monotonic() - start:.0f} s)"
            + (f" — {lost}" if lost else ""))
        return done

    try:
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            for done in pool.map(grade_one, chosen.items()):
                verdicts += done
        for student in dict.fromkeys(s for s, _ in chosen):
            for number in numbers:
                if (student, number) not in chosen:
                    verdicts += [Verdict(student, number, check, judge.title(number, check), "not attempted",
                                         f"no notebook {number} in the submission", "")
                                 for check in (x["check"] for x in table[number]["exercises"])]
    finally:
        judge.close()
    return sorted(verdicts, key=lambda v: (v.student, v.notebook))  # stable: exercises stay in the notebook's order


def write_csv(verdicts, path):
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(v.row() for v in verdicts)


def _table(rows) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def summary(verdicts) -> str:
    """How many students solved each exercise, and how the others did."""
    rows = [("notebook", "exercise", "solved", "wrong", "not attempted", "error")]
    exercises = sorted(dict.fromkeys((v.notebook, v.title) for v in verdicts if v.exercise), key=lambda e: e[0])
    for notebook, title in exercises:
        these = [v.verdict for v in verdicts if (v.notebook, v.title) == (notebook, title)]
        rows.append((notebook, title, f"{these.count('correct')}/{len(these)}", these.count("wrong"),
                     these.count("not attempted"), these.count("error")))
    return _table(rows)


def progress_table(verdicts) -> str:
    rows = [("notebook", "exercise", "verdict", "feedback")]
    rows += [(Path(v.file).stem, v.title, f"{ICONS[v.verdict]} {v.verdict}", v.feedback) for v in verdicts]
    solved = sum(v.verdict == "correct" for v in verdicts if v.exercise)
    return _table(rows) + f"\n\n{solved} of {sum(bool(v.exercise) for v in verdicts)} exercises solved."


def grade(paths, csv_path=None, limits: Limits = Limits(), jobs: int = 1) -> int:
    """``python -m course grade``: every student's verdicts to ``csv_path``, a summary printed."""
    submissions = find_submissions(paths)
    if not submissions:
        raise SystemExit("no notebooks found in " + " ".join(map(str, paths)))
    if csv_path:
        try:  # now, not after hours of grading
            write_csv([], csv_path)
        except OSError as e:
            raise SystemExit(f"--csv {csv_path}: cannot write it ({e.strerror})")
    verdicts = grade_notebooks(submissions, limits, log=lambda s: print(s, file=sys.stderr, flush=True), jobs=jobs)
    if csv_path:
        write_csv(verdicts, csv_path)
        print(f"wrote {len(verdicts)} rows to {csv_path}", file=sys.stderr)
    print(summary(verdicts))
    return 0


def progress(paths=(), limits: Limits = Limits(), jobs: int = 1) -> int:
    """``python -m course progress``: the verdicts for your own notebooks (the saved files)."""
    if not paths:
        from course.classroom.notebooks import STUDENT

        paths = [Path("notebooks") if Path("notebooks").is_dir() else STUDENT]
    notebooks = [p for path in map(Path, paths) for p in (sorted(path.glob("[0-9][0-9]_*.ipynb")) if path.is_dir() else [path])]
    if not notebooks:
        raise SystemExit("no notebooks found in " + " ".join(map(str, paths)))
    verdicts = grade_notebooks([("you", p) for p in notebooks], limits, log=lambda s: print(s, file=sys.stderr, flush=True), jobs=jobs)
    print(progress_table(verdicts))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["judge"]:
        sys.exit("usage: python -m course.classroom.grading judge NN [NN ...]  (the grader starts this; see python -m course grade)")
    sys.exit(serve(sys.argv[2:]))
