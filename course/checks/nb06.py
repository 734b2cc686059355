"""Checks for notebook 06 (SyncBatchNorm)."""

import torch
from torch import nn

from course.observe import tracing
from course.classroom.exercises import correct, exercise, wrong
from course.runtime.launcher import launch

SIZES = (5, 1, 10)  # uneven on purpose: rank 1 holds a single sample
CHANNELS = 3


def _rank_batches(sizes=SIZES, channels=CHANNELS, seed=6):
    """One batch per rank, each from a differently shifted distribution, in float64."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, channels, generator=g, dtype=torch.float64) * (1 + r) + 3 * r for r, n in enumerate(sizes)]


def _float32_batches(sizes=SIZES, channels=CHANNELS, seed=7):
    """float32 batches whose mean (about 10,000) is large compared with their spread (about 1):
    here Σx²/n - mean² computed in float32 is off by more than the variance itself."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, channels, generator=g, dtype=torch.float64) + 10_000 + r).float() for r, n in enumerate(sizes)]


def _float32_hint(fn):
    """None if ``fn`` is accurate on float32 batches with a large mean, else a hint."""
    batches = _float32_batches()
    results = launch(_run_mean_var, len(SIZES), fn, batches, backend="traced", show=None, timeout=30)
    if isinstance(results[0], str):
        return f"with float32 input your function returned {results[0]}"
    var, mean = torch.var_mean(torch.cat(batches).double(), dim=0, unbiased=False)
    got_mean, got_var, _ = results[0]
    if not torch.allclose(got_mean, mean, rtol=1e-6, atol=1e-6) or not torch.allclose(got_var, var, rtol=1e-4, atol=1e-4):
        worst = (got_var - var).abs().max().item()
        return ("right in float64, but on float32 batches with mean about 10,000 and spread about 1 your variance "
                f"is off by {worst:.2g}: Σx²/n - mean² subtracts two nearly equal large numbers. Accumulate the sums "
                "in float64 (x.double()).")
    return None


def _run_mean_var(rank, world_size, fn, batches=None):
    """On the "traced" backend: every all-reduce the answer runs is counted, however it calls it."""
    x = (batches or _rank_batches())[rank]
    tracing.clear()
    result = fn(x.clone())
    all_reduces = sum(e.op == "all_reduce" for e in tracing.collectives())
    try:
        mean, var = result
        return torch.as_tensor(mean).detach().double(), torch.as_tensor(var).detach().double(), all_reduces
    except (TypeError, ValueError, RuntimeError):
        return repr(result)[:80]


def _close(a, b):
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-6, atol=1e-9)


@exercise(
    "Exercise 1 (global_mean_var)",
    hint="mean = (Σx summed over ranks) / (count summed over ranks), per channel (dim 0).",
    finished=("course.parallel.syncbn.global_mean_var",),
)
def global_mean_var(fn):
    """Exercise 1: per-channel mean and biased variance of the global batch, with one all_reduce."""
    results = launch(_run_mean_var, len(SIZES), fn, backend="traced", show=None, timeout=30)
    if any(isinstance(r, str) for r in results):
        return wrong(f"return two tensors, (mean, var), each of shape (C,); rank 0 returned {results[0]}")
    batches = _rank_batches()
    var, mean = torch.var_mean(torch.cat(batches), dim=0, unbiased=False)
    got_mean, got_var, all_reduces = results[0]
    if got_mean.shape != mean.shape or got_var.shape != var.shape:
        return wrong(f"return one mean and one variance per channel: shapes {tuple(mean.shape)}, "
                           f"got {tuple(got_mean.shape)} and {tuple(got_var.shape)}.")
    local = [torch.var_mean(b, dim=0, unbiased=False) for b in batches]
    if all(_close(m, lm) for (m, _, _), (_, lm) in zip(results, local)):
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
            if not all(_close(m, mean) and _close(v, var) for m, v, _ in results):
                return wrong("rank 0 is right but some ranks are not: every rank must end with the same statistics.")
            if all_reduces > 1:
                return wrong(f"right, with {all_reduces} all-reduces: put Σx, Σx² and the count side by side in one "
                             "tensor and all-reduce it once. Every collective pays a fixed latency, and a synchronised "
                             "BatchNorm's forward waits for it.")
            hint = _float32_hint(fn)
            if hint:
                return wrong(hint)
            return correct(f"ranks of {', '.join(map(str, SIZES))} samples agree with one process on all "
                                 f"{sum(SIZES)}.")
        return wrong("the mean is right; the biased variance is Σx²/n - mean², with Σx² summed over all ranks.")
    return wrong("mean = (Σx summed over ranks) / (count summed over ranks), per channel (dim 0).")


