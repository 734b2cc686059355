"""Notebook 03's checks reject plausible wrong answers, each with a hint that fits the mistake.
(That they accept the notebook's solutions and report stubs as "not attempted" is tested for
every notebook in test_checks.py.)"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset

from course.checks import nb03

# ------------------------------------------------------------------ Exercise 1: indices


@pytest.mark.parametrize(
    "padded, dropped, hint",
    [
        ([3, 7, 11, 0], [3, 7, 11], "first* indices"),  # padding with zeros / with index 0
        ([3, 7, 11, 13], [3, 7, 11], "first* indices"),  # padding with the last index
        ([3, 7, 11], [3, 7, 11], "padded to 16"),  # forgot the padding
        ([3, 7, 11, 1], [3, 7, 11, 1], "cut to 12"),  # thinks drop_last changes nothing
        ([3, 7, 11, 1], [3, 7], "cut to 12"),
        ([2, 6, 10, 0], [2, 6, 10], "Ranks count from 0"),  # rank 3 read as the third rank
        ([12, 13, 0, 1], [9, 10, 11], "contiguous blocks"),  # contiguous shards
        ("3, 7", [3], "two lists of whole numbers"),
    ],
)
def test_rank_indices_rejects_wrong_answers(padded, dropped, hint):
    feedback = nb03.rank_indices(padded, dropped)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_rank_indices_needs_both_answers():
    assert nb03.rank_indices([3, 7, 11, 1], ...).status == "todo"
    assert nb03.rank_indices((3, 7, 11, 1), range(3, 12, 4)).status == "correct"  # any sequence will do


# ------------------------------------------------------------------ Exercise 2: global batch, steps


@pytest.mark.parametrize(
    "global_batch, steps, hint",
    [
        (32, 391, "per-rank batch times the number of ranks"),
        (128, 1563, "only its quarter"),
        (128, 1562, "only its quarter"),
        (128, 390, "round up"),
        (128, 98, "cuts them into batches of 32"),  # 12,500 / 128
    ],
)
def test_batch_arithmetic_rejects_wrong_answers(global_batch, steps, hint):
    feedback = nb03.batch_arithmetic(global_batch, steps)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


# ------------------------------------------------------------------ Exercise 3: exact evaluation


def _sums(model, dataset, indices):
    totals = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for x, y in DataLoader(Subset(dataset, list(indices)), batch_size=100):
            logits = model(x)
            totals += torch.tensor(
                [nn.functional.cross_entropy(logits, y, reduction="sum").item(), (logits.argmax(1) == y).sum().item(), len(y)],
                dtype=torch.float64,
            )
    return totals


def _with_padding(model, dataset):  # the naive one: DistributedSampler pads 10 -> 12
    totals = _sums(model, dataset, DistributedSampler(dataset, shuffle=False))
    dist.all_reduce(totals)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def _mean_of_means(model, dataset):  # no padding, but averages the ranks' averages
    rank, world_size = dist.get_rank(), dist.get_world_size()
    totals = _sums(model, dataset, range(rank, len(dataset), world_size))
    means = torch.stack([totals[0] / totals[2], totals[1] / totals[2]])
    dist.all_reduce(means)
    return (means / world_size).tolist()


def _local_only(model, dataset):  # forgets to combine the ranks
    rank, world_size = dist.get_rank(), dist.get_world_size()
    totals = _sums(model, dataset, range(rank, len(dataset), world_size))
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def _loss_sum(model, dataset):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    totals = _sums(model, dataset, range(rank, len(dataset), world_size))
    dist.all_reduce(totals)
    return totals[0].item(), (totals[1] / totals[2]).item()


def _percent(model, dataset):
    loss, accuracy = _loss_sum(model, dataset)
    return loss / 10, 100 * accuracy


def _everything_everywhere(model, dataset):  # the loophole: right numbers, no sharding, no communication
    totals = _sums(model, dataset, range(len(dataset)))
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def _rank0_does_it_all(model, dataset):  # communicates, but does not share the work
    totals = _sums(model, dataset, range(len(dataset))) if dist.get_rank() == 0 else torch.zeros(3, dtype=torch.float64)
    dist.all_reduce(totals)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def _one_number(model, dataset):
    return 0.5


def _crashes(model, dataset):
    raise RuntimeError("typo")


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_with_padding, "counted twice"),
        (_mean_of_means, "mean of their means"),
        (_local_only, "different numbers"),
        (_loss_sum, "*mean* loss"),
        (_percent, "fraction between 0 and 1"),
        (_everything_everywhere, "every rank ran the model on all 10 samples"),
        (_rank0_does_it_all, "share the work evenly"),
        (_one_number, "return two numbers"),
        (_crashes, "a rank failed: RuntimeError: typo"),
    ],
)
def test_evaluate_rejects_wrong_answers(answer, hint):
    feedback = nb03.evaluate(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_exercise_3_data_tells_the_mistakes_apart():
    """The check's data is built so that padding, and averaging unequal shards, both show."""
    model, dataset = nb03._exact_eval_data()
    x, y = dataset.tensors
    exact = nb03._metrics(model, x, y)
    assert exact[1] == pytest.approx(0.8)  # samples 0 and 1 are wrong, the other 8 right
    padded = torch.tensor([i for r in range(3) for i in DistributedSampler(range(10), 3, r, shuffle=False)])
    naive = nb03._metrics(model, x[padded], y[padded])
    assert naive[1] == pytest.approx(8 / 12) and abs(naive[0] - exact[0]) > 0.1


# ------------------------------------------------------------------ one copy of the code


def test_the_notebooks_net_and_transform_are_the_ones_course_train_uses():
    """Notebook 03 derives Net and the transform; course/training/train.py holds the same code (one copy each,
    kept equal by this test). The notebook must not import them from the package."""
    import inspect
    import re

    import nbformat

    import course.training.train
    from course.classroom.notebooks import SOLUTIONS

    nb = nbformat.read(SOLUTIONS / "03_distributed_sampler.ipynb", as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    assert not any(re.search(r"course\.training\.train|from course\.training import train", src) for src in code)

    net_cell = next(src for src in code if src.startswith("class Net(nn.Module):"))
    end = next((m.start() for m in re.finditer(r"^\S", net_cell, re.M) if m.start() > 0), len(net_cell))
    assert net_cell[:end].strip() == inspect.getsource(course.training.train.Net).strip()

    transform_line = next(line for src in code for line in src.splitlines() if line.startswith("transform = "))
    expression = transform_line.split("=", 1)[1].split("#")[0].strip()
    assert expression.startswith("T.Compose(")
    assert f"return {expression}" in inspect.getsource(course.training.train)
