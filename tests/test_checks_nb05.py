"""Notebook 05's checks reject plausible wrong answers with a useful hint."""

import pytest

from course.checks import nb05


@pytest.fixture
def traced_once(launch_once):
    """Each traced run nb05's checks launch runs once in this file: its op names are the same every run."""
    launch_once(nb05)


@pytest.mark.parametrize(
    "answer, hint",
    [
        (15, "strides"),  # sizes only
        (240, "in bytes"),
        (8, "one per *dimension*"),  # one number per parameter
        (16, "one per *dimension*"),  # two numbers per parameter
        (3986, "the parameters' values"),
        (38, "the *parameters* only"),  # + running_mean and running_var
        (42, "the *parameters* only"),  # + num_batches_tracked, counted as 1-D
        (34, "bias=False"),  # a bias for each conv
        (22, "BatchNorm's weight and bias are parameters"),  # the BatchNorm layers left out
        (31, "a conv weight has 4 dimensions"),
        (30.0, "whole number"),
    ],
)
def test_metadata_length_rejects_wrong_answers(answer, hint, traced_once):
    feedback = nb05.metadata_length(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_metadata_length_accepts_the_answer(traced_once):
    assert nb05.metadata_length(30).status == "correct"


def _reference(sync, n_buckets, construction=("all_gather", "broadcast", "broadcast", "broadcast"),
               buffers_rule="previous", layout_under_no_sync=True, reduce_under_no_sync=False,
               first_step_buckets=1, buckets_after_no_sync=None, layout_after_reduces=False):
    """The rule the notebook teaches; each keyword swaps one part of it for a plausible wrong one."""
    phases = [list(construction)]
    for step, normal in enumerate(sync):
        layout = ["broadcast", "broadcast"] if step == 1 and (normal or layout_under_no_sync) else []
        buffers = {
            "previous": step == 0 or sync[step - 1],  # right: the previous forward decides
            "current": normal,  # wrong: this step's no_sync() decides
            "always": True,
            "never": False,
        }[buffers_rule]
        n = first_step_buckets if step == 0 else n_buckets
        if buckets_after_no_sync is not None and step > 0 and not sync[step - 1]:
            n = buckets_after_no_sync
        reduces = ["all_reduce"] * (n if normal or reduce_under_no_sync else 0)
        forward = ([] if layout_after_reduces else layout) + (["broadcast", "broadcast"] if buffers else [])
        phases.append(forward + reduces + (layout if layout_after_reduces else []))
    return phases


def _answer(**wrong):
    return lambda sync, n_buckets: _reference(sync, n_buckets, **wrong)


def _flat(sync, n_buckets):
    return [op for phase in _reference(sync, n_buckets) for op in phase]


def _no_construction_list(sync, n_buckets):
    return _reference(sync, n_buckets)[1:]


def _crashes(sync, n_buckets):
    raise KeyError("oops")


@pytest.mark.parametrize(
    "answer, hint",
    [
        # the construction: no int64 broadcast for the buffers' counter, or a barrier first
        (_answer(construction=["all_gather", "broadcast", "broadcast"]), "one message per dtype"),
        (_answer(construction=["barrier", "all_gather", "broadcast", "broadcast", "broadcast"]), "the parameter count (all_gather)"),
        # the buffers: never sent, sent in every forward, or skipped by the no_sync() step itself
        (_answer(buffers_rule="never"), "The first forward, and every forward after a normal one"),
        (_answer(buffers_rule="always"), "the forward right after a forward inside no_sync() broadcasts no buffers"),
        (_answer(buffers_rule="current"), "still starts with the broadcasts the previous forward"),
        # the layout: missing under no_sync(), or sent after the all_reduces
        (_answer(layout_under_no_sync=False), "in step 1, with the new bucket layout"),
        (_answer(layout_after_reduces=True), "the broadcasts come in the forward, before the backward's all_reduces"),
        # the all_reduces: under no_sync(), one per bucket in step 0, one only after accumulating
        (_answer(reduce_under_no_sync=True), "the backward all-reduces nothing"),
        (lambda sync, n: _reference(sync, n, first_step_buckets=n), "the first step runs with a single bucket"),
        (_answer(buckets_after_no_sync=1), "after no_sync() steps too"),
        # the shape of the answer
        (_flat, "a list of lists of op names"),
        (_no_construction_list, "one for DDP(model), then one per step"),
        (_crashes, "raised KeyError"),
    ],
)
def test_expected_ops_rejects_wrong_answers(answer, hint, traced_once):
    feedback = nb05.expected_ops(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_expected_ops_accepts_the_reference(traced_once):
    assert nb05.expected_ops(_reference).status == "correct"
    assert nb05.expected_ops(lambda sync, n: tuple(tuple(p) for p in _reference(sync, n))).status == "correct"

