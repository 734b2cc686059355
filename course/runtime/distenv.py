"""Where am I in the job? Read rank, world size and rendezvous from whichever launcher started us.

Every launcher tells a process its place through environment variables, each with its own names:

==============  ====================  ====================  ==========================  ============================================
launcher        rank                  world size            local rank                  rendezvous address
==============  ====================  ====================  ==========================  ============================================
torchrun        RANK                  WORLD_SIZE            LOCAL_RANK                  MASTER_ADDR/PORT
Slurm ``srun``  SLURM_PROCID          SLURM_NTASKS          SLURM_LOCALID               first host of SLURM_JOB_NODELIST
Open MPI        OMPI_COMM_WORLD_RANK  OMPI_COMM_WORLD_SIZE  OMPI_COMM_WORLD_LOCAL_RANK  MASTER_ADDR, or 127.0.0.1 on one node
MPICH (Hydra)   PMI_RANK              PMI_SIZE              MPI_LOCALRANKID             MASTER_ADDR, or 127.0.0.1 on one node
course.launch   RANK                  WORLD_SIZE            LOCAL_RANK                  none: a FileStore (COURSE_LAUNCHER names it)
==============  ====================  ====================  ==========================  ============================================

:func:`discover` turns any of them into one :class:`DistEnv`. It reads variables and nothing
else (no torch): whether a process group already exists is the caller's question
(``dist.is_initialized()``; ``course.launch`` makes one unless ``init_process_group=False``,
and then it sets ``MASTER_ADDR``/``MASTER_PORT`` too). :data:`MPI_VARIABLES` is the one list
of MPI's names; :mod:`course.runtime.mpi` reads it too.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

DEFAULT_PORT = 29500

#: Each MPI family's names for (rank, world size, local rank, local world size).
MPI_VARIABLES = {
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # also Intel MPI (Hydra)
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "pmix": ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),  # other PMIx launchers
}


class NoLauncherError(RuntimeError):
    """No launcher's variables are set: this process was not started by torchrun, Slurm, MPI or course.launch."""


@dataclass(frozen=True)
class DistEnv:
    launcher: str  # "course.launch", "torchrun", "slurm", "openmpi", "mpich", "pmix"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    @property
    def node_rank(self) -> int:
        return self.rank // self.local_world_size

    def export(self, environ=os.environ):
        """Set torchrun's variables, so that ``init_process_group("env://")`` works."""
        environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
            LOCAL_WORLD_SIZE=str(self.local_world_size),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
        )


def discover(environ=None) -> DistEnv:
    """Read the launcher's environment (``os.environ`` by default). The innermost launcher wins:
    torchrun inside an ``srun`` allocation is torchrun."""
    env = os.environ if environ is None else environ
    if "COURSE_LAUNCHER" in env and "RANK" in env:  # course.launch, course.runtime.mpi
        world_size = _int(env, "WORLD_SIZE")
        return _checked(DistEnv(env["COURSE_LAUNCHER"], _int(env, "RANK"), world_size, _int(env, "LOCAL_RANK", 0),
                                _int(env, "LOCAL_WORLD_SIZE", world_size), env.get("MASTER_ADDR", ""),
                                _int(env, "MASTER_PORT", 0)))
    if "RANK" in env and "WORLD_SIZE" in env:
        return _from(env, "torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    slurm = "SLURM_PROCID" in env and "SLURM_NTASKS" in env
    for family, names in MPI_VARIABLES.items():
        # srun's MPI plugins give its tasks PMI_RANK (pmi2) or PMIX_RANK (pmix) too, but not the local
        # rank that mpirun's processes get: without it, a Slurm task is Slurm's.
        if names[0] in env and not (slurm and names[2] not in env):
            return _from(env, family, *names)
    if slurm:
        return _from_slurm(env)
    raise NoLauncherError(
        "No launcher environment found. Start this script with torchrun "
        "(torchrun --nproc-per-node=2 script.py), srun, mpirun, or call it through course.launch."
    )


def mpi_rank_and_size(environ) -> tuple[int, int]:
    """(rank, world size) from whichever MPI family's variables are set."""
    for rank, size, _, _ in MPI_VARIABLES.values():
        if rank in environ and size in environ:
            return int(environ[rank]), int(environ[size])
    names = ", ".join(names[0] for names in MPI_VARIABLES.values())
    raise RuntimeError(f"Not started by mpirun: none of {names} is set.")


def _int(env, name, default=None):
    value = env.get(name)
    if value is None:
        if default is None:
            raise NoLauncherError(f"{name} is not set, but the launcher's other variables are.")
        return default
    try:
        return int(value)
    except ValueError:
        raise NoLauncherError(f"{name}={value!r} is not a whole number.") from None


def _from(env, launcher, rank, size, local_rank, local_size):
    world_size = _int(env, size)
    local_world_size = _int(env, local_size, default=world_size)
    addr = env.get("MASTER_ADDR")
    if addr is None:
        if local_world_size != world_size:
            raise NoLauncherError(f"{launcher} on several nodes: set MASTER_ADDR to rank 0's host name.")
        addr = "127.0.0.1"
    return _checked(DistEnv(launcher, _int(env, rank), world_size, _int(env, local_rank, default=0),
                            local_world_size, addr, _int(env, "MASTER_PORT", default=DEFAULT_PORT)))


def _from_slurm(env):
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise NoLauncherError("SLURM_JOB_NODELIST is not set: run under srun or sbatch.")
    world_size = _int(env, "SLURM_NTASKS")
    tasks_per_node = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE") or str(world_size)
    job_id = _int(env, "SLURM_JOB_ID", default=0)
    return _checked(DistEnv(
        "slurm", _int(env, "SLURM_PROCID"), world_size, _int(env, "SLURM_LOCALID", default=0),
        int(re.match(r"\d+", tasks_per_node).group()),  # "4(x2)" = 4 tasks on each of 2 nodes
        env.get("MASTER_ADDR") or expand_nodelist(nodelist)[0],
        _int(env, "MASTER_PORT", default=15000 + job_id % 20000),  # same on every node of the job
    ))


def _checked(d: DistEnv) -> DistEnv:
    if not (0 <= d.rank < d.world_size and 0 <= d.local_rank < d.local_world_size <= d.world_size):
        raise NoLauncherError(f"inconsistent {d.launcher} environment: {d}")
    return d


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed host list: ``"node[01-03,7],gpu5"`` ->
    ``["node01", "node02", "node03", "node7", "gpu5"]`` (zero padding kept)."""
    hosts = []
    for prefix, ranges, suffix in re.findall(r"([^,\[]+)(?:\[([^\]]+)\])?([^,\[]*)", nodelist):
        if not ranges:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{width}d}{suffix}")
    if not hosts:
        raise NoLauncherError(f"cannot read the Slurm node list {nodelist!r}")
    return hosts
