"""course.runtime.distenv: every launcher's environment, without the launchers."""

import pytest

from course import launch
from course.runtime.distenv import DistEnv, NoLauncherError, discover, expand_nodelist


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-04]", ["node01", "node02", "node03", "node04"]),
        ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),
        ("node[001-002,010],login5", ["node001", "node002", "node010", "login5"]),
        ("rack1-n[1-2]-ib,rack2-n7", ["rack1-n1-ib", "rack1-n2-ib", "rack2-n7"]),
    ],
)
def test_slurm_node_lists_expand(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_slurm_two_nodes_four_tasks_each():
    env = {
        "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_NODELIST": "gpu-node[07-08]", "SLURM_NODEID": "1", "SLURM_JOB_ID": "123456",
    }
    d = discover(env)
    assert d == DistEnv("slurm", 5, 8, 1, 4, "gpu-node07", 15000 + 123456 % 20000)
    assert d.node_rank == 1
    assert discover({**env, "MASTER_PORT": "29999"}).master_port == 29999


def test_srun_with_an_mpi_plugin_is_still_slurm():
    env = {
        "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_NODELIST": "gpu-node[07-08]", "SLURM_JOB_ID": "123456",
    }
    slurm = discover(env)
    assert discover({**env, "PMI_RANK": "5", "PMI_SIZE": "8"}) == slurm  # srun --mpi=pmi2
    assert discover({**env, "PMIX_RANK": "5"}) == slurm  # srun --mpi=pmix
    # mpirun inside an allocation: its processes carry the batch step's SLURM_PROCID and their own local rank
    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert discover(ompi).launcher == "openmpi" and discover(ompi).rank == 3


def test_torchrun_variables_and_torchrun_inside_slurm_wins():
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29400"}
    expected = DistEnv("torchrun", 3, 4, 1, 2, "10.1.2.3", 29400)
    assert discover(torchrun) == expected
    assert discover({**torchrun, "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]"}) == expected


def test_open_mpi_and_mpich_on_one_node_default_to_loopback():
    ompi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert discover(ompi) == DistEnv("openmpi", 1, 2, 1, 2, "127.0.0.1", 29500)
    mpich = {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2", "MASTER_PORT": "4000"}
    assert discover(mpich) == DistEnv("mpich", 0, 2, 0, 2, "127.0.0.1", 4000)


def test_mpi_on_several_nodes_needs_master_addr():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(NoLauncherError, match="set MASTER_ADDR"):
        discover(env)
    assert discover({**env, "MASTER_ADDR": "head"}).master_addr == "head"


@pytest.mark.parametrize(
    "env, message",
    [
        ({}, "No launcher environment found"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "not a whole number"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "inconsistent"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, "SLURM_JOB_NODELIST is not set"),
    ],
)
def test_missing_or_broken_environments_say_what_to_do(env, message):
    with pytest.raises(NoLauncherError, match=message):
        discover(env)


def test_export_gives_torchrun_variables():
    target = {}
    DistEnv("slurm", 5, 8, 1, 4, "gpu-node07", 23456).export(target)
    assert target == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                      "MASTER_ADDR": "gpu-node07", "MASTER_PORT": "23456"}


def test_inside_course_launch_the_process_group_is_reported():
    results = launch(lambda rank, world_size: discover(), 2, show=None)
    assert [(d.launcher, d.rank, d.world_size, d.local_rank) for d in results] == [
        ("course.launch", 0, 2, 0), ("course.launch", 1, 2, 1)]
