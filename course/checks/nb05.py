"""Checks for notebook 05 (tracing the collectives DDP issues)."""

import contextlib

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course.observe import tracing
from course.classroom.exercises import correct, exercise, wrong
from course.runtime.launcher import launch


def exercise_model():
    """Exercise 1's model: a small CNN, two conv + BatchNorm blocks (the convs without bias) and a linear head, for 8×8 images."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Flatten(), nn.Linear(16 * 4 * 4, 10),
    )


def _construction_trace(rank, world_size):
    DDP(exercise_model())
    tracing.wait_all()
    return tracing.collectives()


_HINT_1 = ("list the model's parameters (model.parameters(): not its buffers) and write down each one's sizes and "
           "strides: a conv weight has 4 dimensions, a BatchNorm weight or bias 1, a linear weight 2, a linear bias 1.")


@exercise("Exercise 1 (the shapes broadcast)", hint=_HINT_1)
def metadata_length(answer):
    """Exercise 1: how many int64 numbers DDP's first broadcast carries for ``exercise_model()``."""
    if isinstance(answer, bool) or not isinstance(answer, int):
        return wrong("answer with a whole number of int64 values, e.g. 12.")
    trace = launch(_construction_trace, 2, backend="traced", show=None, timeout=60)[0]
    metadata = next(e for e in trace if e.op == "broadcast")
    expected = metadata.shapes[0][0]
    model = exercise_model()
    params = list(model.parameters())
    numbers = lambda tensors: sum(2 * t.dim() for t in tensors)  # sizes and strides: one each per dimension
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    if answer == expected:
        return correct(f"{expected} numbers: every parameter's sizes and then its strides, {expected * 8} bytes.")
    if answer == expected // 2:
        return wrong("sizes alone are not enough: DDP also checks the strides (memory layout), one per dimension.")
    if answer == expected * 8:
        return wrong("that is in bytes: count the int64 numbers.")
    if answer in (len(params), 2 * len(params)):
        return wrong("not one number per parameter: one per *dimension* of each parameter, for the sizes and again for the strides.")
    if answer == sum(p.numel() for p in params):
        return wrong("that is the parameters' values, which the *next* broadcast carries (as float32).")
    with_buffers = expected + numbers(b for m in norms for b in (m.running_mean, m.running_var))
    if answer in (with_buffers, with_buffers + len(norms), with_buffers + 2 * len(norms)):
        return wrong("this message checks the *parameters* only: BatchNorm's buffers (running_mean, running_var, "
                     "num_batches_tracked) are not in it; they travel with the weights, in the next broadcast.")
    if answer == expected + 2 * len(convs):
        return wrong("the convolutions are built with bias=False: they have a weight only.")
    if answer == expected - numbers(p for m in norms for p in m.parameters()):
        return wrong("BatchNorm's weight and bias are parameters too (learned, with gradients): they are in the message.")
    return wrong(_HINT_1)


# ------------------------------------------------------------------ Exercise 2


def trace_model(n_buckets):
    """Exercise 2's models: with ``bucket_cap_mb=0.01`` (10 kB) their rebuilt layout has ``n_buckets`` buckets.
    The BatchNorm gives them buffers: float32 running statistics and an int64 counter."""
    torch.manual_seed(0)
    layers = [nn.Linear(10, 64), nn.BatchNorm1d(64)]
    for _ in range(n_buckets - 1):
        layers += [nn.ReLU(), nn.Linear(64, 64)]
    return nn.Sequential(*layers)


def _ops_by_phase(rank, world_size, sync, n_buckets):
    ddp = DDP(trace_model(n_buckets), bucket_cap_mb=0.01)
    phases = [[e.op for e in tracing.collectives()]]
    for step, synced in enumerate(sync):
        tracing.clear()
        with contextlib.nullcontext() if synced else ddp.no_sync():
            ddp(torch.randn(2, 10)).sum().backward()
        phases.append([e.op for e in tracing.collectives()])
    return phases


# (sync, n_buckets): the first case has no no_sync() step, so that its feedback comes first.
CASES = [((True, True, True), 3), ((True, False, True), 2), ((True, False, False, True, True), 1),
         ((True, True, False, False, True), 2)]


