"""Checks for notebook 13 (pipeline parallelism)."""

import numbers

import torch
from torch import nn

from course import tracing
from course.exercises import correct, exercise, wrong
from course.launcher import launch
from course.pipeline import (
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

# The schedule whose bubble the student predicts. m = 5 keeps the answer, 3/8, apart from plausible wrong
# formulas (m = 6 gave 1/3, which 1/(p - 1) and (p - 2)/m also give; m = p would accept m and p swapped).
P1, M1 = 4, 5


def _is_number(answer):
    return not isinstance(answer, bool) and isinstance(answer, numbers.Real)


@exercise(
    "Exercise 1 (bubble fraction)",
    hint="draw it: how long does the forward phase last, from stage 0's first forward to the last stage's "
    "last forward (count forwards), how long the backward phase, and how much of that is a stage working?",
)
def bubble_fraction(answer):
    """Exercise 1: the fraction of a GPipe step each stage is idle, for p = 4 stages, m = 5 micro-batches."""
    if not _is_number(answer):
        return wrong("answer with a number between 0 and 1, e.g. 0.25 or 1/4.")
    measured = bubble(simulate([gpipe_order(M1)] * P1))  # the bubble is a property of the order
    close = lambda value: abs(answer - value) < 0.01
    if close(measured):
        return correct(
            f"GPipe's order on {P1} stages with {M1} micro-batches, replayed in logical time, leaves each stage "
            f"idle {measured:.3f} of the step: (p - 1) / (m + p - 1) = {P1 - 1}/{M1 + P1 - 1}."
        )
    if 1 < answer <= 100 and abs(answer / 100 - measured) < 0.01:
        return wrong("right number, but as a percentage: give the fraction (between 0 and 1).")
    if close((P1 - 1) / M1):
        return wrong(
            "(p - 1) / m compares the idle time with the *busy* time. The bubble is a fraction of the "
            "whole step, and the step is longer than the busy time by exactly the idle time."
        )
    if close((P1 - 1) / P1):
        return wrong(f"that is the bubble with a single micro-batch: with {M1} micro-batches the stages overlap.")
    if close((P1 - 1) / (M1 + P1)):
        return wrong("off by one: the last stage starts its first forward p - 1 forwards after stage 0, not p.")
    if close(1 - measured):
        return wrong("that is the fraction of the step a stage is *busy*; the bubble is the idle part.")
    return wrong(
        "each stage works m forwards and m backwards; count how many forwards the forward phase lasts "
        "(until the last micro-batch leaves the last stage) and how many backwards the backward phase."
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
