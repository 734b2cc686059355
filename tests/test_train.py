"""course.training.train: one script under every launcher (torchrun, two torchrun agents, Slurm, mpirun,
course.launch), elastic restarts that resume exactly, and failure reports.

Every run trains the same 24 steps on 2 ranks, so every launcher must end with the same weights,
bit for bit, as the run under course.launch (the ``reference`` fixture). Every command runs
through course.runtime.proctree with a timeout, and nothing it started may be left afterwards.
"""

import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

import course.training.train
from course.runtime import proctree
from course.training.checkpoint import load_checkpoint
from course.runtime.launcher import WorkerError, launch

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["--steps", "24", "--batch-size", "64", "--save-every", "8", "--log-every", "8"]
TIMEOUT = 300  # seconds for one group of commands run at once; healthy: 15-70 s on 2 busy cores
LAUNCHER_VARIABLES = re.compile(r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|MASTER_ADDR|MASTER_PORT"
                                r"|SLURM_.*|OMPI_.*|PMI_.*|PMIX_.*|MPI_LOCAL.*|TORCHELASTIC_.*|TORCH_DISTRIBUTED_DEBUG)$")


def free_ports(n):
    """``n`` different free ports (all bound at once, so no two are the same)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def clean_env(**extra):
    """This environment without any launcher's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not LAUNCHER_VARIABLES.match(k)}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="")  # gloo on the CPU, like the reference, even on a GPU machine
    if sys.platform == "linux":
        env["GLOO_SOCKET_IFNAME"] = "lo"  # both "nodes" are this machine
    env.update({k: str(v) for k, v in extra.items()})
    return env


def torchrun(*options):
    return [sys.executable, "-m", "torch.distributed.run", *options, "-m", "course.training.train", *TRAIN]


def weights(path):
    return load_checkpoint(path)["model"]


