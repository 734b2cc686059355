"""Notebook 01's checks reject plausible wrong answers (including the loopholes found in review),
each with a hint that fits the mistake."""

import pytest
import torch
from torch import nn

from course.checks import nb01

# ------------------------------------------------------------------ Exercise 1: weight_grad


def _mse_grad_over_batch_only(model, x, y):
    error = model(x) - y
    return 2 * error.T @ x / len(x)  # forgets the outputs in the mean


def _sign_flipped(model, x, y):
    error = y - model(x)
    return 2 * error.T @ x / error.numel()


def _no_factor_2(model, x, y):
    error = model(x) - y
    return error.T @ x / error.numel()


def _autograd_in_enable_grad(model, x, y):  # the check runs the answer under no_grad: this switches it back on
    with torch.enable_grad():
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
    return model.weight.grad


def _autograd_grad_in_enable_grad(model, x, y):
    with torch.enable_grad():
        return torch.autograd.grad(nn.functional.mse_loss(model(x), y), model.weight)[0]


def _torch_func_grad(model, x, y):
    with torch.enable_grad():
        loss = lambda w: nn.functional.mse_loss(x @ w.T + model.bias, y)
        return torch.func.grad(loss)(model.weight.detach())


_TYPED_IN = nb01._autograd_weight_grad(*nb01._problem())  # autograd's answer for the check's first problem


def _hard_coded(model, x, y):  # the answer typed in, and a guess of the right shape for any other problem
    return _TYPED_IN.clone() if model.weight.shape == _TYPED_IN.shape else torch.zeros_like(model.weight)


def _hard_coded_shape_too(model, x, y):
    return _TYPED_IN.clone()


def _engine_called_directly(model, x, y):  # neither .backward() nor torch.autograd.grad: the engine itself
    with torch.enable_grad():
        loss = nn.functional.mse_loss(model(x), y)
        return torch.autograd.Variable._execution_engine.run_backward(
            (loss,), (torch.ones_like(loss),), False, False, (model.weight,), False)[0]


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_hard_coded, "wrong on a second one"),
        (_hard_coded_shape_too, "a second problem has other shapes"),
        (_engine_called_directly, "it records a graph"),
        (lambda m, x, y: 1 / 0, "raised ZeroDivisionError"),
        (_mse_grad_over_batch_only, "every element"),
        (_sign_flipped, "sign"),
        (_no_factor_2, "factor 2"),
        (lambda m, x, y: torch.zeros(3), "shaped like model.weight"),
        (lambda m, x, y: torch.zeros_like(m.weight), "chain rule"),
        (lambda m, x, y: m.weight.grad, "shaped like model.weight"),  # autograd's answer, not derived
        (_autograd_in_enable_grad, "asks autograd"),
        (_autograd_grad_in_enable_grad, "asks autograd"),
        (_torch_func_grad, "asks autograd"),
    ],
)
def test_weight_grad_rejects_wrong_answers(answer, hint):
    feedback = nb01.weight_grad(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


@pytest.mark.parametrize(
    "answer",
    [
        lambda m, x, y: 2 * (m(x) - y).T @ x / (len(x) * y.shape[1]),
        lambda m, x, y: torch.einsum("nd,ni->di", 2 * (x @ m.weight.T + m.bias - y), x) / y.numel(),
    ],
)
def test_weight_grad_accepts_hand_derived_answers(answer):
    assert nb01.weight_grad(answer).status == "correct"


# ------------------------------------------------------------------ Exercise 2: chunk_mean_grad


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


def _full_batch_gradient(model, x, y, n_chunks):  # the loophole: equals the plain mean for equal chunks
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    return model.weight.grad.clone()


def _size_weighted(model, x, y, n_chunks):  # also the full batch's gradient, computed chunk by chunk
    total = 0
    for xc, yc in zip(x.chunk(n_chunks), y.chunk(n_chunks)):
        model.zero_grad()
        nn.functional.mse_loss(model(xc), yc).backward()
        total = total + model.weight.grad.clone() * len(xc) / len(x)
    return total


def _tensor_split(model, x, y, n_chunks):  # chunks of 3, 3, 2, 2 instead of torch.chunk's 3, 3, 3, 1
    grads = []
    for xc, yc in zip(x.tensor_split(n_chunks), y.tensor_split(n_chunks)):
        model.zero_grad()
        nn.functional.mse_loss(model(xc), yc).backward()
        grads.append(model.weight.grad.clone())
    return torch.stack(grads).mean(0)


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_chunk_grad_sum, "summed"),
        (_chunk_grad_accumulated, "zero the gradients"),
        (_full_batch_gradient, "gradient of the whole batch"),
        (_size_weighted, "gradient of the whole batch"),
        (_tensor_split, "3, 3, 3 and 1"),
    ],
)
def test_chunk_mean_grad_rejects_wrong_answers(answer, hint):
    feedback = nb01.chunk_mean_grad(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


# ------------------------------------------------------------------ Exercise 3: chunk_loss


def _chunk_mean_loss(model, xc, yc, batch_size, n_chunks):
    return nn.functional.mse_loss(model(xc), yc)


def _share_without_n_chunks(model, xc, yc, batch_size, n_chunks):
    return nn.functional.mse_loss(model(xc), yc, reduction="sum") / (batch_size * yc.shape[1])


def _forgets_outputs(model, xc, yc, batch_size, n_chunks):
    return nn.functional.mse_loss(model(xc), yc, reduction="sum") * n_chunks / batch_size


def _sum_over_batch_size(model, xc, yc, batch_size, n_chunks):
    return nn.functional.mse_loss(model(xc), yc, reduction="sum") / batch_size


def _not_a_scalar(model, xc, yc, batch_size, n_chunks):
    return (model(xc) - yc) ** 2


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_chunk_mean_loss, "each chunk's own mean loss"),
        (_share_without_n_chunks, "multiply by n_chunks"),
        (_forgets_outputs, "averages over the outputs too"),
        (_sum_over_batch_size, "multiply by n_chunks to undo the plain mean"),
        (_not_a_scalar, "one element"),
    ],
)
def test_chunk_loss_rejects_wrong_answers(answer, hint):
    feedback = nb01.chunk_loss(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_chunk_loss_accepts_the_mean_weighted_form():
    def weighted_mean(model, xc, yc, batch_size, n_chunks):
        return nn.functional.mse_loss(model(xc), yc) * len(xc) * n_chunks / batch_size

    assert nb01.chunk_loss(weighted_mean).status == "correct"