def _construction_hint(got, ops):
    if got == ops[:-1]:  # the weights' broadcast without the int64 one
        return ("a model with buffers: DDP(model) broadcasts rank 0's parameters and buffers as one message per dtype: "
                "float32 (the weights and the running statistics), then int64 (num_batches_tracked).")
    return (f"DDP(model) issues {ops}: the parameter count (all_gather), the shapes, then rank 0's parameters and "
            "buffers, one broadcast per dtype.")


def _step_hint(step, sync, n_buckets, got, ops):
    where = f"in step {step} of sync={list(sync)}"
    previous_normal = step == 0 or sync[step - 1]
    if got.count("all_reduce") != ops.count("all_reduce"):
        if not sync[step]:
            return f"{where} (inside no_sync()) the backward all-reduces nothing: the gradients accumulate locally."
        if step == 0:
            return f"{where} DDP all-reduces once: the first step runs with a single bucket."
        return (f"{where} DDP all-reduces {ops.count('all_reduce')} time(s), not {got.count('all_reduce')}: every normal "
                f"step after the first all-reduces each of the {n_buckets} rebuilt bucket(s) once, after no_sync() steps too.")
    if got.count("broadcast") != ops.count("broadcast"):
        if not previous_normal and got.count("broadcast") > ops.count("broadcast"):
            return (f"{where}: the forward right after a forward inside no_sync() broadcasts no buffers. DDP syncs them "
                    "only when the *previous* forward ran with gradients and outside no_sync().")
        if step == 0:
            return (f"{where}: a model with buffers. The first forward, and every forward after a normal one, starts "
                    "with a broadcast of rank 0's buffers, one per dtype: the float32 statistics, then the int64 counter.")
        if previous_normal and not sync[step]:
            return (f"{where}: a forward inside no_sync() still starts with the broadcasts the previous forward "
                    "calls for (the buffers, after a normal forward) and, in step 1, with the new bucket layout.")
        if step == 1:
            return (f"{where}: step 1's forward also sends rank 0's rebuilt bucket layout (two broadcasts), once, "
                    "before the buffers.")
        return (f"{where} DDP broadcasts {ops.count('broadcast')} time(s), not {got.count('broadcast')}: the layout "
                "(two, in step 1 only) and the buffers (two, unless the previous forward ran inside no_sync()).")
    return f"{where} the order differs: the broadcasts come in the forward, before the backward's all_reduces."


@exercise("Exercise 2 (predict the trace)", hint="one list for DDP(model), then one per step; in each step, the forward's "
          "broadcasts (the new layout in step 1; the buffers unless the previous forward ran inside no_sync()), then "
          "the backward's all_reduces (none inside no_sync(); one in step 0; one per bucket after).")
def expected_ops(fn):
    """Exercise 2: rank 0's op names, per phase, for a model with buffers, steps in and out of ``no_sync()``."""
    for sync, n_buckets in CASES:
        try:
            got = fn(list(sync), n_buckets)
        except Exception as e:
            return wrong(f"expected_ops({list(sync)}, {n_buckets}) raised {type(e).__name__}: {e}")
        if not isinstance(got, (list, tuple)) or not all(
                isinstance(phase, (list, tuple)) and all(isinstance(op, str) for op in phase) for phase in got):
            return wrong("return a list of lists of op names: [[ops of DDP(model)], [ops of step 0], [ops of step 1], ...].")
        got = [list(phase) for phase in got]
        ops = launch(_ops_by_phase, 2, sync, n_buckets, backend="traced", show=None, timeout=60)[0]
        if len(got) != len(ops):
            return wrong(f"for sync={list(sync)} return {len(ops)} lists: one for DDP(model), then one per step; you returned {len(got)}.")
        if got[0] != ops[0]:
            return wrong(_construction_hint(got[0], ops[0]))
        for step in range(len(sync)):
            if got[step + 1] != ops[step + 1]:
                return wrong(_step_hint(step, sync, n_buckets, got[step + 1], ops[step + 1]))
    return correct(f"your function reproduces {len(CASES)} real traces, phase by phase.")
