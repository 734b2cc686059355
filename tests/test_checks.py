"""Every exercise check accepts the solution (taken from the solution notebook), reports
an untouched stub as "not attempted", and rejects plausible wrong answers with a hint."""

import importlib
import re

import nbformat
import pytest
import torch
import torch.distributed as dist
from torch import nn

from course.exercises import Feedback, is_stub
from course.checks import nb01, nb02
from course.notebooks import SOLUTIONS, make_student, solution_paths


def _exercise_namespace(nb):
    """Run a notebook's exercise cells (those with solution markers) in a namespace
    with the usual imports; return it and the check calls found in the notebook."""
    namespace = {"torch": torch, "nn": nn, "dist": dist}
    for cell in nb.cells:
        if cell.cell_type == "code" and ("SOLUTION" in cell.source or "✏️ your" in cell.source):
            exec(cell.source, namespace)
    calls = [
        m.group(0)
        for cell in nb.cells
        if cell.cell_type == "code"
        for m in re.finditer(r"^check\.\w+\(.*\)$", cell.source, re.M)
    ]
    return namespace, calls


def _checks_of(path):
    return importlib.import_module(f"course.checks.nb{path.name[:2]}")


@pytest.mark.parametrize("path", solution_paths(), ids=lambda p: p.stem)
def test_every_check_accepts_the_notebooks_solution(path):
    namespace, calls = _exercise_namespace(nbformat.read(path, as_version=4))
    namespace["check"] = _checks_of(path)
    assert len(calls) >= 2
    for call in calls:
        feedback = eval(call, namespace)
        assert isinstance(feedback, Feedback) and feedback.status == "correct", (call, feedback)


@pytest.mark.parametrize("path", solution_paths(), ids=lambda p: p.stem)
def test_every_check_says_not_attempted_for_the_student_stub(path):
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


# ------------------------------------------------------------------ wrong answers, nb01


def _mse_grad_over_batch_only(model, x, y):
    error = model(x) - y
    return 2 * error.T @ x / len(x)  # forgets the outputs in the mean


def _sign_flipped(model, x, y):
    error = y - model(x)
    return 2 * error.T @ x / error.numel()


@pytest.mark.parametrize(
    "answer, hint",
    [(_mse_grad_over_batch_only, "every element"), (_sign_flipped, "sign"), (lambda m, x, y: torch.zeros(3), "shaped")],
)
def test_weight_grad_rejects_wrong_answers(answer, hint):
    feedback = nb01.weight_grad(answer)
    assert feedback.status == "wrong" and hint in feedback.message


def _chunk_grad_sum(model, x, y, n_chunks):
    total = 0
    for xc, yc in zip(x.chunk(n_chunks), y.chunk(n_chunks)):
        model.zero_grad()
        nn.functional.mse_loss(model(xc), yc).backward()
        total = total + model.weight.grad.clone()
    return total


def _chunk_grad_accumulated(model, x, y, n_chunks):
    model.zero_grad()  # forgets to zero between chunks: .grad accumulates
    grads = []
    for xc, yc in zip(x.chunk(n_chunks), y.chunk(n_chunks)):
        nn.functional.mse_loss(model(xc), yc).backward()
        grads.append(model.weight.grad.clone())
    return torch.stack(grads).mean(0)


@pytest.mark.parametrize("answer, hint", [(_chunk_grad_sum, "summed"), (_chunk_grad_accumulated, "zero the gradients")])
def test_chunk_mean_grad_rejects_wrong_answers(answer, hint):
    feedback = nb01.chunk_mean_grad(answer)
    assert feedback.status == "wrong" and hint in feedback.message


@pytest.mark.parametrize(
    "answer, hint",
    [
        (lambda sizes: [1 / len(sizes)] * len(sizes), "equal weights"),
        (lambda sizes: [s / max(sizes) for s in sizes], "more samples counts more"),
        (lambda sizes: 0.5, "one number per chunk"),
    ],
)
def test_chunk_weights_rejects_wrong_answers(answer, hint):
    feedback = nb01.chunk_weights(answer)
    assert feedback.status == "wrong" and hint in feedback.message


# ------------------------------------------------------------------ wrong answers, nb02


@pytest.mark.parametrize(
    "answer, hint",
    [([3.0, 4.0], "before"), ([2.5, 3.75], "SUM"), ([10.0, 16.0], "add up"), ("ten", "two numbers")],
)
def test_all_reduce_result_rejects_wrong_answers(answer, hint):
    feedback = nb02.all_reduce_result(answer)
    assert feedback.status == "wrong" and hint in feedback.message


def _sum_only(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def _local_only(model):
    for p in model.parameters():
        p.grad /= dist.get_world_size()


def _weight_only(model):
    dist.all_reduce(model.weight.grad)
    model.weight.grad /= dist.get_world_size()


def _crashes(model):
    raise RuntimeError("typo")


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_sum_only, "divide by the world size"),
        (_local_only, "all_reduce"),
        (_weight_only, "weight and bias"),
        (_crashes, "a rank failed: RuntimeError: typo"),
    ],
)
def test_average_gradients_rejects_wrong_answers(answer, hint):
    feedback = nb02.average_gradients(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_exercise_wrapper_names_feedback_and_handles_stubs_and_failed_ranks():
    from course.exercises import correct, exercise, wrong
    from course.launcher import launch

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
    assert failed.status == "wrong" and "a rank failed" in failed.message and "boom" in failed.message
    assert demo.hint() == "💡 Exercise 9 (demo): think about it."
    assert "no stored solution" in demo.solution()

    @exercise("Exercise 10 (broken check)", hint="-")
    def broken(answer):
        return True

    with pytest.raises(TypeError, match="not correct"):
        broken(1)