def same(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def ok(result):
    assert not result.timed_out, f"timed out:\n{result.output[-3000:]}"
    assert result.returncode == 0, result.output[-3000:]
    return result.output


def leftovers(folder):
    """Kill every process whose command line names ``folder``; return what they were."""
    left = [p for p in psutil.process_iter(["pid", "cmdline"]) if str(folder) in " ".join(p.info["cmdline"] or [])]
    for p in left:
        p.kill()
    return [p.info for p in left]


@pytest.fixture(autouse=True)
def nothing_left_behind(tmp_path):
    """Every command of a test names a file in tmp_path: no process with it may survive the test."""
    yield
    left = leftovers(tmp_path)
    assert not left, f"processes left behind: {left}"


def _main(rank, world_size, argv):
    return course.training.train.main(argv)


@pytest.fixture(scope="module")
def reference():
    """The final weights of the 24 steps on 2 ranks under course.launch (no torchrun)."""
    results = launch(_main, 2, TRAIN, show=None, timeout=120)
    assert same(results[0], results[1])
    return results[0]


# ------------------------------------------------------------------ set-up, without launching


def test_without_a_launcher_it_says_how_to_start_it(tmp_path, monkeypatch):
    for name in [k for k in os.environ if LAUNCHER_VARIABLES.match(k)]:
        monkeypatch.delenv(name)
    with pytest.raises(SystemExit) as exit:  # sys.exit("error: ..."): Python prints it, no traceback
        course.training.train.main(["--out", str(tmp_path / "w.pt")])
    assert str(exit.value.code).startswith("error: No launcher environment found") and "torchrun" in str(exit.value.code)
    assert not (tmp_path / "w.pt").exists()


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--save-every", "-1"], ["--crash-how", "explode"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        course.training.train.parse_args(argv)
    assert "error" in capsys.readouterr().err


SLURM_4_NODES = {  # what srun gives task 13 of 16 (4 nodes x 4 tasks) in job 734519
    "SLURM_JOB_ID": "734519", "SLURM_JOB_NODELIST": "node[01-04]", "SLURM_NODELIST": "node[01-04]",
    "SLURM_NNODES": "4", "SLURM_NTASKS": "16", "SLURM_TASKS_PER_NODE": "4(x4)", "SLURM_NTASKS_PER_NODE": "4",
    "SLURM_PROCID": "13", "SLURM_LOCALID": "1", "SLURM_NODEID": "3", "SLURMD_NODENAME": "node04",
    "SLURM_CPUS_PER_TASK": "8", "SLURM_JOB_NAME": "ddp-course", "SLURM_STEP_ID": "0",
}


@pytest.fixture
def fake_init(monkeypatch):
    """Record what setup() asks init_process_group for, instead of connecting to node01."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "placeholder")  # restored after the test; setup() exports them
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: calls.append((a, kw)))
    return calls


def test_setup_from_a_slurm_environment_with_a_compressed_node_list(fake_init):
    env, device = course.training.train.setup(timeout=30, environ=SLURM_4_NODES)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.node_rank) == ("slurm", 13, 16, 1, 3)
    assert device == torch.device("cpu") or torch.cuda.is_available()
    (args, kwargs), = fake_init
    assert kwargs["init_method"] == "env://" and kwargs["timeout"].total_seconds() == 30
    expected = {"RANK": "13", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                "MASTER_ADDR": "node01", "MASTER_PORT": str(15000 + 734519 % 20000)}
    assert {k: os.environ[k] for k in expected} == expected


def test_setup_picks_nccl_and_this_ranks_gpu_when_every_local_rank_has_one(fake_init, monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        env, device = course.training.train.setup(environ=SLURM_4_NODES)
        assert torch.are_deterministic_algorithms_enabled()  # exact resume on a GPU needs it
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
    (args, kwargs), = fake_init
    assert args == ("nccl",) and device == torch.device("cuda", 1) and chosen == [device]
    assert kwargs["device_id"] == device


@pytest.mark.parametrize("available, count, local_world_size, expected", [
    (False, 0, 2, ("gloo", "cpu")),
    (True, 2, 2, ("nccl", "cuda:1")),
    (True, 8, 4, ("nccl", "cuda:1")),
    (True, 1, 2, ("gloo", "cpu")),  # 2 ranks cannot share 1 GPU with NCCL
])
def test_choose_device(monkeypatch, available, count, local_world_size, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    backend, device = course.training.train.choose_device(1, local_world_size)
    assert (backend, str(device)) == expected


# ------------------------------------------------------------------ real runs, every launcher
#
# A launcher run costs mostly process start-up: torchrun's agent and every rank import torch
# (seconds of CPU each); the 24 steps take about a second. So there are few jobs, and one job
# proves several things: the elastic run is also the test of a c10d rendezvous between two
# agents and of a SIGKILLed rank. Independent jobs run at the same time (proctree.run_all),
# at most 4 ranks at once.


def run_jobs(commands: dict, base, env=None, timeout=TIMEOUT) -> dict:
    """Run ``{name: command}`` all at once; return ``{name: proctree.Result}``. Every command
    names a file under ``base``: afterwards no process with it may be left."""
    names = list(commands)
    results = proctree.run_all([commands[n] for n in names], timeout, env or clean_env())
    left = leftovers(base)
    assert not left, f"processes left behind: {left}"
    return dict(zip(names, results))


def test_under_course_launch_a_crash_names_the_rank():
    with pytest.raises(WorkerError) as failure:
        launch(_main, 2, TRAIN + ["--crash-at", "4"], show=None, timeout=60)
    assert failure.value.rank == 1
    assert failure.value.failed[1] == "RuntimeError: simulated failure on rank 1 after step 4"


def two_agents(node_rank_options, out, *train_args, log_dir=None):
    """The commands you would type on two hosts (here both this one): a torchrun agent per 'node',
    1 rank each; each agent writes its --log-dir and --out with the node's number."""
    return [torchrun("--nnodes=2", "--nproc-per-node=1", f"--node-rank={node}", *node_rank_options,
                     *([f"--log-dir={log_dir}{node}"] if log_dir else []))
            + [*train_args, "--out", f"{out}{node}.pt"] for node in (0, 1)]


@pytest.fixture(scope="module")
def failing_jobs(tmp_path_factory):
    """Two torchrun jobs at once, each two agents (like two nodes, 1 rank each), in which a rank fails:

    * "elastic": a c10d rendezvous, --max-restarts=1; rank 1 is killed (SIGKILL) after step 20.
      Its agent restarts it, the other agent restarts rank 0 (the group changed), and the new
      ranks resume from the checkpoint of step 16;
    * "record": a static rendezvous (node 0 hosts the store; each agent's --node-rank decides its
      ranks), --max-restarts=0; rank 1 raises after step 4.

    (`torchrun --standalone` runs in notebook 08, whose job crashes, restarts and must end with
    course.launch's weights bit for bit.)"""
    base = tmp_path_factory.mktemp("failing")
    elastic, record = base / "elastic", base / "record"
    elastic_port, static_port = free_ports(2)
    elastic_agents = two_agents(["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{elastic_port}",
                                 "--rdzv-id=elastic-job", "--max-restarts=1"], elastic / "w",
                                "--checkpoint", elastic / "ckpt.pt", "--crash-at", "20", "--crash-how", "kill",
                                log_dir=elastic / "logs")
    static_agents = two_agents(["--master-addr=127.0.0.1", f"--master-port={static_port}", "--max-restarts=0"],
                               record / "w", "--checkpoint", record / "ckpt.pt", "--crash-at", "4",
                               log_dir=record / "logs")
    commands = {("elastic", 0): elastic_agents[0], ("elastic", 1): elastic_agents[1],
                ("record", 0): static_agents[0], ("record", 1): static_agents[1]}
    results = run_jobs(commands, base, clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1))
    return {job: ([results[job, 0], results[job, 1]], folder) for job, folder in (("elastic", elastic), ("record", record))}


@pytest.mark.slow  # two torchrun agents, each rank a fresh interpreter: in .ci/run's slow part
def test_two_agents_restart_after_a_lost_rank_and_end_with_the_same_weights(failing_jobs, reference):
    """c10d rendezvous: the ranks are given out by the rendezvous and --node-rank is ignored.
    The first attempt (steps 1-20) and the resumed one (from step 16) together end with the
    same weights as the run that never failed."""
    results, folder = failing_jobs["elastic"]
    outputs = [ok(r) for r in results]
    first = [re.search(r"rank (\d): local rank 0, node (\d)", out).groups() for out in outputs]
    assert sorted(first) == [("0", "0"), ("1", "1")]  # whichever agent got which rank
    assert [len(re.findall(r"rank \d: local rank 0, node \d", out)) for out in outputs] == [2, 2]  # two attempts
    everything = "".join(outputs)
    assert everything.count("torchrun: 2 ranks, gloo on cpu") == 2
    assert everything.count("rank 1: crashing after step 20 (kill)") == 1
    assert everything.count("resumed from step 16 (epoch 0, 16 batches of it done)") == 1
    written = [folder / f"w{n}.pt" for n in (0, 1) if (folder / f"w{n}.pt").exists()]
    assert len(written) == 1 and same(weights(written[0]), reference)  # rank 0 writes, on one node


def error_files(log_dir, attempt, local_rank):
    """The error file torchrun gave one worker (in --log-dir): @record writes the traceback there."""
    return list(Path(log_dir).glob(f"*/attempt_{attempt}/{local_rank}/error.json"))


@pytest.mark.slow  # failing_jobs: torchrun agents, in .ci/run's slow part
def test_a_killed_rank_has_no_traceback_to_report(failing_jobs):
    """SIGKILL runs no Python: torchrun sees exit code -9 and no error file; its report then
    says only which signal, where a raising rank's report holds its traceback (@record)."""
    results, folder = failing_jobs["elastic"]
    node, = [n for n in (0, 1) if "rank 1: crashing after step 20 (kill)" in results[n].output]
    # That node's agent has one rank, the killed one: it logs the failure (and restarts it).
    assert re.search(r"failed \(exitcode: -9\) local_rank: 0 \(pid: \d+\)", results[node].output), results[node].output[-3000:]
    assert error_files(f"{folder / 'logs'}{node}", 0, 0) == []  # the @record test finds its file this way
    # What torchrun's report says for such a rank (it prints one only when it gives up):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    report = ChildFailedError("course.training.train", {1: ProcessFailure(1, 4242, -9, str(folder / "no-such-file.json"))})
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\n\s*exitcode\s*: -9", report.format_msg())
    assert "Signal 9 (SIGKILL) received by PID 4242" in report.format_msg()


@pytest.mark.slow  # failing_jobs: torchrun agents, in .ci/run's slow part
def test_two_torchrun_agents_with_a_static_rendezvous(failing_jobs):
    results, folder = failing_jobs["record"]
    outputs = [r.output for r in results]
    assert "torchrun: 2 ranks, gloo on cpu" in outputs[0]  # rank 0 says so once the agents' ranks found each other
    ranks_and_nodes = [re.search(r"rank (\d): local rank 0, node (\d)", out).groups() for out in outputs]
    assert ranks_and_nodes == [("0", "0"), ("1", "1")]  # each agent's --node-rank decided its rank


@pytest.mark.slow  # failing_jobs: torchrun agents, in .ci/run's slow part
def test_record_puts_the_failing_ranks_traceback_in_torchruns_report(failing_jobs):
    results, folder = failing_jobs["record"]
    node1 = results[1]  # the agent of rank 1 (static rendezvous: --node-rank=1)
    assert not node1.timed_out and node1.returncode == 1, node1.output[-3000:]
    report = node1.output[node1.output.index("course.training.train FAILED"):]
    failures = re.split(r"\n\[\d+\]:\n", report)[1:]  # one section per failed rank
    crashed = [f for f in failures if re.search(r"rank\s*: 1 \(local_rank: 0\)", f)]
    assert len(crashed) == 1
    assert "error_file: <N/A>" not in crashed[0]  # @record wrote it
    assert len(error_files(f"{folder / 'logs'}1", 0, 0)) == 1
    assert 'in crash\n      raise RuntimeError(f"simulated failure' in crashed[0]
    assert "RuntimeError: simulated failure on rank 1 after step 4" in crashed[0]
    assert not results[0].timed_out and results[0].returncode == 1  # rank 0 lost its peer: its agent fails too
    assert not list(folder.glob("w*.pt"))


