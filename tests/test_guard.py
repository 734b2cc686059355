"""course.classroom.guard: an exercise's check refuses the course's own finished version of the answer, in
every form a student might hand it in (itself, a wrapper that calls it through its module or an
imported name, a partial, a subclass, a default value), on every start method, and still lets
the check use it; every exercise whose answer the package holds says so."""

import ast
import functools
import importlib
import pkgutil
from pathlib import Path

import pytest

import course
import course.checks
from course.classroom import guard
from course.classroom.doctor import PART_II_TORCH, torch_at_least
from course.classroom.exercises import Exercise, solutions


def _exercises():
    for info in pkgutil.iter_modules(course.checks.__path__):
        module = importlib.import_module(f"course.checks.{info.name}")
        yield from (obj for obj in vars(module).values() if isinstance(obj, Exercise))


GUARDED = sorted((ex for ex in _exercises() if ex.finished), key=lambda ex: (ex.notebook, ex.__name__))
NEEDS_PART_II_TORCH = {"11", "15", "16", "17", "18"}


def _skip_old_torch(ex):
    if ex.notebook in NEEDS_PART_II_TORCH and not torch_at_least(PART_II_TORCH):
        pytest.skip(f"notebook {ex.notebook} needs torch >= {PART_II_TORCH}")


def _through_the_module(dotted):
    """A student's wrapper, written in a notebook cell: ``import course.x as m`` and call ``m.name``."""
    module_name, _, name = dotted.rpartition(".")
    space = {"__name__": "__main__"}
    exec(compile(f"import {module_name} as m\ndef answer(*args, **kwargs):\n    return m.{name}(*args, **kwargs)\n",
                 "<notebook cell>", "exec"), space)
    return space["answer"]


def _through_an_imported_name(dotted):
    """The same, after ``from course.x import name``: the name the notebook holds is rebound too."""
    module_name, _, name = dotted.rpartition(".")
    space = {"__name__": "__main__"}
    exec(compile(f"from {module_name} import {name} as finished\ndef answer(*args, **kwargs):\n"
                 "    return finished(*args, **kwargs)\n", "<notebook cell>", "exec"), space)
    return space["answer"]


def _answers(ex, make):
    """One answer per answer the check takes, from the first finished versions it names (notebook 10's
    ring also names its two halves)."""
    import inspect

    taken = [p for p in inspect.signature(ex.judge).parameters.values() if p.default is inspect.Parameter.empty]
    return [make(dotted) for dotted in ex.finished[:len(taken)]]


@pytest.mark.parametrize("ex", GUARDED, ids=lambda ex: f"nb{ex.notebook}-{ex.__name__}")
def test_the_finished_version_itself_is_refused(ex):
    _skip_old_torch(ex)
    originals = _answers(ex, lambda dotted: getattr(*guard.resolve(dotted)))
    feedback = ex(*originals)
    assert feedback.status == "wrong" and f"the course's own finished version, {ex.finished[0]}" in feedback.message


@pytest.mark.parametrize("make", [_through_the_module, _through_an_imported_name])
@pytest.mark.parametrize("ex", GUARDED, ids=lambda ex: f"nb{ex.notebook}-{ex.__name__}")
def test_a_wrapper_that_calls_it_is_refused_and_it_works_again_after(ex, make):
    _skip_old_torch(ex)
    if isinstance(getattr(*guard.resolve(ex.finished[0])), type):
        pytest.skip("a class: see test_a_class_that_borrows_its_parts_is_refused")
    feedback = ex(*_answers(ex, make))
    assert feedback.status == "wrong", feedback
    assert feedback.message.startswith("not yet: your answer uses the course's own finished version, "), feedback
    assert guard.active() == ()
    for dotted in ex.finished:  # unguarded again: the student's own code may call it after the check
        function = getattr(*guard.resolve(dotted))
        space = {"f": function}
        exec(compile("try:\n    f()\nexcept TypeError:\n    pass  # no arguments: it ran", "<notebook cell>", "exec"), space)


def _notebook(source):
    space = {"__name__": "__main__"}
    exec(compile(source, "<notebook cell>", "exec"), space)
    return space


def test_forms_that_hold_it_are_refused_at_once():
    from course.checks import nb15
    from course.parallel.context_parallel import merge

    def with_default(*args, f=merge):
        return f(*args)

    def closure():
        def answer(*args):
            return merge(*args)
        return answer

    @functools.wraps(merge)
    def wrapped(*args):
        return sorted(args)  # says it wraps merge (functools.wraps): taken at its word

    for answer in (functools.partial(merge), with_default, closure(), wrapped):
        assert "course.parallel.context_parallel.merge" in guard.refused(answer, nb15.merge.finished), answer
    assert guard.refused(lambda *args: args, nb15.merge.finished) is None


