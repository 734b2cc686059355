"""Checks for notebook 14 (pipeline parallelism)."""

import numbers
import random

import torch
from torch import nn

from course.observe import tracing
from course.classroom.exercises import correct, exercise, wrong
from course.runtime.launcher import launch
from course.parallel.pipeline import (
    BATCH,
    WIDTH,
    Deadlock,
    bubble,
    gpipe_order,
    make_batch,
    make_model,
    peak_activations,
    run_stage,
    simulate,
    split,
)


def _run(rank, world_size, orders, batch):
    """Run a real pipeline step on ``world_size`` stages with the given order per stage."""
    x, y = make_batch(batch)
    m = len(orders[rank]) // 2
    stage = split(make_model(), world_size)[rank]
    log, peak = run_stage(stage, orders[rank], list(x.chunk(m)), list(y.chunk(m)))
    return {"order": [(kind, i) for kind, i, _, _ in log], "peak": peak, "grads": [p.grad for p in stage.parameters()]}


def _reference_grads(batch):
    model = make_model()
    x, y = make_batch(batch)
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad for p in model.parameters()]


# ------------------------------------------------------------------ Exercise 1

# The (p, m) the notebook's text names first. m = 5 keeps the answer, 3/8, apart from plausible wrong
# formulas (m = 6 gave 1/3, which 1/(p - 1) and (p - 2)/m also give; m = p would accept m and p swapped).
P1, M1 = 4, 5
# Then more schedules, so that only a formula right for every p and m passes (one that matches a single
# point, a constant, a table of answers, does not): one stage, one micro-batch, m < p, m > p, large p.
POINTS = [(P1, M1), (1, 3), (2, 1), (2, 7), (3, 4), (8, 3), (5, 16)]


def _points():
    """POINTS and one (p, m) drawn afresh at each call, so that a table of the answers at POINTS fails."""
    while (point := (random.randint(2, 12), random.randint(1, 24))) in POINTS:
        pass
    return [*POINTS, point]


def _is_number(answer):
    return not isinstance(answer, bool) and isinstance(answer, numbers.Real)


def _gpipe_bubble(p, m):
    return bubble(simulate([gpipe_order(m)] * p))  # the bubble is a property of the order


def _hint_at(value, p, m):
    """A specific hint for a wrong value at (p, m), or None."""
    right = _gpipe_bubble(p, m)
    close = lambda other: abs(value - other) < 0.01
    if 1 < value <= 100 and abs(value / 100 - right) < 0.01:
        return "right number, but as a percentage: give the fraction (between 0 and 1)."
    if m and close((p - 1) / m):
        return ("(p - 1) / m is the bubble divided by the *ideal* (busy) time of a stage: what Megatron-LM and the "
                "Ultra-Scale Playbook call the bubble fraction. Here the question is the fraction of the whole step, "
                "which is longer than the busy time by exactly the idle time.")
    if close((p - 1) / p) and m > 1:
        return "that is the bubble with a single micro-batch: with m micro-batches the stages overlap."
    if close((p - 1) / (m + p)):
        return "off by one: the last stage starts its first forward p - 1 forwards after stage 0, not p."
    if close(1 - right):
        return "that is the fraction of the step a stage is *busy*; the bubble is the idle part."
    return None


@exercise(
    "Exercise 1 (bubble fraction)",
    hint="draw it: how long does the forward phase last, from stage 0's first forward to the last stage's "
    "last forward (count forwards), how long the backward phase, and how much of that is a stage working?",
)
def bubble_fraction(fn):
    """Exercise 1: the fraction of a GPipe step each stage is idle, as a function of p stages and m micro-batches."""
    if not callable(fn):
        return wrong("write a function of p (stages) and m (micro-batches) that returns the idle fraction, "
                     "e.g. def gpipe_bubble(p, m): return ...")
    points = _points()
    for p, m in points:
        try:
            value = fn(p, m)
        except Exception as e:  # ZeroDivisionError for p = 1 or m = 1, a KeyError from a table...
            return wrong(f"your function fails for p = {p}, m = {m}: {type(e).__name__}: {e}. It must work for any "
                         "number of stages and micro-batches.")
        if not _is_number(value):
            return wrong(f"for p = {p}, m = {m} your function returned {value!r}: return a number between 0 and 1.")
        right = _gpipe_bubble(p, m)
        if abs(value - right) >= 0.01:
            where = f"p = {p}, m = {m}: GPipe's order idles {right:.3f} of the step, your function says {value:.3f}"
            hint = _hint_at(value, p, m)
            if hint is None and (p, m) != (P1, M1):
                hint = (f"it matches at p = {P1}, m = {M1} but not everywhere: a formula that fits one schedule "
                        "may miss the others. Count the phases for general p and m.")
            return wrong(f"{where}. " + (hint or "each stage works m forwards and m backwards; count how many forwards "
                                                 "the forward phase lasts (until the last micro-batch leaves the last "
                                                 "stage) and how many backwards the backward phase."))
    cases = ", ".join(f"({p}, {m})" for p, m in POINTS)
    return correct(
        f"GPipe's order replayed in logical time for (p, m) = {cases} and one drawn at random: your function gives its idle fraction "
        f"every time, {_gpipe_bubble(P1, M1):.3f} of the step for p = {P1}, m = {M1}: (p - 1) / (m + p - 1)."
    )


# ------------------------------------------------------------------ Exercise 2

CASES = [(4, 8), (4, 4), (2, 5), (3, 7), (4, 2), (3, 1)]  # (p, m): some with fewer micro-batches than stages
P2, M2 = 4, 8  # the real run


