"""``python -m course doctor``: can this machine run the course? For instructors.

Prints versions, cores and what torch.distributed offers, then does a real 2-rank
gloo launch. Exits non-zero, saying what to do, if something the course needs fails.
"""

import os
import platform
import sys
import time


def _line(ok, what, detail=""):
    mark = {True: "ok  ", False: "FAIL", None: "info"}[ok]
    print(f"[{mark}] {what}{': ' + detail if detail else ''}")
    return ok is not False


def doctor() -> int:
    ok = _line(None, "python", f"{platform.python_version()} on {sys.platform} ({platform.machine()})")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ok &= _line(None, "cpu cores", str(cores))
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        _line(False, "torch", f"{e} — run the install command in README.md")
        return 1
    ok &= _line(None, "torch", f"{torch.__version__} (CUDA GPUs: {torch.cuda.device_count() if torch.cuda.is_available() else 0})")
    try:
        import torchvision

        ok &= _line(True, "torchvision", torchvision.__version__)
    except Exception as e:  # e.g. "operator torchvision::nms does not exist"
        ok &= _line(
            False,
            "torchvision",
            f"{type(e).__name__}: {e}. torchvision must match torch's build: "
            "pip install --force-reinstall torch torchvision (from the same index)",
        )
    ok &= _line(dist.is_available(), "torch.distributed available")
    ok &= _line(dist.is_gloo_available(), "gloo backend (CPU)")
    _line(None, "nccl backend (GPU)", str(dist.is_nccl_available()))
    _line(None, "mpi backend", f"{dist.is_mpi_available()} (pip wheels never include it; the course uses gloo under mpirun)")
    from course.mpi import find_mpirun

    _line(None, "mpirun (notebook 05)", find_mpirun() or "not found: pip install mpich (part of the dev extra)")
    if not ok:
        return 1

    from course.launcher import launch

    def ping(rank, world_size):
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        return t.item()

    start = time.perf_counter()
    try:
        results = launch(ping, 2, show=None, timeout=60)
    except Exception as e:
        _line(False, "2-rank gloo launch", f"{type(e).__name__}: {e}")
        return 1
    seconds = time.perf_counter() - start
    ok &= _line(results == [3.0, 3.0], "2-rank gloo launch + all_reduce", f"{results} in {seconds:.2f} s")
    print("All good: the course runs here." if ok else "Something above failed: see README.md, Troubleshooting.")
    return 0 if ok else 1