@pytest.mark.skipif(not torch_at_least(PART_II_TORCH), reason=f"notebook 15 needs torch >= {PART_II_TORCH}")
@pytest.mark.parametrize("source", [
    "fns = [cp.merge]\ndef answer(*a):\n    return fns[0](*a)",  # kept in a container
    "def make(f):\n    return lambda *a: f(*a)\nhelper = make(cp.merge)\ndef answer(*a):\n    return helper(*a)",
    "class A:\n    __call__ = staticmethod(cp.merge)\nanswer = A()",  # the check calls it straight
    "def answer(*a):\n    return cp.merge.__get__(object()).__func__(*a)",
    "import concurrent.futures as cf\npool = cf.ThreadPoolExecutor(1)\n"
    "def answer(*a):\n    return pool.submit(cp.merge, *a).result()",  # in a thread of the answer's
    "def answer(*a):\n    return getattr(__import__('importlib').import_module('course.parallel.context_parallel'), 'merge')(*a)",
])
def test_references_kept_anywhere_reach_the_guard(source):
    from course.checks import nb15

    answer = _notebook("import course.parallel.context_parallel as cp\n" + source)["answer"]
    feedback = nb15.merge(answer)
    assert feedback.status == "wrong" and "course.parallel.context_parallel.merge" in feedback.message, feedback


def test_the_halves_of_the_ring_are_refused_too():
    """course.parallel.collectives.ring_all_reduce is its two halves, printed in notebook 10 after the exercise."""
    from course.checks import nb10

    answer = _notebook("from course.parallel import collectives as c\ndef ring(t):\n    c.ring_reduce_scatter(t)\n"
                       "    c.ring_all_gather(t)\n    return t")["ring"]
    feedback = nb10.ring_all_reduce(answer)
    assert feedback.status == "wrong" and "course.parallel.collectives.ring_reduce_scatter" in feedback.message, feedback


@pytest.mark.parametrize("source", [
    "class Mine(OverlapPerParameter):\n    pass",
    "class Mine:\n    __init__ = OverlapPerParameter.__init__\n    grad_ready = OverlapPerParameter.grad_ready\n"
    "    finish = OverlapPerParameter.finish",
    "class Mine:\n    def __init__(self, model):\n        self.inner = OverlapPerParameter(model)\n"
    "    def finish(self):\n        self.inner.finish()",
    "class Mine:\n    def __init__(self, model):\n        self.inner = OverlapPerParameter.__mro__[0](model)\n"
    "    def finish(self):\n        self.inner.finish()",
])
def test_a_class_that_borrows_its_parts_is_refused(source):
    from course.checks import nb10

    answer = _notebook("from course.parallel.data_parallel import OverlapPerParameter\n" + source)["Mine"]
    feedback = nb10.overlap_per_parameter(answer)
    assert feedback.status == "wrong" and "course.parallel.data_parallel.OverlapPerParameter" in feedback.message, feedback


@pytest.mark.skipif(not torch_at_least(PART_II_TORCH), reason=f"notebook 15 needs torch >= {PART_II_TORCH}")
@pytest.mark.parametrize("start_method", ["forkserver", pytest.param("spawn", marks=pytest.mark.slow)])  # spawn: ~10 s
def test_ranks_that_are_not_forks_guard_it_too(monkeypatch, start_method):
    """Under forkserver and spawn a rank imports the course afresh: it installs the guards itself
    before it unpickles the answer. (Spawn is the default on macOS and Windows.)"""
    from course.checks import nb15

    monkeypatch.setenv("COURSE_START_METHOD", start_method)
    for answer in (_through_the_module("course.parallel.context_parallel.ring_forward"),
                   _notebook("import course.parallel.context_parallel as cp\nfns = [cp.ring_forward]\n"
                             "def answer(*a, **k):\n    return fns[0](*a, **k)")["answer"]):
        feedback = nb15.ring_forward(answer)
        assert feedback.status == "wrong" and "course.parallel.context_parallel.ring_forward" in feedback.message, feedback


def _frame(source, filename, space):
    """Run ``source`` as if it were in ``filename``; it sets ``space["frame"]``."""
    exec(compile(source, filename, "exec"), space)
    return space


