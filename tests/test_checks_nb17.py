"""Notebook 17's checks reject plausible wrong answers with a useful hint."""

import pytest

from course.checks import nb17
from course.classroom.doctor import PART_II_TORCH, torch_at_least
from course.parallel.planner import LLAMA3_8B, Config

# course declares notebooks 11-17 for torch >= PART_II_TORCH (course/classroom/doctor.py, README); the planner's
# activation coefficient is measured on this torch's kernels (torch 2.8's keep other tensors).
pytestmark = pytest.mark.skipif(
    not torch_at_least(PART_II_TORCH), reason=f"notebooks 11-17 need torch >= {PART_II_TORCH}"
)


def _grid(dp, pp, tp):  # the solution, written independently of the package
    rank = lambda d, p, t: (d * pp + p) * tp + t  # noqa: E731
    return {
        "dp": [[rank(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[rank(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
        "tp": [[rank(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)],
    }


def _tp_slowest(dp, pp, tp):  # rank = (t * pp + p) * dp + d: the dimensions in the wrong order
    rank = lambda d, p, t: (t * pp + p) * dp + d  # noqa: E731
    return {
        "dp": [[rank(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[rank(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
        "tp": [[rank(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)],
    }


def _hard_coded(dp, pp, tp):  # the 2 x 2 x 2 answer, copied from the printed table
    return {"dp": [[0, 4], [1, 5], [2, 6], [3, 7]], "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7]]}


def _swapped(dp, pp, tp):  # dp and tp groups exchanged
    g = _grid(dp, pp, tp)
    return {"dp": g["tp"], "pp": g["pp"], "tp": g["dp"]}


def _strided_pp(dp, pp, tp):  # pp groups stride by 1 instead of tp
    g = _grid(dp, pp, tp)
    g["pp"] = [list(range(start, start + pp)) for start in range(0, dp * pp * tp, pp)]
    return g


def _only_mine(dp, pp, tp):  # rank 0's groups only
    g = _grid(dp, pp, tp)
    return {dim: groups[:1] for dim, groups in g.items()}


def test_mesh_groups_accepts_a_solution_in_any_order():
    assert nb17.mesh_groups(_grid).status == "correct"
    reordered = lambda *shape: {dim: [list(reversed(g)) for g in reversed(gs)] for dim, gs in _grid(*shape).items()}  # noqa: E731
    assert nb17.mesh_groups(reordered).status == "correct"


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_tp_slowest, "tp varies fastest"),
        (_hard_coded, "(1, 2, 4)"),
        (_swapped, "your tp groups are the dp groups"),
        (_strided_pp, "pp groups should be"),
        (_only_mine, "cover every rank exactly once"),
        (lambda dp, pp, tp: [[0]], 'return a dict with the keys "dp", "pp" and "tp"'),
        (lambda dp, pp, tp: 1 / 0, "ZeroDivisionError"),
        (__import__("course.parallel.parallel3d").parallel.parallel3d.mesh_groups, "course's own"),
    ],
)
def test_mesh_groups_rejects_wrong_answers(answer, hint):
    feedback = nb17.mesh_groups(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_state_gb_accepts_the_answer():
    assert nb17.state_gb((2 + 2 + 12 / 8) * LLAMA3_8B.params() / 1e9).status == "correct"


P = LLAMA3_8B.params()


@pytest.mark.parametrize(
    "answer, hint",
    [
        (16 * P / 8 / 1e9, "ZeRO-3"),
        (16 * P / 1e9, "one whole copy"),
        ((2 + 12 / 8) * P / 1e9, "count both"),
        (4 * P / 1e9, "count both"),
        ((2 + 2 + 8 / 8) * P / 1e9, "fp32 master weights"),
        ((2 + 2 + 12 / 8) * P / 2**30, "GiB"),
        ((2 + 4 + 12 / 8) * P / 1e9, "fp32 gradients"),
        (float("inf"), "answer with a number"),
        (float("nan"), "answer with a number"),
        (12.0, "see the hint"),
        ("44", "answer with a number"),
        (True, "answer with a number"),
    ],
)
def test_state_gb_rejects_wrong_answers(answer, hint):
    feedback = nb17.state_gb(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_configuration_accepts_near_best_configurations():
    assert nb17.configuration(Config(dp=8, tp=8, pp=1, zero=3)).status == "correct"
    assert nb17.configuration(Config(dp=8, tp=8, pp=1, zero=2)).status == "correct"
    assert nb17.configuration(Config(dp=4, tp=8, pp=2, zero=3)).status == "correct"  # 0.7% slower: accepted


@pytest.mark.parametrize(
    "answer, hint",
    [
        (Config(dp=64, zero=0), "more than the 72 GB"),  # plain DDP: 1.1 TB of state per GPU
        (Config(dp=64, zero=3), "more than the 72 GB"),  # sharded state, but 80 layers of activations
        (Config(dp=4, tp=4, pp=4, zero=2), "more than the 72 GB"),  # fits only with a GPT block's activations
        (Config(dp=4, tp=16, zero=1), "spans nodes"),
        (Config(dp=8, tp=4, pp=4, zero=1), "must use all 64 GPUs"),
        (Config(dp=4, tp=2, pp=8, zero=1, micro_batch=3), "split over"),  # 512 sequences over 4 x 3
        (Config(dp=64, zero=3, recompute=True), "the best configuration takes"),  # fits, slower
        (Config(dp=8, tp=8, zero=3, recompute=True), "the best configuration takes"),  # needless recomputation
        ((4, 4, 4), "answer with a Config"),
    ],
)
def test_configuration_rejects_wrong_answers(answer, hint):
    feedback = nb17.configuration(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


@pytest.mark.parametrize("bad", [dict(dp=-64, tp=-1), dict(dp=64, zero=5), dict(dp=64, micro_batch=0), dict(dp=8.0)])
def test_config_refuses_impossible_values(bad):
    with pytest.raises(ValueError, match="Config:"):
        Config(**bad)
