"""Notebook 17's checks reject plausible wrong answers with a useful hint."""

import random
import types

import nbformat
import pytest

from course.checks import nb17
from course.classroom.doctor import PART_II_TORCH, torch_at_least
from course.classroom.notebooks import SOLUTIONS
from course.parallel import schedules

# course declares notebooks 11-18 for torch >= PART_II_TORCH (course/classroom/doctor.py, README).
pytestmark = pytest.mark.skipif(
    not torch_at_least(PART_II_TORCH), reason=f"notebooks 11-18 need torch >= {PART_II_TORCH}"
)


def _rows(orders):
    return [(r, s, op, i, c) for r, order in enumerate(orders) for s, (op, i, c) in enumerate(order)]


def _interleaved(warmup_of=None, reverse=True):
    """Interleaved 1F1B written independently of the package, with a warm-up and backward order to vary."""

    def table(p, m, v):
        rounds = max(1, m // p)
        size = -(-m // rounds)
        starts = [sum(m // rounds + (j < m % rounds) for j in range(k)) for k in range(rounds + 1)]
        fwd = [(i, c) for k in range(rounds) for c in range(v) for i in range(starts[k], starts[k + 1])]
        chunks = (lambda v: reversed(range(v))) if reverse else range
        bwd = [(i, c) for k in range(rounds) for c in chunks(v) for i in range(starts[k], starts[k + 1])]
        orders = []
        for r in range(p):
            w = min(warmup_of(p, m, v, r, size) if warmup_of else (v - 1) * size + 2 * (p - 1 - r), m * v)
            order = [("F", *f) for f in fwd[:w]]
            for k in range(m * v - w):
                order += [("F", *fwd[w + k]), ("B", *bwd[k])]
            orders.append(order + [("B", *b) for b in bwd[m * v - w:]])
        return _rows(orders)

    return table


def _zb(lag=lambda r: r, warmup=lambda p, r: p - r - 1, w_first=False):
    """ZB-H1 written independently: rank r's W's lag ``lag(r)`` behind its B's."""

    def table(p, m):
        orders = []
        for r in range(p):
            ws = min(warmup(p, r), m)
            order, due = [("F", i, 0) for i in range(ws)], 0
            for i in range(m):
                if ws + i < m:
                    order.append(("F", ws + i, 0))
                b = ("B", i, 0)
                if i - due >= lag(r):
                    order += [("W", due, 0), b] if w_first else [b, ("W", due, 0)]
                    due += 1
                else:
                    order.append(b)
            orders.append(order + [("W", i, 0) for i in range(due, m)])
        return _rows(orders)

    return table


def _stub(p, m, v):
    ...


def _stub_zb(p, m):
    ...


def test_interleaved_accepts_a_right_answer_and_says_not_attempted_for_the_stub():
    assert nb17.interleaved(_interleaved()).status == "correct"
    # a shorter warm-up (1F1B's p - 1 - r below the rank) reaches the same bubble with less memory: accepted
    assert nb17.interleaved(_interleaved(lambda p, m, v, r, size: (v - 1) * size + (p - 1 - r))).status == "correct"
    assert nb17.interleaved(_stub).status == "todo"


def _b_before_f(p, m, v):
    rows = _interleaved()(p, m, v)
    first = [row for row in rows if row[0] == 0 and row[2] == "B"][0]
    return [(r, -1 if (r, op, i, c) == (0, *first[2:]) else s, op, i, c) for r, s, op, i, c in rows]


def _torch_under_another_name(p, m, v):
    """torch's own order (its _calculate_single_rank_operations, without building a stage), renamed."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    rounds = max(1, m // p)
    fake = types.SimpleNamespace(n_local_stages=v, pp_group_size=p, _n_microbatches=m, microbatches_per_round=m // rounds)
    orders = []
    for r in range(p):
        actions = [a for a in ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, r) if a is not None]
        orders.append([("F" if a.computation_type.value == "F" else "B", a.microbatch_index, a.stage_index // p)
                       for a in actions])
    return _rows(orders)


def test_torch_under_another_name_is_right_without_the_check():
    """The wrong answer below is torch's real order: equal to the right table where torch accepts m."""
    assert schedules.orders_of([schedules.Op(*r) for r in _torch_under_another_name(2, 4, 2)], 2) == \
        schedules.orders_of(schedules.interleaved_1f1b(2, 4, 2), 2)


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_b_before_f, "before its F"),
        (_interleaved(reverse=False), "deadlocks"),  # backwards through the chunks in forward order
        (_interleaved(lambda p, m, v, r, size: m * v), "too many in the warm-up"),  # every forward first: GPipe's
        (_interleaved(lambda p, m, v, r, size: (v - 1) * size + 2 * (1 - r)), "p = 4"),  # right for p = 2 only
        (_interleaved(lambda p, m, v, r, size: (v - 1) * size), "idles"),  # no 1F1B warm-up below the rank
        (_interleaved(lambda p, m, v, r, size: (v - 1) * p + 2 * (p - 1 - r)), "p = 4, m = 6"),  # m % p == 0 only
        (_interleaved(lambda p, m, v, r, size: (v - 1) * size + 2 * min(p - 1 - r, 3)), "p = 5"),  # right for p <= 4
        (_interleaved(lambda p, m, v, r, size: m * v if m > 8 else (v - 1) * size + 2 * (p - 1 - r)),
         "holds up to"),  # GPipe's memory for m > 8 only
        (lambda p, m, v: _interleaved()(p, m, 1) if v == 1 else _interleaved()(p, m, 1)[:0], "missing"),
        (_torch_under_another_name, "asks torch.distributed.pipelining"),
        (schedules.interleaved_1f1b, "course's own finished version"),
        (lambda p, m, v: _zb()(p, m), "no W"),
        (lambda p, m, v: 1 / 0, "ZeroDivisionError"),
        ((2, 4, 2), "write a function"),
    ],
)
def test_interleaved_rejects_wrong_answers(answer, hint):
    feedback = nb17.interleaved(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_zero_bubble_accepts_a_right_answer_and_says_not_attempted_for_the_stub():
    assert nb17.zero_bubble(_zb()).status == "correct"
    assert nb17.zero_bubble(_stub_zb).status == "todo"


def _torch_zb(p, m):
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    fake = types.SimpleNamespace(n_local_stages=1, pp_group_size=p, _n_microbatches=m, microbatches_per_round=m)
    orders = [[({"F": "F", "I": "B", "W": "W"}[a.computation_type.value], a.microbatch_index, 0)
               for a in ScheduleInterleavedZeroBubble._calculate_single_rank_operations(fake, r) if a is not None]
              for r in range(p)]
    return _rows(orders)


@pytest.mark.parametrize(
    "answer, hint",
    [
        (lambda p, m: _interleaved()(p, m, 1), "no W"),  # 1F1B
        (_zb(w_first=True), "before its B"),
        (_zb(lag=lambda r: 10**6), "W's are held back too long"),  # every W at the end
        (_zb(lag=lambda r: r + 1), "W's are held back too long"),  # one W too many deferred, warm-up right
        (_zb(lag=lambda r: 0, warmup=lambda p, r: p - r), "too many in the warm-up"),  # one forward too many
        (_zb(warmup=lambda p, r: p - r), "holds up to"),  # both: the warm-up is named first
        (_zb(lag=lambda r: 0), "idles"),  # W right after B: 1F1B's bubble
        (_zb(lag=lambda r: r, warmup=lambda p, r: 1 - r), "p = 4"),  # 1F1B's warm-up for p = 2 only
        (_zb(warmup=lambda p, r: r), "deadlocks"),  # the warm-up reversed: rank 0 waits for a gradient of F1
        (_zb(lag=lambda r: min(r, 3)), "p = 5"),  # right for p <= 4
        (_torch_zb, "asks torch.distributed.pipelining"),
        (schedules.zb_h1, "course's own finished version"),
    ],
)
def test_zero_bubble_rejects_wrong_answers(answer, hint):
    feedback = nb17.zero_bubble(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_torch_schedules_work_again_after_the_check():
    from torch.distributed.pipelining import schedules as ts

    before = ts.ScheduleInterleaved1F1B.__init__, ts._get_1f1b_rank_ops
    nb17.zero_bubble(_torch_zb)
    assert (ts.ScheduleInterleaved1F1B.__init__, ts._get_1f1b_rank_ops) == before
    assert _torch_zb(2, 4) == _zb()(2, 4)  # torch's ZB order with one chunk per rank is ZB-H1's


def _looked_up(tables):
    return lambda *point: tables[point]


@pytest.mark.parametrize("seed", range(5))
def test_a_dict_of_tables_prepared_for_every_fixed_case_fails_on_the_points_drawn_at_call_time(seed):
    """Tables precomputed (here the course's own, so right) for every fixed case and every point the
    check drew before this change: the 3 points drawn when the check runs are not among them."""
    ex1 = {pmv: [tuple(r) for r in schedules.interleaved_1f1b(*pmv)]
           for pmv in {*nb17.INTERLEAVED, *((p, m, v) for p in range(2, 6) for m in range(2, 13) for v in range(1, 5))}}
    ex2 = {pm: [tuple(r) for r in schedules.zb_h1(*pm)]
           for pm in {*nb17.ZERO_BUBBLE, *((p, m) for p in range(2, 7) for m in range(2, 13))}}
    random.seed(seed)
    feedback = nb17.interleaved(_looked_up(ex1))
    assert feedback.status == "wrong" and "KeyError" in feedback.message, feedback
    random.seed(seed)
    feedback = nb17.zero_bubble(_looked_up(ex2))
    assert feedback.status == "wrong" and "KeyError" in feedback.message, feedback


def test_success_messages_fit_in_100_columns():
    for check, answer in [(nb17.interleaved, _interleaved()), (nb17.zero_bubble, _zb())]:
        feedback = check(answer)
        assert feedback.status == "correct" and max(map(len, repr(feedback).splitlines())) <= 100, feedback


def test_exercise_1_asks_for_the_warm_up_and_shows_it_only_after_the_check():
    """The text before Exercise 1 states the rules and asks for a prediction; the warm-up count
    appears first in the cell after the check; hint() gives the counting rule, not the count."""
    cells = nbformat.read(SOLUTIONS / "17_pipeline_schedules.ipynb", as_version=4).cells
    check = next(i for i, c in enumerate(cells) if c.source.strip() == "check.interleaved(interleaved_1f1b)")
    before = "\n".join(c.source for c in cells[:check] if c.cell_type == "markdown")
    assert "**Predict**" in before and "forwards before its first backward" in before
    for formula in ("2(p-1-r)", "2(p - 1 - r)", "(v-1)\\cdot", "(v - 1) * (round size)"):
        assert formula not in before, formula
    assert "2 * (P - 1 - r)" in cells[check + 2].source
    hint = str(nb17.interleaved.hint())
    assert "larger rounds first" in hint  # a split with the remainder in the last round fails otherwise
    assert "round trip" in hint and "2 * (p - 1 - r)" not in hint and "(round size)" not in hint
