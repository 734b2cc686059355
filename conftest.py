"""pytest setup shared by the whole repository.

nbval runs every notebook it collects, one pytest item per code cell.

* The solution notebooks (solutions/) must reproduce their stored outputs (``--nbval``).
* The student notebooks (notebooks/) have no stored outputs and only have to run without
  error, like ``--nbval-lax``. When the same session also runs the solution notebook,
  a student notebook's cells that the solution run already executed in the same state
  are skipped (see ``course.classroom.notebooks.student_cells_to_run``): only the cells that
  differ from the solution, depend on a stub, or feed such a cell run again.
* Likewise a test marked ``repeats_solution_notebook`` (parametrized by a solution notebook's
  ``path``) is skipped when that notebook runs in the same session: it calls the notebook's
  checks on the notebook's answers, which the notebook does itself (nbval compares the ✅).
* nbval compares a cell's text/plain outputs, not their text/markdown twins: a check's verdict,
  ``hint()`` and ``solution()`` show as Markdown in Jupyter (``course.classroom.exercises``) and as the same
  text in text/plain, which is compared (tests/test_feedback.py asserts the two say the same). So
  stored outputs made before or after the Markdown form existed compare equal.
* tests/test_browser.py (JupyterLab in headless Chromium, about a minute) and tests/test_site.py
  (the website: built with Sphinx, then read in Chromium) run only when named (``pytest
  tests/test_browser.py tests/test_site.py``, as ``.ci/run`` does beside the main run), not in ``pytest``.
* Tests of a judge's own reasons use the fixture ``judges_only`` (``course.classroom.guard`` off: their
  wrong answers are the course's finished code with one thing changed).
* A test that patches something in this process for the ranks to see uses the fixture ``forked_ranks``:
  only a forked rank inherits the patch, and on Linux with a CUDA GPU the default is forkserver.
* A number printed with a leading ``~`` (``f"~{loss:.2f}"``) is a measurement that changes
  with the CPU; tests/nbval_sanitize.cfg makes nbval compare it as ``~N``.
* With ``-n 2 --dist loadfile`` (pytest-xdist) a notebook's cells stay on one worker, with
  one kernel. xdist hands out the files with the most items first (not the longest ones);
  without xdist, notebooks run first.
"""

import json
import os
import signal
import time
from pathlib import Path

import nbformat
import pytest

# A shell without job control (a script's `pytest ... &`, nohup in the background) starts a
# background command with SIGINT ignored, and an ignored SIGINT is inherited by every process
# started from it, Python keeping it ignored: the tests that press Ctrl-C at ranks, judges and
# kernels would then see every press lost. Take SIGINT as an interactive Python does; processes
# this one starts then begin with SIGINT at its default (a handler does not survive exec).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

ROOT = Path(__file__).parent
SOLUTION_DIR = ROOT / "solutions"
STUDENT_DIR = ROOT / "notebooks"


def _is_notebook_cell(item):
    return isinstance(getattr(item, "options", None), dict) and str(item.path).endswith(".ipynb")


def _start_autograd_before_any_fake_cuda():
    """The process's first ``backward()`` decides, once, whether autograd starts a thread per GPU; if it does,
    every forked rank's backward fails ("Unable to handle autograd's threading in combination with fork-based
    multiprocessing"). Without a GPU none start, unless ``FakeTensorMode`` has already given CUDA a stand-in
    device (torch/_subclasses/fake_tensor.py, ``_ensureCUDADeviceGuardSet``, torch 2.15): then 8 start
    (measured). The planner's tests trace on fake CUDA and other tests fork ranks that run backward, in any
    order: one CPU backward first settles it (with a GPU the launcher uses forkserver anyway)."""
    import torch

    torch.ones(1, requires_grad=True).sum().backward()


def pytest_configure(config):
    if getattr(config.option, "nbval_sanitize_with", "unset") is None:  # nbval loaded, no file given
        config.option.nbval_sanitize_with = str(ROOT / "tests" / "nbval_sanitize.cfg")
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):  # not xdist's controller
        _start_autograd_before_any_fake_cuda()


RICH_TWINS = ("text/markdown",)  # shown in Jupyter; their text/plain twin is what nbval compares
BROWSER_TESTS = ("test_browser.py", "test_site.py")  # a minute or two each in Chromium: run on their own (.ci/run does)


