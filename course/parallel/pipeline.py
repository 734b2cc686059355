"""Pipeline parallelism by hand (notebook 14): a model cut into stages, one stage per rank.

A pipeline *schedule* is, for every stage, the order in which it runs its actions:
``("F", i)`` is the forward of micro-batch ``i``, ``("B", i)`` its backward. GPipe runs
all forwards, then all backwards; 1F1B starts backwards as early as it can. The same
executor, :func:`run_stage`, runs any such order on real ranks (gloo ``isend``/``recv``).
:func:`simulate` plays the orders of all stages in *logical* time (a forward takes
``forward`` time units, a backward ``backward``) to find each action's slot, which gives
the bubble without any clock; :func:`bubble` measures it from either kind of timeline.

The notebook derives :func:`gpipe_order` and :func:`run_stage`; a test asserts that its
cells and this file hold the same code.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

WIDTH, DEPTH, BATCH = 32, 4, 16  # the course's pipeline model and batch


def make_model(width: int = WIDTH, depth: int = DEPTH, seed: int = 0) -> nn.Sequential:
    """``depth`` blocks of ``Linear(width, width)`` + ``Tanh``: every cut between blocks
    carries an activation of the same shape, ``(rows, width)``."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])


def make_batch(batch: int = BATCH, width: int = WIDTH, seed: int = 1):
    """A batch of inputs and regression targets (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


def split(model: nn.Sequential, n_stages: int) -> list[nn.Sequential]:
    """Cut a Sequential into ``n_stages`` consecutive stages of equally many blocks."""
    if len(model) % n_stages:
        raise ValueError(f"{len(model)} blocks do not split into {n_stages} equal stages")
    per = len(model) // n_stages
    return [model[s * per : (s + 1) * per] for s in range(n_stages)]


def gpipe_order(m):
    """GPipe: the forwards of all m micro-batches, then their backwards."""
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b_order(stage, p, m):
    """1F1B: enough forwards to fill the pipeline below this stage, then one forward and one
    backward in turn, then the backwards left. Stage ``s`` keeps at most ``p - s`` activations."""
    warmup = min(p - stage - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


def peak_activations(order):
    """How many micro-batches' activations a stage holds at most when it runs ``order``."""
    held = peak = 0
    for kind, _ in order:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def run_stage(stage, order, inputs, targets, device_time=0.0):
    """Run this rank's stage through ``order``; return its log and its peak number of stored activations."""
    rank, p = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == p - 1
    saved = {}  # micro-batch -> (its input, its output): what its backward needs
    sends = []  # isend handles, waited for at the end
    log, peak = [], 0
    for kind, i in order:
        if kind == "F":
            if first:
                x = inputs[i]
            else:
                x = torch.empty_like(inputs[i])  # every cut has the input's shape
                dist.recv(x, rank - 1)
                x.requires_grad_()
            start = time.perf_counter()
            y = stage(x)
            if last:  # micro-batch i's loss, weighted so that the m losses add up to the batch mean
                y = nn.functional.mse_loss(y, targets[i]) / len(inputs)
            saved[i] = (x, y)
            peak = max(peak, len(saved))
            out, to = y.detach(), rank + 1
        else:
            x, y = saved.pop(i)
            grad = None  # the last stage starts from its loss
            if not last:
                grad = torch.empty_like(y)
                dist.recv(grad, rank + 1)
            start = time.perf_counter()
            y.backward(grad)
            out, to = x.grad, rank - 1
        time.sleep(device_time * (1 if kind == "F" else 2))  # stands in for a GPU kernel's time
        log.append((kind, i, start, time.perf_counter()))
        if 0 <= to < p:
            sends.append(dist.isend(out, to))  # isend: gloo's send would wait for the recv
    for work in sends:
        work.wait()
    return log, peak


class Deadlock(RuntimeError):
    """The orders cannot run: every stage waits for something that never comes."""


def _needs(stage, p, kind, i):
    """The action another stage must have finished before ``stage`` can run ``(kind, i)``."""
    if kind == "F":
        return (stage - 1, "F", i) if stage > 0 else None
    return (stage + 1, "B", i) if stage < p - 1 else (stage, "F", i)


def simulate(orders, forward=1, backward=2):
    """Play every stage's order in logical time: an action starts when its stage is free
    and its input (activation or gradient) has arrived; sends take no time. Returns, per
    stage, ``[(kind, i, start, end), ...]`` like :func:`run_stage`'s log."""
    p = len(orders)
    finished = {}  # (stage, kind, i) -> end time
    free = [0] * p  # when each stage is next free
    logs = [[] for _ in range(p)]
    while any(len(logs[s]) < len(orders[s]) for s in range(p)):
        progress = False
        for s in range(p):
            if len(logs[s]) == len(orders[s]):
                continue
            kind, i = orders[s][len(logs[s])]
            need = _needs(s, p, kind, i)
            if need is not None and need not in finished:
                continue
            start = max(free[s], finished.get(need, 0))
            free[s] = start + (forward if kind == "F" else backward)
            finished[(s, kind, i)] = free[s]
            logs[s].append((kind, i, start, free[s]))
            progress = True
        if not progress:
            stuck = {s: orders[s][len(logs[s])] for s in range(p) if len(logs[s]) < len(orders[s])}
            waits = ", ".join(f"stage {s} waits at {k}{i}" for s, (k, i) in stuck.items())
            raise Deadlock(f"no stage can go on: {waits}")
    return logs


def bubble(logs):
    """Fraction of the step each stage is idle, averaged over the stages. The step runs
    from the first action's start to the last action's end, over all stages."""
    start = min(a[2] for log in logs for a in log)
    end = max(a[3] for log in logs for a in log)
    busy = [sum(a[3] - a[2] for a in log) for log in logs]
    return 1 - sum(busy) / (len(logs) * (end - start))


def plot_schedule(logs, ax, title="", unit=""):
    """A Gantt chart: one row per stage, a box per action (F light, B dark), labelled by micro-batch."""
    origin = min(a[2] for log in logs for a in log)
    for s, log in enumerate(logs):
        for kind, i, start, end in log:
            color = "#9ecae1" if kind == "F" else "#3182bd"
            ax.broken_barh([(start - origin, end - start)], (s - 0.4, 0.8), facecolors=color, edgecolor="black", linewidth=0.5)
            ax.text(start - origin + (end - start) / 2, s, f"{kind}{i}", ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(logs)), [f"stage {s}" for s in range(len(logs))])
    ax.set_ylim(len(logs) - 0.5, -0.5)  # stage 0 on top
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=10)
