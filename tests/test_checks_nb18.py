"""The capstone's checks reject plausible wrong answers with a useful hint."""

import pytest

from course.checks import nb18
from course.classroom.doctor import PART_II_TORCH, torch_at_least
import math
import random

from course.parallel import planner
from course.parallel.planner import LLAMA3_8B, Config

# course declares notebooks 11-18 for torch >= PART_II_TORCH (course/classroom/doctor.py, README); the planner's
# activation coefficient is measured on this torch's kernels (torch 2.8's keep other tensors).
pytestmark = pytest.mark.skipif(
    not torch_at_least(PART_II_TORCH), reason=f"notebooks 11-18 need torch >= {PART_II_TORCH}"
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


def _table(dp, pp, tp):  # the six listed shapes' answers, copied out; anything else made up
    known = {shape: _grid(*shape) for shape in nb18.SHAPES}
    return known.get((dp, pp, tp), _grid(1, 1, dp * pp * tp))


def _only_mine(dp, pp, tp):  # rank 0's groups only
    g = _grid(dp, pp, tp)
    return {dim: groups[:1] for dim, groups in g.items()}


def test_mesh_groups_accepts_a_solution_in_any_order():
    assert nb18.mesh_groups(_grid).status == "correct"
    reordered = lambda *shape: {dim: [list(reversed(g)) for g in reversed(gs)] for dim, gs in _grid(*shape).items()}  # noqa: E731
    assert nb18.mesh_groups(reordered).status == "correct"


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_tp_slowest, "tp varies fastest"),
        (_hard_coded, "(1, 2, 4)"),
        (_table, "for (dp, pp, tp) = ("),
        (_swapped, "your tp groups are the dp groups"),
        (_strided_pp, "pp groups should be"),
        (_only_mine, "cover every rank exactly once"),
        (lambda dp, pp, tp: [[0]], 'return a dict with the keys "dp", "pp" and "tp"'),
        (lambda dp, pp, tp: 1 / 0, "ZeroDivisionError"),
        (__import__("course.parallel.parallel3d").parallel.parallel3d.mesh_groups, "course's own"),
    ],
)
def test_mesh_groups_rejects_wrong_answers(answer, hint):
    for seed in range(40):  # every time, whatever shape the check draws (_table once passed 1 draw in 20)
        random.seed(seed)
        feedback = nb18.mesh_groups(answer)
        assert feedback.status == "wrong" and hint in feedback.message, (seed, feedback)


def _state(params, zero, dp):  # the solution, written independently of the check
    return (2 / (dp if zero == 3 else 1) + 2 / (dp if zero >= 2 else 1) + 12 / (dp if zero else 1)) * params / 1e9


def test_state_gb_accepts_the_answer():
    assert nb18.state_gb(_state).status == "correct"


def _via_planner(params, zero, dp):  # the planner's own memory() for a model of that size
    model = planner.Model("x", layers=1, hidden=1, ffn=1, heads=1, kv_heads=1, vocab=1)
    used = planner.memory(model, Config(dp=dp, zero=zero), 1, dp)
    return (used["parameters"] + used["gradients"] + used["optimizer"]) / model.params() * params / 1e9