def test_who_may_call_it(tmp_path):
    """Course code a check runs may call it (Exercise 1 of notebook 11 measures the course's own
    step as its reference); a check calling it straight is calling the answer (a borrowed method),
    and must ask for guard.original; the student's code may not, nor code with no check below it.
    Also through a symbolic link to the checkout (macOS's /tmp, an HPC's /home)."""
    import sys

    checks = Path(course.checks.__file__).parent
    link = tmp_path / "link"
    link.symlink_to(checks.parent, target_is_directory=True)
    for root in (checks.parent, link):
        space = {"sys": sys}
        _frame("def course_code():\n    frame = sys._getframe()\n    return frame", str(root / "nb99_helper.py"), space)
        _frame("def a_check(inner):\n    return inner()", str(root / "checks" / "nb99.py"), space)
        _frame("def student():\n    return course_code()", "<notebook cell>", space)
        assert guard.called_from_an_answer(space["a_check"](space["course_code"])) is False  # course code under a check
        assert guard.called_from_an_answer(space["a_check"](lambda: sys._getframe())) is True  # test code: student
        assert guard.called_from_an_answer(space["a_check"](space["student"])) is True  # the student's, via course code
        assert guard.called_from_an_answer(space["course_code"]()) is True  # called by this test: the student

    # A library outside this Python's own folders (Debian's /usr/lib/python3/dist-packages, as on
    # Colab) is a library: torch's autograd between a check and course code is not the student.
    space = {"sys": sys}
    _frame("def course_code():\n    return sys._getframe()", str(checks.parent / "nb99_helper.py"), space)
    _frame("def torch_code(inner):\n    return inner()", "/usr/lib/python3/dist-packages/torch/autograd/x.py", space)
    _frame("def a_check():\n    return torch_code(course_code)", str(checks / "nb99.py"), space)
    assert guard.called_from_an_answer(space["a_check"]()) is False

    import torch

    from course.parallel import context_parallel as cp

    x, lse = torch.zeros(2, 3), torch.zeros(2)
    space = {"guard": guard}
    _frame("def reference(f):\n    return guard.original(f)", str(checks / "nb99.py"), space)  # a check's own
    with guard.guarding(["course.parallel.context_parallel.merge"]):
        assert guard.active() == ("course.parallel.context_parallel.merge",)
        assert not hasattr(cp.merge, "__wrapped__")  # nothing hands the original out
        out, merged = space["reference"](cp.merge)(x, lse, x, lse)  # a check's own reference
        assert torch.equal(merged, torch.full((2,), 0.6931471805599453))  # log 2: it ran
        with pytest.raises(guard.FinishedVersionUsed, match="course.parallel.context_parallel.merge"):
            cp.merge(x, lse, x, lse)  # from this test: the student's code
        with pytest.raises(guard.FinishedVersionUsed, match="course.parallel.context_parallel.merge"):
            guard.original(cp.merge)  # asked by this test: the student
    assert guard.active() == () and guard.original(cp.merge) is cp.merge
    assert torch.equal(cp.merge(x, lse, x, lse)[1], merged)


def _names_the_package_holds():
    """(notebook, exercise, name) for each function or class an exercise's solution defines that a
    course module defines too."""
    modules = [importlib.import_module(m.name) for m in pkgutil.walk_packages(course.__path__, "course.")
               if not m.ispkg and not m.name.startswith(("course.checks.", "course.__main__"))]
    for notebook, exercises in solutions().items():
        for exercise, code in exercises.items():
            for node in ast.parse(code).body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    for module in modules:
                        obj = vars(module).get(node.name)
                        if getattr(obj, "__module__", None) == module.__name__:
                            yield notebook, exercise, f"{module.__name__}.{node.name}"


UNRELATED = {"course.parallel.collectives.bytes_sent"}  # a byte counter of notebook 10, not 15's bytes_sent


def test_every_exercise_whose_answer_the_package_holds_guards_it():
    by_name = {(ex.notebook, ex.__name__): ex for ex in _exercises()}
    held = [(nb, name, dotted) for nb, name, dotted in _names_the_package_holds() if dotted not in UNRELATED]
    assert len(held) >= 14
    missing = [(nb, name, dotted) for nb, name, dotted in held if dotted not in by_name[(nb, name)].finished]
    assert missing == []


# ------------------------------------------------------------------ the finished code by other means
# Each of these was handed to notebooks 11, 15, 16 and 17 and passed before the guard compared code by
# what it does (bytecode, names, constants) and refused guard.original and importlib.reload to an answer.

PART_II = [ex for ex in GUARDED if ex.notebook in NEEDS_PART_II_TORCH]
ONE_PER_NOTEBOOK = [next(ex for ex in PART_II if ex.notebook == nb) for nb in sorted(NEEDS_PART_II_TORCH)]


