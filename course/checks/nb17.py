"""Checks for notebook 17 (pipeline schedules: interleaved 1F1B and zero bubble)."""

import contextlib
import random

from course.classroom.exercises import correct, exercise, wrong
from course.parallel.pipeline import Deadlock
from course.parallel.schedules import Op, ScheduleError, bubble_fraction, orders_of, simulate


class TorchScheduleUsed(RuntimeError):
    """The answer built one of torch.distributed.pipelining's schedules."""


TORCH_SCHEDULES = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
                   "ScheduleDualPipeV", "ScheduleLoopedBFS", "Schedule1F1B", "ScheduleGPipe")


@contextlib.contextmanager
def torch_schedules_refused():
    """While the answer runs, torch's schedules refuse to compute their order (``pipeline_order``):
    the answer is meant to be the student's own generator, not torch's under another name.
    Only the imported module is patched: a copy of torch's code (a second import of its file,
    its functions with their globals saved beforehand, tables computed earlier) is not seen. No
    check can see where a table came from; the random points drawn at each call stop tables
    computed in advance."""
    from torch.distributed.pipelining import schedules

    def refuse(*args, **kwargs):
        raise TorchScheduleUsed("torch.distributed.pipelining computed this schedule")

    undo = []
    for name in TORCH_SCHEDULES:
        cls = getattr(schedules, name, None)
        for attribute in ("__init__", "_calculate_single_rank_operations"):
            if cls is not None and attribute in vars(cls):
                undo.append((cls, attribute, vars(cls)[attribute]))
                setattr(cls, attribute, refuse)
    undo.append((schedules, "_get_1f1b_rank_ops", schedules._get_1f1b_rank_ops))
    schedules._get_1f1b_rank_ops = refuse
    try:
        yield
    finally:
        for owner, attribute, value in reversed(undo):
            setattr(owner, attribute, value)


def _table(fn, *args):
    """The answer's table as Op rows, or a wrong(...) saying why not."""
    try:
        with torch_schedules_refused():
            table = fn(*args)
        return [Op(*(int(x) if k != 2 else str(x) for k, x in enumerate(row))) for row in table]
    except TorchScheduleUsed:
        return wrong("your function asks torch.distributed.pipelining for its schedule (pipeline_order): the "
                     "check runs *your* generator; the notebook compares with torch's afterwards.")
    except Exception as e:
        return wrong(f"for {args} your function raised {type(e).__name__}: {e}. Return a list of "
                     "(rank, slot, op, mb, chunk) rows.")


def _judge(table, p, m, v, promise, law, name):
    """wrong(...) if the table does not run, holds more than ``promise(r)`` activations on a rank,
    or idles more than ``law``; else None."""
    where = f"p = {p}, m = {m}" + (f", v = {v}" if v > 1 else "")
    try:
        timeline = simulate(table, p, m, v)
    except ScheduleError as e:
        return wrong(f"{where}: {e}.")
    except Deadlock as e:
        return wrong(f"{where}: the schedule deadlocks: {e}. A rank that starts a backward too early waits for a "
                     "gradient whose forward it has not sent yet: warm up with more forwards.")
    for r, held in enumerate(timeline.peak):
        if held > promise(r):
            return wrong(f"{where}: rank {r} holds up to {held} {'chunk' if v > 1 else 'micro-batch'} activations "
                         f"at once; {name} promises at most {promise(r)}. {_why_held(table, p, r, promise(r))}")
    if law is not None and timeline.bubble > law + 1e-9:
        return wrong(f"{where}: the pipeline idles {timeline.bubble:.3f} of the step, {name}'s law says "
                     f"{law:.3f}. The ranks wait for each other: which action could run earlier?")
    return None


def _why_held(table, p, r, promised):
    """Why rank r holds too much, read from its order: an activation lives from its F until the
    action that frees it (its B, or its W where the backward is split)."""
    order = [op for op, _, _ in orders_of(table, p)[r]]
    if order.index("B") > promised:
        return f"It runs {order.index('B')} forwards before its first backward: too many in the warm-up."
    if "W" in order:
        return ("Its warm-up is not too long: its W's are held back too long (an activation lives from its F "
                "until its W).")
    return "Its warm-up is not too long: after it, does it run more forwards than backwards?"


def _random_points(points, draw, n=3):
    """``points`` and ``n`` more drawn at call time (not in ``points``): an answer that looks its
    tables up in a dict prepared for the fixed points fails on them."""
    points = list(points)
    for _ in range(n):
        while (point := draw()) in points:
            pass
        points.append(point)
    return points


# ------------------------------------------------------------------ Exercise 1

# (p, m, v): m a multiple of p and not, v from 1 to 4, m < p, p up to 6 and m up to 13 (a rule
# that holds only for small p or m fails there); the law is checked where m >= p.
INTERLEAVED = [(2, 4, 2), (4, 8, 2), (3, 6, 3), (4, 6, 2), (2, 5, 3), (3, 7, 2), (4, 4, 4), (3, 2, 2), (2, 3, 1),
               (5, 10, 2), (6, 13, 2), (5, 12, 1)]