FAKE_SRUN = """\
#!{python}
# A stand-in for Slurm's srun on one node: start SLURM_NTASKS copies of the command,
# each with its SLURM_PROCID and SLURM_LOCALID, and return the worst exit code.
import os, subprocess, sys
args = sys.argv[1:]
while args and args[0].startswith("-"):
    args.pop(0)  # srun's own options
procs = [subprocess.Popen(args, env={{**os.environ, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i), "SLURM_NODEID": "0"}})
         for i in range(int(os.environ["SLURM_NTASKS"]))]
sys.exit(max(p.wait() for p in procs))
"""


def find_mpirun():
    here = Path(sys.executable).with_name("mpirun")
    return str(here) if here.exists() else shutil.which("mpirun")


@pytest.fixture(scope="module")
def slurm_and_mpi_jobs(tmp_path_factory):
    """scripts/train.sbatch under a fake srun, and mpirun (if there is one), at once."""
    base = tmp_path_factory.mktemp("slurm-mpi")
    bin_dir = base / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(FAKE_SRUN.format(python=sys.executable))
    srun.chmod(0o755)
    slurm_port, mpi_port = free_ports(2)
    slurm_env = dict(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHON=sys.executable,
        CHECKPOINT=base / "ckpt" / "job.pt", MASTER_PORT=slurm_port,
        # what sbatch sets for a 1-node, 2-task job
        SLURM_JOB_ID=4242, SLURM_JOB_NODELIST="localhost", SLURM_NNODES=1, SLURM_NTASKS=2,
        SLURM_TASKS_PER_NODE=2, SLURM_CPUS_PER_TASK=1,
    )
    # Both commands get clean_env(); `env NAME=value ... command` adds each one's own variables.
    commands = {"slurm": ["env", *[f"{k}={v}" for k, v in slurm_env.items()],
                          "bash", ROOT / "scripts" / "train.sbatch", *TRAIN, "--out", base / "slurm.pt"]}
    mpirun = find_mpirun()
    if mpirun is not None:
        version = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30).stdout
        if "Open MPI" in version:  # runs as root only when told to; -x passes variables on
            flags = ["--allow-run-as-root", "--oversubscribe", "-x", "MASTER_PORT", "-x", "PYTHONPATH",
                     "-x", "GLOO_SOCKET_IFNAME", "-x", "OMP_NUM_THREADS"]
        else:  # MPICH's Hydra passes the whole environment on
            flags = []
        commands["mpi"] = ["env", f"MASTER_PORT={mpi_port}", mpirun, *flags, "-n", "2", sys.executable,
                           "-m", "course.training.train", *TRAIN, "--out", base / "mpi.pt"]
    results = run_jobs(commands, base)
    return results, base


@pytest.mark.slow  # a fake srun starts torchrun agents: in .ci/run's slow part
def test_sbatch_template_under_a_fake_srun(slurm_and_mpi_jobs, reference):
    results, folder = slurm_and_mpi_jobs
    out = ok(results["slurm"])
    assert "slurm: 2 ranks, gloo on cpu" in out
    assert same(weights(folder / "slurm.pt"), reference)
    assert load_checkpoint(folder / "ckpt" / "job.pt")["step"] == 24


def test_sbatch_template_asks_for_what_it_says():
    text = (ROOT / "scripts" / "train.sbatch").read_text()
    options = dict(re.findall(r"^#SBATCH --([\w-]+)=?(\S*)", text, re.M))
    assert options["nodes"] == "2" and options["ntasks-per-node"] == options["gpus-per-node"] == "4"
    assert "requeue" in options
    assert subprocess.run(["bash", "-n", ROOT / "scripts" / "train.sbatch"]).returncode == 0


@pytest.mark.slow  # slurm_and_mpi_jobs: in .ci/run's slow part
@pytest.mark.skipif(find_mpirun() is None, reason="mpirun not found: pip install mpich, or install Open MPI or MPICH")
def test_mpirun(slurm_and_mpi_jobs, reference):
    results, folder = slurm_and_mpi_jobs
    out = ok(results["mpi"])
    assert re.search(r"(openmpi|mpich): 2 ranks, gloo on cpu", out)
    assert same(weights(folder / "mpi.pt"), reference)


