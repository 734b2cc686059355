"""Every exercise check accepts the solution (taken from the solution notebook), reports
an untouched stub as "not attempted", and rejects plausible wrong answers with a hint."""

import ast
import importlib
import re

import nbformat
import pytest
import torch
import torch.distributed as dist
from torch import nn

from course.classroom.exercises import Feedback, is_stub
from course.classroom.notebooks import make_student, solution_paths


def _exercise_namespace(nb):
    """Run a notebook's exercise cells (those with solution markers) in a namespace with
    the usual imports, the notebook's own imports and the functions and classes it defines elsewhere (an
    answer may use them, as in the notebook; they never replace an answer); return the
    namespace and the check calls found in the notebook."""
    namespace = {"torch": torch, "nn": nn, "dist": dist}
    answers = set()
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if "SOLUTION" in cell.source or "✏️ your" in cell.source:
            before = dict(namespace)
            exec(compile(cell.source, "<notebook cell>", "exec"), namespace)  # a cell's file, not exec's <string>
            answers |= {name for name in namespace if namespace[name] is not before.get(name)}
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:  # IPython syntax (!command, %magic): defines nothing an answer needs
            continue
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):  # what an answer may use (Config, a model)
                bound = {(alias.asname or alias.name).split(".")[0] for alias in node.names}
                if not bound & answers:  # an import after the exercise never replaces the answer
                    exec(compile(ast.Module([node], []), "<notebook cell>", "exec"), namespace)
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name not in answers:
                try:
                    exec(compile(ast.Module([node], []), "<notebook cell>", "exec"), namespace)
                except NameError:  # a default value from the notebook's state: not one an answer calls
                    pass
    calls = [
        m.group(0)
        for cell in nb.cells
        if cell.cell_type == "code"
        for m in re.finditer(r"^check\.\w+\(.*\)$", cell.source, re.M)
    ]
    return namespace, calls


def _checks_of(path):
    return importlib.import_module(f"course.checks.nb{path.name[:2]}")


def _skip_where_the_notebook_cannot_run(nb):
    """Notebooks 11-18 declare torch >= PART_II_TORCH in their first cell (require_torch): their
    answers and checks are tested on such a torch only, as the notebooks themselves are."""
    from course.classroom.doctor import PART_II_TORCH, torch_at_least

    declared = any("require_torch(PART_II_TORCH" in c.source for c in nb.cells if c.cell_type == "code")
    if declared and not torch_at_least(PART_II_TORCH):
        pytest.skip(f"the notebook needs torch >= {PART_II_TORCH}")


@pytest.mark.repeats_solution_notebook  # the notebook's check cells do this; tests/ alone (old torch) need it
@pytest.mark.parametrize("path", solution_paths(), ids=lambda p: p.stem)
def test_every_check_accepts_the_notebooks_solution(path):
    nb = nbformat.read(path, as_version=4)
    _skip_where_the_notebook_cannot_run(nb)
    namespace, calls = _exercise_namespace(nb)
    namespace["check"] = _checks_of(path)
    assert len(calls) >= 2
    for call in calls:
        feedback = eval(call, namespace)
        assert isinstance(feedback, Feedback) and feedback.status == "correct", (call, feedback)


@pytest.mark.parametrize("path", solution_paths(), ids=lambda p: p.stem)
def test_every_check_says_not_attempted_for_the_student_stub(path):
    _skip_where_the_notebook_cannot_run(nbformat.read(path, as_version=4))
    student = make_student(nbformat.read(path, as_version=4), path.name)
    namespace, calls = _exercise_namespace(student)
    namespace["check"] = _checks_of(path)
    for call in calls:
        feedback = eval(call, namespace)
        assert feedback.status == "todo", (call, feedback)
        assert "not attempted" in repr(feedback)


def test_is_stub():
    def empty(model):
        """Docstrings do not count as an attempt."""
        ...

    def attempt(model):
        return model

    assert is_stub(...) and is_stub(None) and is_stub(empty)
    assert not is_stub(attempt) and not is_stub(0) and not is_stub([])
    assert not is_stub(lambda sizes: 0.5) and not is_stub(lambda: "text")


def test_exercise_wrapper_names_feedback_and_handles_stubs_and_failed_ranks():
    from course.classroom.exercises import correct, exercise, wrong
    from course.runtime.launcher import launch

    def _fails(rank, world_size):
        raise ValueError(f"boom on {rank}")

    @exercise("Exercise 9 (demo)", hint="think about it.")
    def demo(answer):
        if answer == "launch":
            launch(_fails, 2, show=None)
        return correct("yes") if answer == 1 else wrong("no")

    assert repr(demo(1)) == "✅ Exercise 9 (demo): yes"
    assert demo(2).status == "wrong" and demo(2).exercise == "Exercise 9 (demo)"
    assert demo(...).status == "todo" and demo(None).status == "todo"
    failed = demo("launch")
    assert failed.status == "wrong" and "a rank failed: ValueError: boom on" in failed.message
    assert "(rank 0, in your code at" in failed.message or "(rank 1, in your code at" in failed.message
    assert demo.hint() == "💡 Exercise 9 (demo): think about it."
    assert demo.hint()._repr_markdown_() == "💡 **Exercise 9 (demo)**: think about it."
    assert "no stored solution" in demo.solution()

    @exercise("Exercise 10 (broken check)", hint="-")
    def broken(answer):
        return True

    with pytest.raises(TypeError, match="not correct"):
        broken(1)
