"""Checks for notebook 02 (collectives and data parallelism by hand)."""

import torch
import torch.distributed as dist
from torch import nn

from course.baseline import classic_data, single_device_step
from course.exercises import correct, exercise, wrong
from course.launcher import launch


@exercise("Exercise 1 (all_reduce)", hint="add up the tensors of ranks 0, 1, 2 and 3, element by element.")
def all_reduce_result(answer):
    """Exercise 1: what rank 2 holds after all_reduce of ``[r + 1, 2 ** r]`` on 4 ranks."""
    try:
        got = torch.as_tensor(answer, dtype=torch.float64).flatten()
    except (TypeError, ValueError, RuntimeError):
        return wrong("give two numbers, e.g. [1.0, 2.0] or a tensor.")
    ranks = torch.arange(4, dtype=torch.float64)
    expected = torch.stack([(ranks + 1).sum(), (2**ranks).sum()])
    if got.shape == expected.shape and torch.allclose(got, expected):
        return correct("every rank ends with the element-wise sum over all ranks.")
    if got.shape == expected.shape and torch.allclose(got, expected / 4):
        return wrong("the default op is ReduceOp.SUM, not the average.")
    if got.shape == expected.shape and torch.allclose(got, torch.tensor([3.0, 4.0], dtype=torch.float64)):
        return wrong("that is what rank 2 held before: all_reduce changes the tensor in place on every rank.")
    return wrong("add up the tensors of ranks 0, 1, 2 and 3, element by element.")


def _manual_data_parallel_step(rank, world_size, average_gradients):
    inputs, labels = classic_data()
    model = nn.Linear(inputs.shape[1], labels.shape[1])  # same seed and draws on every rank
    x, y = inputs.chunk(world_size)[rank], labels.chunk(world_size)[rank]
    nn.functional.mse_loss(model(x), y).backward()
    local = model.weight.grad.clone()
    average_gradients(model)
    averaged = model.weight.grad.clone()
    with torch.no_grad():
        for p in model.parameters():
            p -= 1.0 * p.grad  # SGD, lr=1
    return {"local": local, "averaged": averaged, "weight": model.weight.detach(), "bias": model.bias.detach()}


@exercise("Exercise 2 (average_gradients)", hint="all_reduce every parameter's .grad (weight and bias), then divide by dist.get_world_size().")
def average_gradients(fn, world_size=4):
    """Exercise 2: data parallelism without DDP — average the gradients across ranks."""
    results = launch(_manual_data_parallel_step, world_size, fn, show=None, timeout=30)
    reference = single_device_step()
    inputs, labels = classic_data()
    full_grad_model = nn.Linear(10, 10)
    nn.functional.mse_loss(full_grad_model(inputs), labels).backward()
    full_grad = full_grad_model.weight.grad
    averaged = results[0]["averaged"]
    if all(torch.allclose(r["averaged"], r["local"] / world_size) or torch.equal(r["averaged"], r["local"]) for r in results):
        return wrong("each rank still has only its own gradient: combine the ranks' .grad with dist.all_reduce.")
    if torch.allclose(averaged, world_size * full_grad, atol=1e-6):
        return wrong("all_reduce sums: divide by the world size to get the mean.")
    if not all(torch.equal(r["weight"], results[0]["weight"]) for r in results):
        return wrong("the ranks ended with different weights: every rank must end with the same gradients.")
    if torch.allclose(results[0]["weight"], reference.weight, atol=1e-6) and torch.allclose(
        results[0]["bias"], reference.bias, atol=1e-6
    ):
        return correct(f"{world_size} ranks, one step: the same weights as one device.")
    return wrong("all_reduce every parameter's .grad (weight and bias), then divide by dist.get_world_size().")