def _by(cell):
    """A way to hand in the finished version: ``cell`` (a notebook cell, with ``m`` the finished
    version's module and ``name`` its name) defines ``answer``."""
    def make(dotted):
        module_name, _, name = dotted.rpartition(".")
        space = {"__name__": "__main__"}
        source = f"import {module_name} as m\nname = {name!r}\n" + cell
        exec(compile(source, "<notebook cell>", "exec"), space)
        return space["answer"]
    return make


ASK_FOR_THE_ORIGINAL = _by("from course.classroom import guard\n"
                           "def answer(*a, **k):\n    return guard.original(getattr(m, name))(*a, **k)")
REBUILD = ("import types\nf = getattr(m, name)\n"
           "def rebuilt():\n    g = types.FunctionType(f.__code__.replace(co_firstlineno=1), f.__globals__, f.__name__,"
           " f.__defaults__, f.__closure__)\n    g.__kwdefaults__ = f.__kwdefaults__\n    return g\n")
WAYS = {
    "a relined copy in a container": _by(REBUILD + "fns = [rebuilt()]\ndef answer(*a, **k):\n    return fns[0](*a, **k)"),
    "its source run by exec": _by("import inspect\nspace = dict(vars(m))\nexec(inspect.getsource(getattr(m, name)), space)\n"
                                  "fns = {'f': space[name]}\ndef answer(*a, **k):\n    return fns['f'](*a, **k)"),
    "a copy reached by a computed name": _by(REBUILD + "globals()['hid' + 'den'] = rebuilt()\n"
                                             "def answer(*a, **k):\n    return globals()['hid' + 'den'](*a, **k)"),
    "kept from before a reload": _by("import importlib\nold = [getattr(m, name)]\nimportlib.reload(m)\n"
                                     "def answer(*a, **k):\n    return old[0](*a, **k)"),
    "a reload during the check": _by("import importlib\n"
                                     "def answer(*a, **k):\n    importlib.reload(m)\n    return getattr(m, name)(*a, **k)"),
}


@pytest.fixture
def reloads_undone(ex):
    """A test that reloads a course module puts its old contents back (checks hold its functions)."""
    modules = [guard.resolve(dotted)[0] for dotted in ex.finished]
    saved = [dict(vars(module)) for module in modules]
    yield
    for module, contents in zip(modules, saved):
        vars(module).clear()
        vars(module).update(contents)


def _refused(ex, answers):
    feedback = ex(*answers)
    named = [d for d in ex.finished if f"the course's own finished version, {d}" in feedback.message]
    assert feedback.status == "wrong" and named, feedback  # an exercise of two answers names the one refused
    assert guard.active() == ()


@pytest.mark.parametrize("ex", PART_II, ids=lambda ex: f"nb{ex.notebook}-{ex.__name__}")
def test_the_answer_may_not_ask_for_the_original(ex):
    _skip_old_torch(ex)
    _refused(ex, _answers(ex, ASK_FOR_THE_ORIGINAL))


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("ex", ONE_PER_NOTEBOOK, ids=lambda ex: f"nb{ex.notebook}-{ex.__name__}")
def test_its_code_by_other_means_is_refused(ex, way, reloads_undone):
    _skip_old_torch(ex)
    _refused(ex, _answers(ex, WAYS[way]))


def test_a_check_helper_called_by_the_answer_may_not_ask_for_it_either(tmp_path):
    """guard.original answers a check (or course code a check runs), not the answer through one."""
    checks = Path(course.checks.__file__).parent
    space = {"guard": guard}
    _frame("def helper(f):\n    return guard.original(f)\ndef judge(answer, f):\n    return answer(f)",
           str(checks / "nb99.py"), space)
    _frame("def answer(f):\n    return helper(f)", "<notebook cell>", space)
    from course.parallel import context_parallel as cp

    with guard.guarding(["course.parallel.context_parallel.merge"]):
        assert space["judge"](space["helper"], cp.merge) is not cp.merge  # the check's helper, called by it
        with pytest.raises(guard.FinishedVersionUsed):
            space["judge"](space["answer"], cp.merge)


def test_the_same_text_written_in_a_notebook_cell_is_the_students_own():
    """The capstone's solution compiles to the very bytecode of course.parallel.parallel3d.mesh_groups:
    typed in a cell it is a derivation, and passes; the same text run by exec (file <string>) is a copy."""
    from course.checks import nb18

    code = solutions()["18"]["mesh_groups"]
    for filename, status in (("<notebook cell>", "correct"), ("/tmp/ipykernel_1/2.py", "correct"), ("<string>", "wrong")):
        space = {"__name__": "__main__"}
        exec(compile(code, filename, "exec"), space)
        assert nb18.mesh_groups(space["mesh_groups"]).status == status, filename
