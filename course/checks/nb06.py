"""Checks for notebook 06 (SyncBatchNorm)."""

import torch
from torch import nn

from course.exercises import correct, exercise, wrong
from course.launcher import launch

SIZES = (5, 1, 10)  # uneven on purpose: rank 1 holds a single sample
CHANNELS = 3


def _rank_batches(sizes=SIZES, channels=CHANNELS, seed=6):
    """One batch per rank, each from a differently shifted distribution, in float64."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, channels, generator=g, dtype=torch.float64) * (1 + r) + 3 * r for r, n in enumerate(sizes)]


def _run_mean_var(rank, world_size, fn):
    x = _rank_batches()[rank]
    result = fn(x.clone())
    try:
        mean, var = result
        return torch.as_tensor(mean).detach().double(), torch.as_tensor(var).detach().double()
    except (TypeError, ValueError, RuntimeError):
        return repr(result)[:80]


def _close(a, b):
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-6, atol=1e-9)


@exercise("Exercise 1 (global_mean_var)", hint="mean = (Σx summed over ranks) / (count summed over ranks), per channel (dim 0).")
def global_mean_var(fn):
    """Exercise 1: per-channel mean and biased variance of the global batch, with one all_reduce."""
    results = launch(_run_mean_var, len(SIZES), fn, show=None, timeout=30)
    if any(isinstance(r, str) for r in results):
        return wrong(f"return two tensors, (mean, var), each of shape (C,); rank 0 returned {results[0]}")
    batches = _rank_batches()
    var, mean = torch.var_mean(torch.cat(batches), dim=0, unbiased=False)
    got_mean, got_var = results[0]
    if got_mean.shape != mean.shape or got_var.shape != var.shape:
        return wrong(f"return one mean and one variance per channel: shapes {tuple(mean.shape)}, "
                           f"got {tuple(got_mean.shape)} and {tuple(got_var.shape)}.")
    local = [torch.var_mean(b, dim=0, unbiased=False) for b in batches]
    if all(_close(m, lm) for (m, _), (_, lm) in zip(results, local)):
        return wrong("each rank used only its own samples: all_reduce the per-channel sums across ranks.")
    if _close(got_mean, torch.stack([lm for _, lm in local]).mean(0)):
        return wrong("the mean of the ranks' means is wrong when ranks hold different numbers of "
                           "samples: all_reduce the count as well and divide the global sum by it.")
    if _close(got_mean, mean):
        n = sum(SIZES)
        if _close(got_var, var * n / (n - 1)):
            return wrong("BatchNorm normalises with the biased variance: divide by n, not n - 1.")
        if _close(got_var, torch.stack([lv for lv, _ in local]).mean(0)):
            return wrong("averaging the ranks' variances misses how far each rank's mean lies from the "
                               "global mean: all_reduce Σx² and use var = Σx²/n - mean².")
        if _close(got_var, var):
            if not all(_close(m, mean) and _close(v, var) for m, v in results):
                return wrong("rank 0 is right but some ranks are not: every rank must end with the same statistics.")
            return correct(f"ranks of {', '.join(map(str, SIZES))} samples agree with one process on all "
                                 f"{sum(SIZES)}.")
        return wrong("the mean is right; the biased variance is Σx²/n - mean², with Σx² summed over all ranks.")
    return wrong("mean = (Σx summed over ranks) / (count summed over ranks), per channel (dim 0).")


@exercise("Exercise 2 (running_stats)", hint="running_var = (1 - momentum) * running_var + momentum * var * n / (n - 1).")
def running_stats(fn):
    """Exercise 2: update the running mean and variance like nn.BatchNorm does."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, CHANNELS, generator=g, dtype=torch.float64) * 2 + 1
    for momentum in (0.1, 0.3):
        bn = nn.BatchNorm1d(CHANNELS, momentum=momentum).double()
        with torch.no_grad():
            bn.running_mean.uniform_(-1, 1, generator=g)
            bn.running_var.uniform_(0.5, 2, generator=g)
        old_mean, old_var = bn.running_mean.clone(), bn.running_var.clone()
        bn(x)
        var, mean = torch.var_mean(x, dim=0, unbiased=False)
        try:
            new_mean, new_var = fn(old_mean.clone(), old_var.clone(), mean, var, len(x), momentum)
            new_mean, new_var = torch.as_tensor(new_mean).double(), torch.as_tensor(new_var).double()
        except (TypeError, ValueError, RuntimeError):
            return wrong("return the pair (new running_mean, new running_var).")
        if not _close(new_mean, bn.running_mean):
            if _close(new_mean, momentum * old_mean + (1 - momentum) * mean):
                return wrong("momentum is the weight of the *new* batch: (1 - momentum) * old + momentum * new.")
            return wrong("running_mean = (1 - momentum) * running_mean + momentum * batch mean.")
        if _close(new_var, (1 - momentum) * old_var + momentum * var):
            return wrong("the running variance uses the unbiased batch variance: var * n / (n - 1).")
        if not _close(new_var, bn.running_var):
            return wrong("running_var = (1 - momentum) * running_var + momentum * var * n / (n - 1).")
    return correct("the same running statistics as nn.BatchNorm1d.")


