"""Notebook 02's checks reject plausible wrong answers, each with a hint that fits the mistake."""

import pytest
import torch.distributed as dist

from course.checks import nb02

# ------------------------------------------------------------------ Exercise 1: setup by hand (torchrun)

_HEAD = "import os\nimport torch\nimport torch.distributed as dist\n"
_NO_INIT = _HEAD + """
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
print(f"rank {rank} of {world_size}: sum {total.item():g}")
"""
_HARD_CODED = _HEAD + """
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
print(f"rank {rank} of 2: sum {total.item():g}")
dist.destroy_process_group()
"""
_NO_ALL_REDUCE = _HEAD + """
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", init_method="env://")
print(f"rank {rank} of {world_size}: sum {rank + 1.0:g}")
dist.destroy_process_group()
"""
_NO_DESTROY = _HEAD + """
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", init_method="env://")
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
print(f"rank {rank} of {world_size}: sum {total.item():g}")
"""


@pytest.mark.parametrize(
    "script, hint",
    [
        (_NO_INIT, "must call dist.init_process_group"),
        (_HARD_CODED, "read WORLD_SIZE"),
        (_NO_ALL_REDUCE, "all_reduce the tensor"),
        (_NO_DESTROY, "destroy_process_group"),
        (_HEAD + "print('hello')\n", "must call dist.init_process_group"),
        (_HEAD + "# init_process_group(...) and destroy_process_group() come later\nraise ValueError('typo')\n", "failed under torchrun: ValueError: typo"),
        (42, "as a string"),
    ],
)
def test_setup_script_rejects_wrong_answers(script, hint):
    feedback = nb02.setup_script(script)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_setup_script_stub_is_not_attempted():
    stub = _HEAD + "...  # ✏️ your code here\n"
    assert nb02.setup_script(stub).status == "todo"


# ------------------------------------------------------------------ Exercise 2: average_gradients


def _sum_only(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def _local_only(model):
    for p in model.parameters():
        p.grad /= dist.get_world_size()


def _weight_only(model):
    dist.all_reduce(model.weight.grad)
    model.weight.grad /= dist.get_world_size()


def _crashes(model):
    raise RuntimeError("typo")


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_sum_only, "divide by the world size"),
        (_local_only, "all_reduce"),
        (_weight_only, "weight and bias"),
        (_crashes, "a rank failed: RuntimeError: typo"),
    ],
)
def test_average_gradients_rejects_wrong_answers(answer, hint):
    feedback = nb02.average_gradients(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback
