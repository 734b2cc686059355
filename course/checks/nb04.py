"""Checks for notebook 04 (gradient buckets and communication hooks)."""

import importlib
import inspect
import math
import pkgutil
import sys
import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from course.observe import tracing
from course.classroom.exercises import correct, exercise, replaced, wrong
from course.runtime.launcher import WorkerError, launch

BUCKET_CAP_MB = 2
HOOK_RANKS = 3  # not 2, so that a hook dividing by a hard-coded 2 gets the wrong average
HUGE_GRADIENTS = (3e38, 2e38, 1e38)  # one per rank: their sum overflows float32 and bfloat16, their average does not


def exercise_model():
    """Exercise 1's model: 4.4 MB of float32 parameters in three Linear layers."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(100, 1000), nn.ReLU(), nn.Linear(1000, 1000), nn.ReLU(), nn.Linear(1000, 10))


def _buckets_per_iteration(rank, world_size, iterations=3):
    ddp = DDP(exercise_model(), bucket_cap_mb=BUCKET_CAP_MB)
    counts = [0] * iterations

    def counting_hook(state, bucket):
        counts[iteration] += 1
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())  # no communication needed to count
        return fut

    ddp.register_comm_hook(None, counting_hook)
    for iteration in range(iterations):
        ddp(torch.randn(2, 100)).sum().backward()
    return counts


@exercise("Exercise 1 (number of buckets)", hint="list the parameters in the order their gradients are ready (last layer first, bias before weight), add up 4 bytes per element, and start a new bucket each time the running total reaches 2 MiB.")
def n_buckets(answer):
    """Exercise 1: how many buckets DDP uses for ``exercise_model()`` from the 2nd iteration on."""
    if isinstance(answer, bool) or not isinstance(answer, int):
        return wrong("answer with a whole number of buckets, e.g. 4.")
    first, *later = launch(_buckets_per_iteration, 1, show=None, timeout=60)[0]
    expected = later[-1]
    if answer == expected:
        return correct(f"{expected} buckets from the second iteration on (the first iteration used {first}).")
    if answer == first:
        return wrong("that is the first iteration only: after it DDP rebuilds the buckets in the order the gradients arrived, cut at bucket_cap_mb.")
    if answer == 6:
        return wrong("parameters share buckets: DDP fills a bucket until it reaches the cap.")
    if answer == expected + 1:
        return wrong(
            "a bucket is closed only once it has *reached* the cap, so the parameter that crosses the cap "
            "goes into it (a bucket can be bigger than bucket_cap_mb). Walk the parameters from the last "
            "layer's bias backwards, adding up bytes.",
        )
    return wrong("list the parameters in the order their gradients are ready (last layer first, bias before weight), add up 4 bytes per element, and start a new bucket each time the running total reaches 2 MiB.")


def _builtin_hook_code():
    """Where every function of PyTorch's comm-hook modules is defined (file, line, name), nested functions
    included (the hooks that ``bf16_compress_wrapper`` and friends return). A hook that runs any of that
    code uses PyTorch's hooks, whatever name it was imported, renamed or wrapped under. (Compared by place,
    not by identity: a spawned rank receives a wrapped hook by value, with a copy of its code.)"""
    from torch.distributed.algorithms import ddp_comm_hooks

    found = set()

    def collect(code):
        found.add(_where(code))
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                collect(const)

    for info in pkgutil.iter_modules(ddp_comm_hooks.__path__):
        try:
            module = importlib.import_module(f"{ddp_comm_hooks.__name__}.{info.name}")
        except Exception:  # a module this torch cannot import (an optional dependency): nothing to flag
            continue
        for value in vars(module).values():
            if isinstance(value, types.FunctionType) and value.__module__ == module.__name__:
                collect(value.__code__)
    return found


def _where(code):
    return code.co_filename, code.co_firstlineno, code.co_name


def _grads_with_hook(rank, world_size, hook):
    # Flag PyTorch's own hooks, however they are called (directly, imported by name, renamed, wrapped):
    # a profile function sees every Python call this thread makes, and compares its code with theirs.
    builtin, used_builtin = _builtin_hook_code(), []

    def watch_calls(frame, event, arg):
        if event == "call" and _where(frame.f_code) in builtin:
            used_builtin.append(frame.f_code.co_name)

    sys.setprofile(watch_calls)
    try:
        return _run_hook(rank, world_size, hook, used_builtin)
    finally:
        sys.setprofile(None)


def _run_hook(rank, world_size, hook, used_builtin):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    reference = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    reference.load_state_dict(model.state_dict())
    torch.manual_seed(100 + rank)  # each rank its own data
    x = torch.randn(16, 8)

    # What the gradients should be: the fp32 average over ranks.
    reference(x).square().mean().backward()
    expected = [p.grad.clone() for p in reference.parameters()]
    for g in expected:
        dist.all_reduce(g)
        g /= world_size

    # Note how the hook calls all_reduce (blocking or not, in which group) and whether it waits for it.
    calls, waited = [], []
    real_all_reduce = dist.all_reduce

    class Watched:  # the all-reduce's work, noting a wait() (DDP waits on the future, after backward)
        def __init__(self, work):
            self.work = work

        def wait(self, *args, **kwargs):
            waited.append(True)
            return self.work.wait(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.work, name)

    def watched_all_reduce(tensor, *args, **kwargs):
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        async_op = kwargs.get("async_op", args[2] if len(args) > 2 else False)
        calls.append({"async": bool(async_op), "group": group})
        work = real_all_reduce(tensor, *args, **kwargs)
        return Watched(work) if async_op else work

    ddp = DDP(model)
    ddp.register_comm_hook(None, hook)
    tracing.clear()
    with replaced(dist, "all_reduce", watched_all_reduce, hook):
        ddp(x).square().mean().backward()
        tracing.wait_all()
        main_calls = list(calls)

        # Huge gradients: 3e38, 2e38, 1e38 on ranks 0, 1, 2. Their sum overflows; their average does not.
        # This DDP runs in a group of its own (the same ranks), passed to the hook as process_group.
        group = dist.new_group(list(range(world_size)))
        big = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            big.weight.fill_(1.0)
        big_ddp = DDP(big, process_group=group)
        big_ddp.register_comm_hook(group, hook)
        calls.clear()
        big_ddp(torch.tensor([[HUGE_GRADIENTS[rank]]])).sum().backward()
    dtypes = [e.dtypes[0] for e in tracing.collectives() if e.op == "all_reduce"]
    return {"expected": expected, "got": [p.grad.clone() for p in model.parameters()], "dtypes": dtypes,
            "big": big.weight.grad.item(), "builtin": sorted(set(used_builtin)),
            "blocking": any(not c["async"] for c in main_calls), "waited": bool(waited),
            "group_used": bool(calls) and all(c["group"] is group for c in calls)}


@exercise("Exercise 2 (bf16 compression hook)", hint="cast bucket.buffer() to bfloat16 and divide it by the world size *before* the all_reduce (async_op=True); in .then(...) copy the result back into the float32 buffer and return that buffer.")
def bf16_hook(fn):
    """Exercise 2: a comm hook, written without PyTorch's hooks, that all-reduces the bucket in
    bfloat16 and averages without overflowing."""
    if not callable(fn):
        return wrong("write a function `bf16_hook(process_group, bucket)`.")
    params = list(inspect.signature(fn).parameters)
    if len(params) != 2 or params[1] != "bucket":
        return wrong("DDP calls a hook with two arguments, and the second must be named `bucket`: def bf16_hook(process_group, bucket).")
    if fn in (default_hooks.bf16_compress_hook, default_hooks.fp16_compress_hook, default_hooks.allreduce_hook) \
            or (hasattr(fn, "__code__") and _where(fn.__code__) in _builtin_hook_code()):
        return wrong("that is PyTorch's own hook: write the cast, the all_reduce and the copy back yourself.")
    try:
        result = launch(_grads_with_hook, HOOK_RANKS, fn, backend="traced", show=None, timeout=60)[0]
    except WorkerError as e:
        summary = e.failed.get(e.rank, str(e))
        if "Future" in summary or "future" in summary:
            return wrong(f"DDP wants a torch.futures.Future back: return dist.all_reduce(..., async_op=True).get_future().then(...). ({summary})")
        return wrong(f"a rank failed: {summary}")
    if result["builtin"]:
        return wrong(f"your hook calls PyTorch's own hook code ({', '.join(result['builtin'])}, in "
                     "torch.distributed.algorithms.ddp_comm_hooks): write the cast, the all_reduce and the copy back yourself.")
    got, expected = torch.cat([g.flatten() for g in result["got"]]), torch.cat([g.flatten() for g in result["expected"]])
    if "bfloat16" not in result["dtypes"]:
        return wrong(f"the all_reduce ran in {', '.join(sorted(set(result['dtypes']))) or 'nothing'}: cast the bucket's buffer to torch.bfloat16 before all-reducing it.")
    if set(result["dtypes"]) != {"bfloat16"}:
        return wrong(f"all-reduces ran in {', '.join(sorted(set(result['dtypes'])))}: the bucket should travel once, "
                     "in bfloat16 only (half the bytes of float32).")
    if result["blocking"] or result["waited"]:
        return wrong("the hook waits for its all-reduce (async_op=False, or .wait()), so backward stops there: "
                     "start it with async_op=True and return its future, with .then(...) for what comes after.")
    close = lambda a, b: torch.allclose(a, b, rtol=2e-2, atol=1e-4)
    if close(got, HOOK_RANKS * expected):
        return wrong("all_reduce sums: divide by the world size to average.")
    if any(close(got, HOOK_RANKS / n * expected) for n in range(1, 9) if n != HOOK_RANKS):
        return wrong(f"on {HOOK_RANKS} ranks your hook does not divide by {HOOK_RANKS}: divide by the world size of the "
                     "group (dist.get_world_size(process_group)), not by a fixed number.")
    if not close(got, expected):
        return wrong("cast bucket.buffer() to bfloat16, divide by the world size, all_reduce it with async_op=True, and in .then(...) copy the result back into the float32 buffer and return that buffer.")
    average = sum(HUGE_GRADIENTS) / HOOK_RANKS
    if not math.isclose(result["big"], average, rel_tol=1e-2):
        return wrong(f"gradients of {', '.join(f'{g:.0e}' for g in HUGE_GRADIENTS)} averaged to {result['big']:.3g}, "
                     f"not {average:.0e}: their sum overflows. "
                     "Divide by the world size *before* the all_reduce, as DDP does.")
    if not result["group_used"]:
        return wrong("when DDP runs in a process group of its own, the hook gets it as `process_group`: all-reduce "
                     "in that group (group=process_group), and in the default group only when it is None.")
    return correct("half the bytes of float32, gradients within bfloat16's ~3 significant digits, no overflow.")