def _orders(fn, p, m):
    orders = [fn(s, p, m) for s in range(p)]
    if not all(isinstance(o, (list, tuple)) for o in orders):
        raise TypeError("not a list")
    return [[(str(kind), int(i)) for kind, i in order] for order in orders]


@exercise(
    "Exercise 2 (1F1B order)",
    hint="micro-batch 0's gradient reaches stage s only after its forward has gone through the stages "
    "below s and its backward has come back: how many forwards can stage s run in that time?",
)
def one_f_one_b(fn):
    """Exercise 2: the 1F1B order of actions of stage ``stage`` of ``p``, for ``m`` micro-batches."""
    for p, m in CASES:
        try:
            orders = _orders(fn, p, m)
        except Exception as e:
            return wrong(f"return a list of ('F', i) and ('B', i) pairs (for p={p}, m={m} it gave {type(e).__name__}: {e}).")
        for s, order in enumerate(orders):
            if any(kind == "F" and i >= m for kind, i in order):
                return wrong(
                    f"p={p}, m={m}, stage {s} runs a forward of micro-batch {max(i for _, i in order)}, which does not "
                    "exist: with fewer micro-batches than stages, there are fewer forwards to warm up with."
                )
            if sorted(order) != sorted(gpipe_order(m)):
                missing = sorted(set(gpipe_order(m)) - set(order))
                return wrong(
                    f"p={p}, m={m}: stage {s} must run F0..F{m - 1} and B0..B{m - 1} once each"
                    + (f" (missing {', '.join(k + str(i) for k, i in missing)}): after the steady state, run the backwards left." if missing else ".")
                )
        if m > 1 and orders == [gpipe_order(m)] * p:
            return wrong("that is GPipe's order: every stage holds all m activations. Start backwards earlier.")
        try:
            logs = simulate(orders)
        except Deadlock as e:
            return wrong(
                f"p={p}, m={m}: {e}. A stage that starts a backward too early waits for a gradient that "
                "needs a forward it has not run yet."
            )
        gpipe = bubble(simulate([gpipe_order(m)] * p))
        peaks = [peak_activations(o) for o in orders]
        if any(peaks[s] > min(p - s, m) for s in range(p)):
            s = next(s for s in range(p) if peaks[s] > min(p - s, m))
            return wrong(
                f"p={p}, m={m}: stage {s} holds up to {peaks[s]} activations; 1F1B needs at most {min(p - s, m)}. "
                "One forward too many before the first backward?"
            )
        if bubble(logs) > gpipe + 1e-9:
            return wrong(
                f"p={p}, m={m}: the pipeline idles {bubble(logs):.2f} of the step, GPipe only {gpipe:.2f}: "
                "the stages wait for each other. Run more forwards before the first backward."
            )
    orders = _orders(fn, P2, M2)
    results = launch(_run, P2, orders, BATCH, show=None, timeout=60)
    reference = _reference_grads(BATCH)
    grads = [g for r in results for g in r["grads"]]
    if not all(torch.allclose(g, r, rtol=1e-5, atol=1e-6) for g, r in zip(grads, reference)):
        return wrong("the real run's gradients differ from one process's: does every stage run every micro-batch's backward?")
    peaks = [r["peak"] for r in results]
    return correct(
        f"no deadlock, GPipe's bubble, and a real {P2}-stage run with {M2} micro-batches held at most "
        f"{peaks} activations per stage (GPipe: {[M2] * P2}), with one process's gradients."
    )


# ------------------------------------------------------------------ Exercise 3

M3 = 4


def _bytes_sent(rank, world_size, m):
    x, y = make_batch()
    stage = split(make_model(), world_size)[rank]
    tracing.clear()
    run_stage(stage, gpipe_order(m), list(x.chunk(m)), list(y.chunk(m)))
    return sum(e.bytes for e in tracing.collectives() if e.op == "send")


@exercise(
    "Exercise 3 (bytes per step)",
    hint="what crosses the cut between the two stages in forward, and how big is it for the whole batch?",
)
def bytes_per_step(answer):
    """Exercise 3: bytes rank 0 sends in one GPipe step, 2 stages, batch 16 x 32 float32, 4 micro-batches."""
    if not _is_number(answer) or not float(answer).is_integer():
        return wrong("answer with a whole number of bytes, e.g. 1024.")
    sent = launch(_bytes_sent, 2, M3, backend="traced", show=None, timeout=60)
    ours = sent[0]
    n_params = sum(p.numel() for p in make_model().parameters())
    if answer == ours:
        return correct(
            f"the traced run: rank 0 sent {ours} B in {M3} sends of {ours // M3} B (the activations), "
            f"rank 1 sent back {sent[1]} B of gradients. Splitting into micro-batches changes the number of messages, not the bytes."
        )
    if answer == ours * M3:
        return wrong(f"each micro-batch has {BATCH // M3} of the {BATCH} rows: together the m sends carry the batch once.")
    if answer == ours // M3:
        return wrong(f"that is one micro-batch's activation in bytes (or the number of floats): rank 0 sends {M3} of them, 4 bytes per float32.")
    if answer == 2 * ours:
        return wrong("rank 0 is the first stage: it sends activations forward and *receives* gradients; it sends no gradients.")
    if answer in (4 * n_params, 8 * n_params):
        return wrong("that is what data parallelism all-reduces (the gradients of the parameters): a pipeline sends activations.")
    if answer == 8 * ours:
        return wrong("bits, not bytes: a float32 is 4 bytes.")
    return wrong(f"rank 0 sends its stage's output, shaped (rows, {WIDTH}) in float32, for every micro-batch.")
