"""course.runtime.mpi: ranks started by a real mpirun, talking gloo (or the traced backend).

The tests that need mpirun use the one `pip install mpich` puts next to Python (the
course's dev extra installs it on Linux and macOS) or any mpirun on PATH, and are
skipped with a message saying how to get one where there is none."""

import os
import stat
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import course
from course.runtime import mpi


@pytest.fixture(scope="module")
def mpirun():
    path = mpi.find_mpirun()
    if path is None:
        pytest.skip("mpirun not found: `pip install mpich` (part of `pip install -e .[dev]` on Linux/macOS) to run these tests")
    return path


def _fake_executable(folder, name, output):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\necho '{output}'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# ---------------------------------------------------------------- without mpirun


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({"PMI_RANK": "1", "PMI_SIZE": "4"}, (1, 4)),  # MPICH (Hydra)
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3"}, (2, 3)),  # Open MPI
        ({"PMIX_RANK": "0", "PMIX_SIZE": "2"}, (0, 2)),
    ],
)
def test_rank_and_size_come_from_the_mpi_launchers_variables(environ, expected):
    assert mpi.rank_and_size(environ) == expected


def test_outside_mpirun_there_is_no_rank_and_the_message_says_so():
    with pytest.raises(RuntimeError, match="Not started by mpirun: none of PMI_RANK, OMPI_COMM_WORLD_RANK"):
        mpi.rank_and_size({})


def test_open_mpi_gets_the_flags_it_needs_on_a_small_machine(tmp_path):
    openmpi = _fake_executable(tmp_path / "ompi", "mpirun", "mpirun (Open MPI) 5.0.11")
    command = mpi.mpirun_command(str(openmpi), 2)
    assert command[0] == str(openmpi) and command[-2:] == ["-n", "2"] and "--oversubscribe" in command
    assert ("--allow-run-as-root" in command) == (os.geteuid() == 0)
    mpich = _fake_executable(tmp_path / "mpich", "mpirun", "HYDRA build details:")
    assert mpi.mpirun_command(str(mpich), 3) == [str(mpich), "-n", "3"]


def test_find_mpirun_looks_next_to_python_first(tmp_path, monkeypatch):
    here = _fake_executable(tmp_path / "venv" / "bin", "mpirun", "")
    elsewhere = _fake_executable(tmp_path / "elsewhere", "mpirun", "")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / "python"))
    monkeypatch.setenv("PATH", str(elsewhere.parent))
    assert mpi.find_mpirun() == str(here)
    here.unlink()
    assert mpi.find_mpirun() == str(elsewhere)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert mpi.find_mpirun() is None


def test_without_mpirun_launch_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(mpi, "find_mpirun", lambda: None)
    with pytest.raises(mpi.MPIRunNotFound, match="pip install mpich"):
        mpi.launch(lambda r, w: r, 2)


def test_bad_arguments_are_refused(mpirun):
    with pytest.raises(ValueError, match="world_size"):
        mpi.launch(lambda r, w: r, 0)
    with pytest.raises(ValueError, match="Unknown backend 'nope'"):
        mpi.launch(lambda r, w: r, 2, backend="nope")


# ---------------------------------------------------------------- with a real mpirun


# Notebook 05 runs the traced backend under mpirun (its cell asserts, where mpirun exists, that the
# ranks were mpirun's and that they trace the same collectives as under course.launch, line for line).


def _fails_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("bad data on rank 1")
    announced = {os.environ[k] for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK") if k in os.environ}
    # Rank 0 first checks how it was set up (an AssertionError here would name rank 0 in the test below):
    assert (dist.get_backend(), torch.get_num_threads(), announced) == ("gloo", 1, {str(rank)}), (
        dist.get_backend(), torch.get_num_threads(), announced)
    dist.barrier()
    return rank


@pytest.mark.slow  # mpirun starts interpreters of its own, each importing torch: in .ci/run's slow part
def test_a_failing_rank_under_mpirun_raises_worker_error_naming_it(mpirun):
    """One mpirun job (mostly start-up: each rank imports torch). Rank 0 also checks that it runs gloo
    with one thread, as the rank mpirun announced; rank 1 fails. (Notebook 05 runs a job that succeeds:
    the traced backend under mpirun, with the same trace as under course.launch.)"""
    with pytest.raises(course.WorkerError) as failure:
        mpi.launch(_fails_on_rank_1, 2, timeout=180, show=None)
    error = failure.value
    assert error.rank == 1 and "AssertionError" not in error.failed.get(0, ""), error
    assert "rank 1 of 2 failed: ValueError: bad data on rank 1" in str(error)
    assert 'raise ValueError("bad data on rank 1")' in error.traceback


def test_the_rank_entry_point_outside_mpirun_exits_with_a_message(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    proc = subprocess.run([sys.executable, "-m", "course.runtime.mpi", str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "Not started by mpirun" in proc.stderr
