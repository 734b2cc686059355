"""Notebook 09's checks reject plausible wrong answers with a useful hint."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course.checks import nb09

# ------------------------------------------------------------------ Exercise 1: predict the skipped collective


@pytest.mark.parametrize("answer, hint", [(30.0, "by order"), (20, "did complete"), (3.0, "by order"),
                                          ("twenty", "one number")])
def test_skipped_collective_rejects_wrong_answers(answer, hint):
    feedback = nb09.skipped_collective(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_skipped_collective_accepts_a_tensor():
    assert nb09.skipped_collective(torch.tensor([21.0])).status == "correct"


# ------------------------------------------------------------------ Exercise 2: stop together


def _alone(model, optimizer, batches, threshold):  # the snippet as given: each rank decides alone
    for step, (x, y) in enumerate(batches):
        loss = nn.functional.mse_loss(model(x), y)
        if loss.item() < threshold:
            return step
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return len(batches)


def _join(model, optimizer, batches, threshold):  # Join does not help: a rank leaves between forward and backward
    from torch.distributed.algorithms.join import Join

    with Join([model]):
        return _alone(model, optimizer, batches, threshold)


def _join_after_the_step(model, optimizer, batches, threshold):  # no hang, but the ranks stop at different steps
    from torch.distributed.algorithms.join import Join

    with Join([model]):
        for step, (x, y) in enumerate(batches):
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if loss.item() < threshold:
                return step
    return len(batches)


def _mean_loss(model, optimizer, batches, threshold):  # all ranks together, but on the mean loss
    for step, (x, y) in enumerate(batches):
        loss = nn.functional.mse_loss(model(x), y)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if mean.item() / dist.get_world_size() < threshold:
            return step
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return len(batches)


def _after_the_step(model, optimizer, batches, threshold):  # decides after training on the batch
    for step, (x, y) in enumerate(batches):
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        stop = torch.tensor([float(loss.item() < threshold)])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            return step
    return len(batches)


def _no_training(model, optimizer, batches, threshold):
    for step, (x, y) in enumerate(batches):
        loss = nn.functional.mse_loss(model(x), y)
        stop = torch.tensor([float(loss.item() < threshold)])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            return step
    return len(batches)


@pytest.mark.parametrize("answer, hint", [
    (_alone, f"still waited after {nb09.HANG_S} s"),
    (_join, f"still waited after {nb09.HANG_S} s"),
    (_join_after_the_step, "stopped at different steps"),
    (_mean_loss, "*any* rank's loss"),
    (_after_the_step, "decide before that step's backward"),
    (_no_training, "the weights never changed"),
])
def test_stop_together_rejects_wrong_answers(answer, hint):
    feedback = nb09.stop_together(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback
