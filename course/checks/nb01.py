"""Checks for notebook 01 (one device)."""

import torch
from torch import nn

from course.exercises import correct, exercise, wrong


def _problem(seed=7, n=6, d_in=4, d_out=3):
    """A small problem of a shape unlike the notebook's, so answers must be general."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g, dtype=torch.float64)
    y = torch.randn(n, d_out, generator=g, dtype=torch.float64)
    model = nn.Linear(d_in, d_out).double()
    with torch.no_grad():
        model.weight.copy_(torch.randn(d_out, d_in, generator=g))
        model.bias.copy_(torch.randn(d_out, generator=g))
    return model, x, y


def _autograd_weight_grad(model, x, y):
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    return model.weight.grad.clone()


@exercise("Exercise 1 (weight_grad)", hint="d/dW mean((xWᵀ + b - y)²) = 2 (xWᵀ + b - y)ᵀ x / (number of elements).")
def weight_grad(fn):
    """Exercise 1: the weight gradient of the MSE loss, by hand."""
    model, x, y = _problem()
    expected = _autograd_weight_grad(model, x, y)
    with torch.no_grad():
        got = fn(model, x, y)
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return wrong(f"return a tensor shaped like model.weight {tuple(expected.shape)}.")
    if torch.allclose(got, expected):
        return correct("matches autograd.")
    if torch.allclose(got, expected * y.shape[1]):
        return wrong("MSELoss averages over every element (batch × outputs), not only over the batch.")
    if torch.allclose(got, -expected):
        return wrong("check the sign: the error is prediction - label.")
    return wrong("d/dW mean((xWᵀ + b - y)²) = 2 (xWᵀ + b - y)ᵀ x / (number of elements).")


@exercise("Exercise 2 (chunk_mean_grad)", hint="zero the gradients before each chunk (or clone them), then average the 4 results.")
def chunk_mean_grad(fn):
    """Exercise 2: the mean over equal chunks of each chunk's gradient."""
    model, x, y = _problem(n=12)
    expected = _autograd_weight_grad(model, x, y)
    got = fn(model, x, y, 4)
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return wrong(f"return the weight gradient, shaped {tuple(expected.shape)}.")
    got = got.detach()
    if torch.allclose(got, expected):
        return correct("the mean of the chunks' gradients is the full batch's gradient.")
    if torch.allclose(got, 4 * expected):
        return wrong("you summed the chunks' gradients: divide by the number of chunks.")
    return wrong("zero the gradients before each chunk (or clone them), then average the 4 results.")


@exercise("Exercise 3 (chunk_weights)", hint="a chunk of n samples out of N in total has weight n / N: the weights add up to 1.")
def chunk_weights(fn):
    """Exercise 3: how to weight uneven chunks so they add up to the full batch."""
    cases = {(7, 7, 6): [0.35, 0.35, 0.3], (5, 5, 5, 5): [0.25] * 4, (1, 3): [0.25, 0.75]}
    for sizes, expected in cases.items():
        got = fn(list(sizes))
        try:
            ok = len(got) == len(expected) and all(abs(float(a) - b) < 1e-9 for a, b in zip(got, expected))
        except TypeError:
            return wrong("return a list with one number per chunk.")
        if not ok:
            if all(abs(float(a) - 1 / len(sizes)) < 1e-9 for a in got):
                return wrong(f"equal weights are right only for equal sizes; try sizes {list(sizes)}.")
            return wrong(f"for sizes {list(sizes)} you gave {list(got)}; a chunk with more samples counts more.")
    return correct("each chunk counts in proportion to its size.")