# ------------------------------------------------------------------ course.runtime.proctree


def _sleeper(tmp_path):
    """Python code that creates tmp_path/started, then sleeps for 10 minutes."""
    return f"import time; open({str(tmp_path / 'started')!r}, 'w').close(); time.sleep(600)"


def test_proctree_timeout_stops_the_whole_tree(tmp_path):
    """A command whose child hides in a session of its own (as torchrun's workers do)."""
    child = _sleeper(tmp_path)
    parent = textwrap.dedent(f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", {child!r}, {str(tmp_path)!r}], start_new_session=True)
        time.sleep(600)
    """)
    result = proctree.run([sys.executable, "-c", parent, str(tmp_path)], timeout=3, env=clean_env())
    assert result.timed_out and result.returncode is None
    assert (tmp_path / "started").exists()  # the child ran; nothing_left_behind checks it is gone


def test_proctree_stops_what_a_command_starts_while_it_shuts_down(tmp_path):
    """A command that starts a process as it handles SIGTERM, in a session of its own, then exits."""
    child = _sleeper(tmp_path)
    parent = textwrap.dedent(f"""
        import signal, subprocess, sys, time
        def stop(signum, frame):
            subprocess.Popen([sys.executable, "-c", {child!r}, {str(tmp_path)!r}], start_new_session=True)
            time.sleep(1)
            sys.exit(1)
        signal.signal(signal.SIGTERM, stop)
        open({str(tmp_path / 'ready')!r}, 'w').close()
        time.sleep(600)
    """)
    result = proctree.run([sys.executable, "-c", parent, str(tmp_path)], timeout=3, env=clean_env())
    assert result.timed_out and (tmp_path / "ready").exists()  # nothing_left_behind checks the child is gone


def test_proctree_stops_a_process_whose_parent_had_already_exited(tmp_path):
    """A command that starts a process in a session of its own and exits at once: the process is
    re-parented before anyone could see it as the command's child; it must not outlive the run."""
    child = _sleeper(tmp_path)
    parent = textwrap.dedent(f"""
        import os, subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", {child!r}, {str(tmp_path)!r}], start_new_session=True)
        while not os.path.exists({str(tmp_path / 'started')!r}):
            time.sleep(0.01)
    """)
    result = proctree.run([sys.executable, "-c", parent, str(tmp_path)], timeout=60, env=clean_env())
    assert result.returncode == 0 and not result.timed_out, result.output
    assert (tmp_path / "started").exists()  # nothing_left_behind checks the child is gone


def test_proctree_stops_what_a_run_inside_the_command_started(tmp_path):
    """The command itself runs a command with course.runtime.proctree, and is killed before it can stop it."""
    child = _sleeper(tmp_path)
    parent = f"from course.runtime import proctree; import sys; proctree.run([sys.executable, '-c', {child!r}], timeout=600)"
    result = proctree.run([sys.executable, "-c", parent, str(tmp_path)], timeout=4, env=clean_env())
    assert result.timed_out and (tmp_path / "started").exists()  # nothing_left_behind checks the child is gone


def test_proctree_marks_what_it_starts_and_a_run_inside_a_run_keeps_the_outer_mark(tmp_path):
    show = "import os; print(os.environ['COURSE_PROCTREE'])"
    inner = (f"from course.runtime import proctree; import os, sys; "  # an explicit env without the outer mark
             f"print(proctree.run([sys.executable, '-c', {show!r}], 60, env={{'PATH': os.environ['PATH']}}).output)")
    outer = proctree.run([sys.executable, "-c", inner, str(tmp_path)], timeout=60, env=clean_env())
    marks = outer.output.split()
    assert outer.returncode == 0 and len(set(marks)) == 2 and all(re.fullmatch("[0-9a-f]{32}", m) for m in marks), outer.output


def test_proctree_stops_a_process_that_dropped_the_environment(tmp_path):
    """``env -i``: no mark to find it by; its parent link, seen while the parent lived, finds it."""
    child = f"{sys.executable} -c 'import time; time.sleep(600)' {tmp_path}"
    result = proctree.run(["bash", "-c", f"env -i {child} & sleep 1", str(tmp_path)], timeout=60, env=clean_env())
    assert result.returncode == 0, result.output  # nothing_left_behind checks the child is gone


def test_proctree_rejects_a_string_command():
    with pytest.raises(TypeError, match="list of arguments"):
        proctree.run("torchrun --standalone train.py", timeout=5)
