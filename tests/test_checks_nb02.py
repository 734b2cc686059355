"""Notebook 02's checks reject plausible wrong answers, each with a hint that fits the mistake."""

from concurrent.futures import ThreadPoolExecutor

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
_PRINT_FIRST = _HEAD + """
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", init_method="env://")
total = torch.tensor([rank + 1.0])
print(f"rank {rank} of {world_size}: sum {total.item():g}")
dist.all_reduce(total)
dist.destroy_process_group()
"""
_NO_DESTROY = _HEAD + """
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", init_method="env://")
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
print(f"rank {rank} of {world_size}: sum {total.item():g}")
"""


_WRONG_SCRIPTS = [  # (script, processes, the hint it must get)
    (_NO_INIT, 3, "must call dist.init_process_group"),
    (_HARD_CODED, 3, "read WORLD_SIZE"),  # prints "of 2": needs a world size other than 2
    (_NO_ALL_REDUCE, 3, "all_reduce the tensor"),  # found before running it
    (_PRINT_FIRST, 2, "each process printed its own number: all_reduce the tensor"),
    (_NO_DESTROY, 3, "destroy_process_group"),
    (_HEAD + "print('hello')\n", 3, "must call dist.init_process_group"),
    ("# init_process_group(), all_reduce() and destroy_process_group() come later\nraise ValueError('typo')\n", 2,
     "failed under torchrun: ValueError: typo"),
    (42, 3, "as a string"),
]


@pytest.fixture(scope="module")
def wrong_script_feedback():
    """The check's verdict on every wrong script, all checked at once: three of them run under
    torchrun, and a torchrun job is mostly start-up (the agent and each process import torch).
    Where the number of processes does not matter, 2 instead of the notebook's 3."""
    with ThreadPoolExecutor(len(_WRONG_SCRIPTS)) as pool:
        return list(pool.map(lambda case: nb02.setup_script(case[0], nproc=case[1]), _WRONG_SCRIPTS))


@pytest.mark.parametrize("case", range(len(_WRONG_SCRIPTS)), ids=[hint for _, _, hint in _WRONG_SCRIPTS])
def test_setup_script_rejects_wrong_answers(wrong_script_feedback, case):
    hint = _WRONG_SCRIPTS[case][2]
    feedback = wrong_script_feedback[case]
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