def _bn_autograd(x, weight, upstream, eps):
    """Input gradient of sum(upstream * BatchNorm(x)) over the whole batch, by autograd."""
    x = x.clone().requires_grad_()
    y = nn.functional.batch_norm(x, None, None, weight, None, training=True, eps=eps)
    (upstream * y).sum().backward()
    return x.grad


@exercise("Exercise 3 (input_grad)", hint="∂L/∂x = weight * invstd * (g - Σg / n - x_hat * Σg·x̂ / n).")
def input_grad(fn):
    """Exercise 3: BatchNorm's input gradient on one rank, given the global sums."""
    eps = 1e-5
    g = torch.Generator().manual_seed(4)
    x = torch.randn(16, CHANNELS, generator=g, dtype=torch.float64) * 2 + 1
    weight = torch.rand(CHANNELS, generator=g, dtype=torch.float64) + 0.5
    upstream = torch.randn(16, CHANNELS, generator=g, dtype=torch.float64)
    expected = _bn_autograd(x, weight, upstream, eps)

    var, mean = torch.var_mean(x, dim=0, unbiased=False)
    invstd = torch.rsqrt(var + eps)
    x_hat = (x - mean) * invstd
    sum_g, sum_g_xhat = upstream.sum(0), (upstream * x_hat).sum(0)
    n = len(x)
    pieces = []
    for rows in torch.arange(n).tensor_split([4, 5]):  # three "ranks": 4, 1 and 11 samples
        try:
            got = fn(upstream[rows], x_hat[rows], weight, invstd, sum_g, sum_g_xhat, n)
        except Exception as e:
            return wrong(f"your function raised {type(e).__name__}: {e}")
        if not isinstance(got, torch.Tensor) or got.shape != (len(rows), CHANNELS):
            return wrong("return one gradient per input value: a tensor shaped like grad_out.")
        pieces.append(got.detach())
    got = torch.cat(pieces)
    if _close(got, expected):
        return correct("three ranks' gradients put together are autograd's gradient for the whole batch.")
    scale = weight * invstd
    without_mean = scale * (upstream - x_hat * sum_g_xhat / n)
    without_var = scale * (upstream - sum_g / n)
    if _close(got, without_mean):
        return wrong("the mean depends on every input too: subtract Σg / n.")
    if _close(got, without_var):
        return wrong("the variance depends on every input too: subtract x_hat * Σg·x̂ / n.")
    if _close(got, expected / weight):
        return wrong("y = weight * x_hat + bias: multiply by weight as well as by invstd.")
    if _close(pieces[0], scale * (upstream[:4] - sum_g / 4 - x_hat[:4] * sum_g_xhat / 4)):
        return wrong("divide by n, the global count, not by this rank's number of samples.")
    return wrong("∂L/∂x = weight * invstd * (g - Σg / n - x_hat * Σg·x̂ / n).")
