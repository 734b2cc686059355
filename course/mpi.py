"""Start ranks with a real ``mpirun``, and let them talk gloo.

pip's torch has no MPI backend: ``dist.is_mpi_available()`` is False, because MPI is
only compiled in when PyTorch is built from source on a machine that has MPI. But
``mpirun`` is useful without it. It starts N copies of a program and tells each one
who it is through environment variables (``PMI_RANK``/``PMI_SIZE`` with MPICH,
``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE`` with Open MPI). That is all
``init_process_group`` needs, plus a place to meet: here a ``FileStore`` in a
temporary folder, as in :func:`course.launch`.

    >>> course.mpi.launch(fn, 2, *args)          # like course.launch, via mpirun
    [rank 0] ...
    [rank 1] ...

Each rank runs ``python -m course.mpi FOLDER``: it reads ``fn`` and its arguments
(sent by value with cloudpickle) from the folder, joins the process group, runs
``fn(rank, world_size, *args)`` and writes its result back. As with
``course.launch``, what each rank prints is shown afterwards in rank order, and a
failing rank raises :class:`course.WorkerError`.

``mpirun`` comes from ``pip install mpich`` (part of the course's ``dev`` extra on
Linux and macOS) or from your system (Open MPI, MPICH).
"""

from __future__ import annotations

import datetime
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from course.launcher import (
    WorkerError,
    WorkerTimeoutError,
    _error_report,
    _flush_all,
    _pickle_by_value,
    _raise_worker_error,
    _redirect_output,
    _register_backend,
    _replay_output,
    _unpickle,
    ranks_to_show,
    registered_backend,
)

# (rank, world size) variables, for each MPI family.
RANK_VARIABLES = [
    ("PMI_RANK", "PMI_SIZE"),  # MPICH, Intel MPI (Hydra)
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),  # Open MPI
    ("PMIX_RANK", "PMIX_SIZE"),  # other PMIx launchers
]


class MPIRunNotFound(RuntimeError):
    """No ``mpirun`` on this machine."""


def find_mpirun() -> str | None:
    """Path of ``mpirun``: next to this Python (a venv where ``pip install mpich``
    put it; a notebook kernel's PATH often lacks that folder), else on PATH."""
    here = Path(sys.executable).parent / "mpirun"
    if here.exists() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("mpirun")


def rank_and_size(environ=None) -> tuple[int, int]:
    """This process's rank and the world size, as ``mpirun`` announced them."""
    environ = os.environ if environ is None else environ
    for rank_var, size_var in RANK_VARIABLES:
        if rank_var in environ and size_var in environ:
            return int(environ[rank_var]), int(environ[size_var])
    names = ", ".join(r for r, _ in RANK_VARIABLES)
    raise RuntimeError(f"Not started by mpirun: none of {names} is set.")


def mpirun_command(mpirun: str, world_size: int) -> list[str]:
    """``mpirun -n N`` plus what Open MPI needs to run as root on a small machine."""
    try:
        version = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        version = ""
    command = [mpirun]
    if "Open MPI" in version or "OpenRTE" in version:
        command.append("--oversubscribe")  # more ranks than cores is fine for the course
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            command.append("--allow-run-as-root")
    return command + ["-n", str(world_size)]


def launch(fn, world_size: int, *args, backend: str = "gloo", timeout: float = 120.0, show="all", mpirun=None):
    """Run ``fn(rank, world_size, *args)`` on ranks started by ``mpirun -n world_size``.

    Returns the results in rank order. ``backend`` is the torch.distributed backend
    the ranks use (``"gloo"``, or a registered one such as ``"traced"``); ``mpirun``
    is a path (default: :func:`find_mpirun`). Raises :class:`MPIRunNotFound` if
    there is no mpirun, :class:`course.WorkerError` if a rank fails and
    :class:`course.WorkerTimeoutError` if the run takes longer than ``timeout``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}.")
    mpirun = mpirun or find_mpirun()
    if mpirun is None:
        raise MPIRunNotFound(
            "mpirun not found. Install MPICH with `pip install mpich` (Linux, macOS) "
            "or Open MPI from your system's packages, then try again."
        )
    plugin = None if backend in ("gloo", "nccl") else registered_backend(backend)
    if backend not in ("gloo", "nccl") and plugin is None:
        raise ValueError(f"Unknown backend {backend!r}: use 'gloo' or a name registered with dist.Backend.register_backend.")
    show_ranks = ranks_to_show(show, world_size)

    with tempfile.TemporaryDirectory(prefix="course-mpi-") as workdir:
        Path(workdir, "payload").write_bytes(_pickle_by_value(fn, args, plugin))
        Path(workdir, "config").write_bytes(pickle.dumps({"backend": backend, "timeout": timeout}))
        command = mpirun_command(mpirun, world_size) + [sys.executable, "-m", "course.mpi", workdir]
        # Like multiprocessing's spawn: the ranks import from where this process does
        # (the course package, the module that defined fn, ...).
        path = os.pathsep.join(p or os.getcwd() for p in sys.path)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            launcher_output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            _replay_output(workdir, show_ranks, world_size)
            stuck = [r for r in range(world_size) if not Path(workdir, f"rank{r}.result").exists()]
            raise WorkerTimeoutError(f"mpirun did not finish within timeout={timeout:g} s; stopped.", ranks=stuck or [0], stacks={})
        _replay_output(workdir, show_ranks, world_size)
        return _collect(workdir, world_size, proc.returncode, launcher_output.decode(errors="replace"))


def _collect(workdir, world_size, returncode, launcher_output):
    results, errors = {}, {}
    for rank in range(world_size):
        path = Path(workdir, f"rank{rank}.result")
        if path.exists():
            kind, data = pickle.loads(path.read_bytes())
            if kind == "result":
                results[rank] = pickle.loads(data)
            else:
                errors[rank] = data
    if errors:
        _raise_worker_error(errors, world_size)
    if len(results) < world_size:
        missing = [r for r in range(world_size) if r not in results]
        raise WorkerError(
            f"mpirun exited with code {returncode} and rank(s) {missing} left no result.\n"
            f"mpirun said:\n{launcher_output.strip()}",
            rank=missing[0],
        )
    return [results[r] for r in range(world_size)]


def _main(workdir):
    """One rank, started by mpirun: ``python -m course.mpi FOLDER``."""
    workdir = Path(workdir)
    code = 1
    rank = None
    try:
        rank, world_size = rank_and_size()
        _redirect_output(workdir / f"rank{rank}.out")
        config = pickle.loads((workdir / "config").read_bytes())
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        fn, args, plugin = _unpickle((workdir / "payload").read_bytes())
        if plugin is not None:
            _register_backend(plugin)
        dist.init_process_group(
            config["backend"],
            init_method=(workdir / "store").as_uri(),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=config["timeout"] + 60),
        )
        try:
            result = ("result", pickle.dumps(fn(rank, world_size, *args), protocol=pickle.HIGHEST_PROTOCOL))
            code = 0
        except BaseException as e:
            result = ("error", _error_report(e))
        dist.destroy_process_group()
    except BaseException as e:  # before fn ran: not under mpirun, bad payload, ...
        result = ("error", _error_report(e))
        if rank is None:
            print(f"course.mpi: {e}", file=sys.stderr)
            raise SystemExit(2)
    _write_atomically(workdir / f"rank{rank}.result", pickle.dumps(result))
    _flush_all()
    os._exit(code)


def _write_atomically(path, data):
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


if __name__ == "__main__":
    _main(sys.argv[1])
