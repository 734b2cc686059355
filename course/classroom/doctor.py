"""``python -m course doctor``: can this machine run the course? For instructors.

Prints versions, cores and what torch.distributed offers, then does a real 2-rank
gloo launch and a traced DDP launch (notebooks 04 and 05 record the collectives DDP's
C++ reducer issues). Exits non-zero, saying what to do, if something the course needs fails.
"""

import os
import platform
import re
import sys
import time


def _line(ok, what, detail=""):
    mark = {True: "ok  ", False: "FAIL", None: "info"}[ok]
    print(f"[{mark}] {what}{': ' + detail if detail else ''}")
    return ok is not False


def _version(text):
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


def oldest_supported(package="torch"):
    """The lowest version of ``package`` the course declares (``torch>=X`` in pyproject), or None."""
    from importlib import metadata

    try:
        requires = metadata.requires("ddp-course") or []
    except metadata.PackageNotFoundError:  # running from a checkout that is not installed
        return None
    for requirement in requires:
        match = re.fullmatch(rf"{package}\s*>=\s*([\w.]+)", requirement.split(";")[0].strip())
        if match:
            return match[1]
    return None


# Notebooks 11-18 (FSDP2, DTensor and pipelining on the traced backend, torch.distributed.pipelining's
# tracer) were tested on torch 2.15; on torch 2.8 parts of them fail (measured), versions in between
# are untested. Part I and notebook 10 work from the course's floor (pyproject) up.
PART_II_TORCH = "2.15"


def torch_at_least(minimum: str) -> bool:
    import torch

    return _version(torch.__version__) >= _version(minimum)


def require_torch(minimum: str, what: str):
    """Raise a clear error, saying what to install, if this torch is older than ``minimum``."""
    import torch

    if not torch_at_least(minimum):
        raise RuntimeError(
            f"{what} needs torch >= {minimum} (it is tested on {minimum}; older releases lack what it uses); "
            f'this is torch {torch.__version__}. Install a newer pair: pip install -U "torch>={minimum}" torchvision'
        )


def _ddp_trace(rank, world_size):
    """One DDP step on the traced backend; the collectives it recorded."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course.observe import tracing

    torch.manual_seed(rank)
    model = DDP(torch.nn.Linear(4, 2))
    model(torch.randn(8, 4)).sum().backward()
    tracing.wait_all()
    return [e.op for e in tracing.collectives()], model.module.weight.grad


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
    oldest = oldest_supported()
    if oldest and _version(torch.__version__) < _version(oldest):
        ok &= _line(False, "torch version", f"{torch.__version__} is older than the course supports (torch>={oldest}): "
                    f'pip install "torch>={oldest}" with its torchvision')
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
    from course.runtime.mpi import find_mpirun

    _line(None, "mpirun (notebook 05)", find_mpirun() or "not found: pip install mpich (part of the dev extra)")
    if not ok:
        return 1

    from course.runtime.launcher import choose_start_method, launch

    try:
        method, why = choose_start_method()
    except ValueError as e:  # a bad COURSE_START_METHOD
        _line(False, "start method", str(e))
        return 1
    _line(None, "start method of course.launch", f"{method} ({why}; COURSE_START_METHOD changes it)")

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

    # Notebooks 04, 05 and some exercise checks record collectives with course.observe.tracing's
    # "traced" backend: it must see the all-reduce that DDP's C++ reducer issues.
    what = "traced backend sees DDP's collectives (notebooks 04, 05)"
    try:
        import course.observe.tracing  # registers "traced"

        (ops, grad0), (_, grad1) = launch(_ddp_trace, 2, backend="traced", show=None, timeout=60)
    except Exception as e:
        too_old = oldest and _version(torch.__version__) < _version(oldest)
        ok &= _line(False, what, f"{type(e).__name__}: {e}".splitlines()[0]
                    + f" — Python {platform.python_version()} with torch {torch.__version__} cannot run course.observe.tracing; "
                    + (f"install a supported torch (>= {oldest})" if too_old else "see README.md, Supported versions"))
    else:
        ok &= _line("all_reduce" in ops and torch.equal(grad0, grad1), what, ", ".join(ops))
    part_ii = torch_at_least(PART_II_TORCH)
    _line(None, "notebooks 11-18 (FSDP2, DTensor, pipelining, Part III)",
          "can run here" if part_ii else f"need torch >= {PART_II_TORCH}; Part I and notebook 10 run on this torch")
    print("All good: the course runs here." if ok else "Something above failed: see README.md, Troubleshooting.")
    return 0 if ok else 1