def pytest_collection_modifyitems(config, items):
    for item in items:
        notebook = getattr(item, "parent", None)
        if _is_notebook_cell(item) and not set(RICH_TWINS) <= set(getattr(notebook, "skip_compare", RICH_TWINS)):
            notebook.skip_compare = tuple(notebook.skip_compare) + RICH_TWINS
    solutions_here = {Path(str(i.path)).name for i in items if _is_notebook_cell(i) and SOLUTION_DIR in Path(str(i.path)).parents}
    to_run = {}
    for item in items:
        if not _is_notebook_cell(item):
            continue
        path = Path(str(item.path))
        if STUDENT_DIR not in path.parents:
            continue
        item.options["check"] = False  # lax: run, do not compare outputs
        if path.name in solutions_here:
            if path.name not in to_run:
                from course.classroom.notebooks import student_cells_to_run

                solution = nbformat.read(SOLUTION_DIR / path.name, as_version=4)
                to_run[path.name] = set(student_cells_to_run(solution, nbformat.read(path, as_version=4)))
            if item.cell.get("id") not in to_run[path.name]:
                item.options["skip"] = True  # ran, in the same state, in the solution notebook
    named = {name for name in BROWSER_TESTS if any(name in arg for arg in config.args)}
    for item in items:
        name = Path(str(item.path)).name
        if name in BROWSER_TESTS and name not in named:
            item.add_marker(pytest.mark.skip(reason=f"a browser test runs on its own: pytest tests/{name}"))
    for item in items:
        callspec = getattr(item, "callspec", None)
        if item.get_closest_marker("repeats_solution_notebook") and Path(callspec.params["path"]).name in solutions_here:
            item.add_marker(pytest.mark.skip(reason=f"solutions/{Path(callspec.params['path']).name} runs it in this session"))
    items.sort(key=lambda i: not _is_notebook_cell(i))  # stable: notebooks first, in order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """nbval 0.11 ignores ``clear_output``, which every frontend and nbclient (the build) apply: a
    launch's live display ends with one, followed by the cell's earlier outputs again
    (course.runtime.live), which nbval would see twice. While a notebook cell runs, nbval's reading
    of the kernel's messages applies it as nbclient does (``wait=True``: at the next output).
    tests/test_live.py runs nbval with this file as a plugin (``-p conftest``)."""
    notebook = getattr(item, "parent", None)
    if not _is_notebook_cell(item) or not hasattr(notebook, "get_kernel_message"):
        yield
        return
    read, cell, pending = notebook.get_kernel_message, [], []

    def get_kernel_message(*args, **kwargs):
        msg = read(*args, **kwargs)
        kind, parent = msg["msg_type"], msg["parent_header"].get("msg_id")
        if kind == "execute_input":
            cell[:] = [parent]  # the messages of this cell's execution: nbval drops the others
        elif parent in cell and kind == "clear_output" and msg["content"].get("wait"):
            pending[:] = [True]
        elif parent in cell and (kind == "clear_output" or kind in ("stream", "display_data", "execute_result", "error") and pending):
            pending.clear()
            item.test_outputs.clear()  # nbval's list of the cell's outputs, filled after this returns
        return msg

    notebook.get_kernel_message = get_kernel_message
    try:
        yield
    finally:
        del notebook.get_kernel_message


TIMELINE = "COURSE_TEST_TIMELINE"  # a file: each test's worker, file, start and end are appended to it


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ``COURSE_TEST_TIMELINE=FILE`` (benchmarks/notebook_times.py --suite sets it), note when each
    test ran on which xdist worker: how busy each worker was, and which file ran last."""
    start = time.time()
    yield
    path = os.environ.get(TIMELINE)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "file": item.nodeid.split("::")[0],
                                "start": start, "end": time.time()}) + "\n")


@pytest.fixture
def judges_only(monkeypatch):
    """Every exercise without its course.classroom.guard: for tests of a judge's own reasons, whose wrong
    answers are the course's finished version with one thing changed (the guard would refuse
    them before the judge looks). tests/test_guard.py tries the guard itself."""
    import importlib
    import pkgutil

    import course.checks
    from course.classroom.exercises import Exercise

    for info in pkgutil.iter_modules(course.checks.__path__):
        for obj in vars(importlib.import_module(f"course.checks.{info.name}")).values():
            if isinstance(obj, Exercise):
                monkeypatch.setattr(obj, "finished", ())


@pytest.fixture(scope="module")
def _launches_of_this_file():
    return {}


@pytest.fixture
def launch_once(monkeypatch, _launches_of_this_file):
    """``launch_once(module)``: the module's ``launch`` runs each distinct launch once per test file and
    returns its results again after. For a check that launches the same reference run for every answer (a
    traced run's op names, the bytes it sends) whose results do not change from run to run: the answers
    are still judged against a real run, without one launch per answer."""
    results = _launches_of_this_file

    def patch(module):
        launch = module.launch

        def once(fn, world_size, *args, **options):
            key = (module.__name__, fn.__name__, world_size, repr(args), repr(sorted(options.items())))
            if key not in results:
                results[key] = launch(fn, world_size, *args, **options)
            return results[key]

        monkeypatch.setattr(module, "launch", once)

    return patch


@pytest.fixture
def forked_ranks(monkeypatch):
    """Launches in this test fork their ranks from this process, so the ranks see its monkeypatches.
    A forkserver's rank (the default on Linux with a CUDA GPU) or a spawned one imports the course
    afresh: a patch made here would not reach it (measured on an H100 machine: the test then failed)."""
    from course.runtime.launcher import START_METHOD_VARIABLE

    monkeypatch.setenv(START_METHOD_VARIABLE, "fork")
