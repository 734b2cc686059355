"""Checks for notebook 09 (the failure lab)."""

import torch
from torch import nn

from course.classroom.exercises import correct, exercise, wrong
from course.runtime.launcher import WorkerTimeoutError, launch

# ------------------------------------------------------------------ Exercise 1


@exercise("Exercise 1 (skipped collective)", hint="collectives are matched by order: pair rank 1's first all_reduce with rank 0's first.")
def skipped_collective(answer):
    """Exercise 1: what rank 1's ``b`` holds when rank 1 skipped the all_reduce of ``a``."""
    try:
        value = float(torch.as_tensor(answer).item())
    except (TypeError, ValueError, RuntimeError):
        return wrong("give one number.")
    if value == 21.0:
        return correct("rank 1's first all_reduce met rank 0's first one, the one of `a`: 1 + 20.")
    if value == 30.0:
        return wrong("that is what a correct program gives. Collectives are not matched by variable "
                     "name, but by order: rank 1's first all_reduce meets rank 0's first all_reduce.")
    if value == 20.0:
        return wrong("rank 1's all_reduce did complete, so it added something from rank 0: "
                     "which of rank 0's two calls came first?")
    return wrong("collectives are matched by order: pair rank 1's first all_reduce with rank 0's first.")


# ------------------------------------------------------------------ Exercise 2

THRESHOLD = 0.05
STEPS = 12
# How long a launch may run before we call it a hang (measured on 2 cores, torch 2.15): a correct answer,
# launch included, took 0.2-0.4 s at load average 4-5, up to 0.55 s with 4 busy processes competing for the
# 2 cores, and answers that finish took up to 1.0 s at load average 10. 3 s leaves 3x over the worst of
# those, and a wrong answer that hangs costs 3 s instead of the 10 s this bound used to be.
HANG_S = 3


def batches(rank):
    """Rank 1's targets are easy (y = 0), rank 0's are noise: rank 1's loss drops below THRESHOLD first."""
    g = torch.Generator().manual_seed(200 + rank)
    x = [torch.randn(8, 4, generator=g) for _ in range(STEPS)]
    return [(xi, torch.randn(8, 1, generator=g) * (1.0 if rank == 0 else 0.0)) for xi in x]


def _job(rank, world_size, fn):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stopped_at = fn(model, optimizer, batches(rank), THRESHOLD)
    return stopped_at, {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def _first_below_anywhere():
    """The step at which the first rank sees a loss below THRESHOLD, and the weights then, replayed in one
    process (DDP's averaged gradient is the gradient of the mean of the two ranks' losses)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    data = [batches(0), batches(1)]
    for step in range(STEPS):
        losses = [nn.functional.mse_loss(model(data[r][step][0]), data[r][step][1]) for r in (0, 1)]
        if min(loss.item() for loss in losses) < THRESHOLD:
            return step, model.state_dict()
        model.zero_grad()
        (sum(losses) / 2).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return STEPS, model.state_dict()


@exercise("Exercise 2 (stop together)", hint="turn this rank's decision into a tensor and all_reduce it (op=dist.ReduceOp.MAX) so that every rank takes the same decision at the same step.")
def stop_together(fn):
    """Exercise 2: early stopping that stops every rank at the same step, without a hang."""
    try:
        results = launch(_job, 2, fn, show=None, timeout=HANG_S)
    except WorkerTimeoutError as e:
        return wrong(f"rank(s) {e.ranks} still waited after {HANG_S} s: a rank that stops alone leaves the others in "
                     "backward's all_reduce. Every rank must take the decision together.")
    steps = [r[0] for r in results]
    if steps[0] != steps[1]:
        return wrong(f"the ranks stopped at different steps {steps}: nobody hung, but the ranks trained "
                     "different numbers of steps. Stop every rank at the same step.")
    expected, reference = _first_below_anywhere()
    weights = [r[1] for r in results]
    torch.manual_seed(0)
    initial = nn.Linear(4, 1).state_dict()
    if all(torch.equal(weights[0][k], initial[k]) for k in initial):
        return wrong("the weights never changed: keep the backward and optimizer.step() of every step before the stop.")
    if steps[0] > expected:
        return wrong(f"all ranks stopped at step {steps[0]}, but at step {expected} one rank's loss was already "
                     "below the threshold: stop when *any* rank's loss is below it, not their mean or all of them.")
    if steps[0] != expected:
        return wrong(f"all ranks stopped at step {steps[0]}, expected {expected}: check the loss before the "
                     "backward of the same step, as the original did.")
    if not all(torch.allclose(weights[0][k], reference[k], atol=1e-6) for k in reference):
        return wrong(f"you stopped at the right step, {expected}, but the weights are not those of training on steps "
                     f"0 to {expected - 1}: decide before that step's backward and optimizer.step(), as the original did.")
    return correct(f"both ranks stopped at step {expected}, the first step at which a rank's loss was below "
                   f"{THRESHOLD}, and nobody hung.")
