"""course.guard: an exercise's check refuses the course's own finished version of the answer, in
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
from course import guard
from course.doctor import PART_II_TORCH, torch_at_least
from course.exercises import Exercise, solutions


def _exercises():
    for info in pkgutil.iter_modules(course.checks.__path__):
        module = importlib.import_module(f"course.checks.{info.name}")
        yield from (obj for obj in vars(module).values() if isinstance(obj, Exercise))


GUARDED = sorted((ex for ex in _exercises() if ex.finished), key=lambda ex: (ex.notebook, ex.__name__))
NEEDS_PART_II_TORCH = {"11", "14", "15", "16"}


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
    return [make(dotted) for dotted in ex.finished]


@pytest.mark.parametrize("ex", GUARDED, ids=lambda ex: f"nb{ex.notebook}-{ex.__name__}")
def test_the_finished_version_itself_is_refused(ex):
    _skip_old_torch(ex)
    originals = [getattr(*guard.resolve(d)) for d in ex.finished]
    feedback = ex(*originals)
    assert feedback.status == "wrong" and f"the course's own finished version, {ex.finished[0]}" in feedback.message


@pytest.mark.parametrize("make", [_through_the_module, _through_an_imported_name])
@pytest.mark.parametrize("ex", GUARDED, ids=lambda ex: f"nb{ex.notebook}-{ex.__name__}")
def test_a_wrapper_that_calls_it_is_refused_and_every_name_is_restored(ex, make):
    _skip_old_torch(ex)
    if isinstance(getattr(*guard.resolve(ex.finished[0])), type):
        pytest.skip("a class: see test_forms_that_hold_it_are_refused_at_once")
    answers = _answers(ex, make)
    before = [getattr(*guard.resolve(d)) for d in ex.finished]
    feedback = ex(*answers)
    assert feedback.status == "wrong", feedback
    assert feedback.message.startswith("not yet: your answer uses the course's own finished version, "), feedback
    assert [getattr(*guard.resolve(d)) for d in ex.finished] == before and guard.active() == ()
    for answer, original in zip(answers, before):  # the notebook's own name is the original again
        assert answer.__globals__.get("finished", original) is original


def test_forms_that_hold_it_are_refused_at_once():
    from course.checks import nb10, nb14
    from course.context_parallel import merge
    from course.data_parallel import OverlapPerParameter

    def with_default(*args, f=merge):
        return f(*args)

    def closure():
        def answer(*args):
            return merge(*args)
        return answer

    @functools.wraps(merge)
    def wrapped(*args):
        return sorted(args)  # says it wraps merge (functools.wraps): taken at its word

    class Mine(OverlapPerParameter):
        pass

    for answer in (functools.partial(merge), with_default, closure(), wrapped):
        assert "course.context_parallel.merge" in guard.refused(answer, nb14.merge.finished), answer
    assert "OverlapPerParameter" in guard.refused(Mine, nb10.overlap_per_parameter.finished)
    assert guard.refused(lambda *args: args, nb14.merge.finished) is None


@pytest.mark.skipif(not torch_at_least(PART_II_TORCH), reason=f"notebook 14 needs torch >= {PART_II_TORCH}")
@pytest.mark.parametrize("start_method", ["forkserver", pytest.param("spawn", marks=pytest.mark.slow)])  # spawn: ~10 s
def test_ranks_that_are_not_forks_guard_it_too(monkeypatch, start_method):
    """Under forkserver and spawn a rank imports the course afresh: it installs the guards itself
    before it unpickles the answer. (Spawn is the default on macOS and Windows.)"""
    from course.checks import nb14

    monkeypatch.setenv("COURSE_START_METHOD", start_method)
    feedback = nb14.ring_forward(_through_the_module("course.context_parallel.ring_forward"))
    assert feedback.status == "wrong" and "course.context_parallel.ring_forward" in feedback.message, feedback


def test_the_check_and_course_code_may_call_it():
    """The guard stands between the answer and the finished code only: a call whose nearest frame
    outside the course and the libraries is a check's goes through (Exercise 1 of notebook 11
    measures the course's own step on the wire as its reference), the student's code is refused."""
    import torch

    from course import context_parallel as cp

    args = {"cp": cp, "x": torch.zeros(2, 3), "lse": torch.zeros(2)}
    a_check = str(Path(course.checks.__file__).with_name("nb99_a_check.py"))
    with guard.guarding(["course.context_parallel.merge"]):
        assert guard.active() == ("course.context_parallel.merge",) and cp.merge.__wrapped__ is not None
        exec(compile("out, lse = cp.merge(x, lse, x, lse)", a_check, "exec"), args)
        assert torch.equal(args["lse"], torch.full((2,), 0.6931471805599453))  # log 2: it ran
        with pytest.raises(guard.FinishedVersionUsed, match="course.context_parallel.merge"):
            exec(compile("cp.merge(x, lse, x, lse)", "<notebook cell>", "exec"), args)
    assert guard.active() == () and not hasattr(cp.merge, "__wrapped__")


def _names_the_package_holds():
    """(notebook, exercise, name) for each function or class an exercise's solution defines that a
    course module defines too."""
    modules = [importlib.import_module(f"course.{m.name}") for m in pkgutil.iter_modules(course.__path__)
               if m.name not in ("checks", "__main__")]
    for notebook, exercises in solutions().items():
        for exercise, code in exercises.items():
            for node in ast.parse(code).body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    for module in modules:
                        obj = vars(module).get(node.name)
                        if getattr(obj, "__module__", None) == module.__name__:
                            yield notebook, exercise, f"{module.__name__}.{node.name}"


UNRELATED = {"course.collectives.bytes_sent"}  # a byte counter of notebook 10, not 15's bytes_sent


def test_every_exercise_whose_answer_the_package_holds_guards_it():
    by_name = {(ex.notebook, ex.__name__): ex for ex in _exercises()}
    held = [(nb, name, dotted) for nb, name, dotted in _names_the_package_holds() if dotted not in UNRELATED]
    assert len(held) >= 14
    missing = [(nb, name, dotted) for nb, name, dotted in held if dotted not in by_name[(nb, name)].finished]
    assert missing == []
