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
     "the script failed: ValueError: typo"),
    (42, 3, "as a string"),
]


@pytest.mark.parametrize("case", range(len(_WRONG_SCRIPTS)), ids=[hint for _, _, hint in _WRONG_SCRIPTS])
def test_setup_script_rejects_wrong_answers(case):
    script, nproc, hint = _WRONG_SCRIPTS[case]
    feedback = nb02.setup_script(script, nproc=nproc)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


_ONLY_RANK_0 = _HEAD + """
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", init_method="env://")
total = torch.tensor([rank + 1.0])
if rank == 0:
    dist.all_reduce(total)
OTHER
print(f"rank {rank} of {world_size}: sum {total.item():g}")
dist.destroy_process_group()
"""


def test_setup_script_with_a_collective_not_every_process_calls():
    # Rank 1 goes on and ends: rank 0's all_reduce loses its peer.
    feedback = nb02.setup_script(_ONLY_RANK_0.replace("OTHER", ""), nproc=2)
    assert feedback.status == "wrong" and "rank 0 waited in a collective" in feedback.message, feedback
    # Rank 1 waits for a message rank 0 never sends: both wait, until the check's timeout.
    stuck = _ONLY_RANK_0.replace("OTHER", "else:\n    dist.recv(total, src=0)")
    feedback = nb02.setup_script(stuck, nproc=2, timeout=2)
    assert feedback.status == "wrong" and "had not ended after 2 s (rank(s) 0, 1 of 2" in feedback.message, feedback


def test_setup_script_runs_as_torchrun_would():
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set, no process group yet, ``__main__``."""
    script = _HEAD + """
import sys
assert not dist.is_initialized()
if __name__ == "__main__":
    print(os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], os.environ["MASTER_ADDR"], bool(os.environ["MASTER_PORT"]))
    sys.exit(0)
"""
    assert nb02.run_script(script, 2) == ["0 2 0 127.0.0.1 True\n", "1 2 1 127.0.0.1 True\n"]


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
