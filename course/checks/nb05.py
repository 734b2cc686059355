"""Checks for notebook 05 (tracing the collectives DDP issues)."""

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course import tracing
from course.exercises import correct, exercise, wrong
from course.launcher import launch


def exercise_model():
    """Exercise 1's model: a small CNN."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))


def _construction_trace(rank, world_size):
    DDP(exercise_model())
    tracing.wait_all()
    return tracing.collectives()


@exercise("Exercise 1 (the shapes broadcast)", hint="for each parameter, write down its sizes and its strides: conv weight has 4 dimensions, conv bias 1, linear weight 2, linear bias 1.")
def metadata_length(answer):
    """Exercise 1: how many int64 numbers DDP's first broadcast carries for ``exercise_model()``."""
    if isinstance(answer, bool) or not isinstance(answer, int):
        return wrong("answer with a whole number of int64 values, e.g. 12.")
    trace = launch(_construction_trace, 2, backend="traced", show=None, timeout=60)[0]
    metadata = next(e for e in trace if e.op == "broadcast")
    expected = metadata.shapes[0][0]
    params = list(exercise_model().parameters())
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
    return wrong("for each parameter, write down its sizes and its strides: conv weight has 4 dimensions, conv bias 1, linear weight 2, linear bias 1.")


def _model_with_buckets(n_buckets):
    """An MLP whose rebuilt layout has ``n_buckets`` buckets at bucket_cap_mb=0.01 (10 kB)."""
    torch.manual_seed(0)
    layers = [nn.Linear(10, 64)]
    for _ in range(n_buckets - 1):
        layers += [nn.ReLU(), nn.Linear(64, 64)]
    return nn.Sequential(*layers)


def _op_names(rank, world_size, n_steps, n_buckets):
    ddp = DDP(_model_with_buckets(n_buckets), bucket_cap_mb=0.01)
    for _ in range(n_steps):
        ddp(torch.randn(2, 10)).sum().backward()
    return [e.op for e in tracing.collectives()]


CASES = [(1, 2), (3, 1), (3, 3), (4, 2)]  # (n_steps, n_buckets)


@exercise("Exercise 2 (predict the trace)", hint="every step all-reduces each bucket once; the construction broadcasts come before the first step; look at the traced run above and count per step.")
def expected_ops(fn):
    """Exercise 2: the op names DDP issues for ``n_steps`` steps of a model with ``n_buckets`` buckets."""
    actual = {case: launch(_op_names, 2, *case, backend="traced", show=None, timeout=60)[0] for case in CASES}
    for (n_steps, n_buckets), ops in actual.items():
        try:
            got = list(fn(n_steps, n_buckets))
        except Exception as e:
            return wrong(f"expected_ops({n_steps}, {n_buckets}) raised {type(e).__name__}: {e}")
        if got == ops:
            continue
        where = f"for {n_steps} step(s) and {n_buckets} bucket(s)"
        if got[:3] != ops[:3]:
            return wrong(f"{where} the trace starts with {ops[:3]}: DDP's constructor checks the parameter count, then broadcasts shapes, then weights.")
        if got.count("all_reduce") != ops.count("all_reduce"):
            return wrong(f"{where} DDP runs {ops.count('all_reduce')} all_reduce(s), not {got.count('all_reduce')}: remember that the first step runs with a single bucket.")
        if got.count("broadcast") != ops.count("broadcast"):
            return wrong(f"{where} DDP runs {ops.count('broadcast')} broadcast(s), not {got.count('broadcast')}: after the first step, rank 0 sends its new bucket layout (two broadcasts), once.")
        return wrong(f"{where} the order differs: the layout broadcasts come at the start of the second step, before its all_reduces.")
    return correct(f"your function reproduces {len(CASES)} real traces.")
