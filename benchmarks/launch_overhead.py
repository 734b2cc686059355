"""Launch overhead: course.launch's start methods vs torch.multiprocessing.spawn vs torchrun.

course.launch is timed with each start method, side by side in one run: fork (Linux without
a GPU), forkserver (Linux with a CUDA GPU; its first launch starts the server, which imports
torch, so it is shown apart from the later ones) and spawn (macOS, Windows). The job is
trivial (init the process group, one all_reduce, return), so the time is
the cost of starting ranks and their rendezvous. Wall time from the call to the
results; medians over repeated runs. For course.launch also the CPU time of the
notebook's process and its ranks together: on a machine that other work keeps busy,
wall times grow with the load, CPU time much less (on an idle 2-core machine a
4-rank launch cannot take less wall time than about half its CPU time).

    python benchmarks/launch_overhead.py [--repeats 10] [--ranks 2 4] [--quick]
"""

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import course  # noqa: E402

SPAWN_SCRIPT = textwrap.dedent(
    """
    import json, os, socket, sys, time
    import torch, torch.distributed as dist, torch.multiprocessing as mp

    def worker(rank, world_size, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        t = torch.ones(1)
        dist.all_reduce(t)
        dist.destroy_process_group()

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    if __name__ == "__main__":
        world_size, repeats = int(sys.argv[1]), int(sys.argv[2])
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            mp.spawn(worker, args=(world_size, free_port()), nprocs=world_size)
            times.append(time.perf_counter() - start)
        print(json.dumps(times))
    """
)

TORCHRUN_JOB = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    """
)


def trivial(rank, world_size):
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def cpu_seconds():
    """CPU time (user + system) of this process and its finished children so far."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def bench_course(world_size, repeats, cpu, start_method="fork", warmup=1):
    def once():
        start = cpu_seconds()
        course.launch(trivial, world_size, show=None, start_method=start_method)
        cpu.append(cpu_seconds() - start)

    return common.timed(once, repeats, warmup)


def first_forkserver_launch(world_size):
    """The first forkserver launch of this process: it starts the server (which imports torch).
    Returns its time and its name in the table (in a process that already has a server, e.g. a
    test run, the launch is timed but does not start one)."""
    running = any("multiprocessing.forkserver" in " ".join(p.cmdline()) for p in psutil.Process().children())
    start = time.perf_counter()
    course.launch(trivial, world_size, show=None, start_method="forkserver")
    name = "course.launch (forkserver, first: " + ("the server was already running)" if running else "starts the server)")
    return time.perf_counter() - start, name


def bench_spawn(world_size, repeats, workdir, warmup=1):
    script = Path(workdir, "spawn_job.py")
    script.write_text(SPAWN_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), str(world_size), str(warmup + repeats)],
        capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    import json

    return json.loads(out.stdout.strip().splitlines()[-1])[warmup:]  # drop the warm-up


def bench_torchrun(world_size, repeats, workdir):
    script = Path(workdir, "torchrun_job.py")
    script.write_text(TORCHRUN_JOB)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, capture_output=True, check=True, env=env)
        times.append(time.perf_counter() - start)
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes (default 2 4)")
    parser.add_argument("--quick", action="store_true", help="one run of each, 1 rank, no warm-up for mp.spawn (smoke test: times nothing well)")
    args = parser.parse_args(argv)
    # --quick only proves that every method runs: each extra rank or run costs a torch import (seconds).
    repeats, sizes, spawn_warmup = (1, [1], 0) if args.quick else (args.repeats, args.ranks, 1)
    torch.set_num_threads(common.cores())
    (torch.randn(256, 256) @ torch.randn(256, 256)).sum()  # a multi-threaded op, as a notebook would have run

    common.header("Launch overhead: call to results, trivial job (init + one all_reduce)")
    rows, medians = [], {}
    few = max(1, repeats // 3)  # for the methods that take seconds per launch
    with tempfile.TemporaryDirectory() as workdir:
        seconds, first = first_forkserver_launch(max(sizes))
        rows.append([first, max(sizes), 1, f"{seconds:.3f}", f"{seconds:.3f}", "-"])
        for n in sizes:
            cpu = {}
            for name, fn in [
                ("course.launch (fork)", lambda c: bench_course(n, repeats, c)),
                ("course.launch (forkserver, later)", lambda c: bench_course(n, repeats, c, "forkserver")),
                ("course.launch (spawn)", lambda c: bench_course(n, few, c, "spawn", warmup=0)),
                ("mp.spawn", lambda c: bench_spawn(n, few, workdir, spawn_warmup)),
                ("torchrun (whole command)", lambda c: bench_torchrun(n, few, workdir)),
            ]:
                times = fn(cpu.setdefault(name, []))
                medians[name, n] = common.median(times)
                # [1:]: not the warm-up. The ranks' CPU counts only for forked children of this process:
                # a forkserver's ranks are the server's children, so their CPU time is not seen here.
                cpu_s = f"{common.median(cpu[name][1:]):.3f}" if name.startswith("course.launch (fork)") and cpu[name][1:] else "-"
                rows.append([name, n, len(times), f"{common.median(times):.3f}", f"{min(times):.3f}", cpu_s])
    common.table(["method", "ranks", "runs", "median s", "min s", "cpu s"], rows)

    n = max(sizes)
    fork, served = medians["course.launch (fork)", n], medians["course.launch (forkserver, later)", n]
    spawn, mp_spawn = medians["course.launch (spawn)", n], medians["mp.spawn", n]
    print(f"\ncourse.launch with {n} ranks, fork: {fork:.3f} s (target <= 0.15 s: {'met' if fork <= 0.15 else 'MISSED'}); "
          f"{mp_spawn / fork:.0f}x faster than mp.spawn (target >= 10x: {'met' if mp_spawn / fork >= 10 else 'MISSED'})")
    print(f"course.launch with {n} ranks, forkserver after the first launch: {served:.3f} s "
          f"(target <= 0.3 s: {'met' if served <= 0.3 else 'MISSED'}); {spawn / served:.0f}x faster than "
          f"course.launch with spawn (target >= 10x: {'met' if spawn / served >= 10 else 'MISSED'})")


if __name__ == "__main__":
    main()