def _step_batches(world_size, steps, seed):
    """batches[rank][step]: 4 samples of 3 channels, each rank's from a differently shifted distribution."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(4, CHANNELS, generator=g) + 2 * rank for _ in range(steps)] for rank in range(world_size)]


def _train_bn(rank, world_size, batches, momentum):
    """Real DDP training of a lone BatchNorm1d with default options; every rank's running_mean at the end."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    bn = nn.BatchNorm1d(CHANNELS, momentum=momentum)
    ddp = DDP(bn)
    for x in batches[rank]:
        (ddp(x) ** 2).sum().backward()
    return bn.running_mean.clone()


def _simulate(batches, momentum, broadcast_before=True, broadcast_after=False, global_stats=False):
    world = len(batches)
    running = [torch.zeros(CHANNELS) for _ in range(world)]
    for step in range(len(batches[0])):
        if broadcast_before:
            running = [running[0].clone() for _ in range(world)]
        if global_stats:
            mean = torch.cat([b[step] for b in batches]).mean(0)
            running = [(1 - momentum) * r + momentum * mean for r in running]
        else:
            running = [(1 - momentum) * r + momentum * b[step].mean(0) for r, b in zip(running, batches)]
        if broadcast_after:
            running = [running[0].clone() for _ in range(world)]
    return running


_PREDICT_CASES = [(2, 2, 0.1, 1), (3, 3, 0.3, 2)]  # (world size, steps, momentum, seed)


@exercise("Exercise 2 (predict_running_means)", hint="DDP broadcasts rank 0's buffers at the *start* of each forward; then each rank's BatchNorm updates them with its own batch.")
def predict_running_means(fn):
    """Exercise 2: predict every rank's running_mean after DDP training with plain BatchNorm."""
    for world_size, steps, momentum, seed in _PREDICT_CASES:
        batches = _step_batches(world_size, steps, seed)
        actual = launch(_train_bn, world_size, batches, momentum, show=None, timeout=60)
        try:
            got = [torch.as_tensor(t).detach().float() for t in fn([[x.clone() for x in b] for b in batches], momentum)]
        except Exception as e:
            return wrong(f"your function raised {type(e).__name__}: {e}")
        if len(got) != world_size or any(t.shape != (CHANNELS,) for t in got):
            return wrong(f"return one running_mean of shape ({CHANNELS},) per rank: a list of {world_size} tensors.")
        if all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, actual)):
            continue
        where = f"({world_size} ranks, {steps} steps, momentum {momentum})"

        def same(**kw):
            return all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, _simulate(batches, momentum, **kw)))

        if same(broadcast_before=False):
            return wrong(f"{where} the ranks' running means are not independent: DDP broadcasts rank 0's buffers "
                         "at the start of every training forward, so each rank starts each step from rank 0's values.")
        if same(broadcast_before=False, broadcast_after=True) or same(broadcast_before=True, broadcast_after=True):
            return wrong(f"{where} the ranks do not end equal: the broadcast happens at the *start* of a forward, "
                         "and then every rank's BatchNorm updates the statistics with its own batch.")
        if same(global_stats=True) or same(broadcast_before=False, global_stats=True):
            return wrong(f"{where} plain BatchNorm under DDP never sees the other ranks' samples: each rank updates "
                         "with the mean of its own batch (only a synchronised BatchNorm uses the global batch).")
        return wrong(f"{where} running_mean ← (1 - momentum) · running_mean + momentum · (this rank's batch mean), "
                     "starting from zeros; and mind when DDP's buffer broadcast happens.")
    return correct("every rank's running_mean, predicted exactly as two real DDP runs ended.")


def _bn_autograd(x, weight, upstream, eps):
    """Input gradient of sum(upstream * BatchNorm(x)) over the whole batch, by autograd."""
    x = x.clone().requires_grad_()
    y = nn.functional.batch_norm(x, None, None, weight, None, training=True, eps=eps)
    (upstream * y).sum().backward()
    return x.grad


_INPUT_GRAD_HINT = ("three paths lead from x_i to the loss: through x̂_i itself, through the mean μ and through the variance σ², which every x̂_j uses. Write ∂L/∂x_i = Σ_j g_j γ ∂x̂_j/∂x_i with ∂μ/∂x_i = 1/n and ∂σ²/∂x_i = 2(x_i − μ)/n, then simplify with Σ_j x̂_j = 0. Every Σ runs over the global batch: that is what sum_g, sum_g_xhat and n are for.")


@exercise("Exercise 3 (input_grad)", hint=_INPUT_GRAD_HINT)
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
    return wrong(_INPUT_GRAD_HINT)
