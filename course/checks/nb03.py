"""Checks for notebook 03 (DistributedSampler, global batch size, exact evaluation)."""

import math

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from course.classroom.exercises import correct, exercise, wrong
from course.runtime.launcher import launch


def _indices(n, world_size, rank, drop_last):
    return list(DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=False, drop_last=drop_last))


@exercise("Exercise 1 (DistributedSampler indices)", hint="with drop_last=False every rank gets ceil(14 / 4) = 4 indices: the list is padded to 16.")
def rank_indices(padded, dropped):
    """Exercise 1: rank 3's indices for 14 samples on 4 ranks, ``shuffle=False``, with
    ``drop_last=False`` (``padded``) and ``drop_last=True`` (``dropped``)."""
    try:
        padded, dropped = [int(i) for i in padded], [int(i) for i in dropped]
    except (TypeError, ValueError):
        return wrong("give two lists of whole numbers, e.g. [3, 7] and [3].")
    n, world_size, rank = 14, 4, 3
    expected_padded, expected_dropped = _indices(n, world_size, rank, False), _indices(n, world_size, rank, True)
    if padded == expected_padded and dropped == expected_dropped:
        return correct("rank 3 takes every 4th index from 3; the padding slot 15 holds index 1.")
    if any(padded == _indices(n, world_size, other, False) for other in range(world_size) if other != rank):
        return wrong("that is another rank's share. Ranks count from 0: rank 3 is the fourth rank.")
    drop_hint = ("with drop_last=True the list is cut to 12 = 4 x 3 indices: the last 2 are dropped, "
                 "and rank 3 takes slots 3, 7 and 11.")
    if padded == expected_padded and dropped == padded:
        return wrong(drop_hint)
    every_4th = list(range(rank, 16, world_size))
    if padded[:3] != every_4th[:3] or dropped != every_4th[: len(dropped)]:
        return wrong("DistributedSampler does not cut the dataset into contiguous blocks: "
                           "rank r takes every 4th index, starting at r.")
    if len(padded) != math.ceil(n / world_size):
        return wrong("with drop_last=False every rank gets ceil(14 / 4) = 4 indices: the list is padded to 16.")
    if padded[3] != expected_padded[3]:
        return wrong("the padding repeats the *first* indices of the list, in order: slot 14 gets "
                           "index 0 and slot 15 gets index 1 (not zeros, not the last index). Which slot is rank 3's?")
    return wrong(drop_hint)


