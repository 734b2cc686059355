"""Start ranks with a real ``mpirun``, and let them talk gloo.

pip's torch has no MPI backend: ``dist.is_mpi_available()`` is False, because MPI is
only compiled in when PyTorch is built from source on a machine that has MPI. But
``mpirun`` is useful without it. It starts N copies of a program and tells each one
who it is through environment variables (``PMI_RANK``/``PMI_SIZE`` with MPICH,
``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE`` with Open MPI). That is all
``init_process_group`` needs, plus a place to meet: here a ``FileStore`` in a
temporary folder, as in :func:`course.launch`.

    >>> course.runtime.mpi.launch(fn, 2, *args)          # like course.launch, via mpirun
    [rank 0] ...
    [rank 1] ...

Each rank runs ``python -m course.runtime.mpi FOLDER``: it reads ``fn`` and its arguments
(sent by value with cloudpickle) from the folder and runs :func:`course.runtime.worker.run_rank`,
exactly as a rank of ``course.launch`` does, then writes its report back. What each
rank prints is shown afterwards in rank order, and a failing rank raises
:class:`course.WorkerError`. This module holds only what is MPI's: finding ``mpirun``,
its command line, and reading the rank from its variables (:mod:`course.runtime.distenv`).

``mpirun`` comes from ``pip install mpich`` (part of the course's ``dev`` extra on
Linux and macOS) or from your system (Open MPI, MPICH).
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from course.runtime import distenv, worker


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
    """This process's rank and the world size, as ``mpirun`` announced them
    (:data:`course.runtime.distenv.MPI_VARIABLES` lists the names each MPI uses)."""
    return distenv.mpi_rank_and_size(os.environ if environ is None else environ)


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
    worker.check_world_size(world_size)
    mpirun = mpirun or find_mpirun()
    if mpirun is None:
        raise MPIRunNotFound(
            "mpirun not found. Install MPICH with `pip install mpich` (Linux, macOS) "
            "or Open MPI from your system's packages, then try again."
        )
    plugin = worker.check_backend(backend)
    show_ranks = worker.ranks_to_show(show, world_size)

    with tempfile.TemporaryDirectory(prefix="course-mpi-") as workdir:
        job = worker.Job(world_size, workdir, backend, timeout, threads=1, launcher="course.runtime.mpi")
        Path(workdir, "payload").write_bytes(worker.pack(fn, args, plugin))
        Path(workdir, "job").write_bytes(pickle.dumps(job))
        command = mpirun_command(mpirun, world_size) + [sys.executable, "-m", "course.runtime.mpi", workdir]
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
            worker.replay_output(job, show_ranks)
            stuck = [r for r in range(world_size) if not _report_path(workdir, r).exists()]
            raise worker.WorkerTimeoutError(f"mpirun did not finish within timeout={timeout:g} s; stopped.", ranks=stuck or [0], stacks={})
        worker.replay_output(job, show_ranks)
        reports = {r: pickle.loads(p.read_bytes()) for r in range(world_size) if (p := _report_path(workdir, r)).exists()}
        said = launcher_output.decode(errors="replace").strip()
        return worker.collect(reports, world_size, missing=f"mpirun exited with code {proc.returncode}; it said:\n{said}")


def _report_path(workdir, rank):
    return Path(workdir, f"rank{rank}.report")


def _main(workdir):
    """One rank, started by mpirun: ``python -m course.runtime.mpi FOLDER``."""
    try:
        rank, world_size = rank_and_size()
    except RuntimeError as e:
        print(f"course.runtime.mpi: {e}", file=sys.stderr)
        raise SystemExit(2)
    try:
        job = pickle.loads(Path(workdir, "job").read_bytes())
        if job.world_size != world_size:
            raise RuntimeError(f"mpirun started {world_size} ranks for a launch of {job.world_size}")
        report = worker.run_rank(rank, job, Path(workdir, "payload").read_bytes())
    except BaseException as e:  # a folder that is not a launch's
        report = worker.Report.from_exception(rank, e)
    tmp = _report_path(workdir, rank).with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(report))
    os.replace(tmp, _report_path(workdir, rank))  # whole, or not there at all
    os._exit(0 if report.ok else 1)  # no teardown: the ranks' work is done


if __name__ == "__main__":
    _main(sys.argv[1])
