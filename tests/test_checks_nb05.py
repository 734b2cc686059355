"""Notebook 05's checks reject plausible wrong answers with a useful hint."""

import pytest

from course.checks import nb05


@pytest.mark.parametrize(
    "answer, hint",
    [
        (8, "strides"),  # sizes only
        (128, "in bytes"),
        (4, "one per *dimension*"),
        (3114, "the parameters' values"),
        (17, "conv weight has 4 dimensions"),
        (16.0, "whole number"),
    ],
)
def test_metadata_length_rejects_wrong_answers(answer, hint):
    feedback = nb05.metadata_length(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def _reference(n_steps, n_buckets):
    ops = ["all_gather", "broadcast", "broadcast"]
    for step in range(n_steps):
        if step == 1:
            ops += ["broadcast", "broadcast"]
        ops += ["all_reduce"] * (1 if step == 0 else n_buckets)
    return ops


def _no_rebuild_broadcasts(n_steps, n_buckets):
    return ["all_gather", "broadcast", "broadcast"] + ["all_reduce"] * (1 + (n_steps - 1) * n_buckets)


def _all_buckets_from_the_start(n_steps, n_buckets):
    ops = ["all_gather", "broadcast", "broadcast"]
    for step in range(n_steps):
        ops += ["broadcast", "broadcast"] if step == 1 else []
        ops += ["all_reduce"] * n_buckets
    return ops


def _rebuild_after_the_all_reduces(n_steps, n_buckets):
    ops = ["all_gather", "broadcast", "broadcast"]
    for step in range(n_steps):
        ops += ["all_reduce"] * (1 if step == 0 else n_buckets)
        ops += ["broadcast", "broadcast"] if step == 1 else []
    return ops


def _with_the_classic_barrier(n_steps, n_buckets):
    return ["barrier"] + _reference(n_steps, n_buckets)


def _crashes(n_steps, n_buckets):
    raise KeyError("oops")


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_no_rebuild_broadcasts, "rank 0 sends its new bucket layout"),
        (_all_buckets_from_the_start, "the first step runs with a single bucket"),
        (_rebuild_after_the_all_reduces, "the layout broadcasts come at the start of the second step"),
        (_with_the_classic_barrier, "the trace starts with ['all_gather', 'broadcast', 'broadcast']"),
        (_crashes, "raised KeyError"),
    ],
)
def test_expected_ops_rejects_wrong_answers(answer, hint):
    feedback = nb05.expected_ops(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_expected_ops_accepts_the_reference():
    assert nb05.expected_ops(_reference).status == "correct"