@pytest.mark.parametrize(
    "answer, hint",
    [
        (lambda p, z, dp: 16 * p / dp / 1e9, "Each ZeRO stage shards a different part"),
        (lambda p, z, dp: 16 * p / 1e9, "Each ZeRO stage shards a different part"),
        (lambda p, z, dp: _state(p, z, dp) * 1e9 / 2**30, "GiB"),
        (lambda p, z, dp: _state(p, z, dp) + 2 * p / (dp if z >= 2 else 1) / 1e9, "fp32 gradients"),
        (lambda p, z, dp: _state(p, z, dp) - 4 * p / (dp if z else 1) / 1e9, "master weights"),
        (lambda p, z, dp: _state(p, min(z + 1, 3), dp), "another ZeRO stage"),
        (lambda p, z, dp: _state(p, 1, 8) if (p, z, dp) == (LLAMA3_8B.params(), 1, 8) else 0.0, "See the hint"),
        (lambda p, z, dp: "44", "return a number"),
        (lambda p, z, dp: math.nan, "return a number"),
        (lambda p, z, dp: 1 / 0, "ZeroDivisionError"),
        (_via_planner, "course's own"),
    ],
)
def test_state_gb_rejects_wrong_answers(answer, hint):
    feedback = nb18.state_gb(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def _activations(model, config, seq, batch, stage, c):  # the solution, written independently of the check
    split = (config.tp if config.sp else 1) * config.cp
    m = max(1, batch // (config.dp * config.micro_batch))
    return c * seq * config.micro_batch * model.hidden / split * planner.stage_layers(model, config.pp, stage) * min(
        config.pp - stage, m)


def test_activation_bytes_accepts_the_answer():
    assert nb18.activation_bytes(_activations).status == "correct"


def _tweak(**change):  # the solution with one mistake
    def answer(model, config, seq, batch, stage, c):
        m = max(1, batch // (config.dp * config.micro_batch))
        split = change.get("split", lambda c_: (c_.tp if c_.sp else 1) * c_.cp)(config)
        held = change.get("held", lambda p, s, m_: min(p - s, m_))(config.pp, stage, m)
        layers = change.get("layers", lambda mo, p, s: planner.stage_layers(mo, p, s))(model, config.pp, stage)
        return c * seq * config.micro_batch * model.hidden / split * layers * held
    return answer


def _memory_less_logits(model, config, seq, batch, stage, c):  # the planner's own memory(), logits taken off
    used = planner.memory(model, config, seq, batch, stage=stage)["activations"]
    return used * c / planner.activation_coefficient(model)


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_tweak(split=lambda c_: c_.tp * c_.cp), "only then"),  # split over tp without SP too
        (_tweak(split=lambda c_: c_.cp), "only then"),  # never split over tp
        (_tweak(split=lambda c_: c_.tp if c_.sp else 1), "context parallelism"),
        (_tweak(held=lambda p, s, m: m), "GPipe"),
        (_tweak(held=lambda p, s, m: p - s), "more micro-batches than the step has"),  # forgets that the step may have fewer micro-batches
        (_tweak(held=lambda p, s, m: min(p, m)), "the later stages"),
        (_tweak(layers=lambda mo, p, s: mo.layers // p), "stage_layers"),
        (lambda model, config, seq, batch, stage, c: _activations(model, config, seq, batch, stage, c)
         / config.micro_batch, "config.micro_batch sequences"),  # forgets the micro-batch's size
        (lambda *args: 0.0, "See the hint"),
        (lambda *args: "1e9", "return a number"),
        (lambda model, config, *args: 1 / 0, "ZeroDivisionError"),
        (_memory_less_logits, "course's own"),
        (lambda model, config, seq, batch, stage, c: c * planner.in_flight("1f1b", config.pp, max(
            1, batch // (config.dp * config.micro_batch)), stage) * seq * config.micro_batch * model.hidden, "course's own"),
    ],
)
def test_activation_bytes_rejects_wrong_answers(answer, hint):
    feedback = nb18.activation_bytes(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


@pytest.mark.parametrize("bad", [dict(dp=-64, tp=-1), dict(dp=64, zero=5), dict(dp=64, micro_batch=0), dict(dp=8.0)])
def test_config_refuses_impossible_values(bad):
    with pytest.raises(ValueError, match="Config:"):
        Config(**bad)


# The check's own references answer Exercises 2 and 3 as well as the package's finished versions do: they are
# private, not advertised by the notebook, and refused like the package's (finished=), in every form.
@pytest.mark.parametrize(
    "check, answer",
    [
        (nb18.state_gb, nb18._state_gb),
        (nb18.state_gb, lambda p, z, d: nb18._state_gb(p, z, d)),
        (nb18.activation_bytes, nb18._activations),
        (nb18.activation_bytes, lambda *a: nb18._activations(*a)),
    ],
)
def test_the_checks_own_references_are_refused(check, answer):
    feedback = check(answer)
    assert feedback.status == "wrong" and "course's own" in feedback.message, feedback


def test_the_references_are_private_and_work_outside_a_check():
    assert not [name for name in vars(nb18) if name.startswith("reference_") and callable(getattr(nb18, name))
                and name != "reference_groups"]
    assert nb18._state_gb(1_000_000, 0, 4) == pytest.approx(0.016)  # unguarded once the check is over
