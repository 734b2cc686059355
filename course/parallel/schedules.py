"""Pipeline schedules beyond 1F1B (notebook 17): the schedule as data, checked, simulated, run.

A *schedule* is a table with one row per action: ``Op(rank, slot, op, mb, chunk)``. Rank
``rank`` runs its rows in ``slot`` order; ``op`` is ``"F"`` (forward), ``"B"`` (backward) or
``"W"``; ``mb`` is the micro-batch and ``chunk`` which of the rank's ``v`` model chunks it
runs. With ``W`` rows the backward is split in two (zero bubble, Qi et al. 2024): ``B`` is the
input gradient, the one the previous stage waits for, and ``W`` the weight gradient, which
nobody waits for. Without them ``B`` is the whole backward.

The model is cut into ``p * v`` stages. Megatron's interleaved placement (``layout="loop"``)
gives rank ``r`` the stages ``r, r + p, r + 2p, ...``; DualPipeV and ZBV (``layout="v"``) give
it stages ``r`` and ``2p - 1 - r``.

What an action waits for, :func:`needs`, is one rule of the stages, used everywhere below.
:func:`simulate` checks a table (each action once, F before B before W on a rank, no
deadlock), plays it in logical time (F, B and W of a chunk take ``1/v`` unit each, or the
times measured, with a message's latency) and returns each rank's timeline and its peak of
activations held. :func:`run_schedule` runs the same table
on real ranks (gloo ``isend``/``irecv``). The notebook derives :func:`interleaved_1f1b` and
:func:`zb_h1`; a test asserts that its cells and this file hold the same code.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from course.parallel.pipeline import Deadlock, one_f_one_b_order


class Op(NamedTuple):
    rank: int
    slot: int
    op: str  # "F", "B" or "W"
    mb: int
    chunk: int


class ScheduleError(ValueError):
    """The table is not a schedule: an action missing or twice, or run before what it needs."""


def stage_of(rank, chunk, p, layout="loop"):
    """The model stage that ``chunk`` of ``rank`` holds (of ``p * v`` stages)."""
    if layout == "loop":
        return chunk * p + rank
    if layout == "v":
        return rank if chunk == 0 else 2 * p - 1 - rank
    raise ValueError(f"layout must be 'loop' or 'v', not {layout!r}")


def needs(op, mb, stage, n):
    """What action ``op`` of micro-batch ``mb`` on ``stage`` (of ``n`` stages) waits for, as
    ``[(op, mb, stage), ...]``: an F needs the previous stage's F of that micro-batch; a B its own F
    and the next stage's B (the gradient at its output); a W its own B. The rule is the stages',
    whichever rank or chunk holds them (:func:`stage_of`); where there are no W rows, B is the whole
    backward and needs the same."""
    return {"F": [("F", mb, stage - 1)] if stage > 0 else [],
            "B": [("F", mb, stage)] + ([("B", mb, stage + 1)] if stage < n - 1 else []),
            "W": [("B", mb, stage)]}[op]


def from_orders(orders):
    """A table from one list of ``(op, mb, chunk)`` per rank, in the order the rank runs them."""
    return [Op(r, s, op, mb, c) for r, order in enumerate(orders) for s, (op, mb, c) in enumerate(order)]


def orders_of(table, p):
    """The table back as one list of ``(op, mb, chunk)`` per rank, in slot order."""
    rows = [sorted((row for row in table if row.rank == r), key=lambda row: row.slot) for r in range(p)]
    return [[(row.op, row.mb, row.chunk) for row in rank_rows] for rank_rows in rows]


def gpipe_table(p, m):
    """GPipe: every forward, then every backward (one chunk per rank)."""
    return from_orders([[(k, i, 0) for k, i in [("F", i) for i in range(m)] + [("B", i) for i in range(m)]]] * p)


def one_f_one_b_table(p, m):
    """1F1B (notebook 14): ``p - r - 1`` forwards to warm up, then one forward, one backward."""
    return from_orders([[(k, i, 0) for k, i in one_f_one_b_order(r, p, m)] for r in range(p)])


def interleaved_1f1b(p, m, v):
    """Megatron's interleaved 1F1B (Narayanan et al. 2021), v chunks per rank, looped. The
    micro-batches go in rounds of at least p (so m need not be a multiple of p); a round
    goes through chunk 0, then chunk 1, ... (depth first), and back in reverse."""
    rounds = max(1, m // p)
    sizes = [m // rounds + (j < m % rounds) for j in range(rounds)]
    firsts = [sum(sizes[:j]) for j in range(rounds)]
    forwards = [(i, c) for f, n in zip(firsts, sizes) for c in range(v) for i in range(f, f + n)]
    backwards = [(i, c) for f, n in zip(firsts, sizes) for c in reversed(range(v))
                 for i in range(f, f + n)]
    orders = []
    for r in range(p):
        warmup = min((v - 1) * sizes[0] + 2 * (p - r - 1), m * v)  # until a gradient is back
        order = [("F", i, c) for i, c in forwards[:warmup]]
        for k in range(m * v - warmup):
            order += [("F", *forwards[warmup + k]), ("B", *backwards[k])]
        orders.append(order + [("B", i, c) for i, c in backwards[m * v - warmup:]])
    return from_orders(orders)


def zb_h1(p, m):
    """ZB-H1 (Qi et al. 2024): 1F1B with the backward split into B and W. Rank r runs its
    first r W's at the end, where its bubble was: it holds at most p micro-batches, as 1F1B's
    rank 0 does."""
    orders = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        order = [("F", i, 0) for i in range(warmup)]
        w = 0  # the next micro-batch whose W is due
        for i in range(m):
            if warmup + i < m:
                order.append(("F", warmup + i, 0))
            order.append(("B", i, 0))
            if i >= r:  # r W's wait for the tail
                order.append(("W", w, 0))
                w += 1
        orders.append(order + [("W", i, 0) for i in range(w, m)])
    return from_orders(orders)


def zb_h2(p, m):
    """ZB-H2 (Qi et al. 2024): more forwards to warm up, up to 2p - 1 micro-batches held, and the
    W's moved to where a rank would wait. Built greedily in unit time (F = B = W): a free rank
    runs the B whose gradient has arrived, else a forward if it holds fewer than 2p - 1
    micro-batches, else its oldest W. With m >= 2p - 1 each rank is then busy from its first
    action to its last (with fewer, rank 0 still waits); it holds min(m, 2p - 1)."""
    orders, end = [[] for _ in range(p)], {}  # end: (op, mb, rank) -> time it ended
    forwards, backwards, held, pending = [0] * p, [0] * p, [0] * p, [[] for _ in range(p)]
    t = 0
    while any(len(order) < 3 * m for order in orders):
        for r in range(p):
            if orders[r] and end[(orders[r][-1][0], orders[r][-1][1], r)] > t or len(orders[r]) == 3 * m:
                continue  # busy, or done
            i, f = backwards[r], forwards[r]
            if i < f and (r == p - 1 or end.get(("B", i, r + 1), t + 1) <= t):
                op, backwards[r] = ("B", i), i + 1
                pending[r].append(i)
            elif f < m and held[r] < 2 * p - 1 and (r == 0 or end.get(("F", f, r - 1), t + 1) <= t):
                op, forwards[r], held[r] = ("F", f), f + 1, held[r] + 1
            elif pending[r]:
                op, held[r] = ("W", pending[r].pop(0)), held[r] - 1
            else:
                continue  # waits
            orders[r].append((*op, 0))
            end[(*op, r)] = t + 1
        t += 1
    return from_orders(orders)


def rank_idle(logs):
    """Per rank, the time it idles between its own first action and its own last one."""
    return [log[-1][-1] - log[0][-2] - sum(a[-1] - a[-2] for a in log) for log in logs]


SCHEDULES = {"gpipe": gpipe_table, "1f1b": one_f_one_b_table, "interleaved": interleaved_1f1b, "zb-h1": zb_h1}


# ------------------------------------------------------------------ checking and simulating


class Timeline(NamedTuple):
    logs: list  # per rank: [(op, mb, chunk, start, end), ...]
    peak: list  # per rank: most chunk activations held at once
    bubble: float  # idle fraction of the step, averaged over the ranks


def check_table(table, p, m, v):
    """Raise :class:`ScheduleError` unless every action is there once and, on each rank,
    F comes before its B and B before its W."""
    rows = [Op(*row) for row in table]
    for row in rows:
        if row.op not in ("F", "B", "W") or not (0 <= row.rank < p and 0 <= row.mb < m and 0 <= row.chunk < v):
            raise ScheduleError(f"{row}: op must be F, B or W, rank < {p}, mb < {m}, chunk < {v}")
    split = any(row.op == "W" for row in rows)
    want = sorted((r, op, i, c) for r in range(p) for c in range(v) for i in range(m) for op in ("FBW" if split else "FB"))
    have = sorted((row.rank, row.op, row.mb, row.chunk) for row in rows)
    if have != want:
        missing, extra = sorted(set(want) - set(have)), [h for h in have if have.count(h) > 1 or h not in want]
        raise ScheduleError(f"each of F, B{', W' if split else ''} of every (rank, mb, chunk) once: "
                            f"missing {missing[:3]}, twice or extra {extra[:3]}")
    for r, order in enumerate(orders_of(rows, p)):
        if len({row.slot for row in rows if row.rank == r}) != len(order):
            raise ScheduleError(f"rank {r} has two actions in one slot")
        done = set()
        for slot, (op, i, c) in enumerate(order):
            before = {"B": "F", "W": "B"}.get(op)
            if before and (before, i, c) not in done:
                raise ScheduleError(f"rank {r} runs {op} of micro-batch {i}, chunk {c} (slot {slot}) before its {before}")
            done.add((op, i, c))


def simulate(table, p, m, v, layout="loop", cost=None, latency=0.0, gap=0.0):
    """Check ``table`` and play it in logical time: an action starts when its rank is free and
    its input has arrived. ``cost``: time of F, B, W for one chunk, ``{op: time}``, or per rank
    and chunk, ``{(rank, op, chunk): time}`` (a whole backward, when there are no W rows, costs
    B + W; give it as ``B``, and ``W`` 0, when measured); ``latency``: time from the end of the
    action on another rank that sends an input to the start of the one that needs it (0: sends
    take no time); ``gap``: time from the end of a rank's action to the start of its next one
    when the input is already there (receiving, sending, Python's bookkeeping). ``latency`` and
    ``gap`` are one number or ``{(rank, op): time}`` (see :func:`time_between`). Raises
    :class:`Deadlock` if it cannot run."""
    check_table(table, p, m, v)
    cost = cost or {"F": 1 / v, "B": 1 / v, "W": 1 / v}
    split = any(Op(*row).op == "W" for row in table)
    n = p * v
    where = {stage_of(r, c, p, layout): (r, c) for r in range(p) for c in range(v)}
    orders = orders_of([Op(*row) for row in table], p)

    def took(op, r, c):  # how long rank r's action runs
        return cost[(r, op, c)] if (r, op, c) in cost else cost[op]

    def wait(times, r, op):  # latency or gap of rank r's op
        return times[(r, op)] if isinstance(times, dict) else times

    done = {}  # (op, mb, stage) -> end time
    free, logs, held, peak = [0.0] * p, [[] for _ in range(p)], [0] * p, [0] * p
    while any(len(logs[r]) < len(orders[r]) for r in range(p)):
        progress = False
        for r in range(p):
            if len(logs[r]) == len(orders[r]):
                continue
            op, i, c = orders[r][len(logs[r])]
            k = stage_of(r, c, p, layout)
            before = needs(op, i, k, n)
            if any(need not in done for need in before):
                continue
            start = max([free[r] + (wait(gap, r, op) if logs[r] else 0)]
                        + [done[need] + (wait(latency, r, op) if where[need[2]][0] != r else 0) for need in before])
            free[r] = start + took(op, r, c) + (took("W", r, c) if op == "B" and not split else 0)
            done[(op, i, k)] = free[r]
            logs[r].append((op, i, c, start, free[r]))
            held[r] += 1 if op == "F" else -1 if op == ("W" if split else "B") else 0
            peak[r] = max(peak[r], held[r])
            progress = True
        if not progress:
            stuck = [(r, orders[r][len(logs[r])]) for r in range(p) if len(logs[r]) < len(orders[r])]
            raise Deadlock("no rank can go on: " + ", ".join(f"rank {r} waits at {o}{i} (chunk {c})" for r, (o, i, c) in stuck))
    assert len(where) == n  # every stage on exactly one (rank, chunk)
    return Timeline(logs, peak, bubble(logs))


def time_between(logs, p, v, layout="loop"):
    """What a measured timeline spends between actions, per rank and op: ``(gap, latency)``, each
    ``{(rank, op): seconds}``, for :func:`simulate`. ``gap``: the median time from the end of the
    rank's previous action to the start of this one, over the actions whose input from another
    rank (if any) had arrived when the previous one ended; ``latency``: the median time from the
    end of the sender's action to the start of this one, over the others (the input came late,
    or the action is the rank's first).
    A (rank, op) without such actions gets the median over all ranks and ops (0 if none)."""
    from statistics import median

    n, end = p * v, {}
    for r, log in enumerate(logs):
        for op, i, c, start, stop in log:
            end[(op, i, stage_of(r, c, p, layout))] = stop
    owner = {stage_of(r, c, p, layout): r for r in range(p) for c in range(v)}
    gaps, lates = {}, {}
    for r, log in enumerate(logs):
        previous = None  # the end of the rank's previous action
        for op, i, c, start, stop in log:
            k = stage_of(r, c, p, layout)
            sent = [end[need] for need in needs(op, i, k, n) if owner[need[2]] != r]  # none or one
            if sent and (previous is None or sent[0] > previous):
                lates.setdefault((r, op), []).append(start - sent[0])
            elif previous is not None:
                gaps.setdefault((r, op), []).append(start - previous)
            previous = stop

    def per_rank_and_op(samples):
        every = [x for xs in samples.values() for x in xs]
        fallback = median(every) if every else 0.0
        return {(r, op): median(samples[(r, op)]) if (r, op) in samples else fallback
                for r in range(p) for op in "FBW"}

    return per_rank_and_op(gaps), per_rank_and_op(lates)


def bubble(logs):
    """Idle fraction of the step, averaged over the ranks (from a simulated or a measured timeline)."""
    start = min(a[-2] for log in logs for a in log)
    end = max(a[-1] for log in logs for a in log)
    busy = [sum(a[-1] - a[-2] for a in log) for log in logs]
    return 1 - sum(busy) / (len(logs) * (end - start))


COLORS = {"F": "#9ecae1", "B": "#3182bd", "W": "#74c476"}


def plot(logs, ax, title="", unit=""):
    """One row per rank, a box per action (F light blue, B dark blue, W green), labelled by
    micro-batch; a later chunk's boxes are hatched."""
    origin = min(a[-2] for log in logs for a in log)
    for r, log in enumerate(logs):
        for op, i, c, start, end in log:
            ax.broken_barh([(start - origin, end - start)], (r - 0.4, 0.8), facecolors=COLORS[op],
                           edgecolor="black", linewidth=0.5, hatch="//" if c else None)
            ax.text(start - origin + (end - start) / 2, r, f"{i}", ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(logs)), [f"rank {r}" for r in range(len(logs))])
    ax.set_ylim(len(logs) - 0.5, -0.5)
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=9)


