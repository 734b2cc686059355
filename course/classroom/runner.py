"""Running one student notebook in a fresh kernel and taking each exercise's answers out by value.

The notebook's calls on ``check`` are left out (their verdict would not count); after each
exercise's check cell (or, if it was deleted, its answer cells) a cell of the grader's pickles
with cloudpickle the names that exercise's ``check.NAME(...)`` call passes in the solution
notebook (``course/checks/answers.json``) into a file: data the grader reads, never code.
"""

from __future__ import annotations

import ast
import asyncio
import json
import math
import os
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

MAX_ANSWER_BYTES = 64 << 20  # one exercise's answers, pickled


@dataclass(frozen=True)
class Limits:
    """Time limits, in seconds."""

    cell: float = 120  # one cell of the student's notebook
    notebook: float = 900  # all its cells together
    check: float = 180  # judging one exercise
    interrupt: float = 10  # a kernel interrupted at a cell's limit, to answer again



_EXTRACT = """\
def _course_grade_extract(exercises, path):
    import base64, inspect, json, cloudpickle
    namespace, out = get_ipython().user_ns, {}
    for check, names in exercises:
        missing = [name for name in names if name not in namespace]
        try:
            if missing:
                out[check] = {"missing": missing}
            else:
                answers = tuple(namespace[name] for name in names)
                data = cloudpickle.dumps(answers)
                out[check] = {"answers": base64.b64encode(data).decode("ascii"), "source": ""}
                try:
                    out[check]["source"] = "\\n".join(inspect.getsource(a) for a in answers)
                except Exception:
                    pass
        except Exception as e:
            out[check] = {"error": f"{type(e).__name__}: {e}"}
    with open(path, "w") as f:
        json.dump(out, f)
"""
_AST = threading.Lock()  # CPython 3.11's ast keeps its recursion depth in shared state: one parse at a time


def without_checks(source: str) -> str:
    """A cell's source without its calls on ``check`` (``check.x(x)``, ``check.x.hint()``): their
    verdict would not count, and running them costs time. Unchanged if the cell is not plain
    Python (IPython syntax) or such a call shares a line with other code."""
    try:
        with _AST:
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


_live = set()  # the kernels running now (their Popen): stop_all() kills them
_stopping = threading.Event()


def stop_all():
    """Kill every kernel running now, with its sandbox, and any started after (the grader was told to stop)."""
    _stopping.set()
    for process in list(_live):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except OSError:
            pass


def resume():
    """Let kernels start again (a new grading run, after one that was stopped)."""
    _stopping.clear()


class _Lost(Exception):
    """The rest of the notebook is lost; the message says why."""


class GraderError(Exception):
    """The grader failed on a notebook, not the notebook: ``taken`` holds what it had taken out."""

    def __init__(self, message, taken):
        super().__init__(message)
        self.taken = taken


def kernel_manager_class(workdir: Path, sandbox=None):
    """A Jupyter kernel manager whose kernel talks over Unix sockets in ``workdir`` (a sandbox has no
    network to reach the grader's TCP ports) and starts, if ``sandbox`` is given, inside it."""
    from jupyter_client.manager import AsyncKernelManager

    from course.classroom.sandbox import give_to_sandbox

    class Manager(AsyncKernelManager):
        started = []  # the kernel's process (a Popen), once started: bubblewrap's, if sandboxed

        def __init__(self, **kwargs):
            super().__init__(transport="ipc", ip=str(workdir / "k"), connection_file=str(workdir / "kernel.json"), **kwargs)

        def write_connection_file(self, **kwargs):
            super().write_connection_file(**kwargs)
            give_to_sandbox(Path(self.connection_file), like=workdir)  # the kernel reads it

        async def _async_launch_kernel(self, kernel_cmd, **kw):
            await super()._async_launch_kernel(kernel_cmd, **kw)
            Manager.started.append(self.provisioner.process)
            _live.add(self.provisioner.process)  # from its first moment: stop_all() reaches a kernel starting up
            if _stopping.is_set():
                stop_all()

        @property
        def kernel_spec(self):
            spec = super().kernel_spec
            if spec is not None and sandbox is not None:  # a signal to its process group would stop the
                spec.interrupt_mode = "message"  # sandbox itself: the kernel interrupts itself when asked
            return spec

        def format_kernel_cmd(self, extra_arguments=None):
            argv = super().format_kernel_cmd(extra_arguments)
            # ipykernel exits when its parent looks like init, as bubblewrap's process does (pid 1):
            # without JPY_PARENT_PID it does not watch its parent (the sandbox dies with the grader)
            return sandbox.command(argv, workdir, unset=["JPY_PARENT_PID"]) if sandbox is not None else argv

    return Manager


