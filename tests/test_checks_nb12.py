"""Notebook 12's checks reject plausible wrong answers with a useful hint."""

import copy
from dataclasses import replace

import pytest

from course.checks import nb12

# The judges' own reasons (course.classroom.guard off, as in tests/test_checks_nb11.py).
pytestmark = pytest.mark.usefixtures("judges_only")


def said(feedback):
    """The verdict's words on one line, after checking that no printed line of it is longer than 100 characters."""
    assert max(len(line) for line in repr(replace(feedback, details="")).splitlines()) <= 100, feedback
    return " ".join(feedback.message.split())


# ------------------------------------------------------------------ Exercise 1 (bytes_per_rank)

# P = 3,371 values (not a multiple of 4) in T = 4 tensors, 4 ranks
RIGHT = {
    0: {"parameters": 13484, "gradients": 13484, "optimizer": 26984},  # 4P, 4P, 8P + 4T
    1: {"parameters": 13484, "gradients": 13484, "optimizer": 6748},  # 8 ceil(P/4) + 4: the padded slice
    3: {"parameters": 3604, "gradients": 3604, "optimizer": 7224},  # rows 8/30, 8/30, 3/11, 3/11 -> 901 values
}


def _with(stage, kind, value):
    answer = copy.deepcopy(RIGHT)
    answer[stage][kind] = value
    return answer


def test_bytes_per_rank_answer_is_what_a_real_run_measures():
    assert nb12.measured_bytes() == RIGHT
    assert nb12.bytes_per_rank(*RIGHT.values()).status == "correct"


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_with(0, "optimizer", 13500), "*two* tensors per parameter"),  # one moment only
        (_with(3, "optimizer", 3620), "*two* tensors per parameter"),
        (_with(0, "optimizer", 26968), "count Adam's `step` too"),
        (_with(1, "optimizer", 6744), "count Adam's `step` too"),
        (_with(1, "optimizer", 6760), "one step counter"),
        (_with(1, "optimizer", 6746), "padded to a multiple of the world size"),  # 8P/4 + 4: no padding
        (_with(1, "optimizer", 6740), "843 per rank, not 842"),  # the unpadded count, 3,371 // 4 = 842
        (_with(1, "optimizer", 6746.0), "padded to a multiple of the world size"),  # 8 * 3,371 / 4 + 4
        (_with(1, "parameters", 3371), "ZeRO-1 shards only the optimizer state"),
        (_with(1, "parameters", 3372), "ZeRO-1 shards only the optimizer state"),
        (_with(1, "gradients", 3371), "ZeRO-1 keeps the full gradients"),
        (_with(0, "parameters", 3371), "DDP replicates everything"),
        (_with(3, "parameters", 3371), "round up per tensor"),  # P / N: forgets the padding of uneven shards
        (_with(3, "optimizer", 6758), "round up per tensor"),
        (_with(3, "gradients", 13484), "reduce-scatters the gradients"),
        (_with(3, "parameters", 3604.5), "whole numbers"),
        (_with(3, "parameters", 3.52), "not KiB"),
        (_with(3, "optimizer", 5360), "rank 0's shards are full"),  # the last rank's, 8 x 668 + 4 x 4
        (_with(3, "parameters", 999), "1 of the 9 numbers are off, the first: stage 3, parameters"),
        ({**RIGHT, 3: [3604, 3604, 7224]}, "stage3 must be a dict with the keys"),
        ({**RIGHT, 3: {"parameters": 1}}, "stage3 must be a dict with the keys"),
        (_with(0, "gradients", "13484"), "numbers of bytes"),
    ],
)
def test_bytes_per_rank_rejects_wrong_answers(answer, hint):
    feedback = nb12.bytes_per_rank(*answer.values())
    assert feedback.status == "wrong" and hint in said(feedback), feedback


# ------------------------------------------------------------------ Exercise 2 (checkpoint_sequential)


def test_checkpoint_sequential_counts_are_measured():
    assert nb12.checkpoint_sequential_counts() == ([2, 2, 1, 1], 320.0)


@pytest.mark.parametrize(
    "calls, kib, hint",
    [
        ([2, 2, 2, 2], 320, "the last segment is never checkpointed"),
        ([2, 2, 2, 1], 320, "len(model) // segments = 1"),
        ([1, 1, 1, 1], 320, "runs its forward again"),
        ([2, 1, 2, 1], 320, "all segments but the last"),
        ([2, 2, 1, 1], 576, "without any checkpointing"),
        ([2, 2, 1, 1], 64, "the last segment saves everything"),
        ([2, 2, 1, 1], 192, "the last segment has two blocks"),
        ([2, 2, 1, 1], 300, "Tensors shared between blocks count once"),
        ([2, 2, 1, 1], 327680, "KiB, not bytes"),  # 320 KiB in bytes
        ([2, 2, 1], 320, "4 of them"),
        ("two", 320, "a list of 4 whole numbers"),
        (["2", "2", "1", "1"], 320, "not strings"),
        ([2, 2, 1, 1], "320", "not strings"),
        ([2.5, 2, 1, 1], 320, "a whole number of times"),
        ([2.4, 2.4, 1.2, 1.2], 320, "a whole number of times"),  # int() would have made them right
        ([True, 2, 1, 1], 320, "a whole number of times"),
    ],
)
def test_checkpoint_sequential_rejects_wrong_answers(calls, kib, hint):
    feedback = nb12.checkpoint_sequential(calls, kib)
    assert feedback.status == "wrong" and hint in said(feedback), feedback