def from_torch(pipeline_order, p, layout="loop"):
    """A table from a ``torch.distributed.pipelining`` schedule's ``pipeline_order``
    ({rank: [_Action or None, ...]}, torch 2.15): idle slots (None) dropped, an input gradient
    (``I``) called B, an overlapped pair (DualPipeV's ``OVERLAP_F_B``) as its two actions in turn,
    and in a split schedule a whole backward (``B``) as B then W."""
    actions = lambda a: a.sub_actions if a.sub_actions else (a,)  # noqa: E731
    every = [b for r in range(p) for a in pipeline_order[r] if a is not None for b in actions(a)]
    split = any(b.computation_type.value == "W" for b in every)
    orders = []
    for r in range(p):
        order = []
        for a in (b for a in pipeline_order[r] if a is not None for b in actions(a)):
            chunk = a.stage_index // p if layout == "loop" else (0 if a.stage_index == r else 1)
            kind = a.computation_type.value
            ops = {"F": ["F"], "I": ["B"], "W": ["W"], "B": ["B", "W"] if split else ["B"]}[kind]
            order += [(op, a.microbatch_index, chunk) for op in ops]
        orders.append(order)
    return from_orders(orders)


# ------------------------------------------------------------------ the laws, and a real configuration


def bubble_fraction(schedule, p, m, v=1):
    """The idle fraction of a step by the schedule's law, F = B = W in time (1F1B's backward is
    B + W). The bubble of GPipe and 1F1B is (p - 1)(F + B + W) per rank; interleaving divides it
    by v (Narayanan et al. 2021); ZB-H1 leaves (p - 1)(F + B - W) (Qi et al. 2024). GPipe's and
    1F1B's law holds for every m; interleaved's and ZB-H1's for m >= p (with fewer micro-batches
    than stages they idle more: :func:`simulate` their tables, as the planner does)."""
    work = 3 * m  # F + B + W per micro-batch, per rank
    idle = {"gpipe": 3 * (p - 1), "1f1b": 3 * (p - 1), "interleaved": 3 * (p - 1) / v, "zb-h1": p - 1}
    if schedule not in idle:
        raise ValueError(f"schedule must be one of {sorted(idle)}, not {schedule!r}")
    return idle[schedule] / (work + idle[schedule])


