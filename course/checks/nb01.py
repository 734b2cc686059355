"""Checks for notebook 01 (one device)."""

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from course.classroom.exercises import correct, exercise, wrong


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


def _plain_mean_of_chunk_grads(model, x, y, n_chunks):
    grads = [_autograd_weight_grad(model, xc, yc) for xc, yc in zip(x.chunk(n_chunks), y.chunk(n_chunks))]
    return torch.stack(grads).mean(0)


class _AutogradSpy(TorchFunctionMode):
    """Notes every call into autograd's engine (``.backward()``, ``torch.autograd.grad``, which ``torch.func``
    uses too) while it is active, even under ``torch.enable_grad()``."""

    ENGINE = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.ENGINE:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


@exercise("Exercise 1 (weight_grad)", hint="write the loss as a sum over every element (n, d) of (ŷ[n,d] − y[n,d])² / (N·D); ŷ[n,d] = Σ_i x[n,i] W[d,i] + b[d], so ∂ŷ[n,d]/∂W[d,i] = x[n,i]. Apply the chain rule and write the sum over n as a matrix product.")
def weight_grad(fn):
    """Exercise 1: the weight gradient of the MSE loss, by hand."""
    for problem, (seed, n, d_in, d_out) in enumerate(((7, 6, 4, 3), (11, 5, 2, 5))):  # two problems: no fixed answer
        model, x, y = _problem(seed, n, d_in, d_out)
        expected = _autograd_weight_grad(model, x, y)
        model.zero_grad(set_to_none=True)  # the answer must compute it, not find autograd's in .grad
        graph = []  # a pack hook runs whenever autograd records a graph, whichever way its engine is then called

        def note_graph(tensor):
            graph.append(tensor.shape)
            return tensor

        try:
            with torch.no_grad(), _AutogradSpy() as spy, torch.autograd.graph.saved_tensors_hooks(note_graph, lambda t: t):
                got = fn(model, x, y)
        except RuntimeError as e:
            if "saved tensor hooks" not in str(e):  # what torch.func says under these hooks
                return wrong(f"your function raised RuntimeError: {e}")
            spy.calls.append("torch.func")
        except Exception as e:
            return wrong(f"your function raised {type(e).__name__}: {e}")
        if spy.calls or graph:
            return wrong(f"your function asks autograd ({spy.calls[0] if spy.calls else 'it records a graph'}): the "
                         "exercise is to derive the gradient by hand, with the chain rule, and compute it with matrix products.")
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            return wrong(f"return a tensor shaped like model.weight {tuple(expected.shape)}: (out_features, in_features)"
                         + (", computed from model, x and y (a second problem has other shapes)." if problem else "."))
        if torch.allclose(got, expected):
            continue
        if problem:
            return wrong("right on the first problem, wrong on a second one (another seed and shape): compute the "
                         "gradient from model, x and y, not a fixed tensor.")
        if torch.allclose(got, expected * y.shape[1]):
            return wrong("MSELoss averages over every element (batch × outputs), not only over the batch.")
        if torch.allclose(got, -expected):
            return wrong("check the sign: the error is prediction - label.")
        if torch.allclose(got, expected / 2):
            return wrong("the derivative of a square brings down a factor 2.")
        return wrong("write the loss as a sum over every element (n, d) of (ŷ[n,d] − y[n,d])² / (N·D); ŷ[n,d] = Σ_i x[n,i] W[d,i] + b[d], so ∂ŷ[n,d]/∂W[d,i] = x[n,i]. Apply the chain rule and write the sum over n as a matrix product.")
    return correct("matches autograd.")  # on two problems of different shapes


