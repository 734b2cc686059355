"""Checks for notebook 02 (collectives and data parallelism by hand)."""

import contextlib
import io
import re

import torch
from torch import nn

from course.training.baseline import classic_data, single_device_step
from course.classroom.exercises import correct, exercise, todo, wrong
from course.runtime.launcher import WorkerError, WorkerTimeoutError, launch
from course.runtime.worker import PEER_GONE


def run_script(script: str, nproc: int, timeout: float = 30) -> list[str]:
    """Run ``script`` (the text of a Python file) in ``nproc`` processes, as torchrun would start it:
    each with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set and no
    process group yet (``course.launch`` with ``init_process_group=False``). Returns what each printed.

    Forked from this process, the ranks need not import torch again: a torchrun job spends seconds
    on that (its agent and every process), this takes a fraction of one."""
    return launch(_run_as_main, nproc, script, init_process_group=False, show=None, timeout=timeout)


def _run_as_main(rank, world_size, script):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            exec(compile(script, "script.py", "exec"), {"__name__": "__main__"})
        except SystemExit as e:  # sys.exit() or sys.exit(0) ends a script successfully
            if e.code not in (None, 0):
                raise
    return printed.getvalue()


_LINE = re.compile(r"rank (\d+) of (\d+): sum ([-+\d.e]+)")


@exercise("Exercise 1 (setup by hand)", hint="read RANK and WORLD_SIZE from os.environ, call dist.init_process_group(\"gloo\", init_method=\"env://\", ...), all_reduce a tensor holding rank + 1, print, then dist.destroy_process_group().")
def setup_script(script, nproc=3, timeout=30):
    """Exercise 1: a script that sets up its own process group (env:// rendezvous), all-reduces
    ``rank + 1`` and prints ``rank R of W: sum S``; run in ``nproc`` processes started as torchrun would."""
    if not isinstance(script, str):
        return wrong("give the script as a string (the text of the file torchrun runs).")
    if "✏️ your code here" in script and "init_process_group" not in script:
        return todo()
    if "init_process_group(" not in script:
        return wrong("every process must call dist.init_process_group(...) before its first collective.")
    if "destroy_process_group(" not in script:
        return wrong("end with dist.destroy_process_group(): it closes the connections before the process exits.")
    # Without a collective the processes never wait for each other: one that is done and exits while
    # another is still connecting makes that one fail with a gloo error that says nothing useful.
    if "all_reduce(" not in script:
        return wrong("all_reduce the tensor (every process calls dist.all_reduce), then print the sum.")
    try:
        printed = run_script(script, nproc, timeout)
    except WorkerTimeoutError as e:
        return wrong(f"the script had not ended after {timeout:g} s (rank(s) {', '.join(map(str, e.ranks))} of {nproc} "
                     "still running): does every process call the same collectives?")
    except WorkerError as e:
        reason = e.failed.get(e.rank, str(e).splitlines()[0])
        if "not been initialized" in reason or "init_process_group" in reason:
            return wrong(f"every process must call dist.init_process_group(...) before its first collective. ({reason})")
        if any(text in reason for text in PEER_GONE):
            return wrong(f"rank {e.rank} waited in a collective while another process had already ended: does every "
                         "process call the same collectives, in the same order?")
        return wrong(f"the script failed: {reason} (rank {e.rank} of {nproc}).")
    expected = {(r, nproc, nproc * (nproc + 1) / 2) for r in range(nproc)}
    found = set()
    for rank, size, total in _LINE.findall("".join(printed)):
        try:
            found.add((int(rank), int(size), float(total)))
        except ValueError:
            return wrong(f"print the sum as a number: `rank {rank} of {size}: sum {total}`.")
    if not found:
        return wrong("each process must print one line `rank R of W: sum S` (for example `rank 0 of 2: sum 3`).")
    if {size for _, size, _ in found} != {nproc}:
        return wrong(f"the check ran {nproc} processes: read WORLD_SIZE (and RANK) from os.environ, torchrun sets them.")
    if all(total == rank + 1 for rank, _, total in found):
        return wrong("each process printed its own number: all_reduce the tensor (every process calls it) before printing.")
    if found != expected:
        return wrong(f"expected one line per rank with the sum 1 + 2 + ... + {nproc}; got {sorted(found)}.")
    return correct(f"{nproc} processes, started as torchrun starts them, each set up the process group from the "
                   "environment, all-reduced, and tore it down.")


def _manual_data_parallel_step(rank, world_size, average_gradients):
    inputs, labels = classic_data()
    model = nn.Linear(inputs.shape[1], labels.shape[1])  # same seed and draws on every rank
    x, y = inputs.chunk(world_size)[rank], labels.chunk(world_size)[rank]
    nn.functional.mse_loss(model(x), y).backward()
    local = model.weight.grad.clone()
    average_gradients(model)
    averaged = model.weight.grad.clone()
    with torch.no_grad():
        for p in model.parameters():
            p -= 1.0 * p.grad  # SGD, lr=1
    return {"local": local, "averaged": averaged, "weight": model.weight.detach(), "bias": model.bias.detach()}


@exercise(
    "Exercise 2 (average_gradients)",
    hint="all_reduce every parameter's .grad (weight and bias), then divide by dist.get_world_size().",
    finished=("course.parallel.parallel3d.average_gradients",),
)
def average_gradients(fn, world_size=4):
    """Exercise 2: data parallelism without DDP — average the gradients across ranks."""
    results = launch(_manual_data_parallel_step, world_size, fn, show=None, timeout=30)
    reference = single_device_step()
    inputs, labels = classic_data()
    full_grad_model = nn.Linear(10, 10)
    nn.functional.mse_loss(full_grad_model(inputs), labels).backward()
    full_grad = full_grad_model.weight.grad
    averaged = results[0]["averaged"]
    if all(torch.allclose(r["averaged"], r["local"] / world_size) or torch.equal(r["averaged"], r["local"]) for r in results):
        return wrong("each rank still has only its own gradient: combine the ranks' .grad with dist.all_reduce.")
    if torch.allclose(averaged, world_size * full_grad, atol=1e-6):
        return wrong("all_reduce sums: divide by the world size to get the mean.")
    if not all(torch.equal(r["weight"], results[0]["weight"]) for r in results):
        return wrong("the ranks ended with different weights: every rank must end with the same gradients.")
    if torch.allclose(results[0]["weight"], reference.weight, atol=1e-6) and torch.allclose(
        results[0]["bias"], reference.bias, atol=1e-6
    ):
        return correct(f"{world_size} ranks, one step: the same weights as one device.")
    return wrong("all_reduce every parameter's .grad (weight and bias), then divide by dist.get_world_size().")