# Llama 3 405B's pre-training (Llama Team 2024, arXiv:2407.21783, Table 4): pipeline parallelism 16,
# 16,384 GPUs with a batch of 16M tokens at sequence length 8,192, TP 8, CP 1, DP 128: 2,048 sequences
# per step, 16 per data-parallel rank.
LLAMA3_405B = {"pp": 16, "tp": 8, "dp": 128, "seq": 8192, "sequences_per_dp_rank": 16}


# ------------------------------------------------------------------ running a table on real ranks


def _tag(op, mb, stage, n):
    return (mb * n + stage) * 2 + (op != "F")


def run_schedule(chunks, order, inputs, targets, layout="loop", cpu=None):
    """Run this rank's ``order`` (``[(op, mb, chunk), ...]``) with its ``chunks`` (one Sequential
    per chunk); activations and input gradients go to the rank holding the next (previous) stage
    by ``isend``, tagged so that none is taken for another. Every receive is posted (``irecv``)
    before the first action, so a message that arrives early lands in its buffer and no rank
    blocks on a receive it could have posted (torch's runtime posts each one as early as its
    sender's action allows); the buffers are shaped as the inputs (every block keeps the
    width). A B without W rows is the whole backward. With them, B is ``autograd.grad`` with
    ``inputs=`` the input of every block of the chunk (the stage's input is what the previous
    stage waits for) and W, later, each block's weight gradient from the gradient at its output.
    Returns the log ``[(op, mb, chunk, start, end), ...]``; weight gradients end in ``.grad``.
    ``cpu``, a list if given, gets each action's CPU seconds on this thread (``time.thread_time``:
    unlike the wall clock, it does not count time the rank was descheduled)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    v, m = len(chunks), len(inputs)
    n = p * v
    owner = {stage_of(r, c, p, layout): r for r in range(p) for c in range(v)}
    split = any(op == "W" for op, _, _ in order)
    saved, local, sends, log = {}, {}, [], []

    def send(tensor, op, i, to_stage):
        if owner[to_stage] == rank:
            local[(op, i, to_stage)] = tensor
        else:
            tag = _tag(op, i, to_stage, n)
            sends.append(dist.isend(tensor.contiguous(), owner[to_stage], tag=tag))

    posted = {}  # (op, mb, stage) -> (buffer, irecv), one per message from another rank
    for op, i, c in order:
        k = stage_of(rank, c, p, layout)
        for _, _, source in needs(op, i, k, n):
            if owner[source] != rank:  # at most one: the input from the neighbouring stage
                buffer, tag = torch.empty_like(inputs[i]), _tag(op, i, k, n)
                posted[(op, i, k)] = buffer, dist.irecv(buffer, owner[source], tag=tag)

    def receive(op, i, stage):
        if (op, i, stage) in local:
            return local.pop((op, i, stage))
        buffer, work = posted.pop((op, i, stage))
        work.wait()
        return buffer

    for op, i, c in order:
        k = stage_of(rank, c, p, layout)
        if op == "F":
            x = inputs[i] if k == 0 else receive("F", i, k).requires_grad_()
            start, cpu_start = time.perf_counter(), time.thread_time()
            outs = [x]  # the input of each block, then the chunk's output
            for block in chunks[c]:
                outs.append(block(outs[-1]))
            # the last stage ends in the loss, weighted: the m losses add up to the batch mean
            root = nn.functional.mse_loss(outs[-1], targets[i]) / m if k == n - 1 else outs[-1]
            saved[(i, c)] = (outs, root)
            # stopped before the send: the receiver may start at once
            stop, cpu_stop = time.perf_counter(), time.thread_time()
            if k < n - 1:
                send(root.detach(), "F", i, k + 1)
        elif op == "B":
            outs, root = saved[(i, c)]
            g = None if k == n - 1 else receive("B", i, k)
            start, cpu_start = time.perf_counter(), time.thread_time()
            if not split:
                root.backward(g)
                saved.pop((i, c))
                gx = outs[0].grad
            else:  # the gradient at every block's input and output, no weight gradient
                wanted = outs[1:] if k == 0 else outs
                at = torch.autograd.grad(root, wanted, g, retain_graph=True)
                saved[(i, c)] = (outs, dict(zip(range(len(outs) - len(wanted), len(outs)), at)))
                gx = saved[(i, c)][1].get(0)
            stop, cpu_stop = time.perf_counter(), time.thread_time()
            if k > 0:
                send(gx, "B", i, k - 1)
        else:  # W: each block's weight gradient, from the gradient at its output
            outs, at = saved.pop((i, c))
            start, cpu_start = time.perf_counter(), time.thread_time()
            for j, block in enumerate(chunks[c]):
                params = list(block.parameters())
                for param, gw in zip(params, torch.autograd.grad(outs[j + 1], params, at[j + 1])):
                    param.grad = gw if param.grad is None else param.grad + gw
            stop, cpu_stop = time.perf_counter(), time.thread_time()
        log.append((op, i, c, start, stop))
        if cpu is not None:
            cpu.append(cpu_stop - cpu_start)
    for work in sends:
        work.wait()
    return log