@exercise("Exercise 2 (chunk_mean_grad)", hint="zero the gradients before each chunk (or clone them), then take the plain mean of the chunks' weight gradients.")
def chunk_mean_grad(fn):
    """Exercise 2: the plain mean, over the chunks of ``torch.chunk``, of each chunk's gradient."""
    model, x, y = _problem(n=12)  # 4 equal chunks of 3
    equal = _plain_mean_of_chunk_grads(model, x, y, 4)
    got = fn(model, x, y, 4)
    if not isinstance(got, torch.Tensor) or got.shape != equal.shape:
        return wrong(f"return the weight gradient, shaped {tuple(equal.shape)}.")
    got = got.detach()
    if torch.allclose(got, 4 * equal):
        return wrong("you summed the chunks' gradients: divide by the number of chunks.")
    if not torch.allclose(got, equal):
        return wrong("zero the gradients before each chunk (or clone them), then take the plain mean of the chunks' weight gradients.")
    # 10 samples in 4 chunks: torch.chunk makes 3, 3, 3 and 1. Now the plain mean is not the full gradient.
    model, x, y = _problem(seed=8, n=10)
    uneven = _plain_mean_of_chunk_grads(model, x, y, 4)
    got = fn(model, x, y, 4).detach()
    if torch.allclose(got, _autograd_weight_grad(model, x, y)) and not torch.allclose(got, uneven):
        return wrong("that is the gradient of the whole batch, computed in one go (or weighted by chunk size). "
                     "The exercise asks for what data parallelism computes: one gradient per chunk, then their "
                     "plain mean. With 10 samples in chunks of 3, 3, 3 and 1 the two differ.")
    if not torch.allclose(got, uneven):
        return wrong("with 10 samples torch.chunk(4) makes chunks of 3, 3, 3 and 1: compute each chunk's gradient, then their plain mean.")
    return correct("the plain mean of the chunks' gradients; with equal chunks it is the full batch's gradient.")


def _mean_of_chunk_grads_of(loss_fn, model, x, y, sizes):
    chunks = list(zip(x.split(sizes), y.split(sizes)))
    grads = []
    for xc, yc in chunks:
        model.zero_grad()
        loss = loss_fn(model, xc, yc, len(x), len(chunks))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return None
        loss.backward()
        grads.append(model.weight.grad.clone())
    return torch.stack(grads).mean(0)


@exercise("Exercise 3 (chunk_loss)", hint="the plain mean divides by n_chunks; the batch's mean divides every squared error by batch_size × outputs. Start from the chunk's *sum* of squared errors and scale it so that, after the mean over chunks, each squared error is divided by exactly batch_size × outputs.")
def chunk_loss(fn):
    """Exercise 3: a per-chunk loss whose gradients, averaged plainly over the chunks (as DDP does),
    give the full batch's gradient for chunks of any sizes."""
    model, x, y = _problem(seed=9, n=10)
    full = _autograd_weight_grad(model, x, y)
    for sizes in ([4, 4, 2], [5, 5], [1, 3, 6], [10]):
        got = _mean_of_chunk_grads_of(fn, model, x, y, sizes)
        if got is None:
            return wrong("return the loss as a tensor with one element, on which .backward() can be called.")
        if torch.allclose(got, full):
            continue
        plain = _mean_of_chunk_grads_of(lambda m, xc, yc, n, k: nn.functional.mse_loss(m(xc), yc), model, x, y, sizes)
        if torch.allclose(got, plain):
            return wrong(f"that is each chunk's own mean loss: with chunks of {sizes} the plain average of their "
                         "gradients gives a small chunk's samples more weight than a big chunk's.")
        for factor, hint in ((1 / len(sizes), "the plain mean over the chunks divides by n_chunks: multiply by n_chunks to undo it."),
                             (y.shape[1], "MSELoss averages over the outputs too: divide by batch_size × outputs (y.shape[1])."),
                             (y.shape[1] / len(sizes), "divide each squared error by batch_size × outputs (y.shape[1]), and multiply by n_chunks to undo the plain mean.")):
            if torch.allclose(got, full * factor):
                return wrong(hint)
        return wrong(f"with chunks of {sizes} the plain mean of your losses' gradients is not the batch's gradient.")
    return correct("the plain mean over chunks of any sizes gives the full batch's gradient: each squared error "
                   "is divided by batch_size × outputs exactly once.")