@exercise("Exercise 2 (global batch and steps)", hint="the last, smaller batch is kept (DataLoader's drop_last=False): round up.")
def batch_arithmetic(global_batch, steps_per_epoch):
    """Exercise 2: 50,000 images, 4 ranks, per-rank batch 32, default DistributedSampler and DataLoader."""
    n, world_size, per_rank = 50_000, 4, 32
    loader = DataLoader(range(n), batch_size=per_rank, sampler=DistributedSampler(range(n), world_size, 0))
    expected_global, expected_steps = per_rank * world_size, len(loader)
    if global_batch == expected_global and steps_per_epoch == expected_steps:
        return correct(f"{expected_global} samples per step; each rank makes {expected_steps} batches "
                             "of its 12,500 samples, the last one smaller.")
    if global_batch != expected_global:
        return wrong("the global batch is what one optimizer step sees: the per-rank batch times the number of ranks.")
    if steps_per_epoch == math.ceil(n / per_rank) or steps_per_epoch == n // per_rank:
        return wrong("each rank sees only its quarter of the dataset in an epoch, 12,500 samples.")
    if steps_per_epoch == (n // world_size) // per_rank:
        return wrong("the last, smaller batch is kept (DataLoader's drop_last=False): round up.")
    return wrong("each rank has 50,000 / 4 samples per epoch and cuts them into batches of 32; "
                       "every rank takes one optimizer step per batch, all ranks together.")


def _exact_eval_data():
    """10 samples, 3 classes, a linear model. Samples 0 and 1 (the ones DistributedSampler
    repeats on 3 ranks) are misclassified, so counting them twice shows."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(10, 4, generator=generator)
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.copy_(torch.randn(3, 4, generator=generator))
        model.bias.zero_()
        logits = model(x)
    y = logits.argmax(1)
    y[:2] = logits[:2].argmin(1)
    return model, TensorDataset(x, y)


def _metrics(model, x, y):
    with torch.no_grad():
        logits = model(x)
    return nn.functional.cross_entropy(logits, y).item(), (logits.argmax(1) == y).double().mean().item()


class _Counting(nn.Module):
    """The model, counting the samples that pass through it on this rank."""

    def __init__(self, model):
        super().__init__()
        self.model, self.seen = model, 0

    def forward(self, x):
        self.seen += len(x)
        return self.model(x)


def _run_evaluate(rank, world_size, evaluate, model, dataset):
    counting = _Counting(model)
    result = evaluate(counting, dataset)
    try:
        loss, accuracy = result
        return float(loss), float(accuracy), counting.seen
    except (TypeError, ValueError):
        return repr(result)[:100]


@exercise("Exercise 3 (exact evaluation)", hint="split the indices without padding, range(rank, len(dataset), world_size), with Subset; on each rank add up the cross-entropy losses (reduction=\"sum\"), the correct predictions and the number of samples; all_reduce the three sums, then divide.")
def evaluate(fn, world_size=3):
    """Exercise 3: exact distributed evaluation (mean loss, accuracy) with all_reduce."""
    model, dataset = _exact_eval_data()
    results = launch(_run_evaluate, world_size, fn, model, dataset, show=None, timeout=30)
    if any(isinstance(r, str) for r in results):
        bad = next(r for r in results if isinstance(r, str))
        return wrong(f"return two numbers, (mean loss, accuracy); got {bad}.")
    x, y = dataset.tensors
    exact = _metrics(model, x, y)
    seen = [r[2] for r in results]
    results = [r[:2] for r in results]
    if all(n >= len(dataset) for n in seen):
        return wrong(f"every rank ran the model on all {len(dataset)} samples ({seen} per rank): that is one "
                     "process's work, repeated. Give each rank its own part, e.g. range(rank, len(dataset), world_size), "
                     "and combine the ranks' sums with dist.all_reduce.")

    def close(a, b):
        return all(math.isclose(u, v, rel_tol=1e-5, abs_tol=1e-6) for u, v in zip(a, b))

    if close(results[0], exact) and all(close(r, exact) for r in results):
        if sum(seen) != len(dataset):
            return wrong(f"the ranks ran the model on {sum(seen)} samples in all ({seen} per rank) for a dataset "
                         f"of {len(dataset)}: each sample should be evaluated by exactly one rank.")
        if max(seen) > math.ceil(len(dataset) / world_size):
            return wrong(f"the ranks ran the model on {seen} samples: share the work evenly, each rank about "
                         f"1/{world_size} of the dataset.")
        return correct(f"{world_size} ranks, 10 samples, each counted once: the same loss and "
                             "accuracy as one process.")
    if not all(close(r, results[0]) for r in results):
        return wrong("the ranks returned different numbers: each rank must end with the metrics of "
                           "the whole dataset. Combine the ranks' sums with dist.all_reduce.")
    padded = [_indices(len(dataset), world_size, r, False) for r in range(world_size)]
    padded_all = torch.tensor([i for part in padded for i in part])
    unpadded = [list(range(r, len(dataset), world_size)) for r in range(world_size)]
    mean_of_means = [sum(v) / world_size for v in zip(*(_metrics(model, x[p], y[p]) for p in unpadded))]
    if close(results[0], _metrics(model, x[padded_all], y[padded_all])):
        return wrong("samples 0 and 1 were counted twice: DistributedSampler pads 10 samples to 12 on "
                           "3 ranks. Split without padding, e.g. range(rank, len(dataset), world_size).")
    if close(results[0], mean_of_means):
        return wrong("the ranks hold 4, 3 and 3 samples, so the mean of their means weights them "
                           "wrongly. all_reduce the sums (loss sum, correct count, sample count), then divide.")
    if math.isclose(results[0][0], exact[0] * len(dataset), rel_tol=1e-5):
        return wrong("return the *mean* loss per sample, not the sum.")
    if math.isclose(results[0][1], 100 * exact[1], rel_tol=1e-5):
        return wrong("give the accuracy as a fraction between 0 and 1, not a percentage.")
    return wrong("every rank must return (mean cross-entropy loss, accuracy) over all 10 samples, each "
                       "counted exactly once.")