def run_notebook(path: Path, exercises: list, limits: Limits, workdir: Path, env: dict, sandbox=None) -> tuple[dict, str | None]:
    """Run one student notebook in a fresh kernel (in ``sandbox``, if given), in ``workdir`` (the
    one folder it may write), and take out each exercise's answers.

    Returns ``(taken, lost)``: ``taken`` maps each exercise to ``{"answers": base64 pickle,
    "source": ...}``, ``{"missing": [names], "where": ..., "why": ...}`` or ``{"error": why}``;
    ``lost`` says why the exercises not in ``taken`` are lost (the kernel died or would not stop),
    else None: answers taken before are kept. ``why`` is the failure (a cell that raised or ran
    past its limit) of one of the exercise's own answer cells, or, if none of them is in the
    notebook, the last failure before the answers were taken; else None: never another
    exercise's failure, never a later cell's. An answer taken at the end that differs from the
    one taken where its exercise stands is kept as ``"final"`` (the stub left in place, the answer
    written further down). Raises :class:`GraderError` if the grader itself failed."""
    import logging

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
    nbformat.write(nb, workdir / path.name)  # the copy the kernel runs beside; the submission is never touched
    quiet = logging.getLogger("course.grading.nbclient")
    quiet.setLevel(logging.CRITICAL)  # an interrupted cell is reported in the verdict, not as a traceback
    manager = kernel_manager_class(workdir, sandbox)
    client = NotebookClient(nb, kernel_name="python3", allow_errors=True, shutdown_kernel="immediate", log=quiet,
                            resources={"metadata": {"path": str(workdir)}}, kernel_manager_class=manager)

    def run(cell, index, limit):
        client.timeout = max(1, math.ceil(limit))
        try:
            client.execute_cell(cell, index)
        except CellTimeoutError:
            run_sync(_stop_reading_outputs)()
            raise
        finally:  # keep only errors: 50 MB printed by a cell stays out of the grader's memory
            cell.outputs = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]

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

    def extract(due) -> dict:
        out = workdir / f"answers-{token}-{len(taken)}-{len(due)}.json"
        names = [[x["check"], x["answers"]] for x in due]
        try:
            run_own(f"{_EXTRACT}_course_grade_extract({names!r}, {str(out)!r})\ndel _course_grade_extract\n", limits.cell)
        except CellTimeoutError:
            raise _Lost("taking the answers out of the kernel ran past its time limit") from None
        found = _read_taken(out, [x["check"] for x in due])
        if isinstance(found, str):
            raise _Lost(found)
        return found

    def take(due, where):
        found = extract(due)
        for exercise in due:
            entry = found[exercise["check"]]
            taken[exercise["check"]] = {**entry, "where": where, "why": why_missing(exercise)} if "missing" in entry else entry

    def take_finals():
        """Each answer as the notebook ends, where it differs from the one taken at its exercise."""
        due = [x for x in exercises if "answers" in taken.get(x["check"], {})]
        if due:
            for check, entry in extract(due).items():
                if "answers" in entry and entry["answers"] != taken[check]["answers"]:
                    taken[check]["final"] = entry

    index = None
    try:
        with client.setup_kernel(env={**env, proctree.MARK: token}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL):
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
                take_finals()
            for due in points.values():  # not reached
                stopped = f"not reached: the notebook ran past its {limits.notebook:g} s limit at {_describe(index, nb.cells[index].source)}"
                taken.update((x["check"], {"error": stopped}) for x in due)
    except _Lost as e:
        return taken, str(e)
    except DeadKernelError:
        where = _describe(index, nb.cells[index].source) if index is not None else "start-up"
        if manager.started and _out_of_cpu_time(manager.started[-1]):
            return taken, f"the kernel ran out of CPU time (its limit: {sandbox.resources.cpu} s) while running {where}"
        return taken, f"the kernel died while running {where} (it crashed, exited, was killed or ran out of memory)"
    except Exception as e:  # the kernel would not start, ...: the grader's failure, not the notebook's
        raise GraderError(f"{type(e).__name__}: {e}", taken) from e
    finally:
        _live.difference_update(manager.started)
        for process in proctree.marked(token).values():  # not sandboxed: whatever the notebook left running
            try:
                process.kill()
            except Exception:
                pass
    return taken, None


async def _stop_reading_outputs():
    """Cancel the task nbclient leaves reading a timed-out cell's outputs (it cancels it on every
    other error): alive, it reads the kernel's outputs beside the next cells' readers, and when the
    grader exits prints "Task was destroyed but it is pending!" or "Task exception was never
    retrieved" (its read failed when the kernel stopped)."""
    import asyncio

    for task in asyncio.all_tasks():
        if task.get_coro().__qualname__.endswith("._async_poll_output_msg"):
            task.cancel()
    await asyncio.sleep(0)


def _out_of_cpu_time(process) -> bool:
    """Whether a kernel's process died of SIGXCPU, its CPU-time limit (a sandbox's process,
    bubblewrap, exits with 128 + the signal that killed the command it ran)."""
    try:
        code = process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return code in (-signal.SIGXCPU, 128 + signal.SIGXCPU)


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
        if isinstance(entry, dict) and set(entry) == {"answers", "source"}:
            answers, source = entry["answers"], entry["source"]
            if isinstance(answers, str) and len(answers) <= MAX_ANSWER_BYTES * 4 // 3 + 4 and isinstance(source, str):
                clean[check] = {"answers": answers, "source": source[:100_000]}
                continue
        if isinstance(entry, dict) and len(entry) == 1:
            (kind, value), = entry.items()
            if kind == "missing" and isinstance(value, list) and all(isinstance(v, str) for v in value):
                clean[check] = entry
                continue
            if kind == "error" and isinstance(value, str):
                clean[check] = {"error": f"could not copy the answer out of the notebook: {value[:500]}"}
                continue
        clean[check] = {"error": "the answer could not be taken out of the notebook (too large, or changed by the notebook)"}
    return clean