def _first_round(p, m):
    rounds = max(1, m // p)
    return -(-m // rounds)  # the size of the first round of micro-batches


@exercise(
    "Exercise 1 (interleaved 1F1B)",
    hint="list the forwards of a rank in the order it runs them: a round of micro-batches through chunk 0, then "
    "the same round through chunk 1, ... The backwards go the same way, chunks reversed. For the warm-up, "
    "count, one slot per F or B, the forwards rank r can run before micro-batch 0's gradient is back on its "
    "last chunk: those of its earlier chunks that come first in the order, its own forward of micro-batch "
    "0 on its last chunk, and one for every slot of the round trip to the last rank and back. Then it alternates "
    "F and B, then runs the backwards left. When p does not divide m, the rounds differ by one micro-batch: put "
    "the larger rounds first (the warm-up is counted on the first round: with a smaller first round a rank "
    "reaches a backward before its forward).",
    finished=("course.parallel.schedules.interleaved_1f1b",),
)
def interleaved(fn):
    """Exercise 1: the interleaved 1F1B table for p ranks, m micro-batches, v chunks per rank."""
    if not callable(fn):
        return wrong("write a function of (p, m, v) that returns the table: a list of (rank, slot, op, mb, chunk).")
    cases = _random_points(INTERLEAVED, lambda: (random.randint(2, 8), random.randint(2, 24), random.randint(1, 4)))
    for p, m, v in cases:
        table = _table(fn, p, m, v)
        if not isinstance(table, list):
            return table
        if any(row.op == "W" for row in table):
            return wrong("interleaved 1F1B has whole backwards (B), no W: that is Exercise 2.")
        warmup = lambda r: min((v - 1) * _first_round(p, m) + 2 * (p - 1 - r), m * v)  # noqa: B023, E731
        law = bubble_fraction("interleaved", p, m, v) if m >= p else None
        verdict = _judge(table, p, m, v, lambda r: warmup(r) + 1, law, "interleaved 1F1B")  # noqa: B023
        if verdict is not None:
            return verdict
    return correct(
        f"{len(cases)} pipelines, p from 2 to 6, m from 2 to 13:\n"
        "m a multiple of p or not, v from 1 to 4, and 3 drawn at random: every action once,\n"
        "each B after its F, no deadlock, no rank over its promised activations, and where m >= p\n"
        f"no more idle than the law (p - 1) / (v m + p - 1): {bubble_fraction('interleaved', 4, 8, 2):.3f} "
        f"for p = 4, m = 8, v = 2 (1F1B: {bubble_fraction('1f1b', 4, 8):.3f})."
    )


# ------------------------------------------------------------------ Exercise 2

ZERO_BUBBLE = [(2, 4), (4, 8), (3, 5), (4, 6), (3, 3), (2, 7), (4, 2), (5, 10), (6, 9), (6, 13)]


@exercise(
    "Exercise 2 (ZB-H1)",
    hint="start from 1F1B (rank r warms up with p - r - 1 forwards), split each backward into B and W, and "
    "let rank r run W right after B except for its first r W's, which go to the end, where its bubble was.",
    finished=("course.parallel.schedules.zb_h1",),
)
def zero_bubble(fn):
    """Exercise 2: the ZB-H1 table (F, B, W) for p ranks and m micro-batches, one chunk per rank."""
    if not callable(fn):
        return wrong("write a function of (p, m) that returns the table: a list of (rank, slot, op, mb, chunk).")
    cases = _random_points(ZERO_BUBBLE, lambda: (random.randint(2, 8), random.randint(2, 24)))
    for p, m in cases:
        table = _table(fn, p, m)
        if not isinstance(table, list):
            return table
        if not any(row.op == "W" for row in table):
            return wrong(f"p = {p}, m = {m}: no W in your table: without the split backward it is 1F1B. "
                         "Split each B into B (input gradient) and W (weight gradient).")
        law = bubble_fraction("zb-h1", p, m) if m >= p else None
        verdict = _judge(table, p, m, 1, lambda r: min(p, m), law, "ZB-H1 (as 1F1B's rank 0)")  # noqa: B023
        if verdict is not None:
            return verdict
    return correct(
        f"{len(cases)} pipelines, p from 2 to 6, m from 2 to 13 (m < p too),\n"
        "and 3 drawn at random: every F, B and W once, in order, no deadlock,\n"
        "no rank over p activations (1F1B's rank 0), and where m >= p no more idle than the law\n"
        "(p - 1) / (3 m + p - 1): "
        f"{bubble_fraction('zb-h1', 4, 8):.3f} for p = 4, m = 8 (1F1B: {bubble_fraction('1f1b', 4, 8):.3f})."
    )
