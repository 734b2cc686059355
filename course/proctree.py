"""Run launcher commands (torchrun, mpirun, ...) as process trees: bounded in time, leaving nothing behind.

    >>> result = course.proctree.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
    ...                               "--nproc-per-node=2", "-m", "course.train"], timeout=120)
    >>> result.returncode, result.output.splitlines()[0]

Why not ``subprocess.run(..., timeout=...)``? On timeout it kills the process it started,
and only that one. ``torchrun`` starts its workers in sessions of their own
(``start_new_session=True``), so they would live on, orphaned, holding ports and CPU.
:func:`run_all` remembers every descendant of each command while it runs (with ``psutil``,
which tells a process from a later one that got its pid, on Linux, macOS and Windows); on timeout it
asks the commands to stop (``SIGTERM``: torchrun then stops its workers itself), and
after a grace period kills every process of the tree that is still there.

``run_all`` runs several commands at the same time (two ``torchrun`` agents that
rendezvous with each other, for example) and returns when all have finished.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass

import psutil


@dataclass
class Result:
    args: list
    returncode: int | None  # None if it was stopped at the timeout
    output: str  # stdout and stderr together, in the order written
    timed_out: bool


def run(args, timeout: float, env: dict | None = None, cwd=None) -> Result:
    """Run one command; see :func:`run_all`."""
    return run_all([args], timeout, env, cwd)[0]


def run_all(commands, timeout: float, env: dict | None = None, cwd=None, grace: float = 5.0) -> list[Result]:
    """Start every command (a list of arguments each) at once, wait for all of them.

    ``env`` replaces the environment (pass ``{**os.environ, ...}`` to extend it). Commands
    still running after ``timeout`` seconds are stopped, with every process they started.
    """
    if not commands or not all(isinstance(c, (list, tuple)) and c for c in commands):
        raise TypeError("commands must be a list of commands, each a list of arguments like ['torchrun', ...].")
    procs, files, tree = [], [], {}
    try:
        for args in commands:
            out = tempfile.TemporaryFile(mode="w+b")
            files.append(out)
            procs.append(subprocess.Popen([str(a) for a in args], stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, cwd=cwd, start_new_session=True))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            tree.update(descendants([p.pid for p in procs]))  # remember them before an orphan is re-parented
            time.sleep(0.2)  # a scan of all processes takes ~1 ms per 100 of them
        timed_out = [p.poll() is None for p in procs]
    finally:
        _stop(procs, tree, grace)
    results = []
    for args, proc, out, late in zip(commands, procs, files, timed_out):
        out.seek(0)
        text = out.read().decode("utf-8", errors="replace")
        out.close()
        results.append(Result(list(args), None if late else proc.returncode, text, late))
    return results


def _stop(procs, tree, grace):
    # Look again before each signal and while the commands shut down: a process started since the last
    # look is found only while its parent lives (then it is re-parented, and no longer a descendant).
    tree.update(descendants([p.pid for p in procs]))
    running = [p for p in procs if p.poll() is None]
    for p in running:
        _signal_group(p.pid, signal.SIGTERM)  # torchrun stops its workers on SIGTERM
    end = time.monotonic() + grace
    while any(p.poll() is None for p in running) and time.monotonic() < end:
        tree.update(descendants([p.pid for p in running]))
        time.sleep(0.05)
    tree.update(descendants([p.pid for p in procs]))
    for p in procs:
        if p.poll() is None:
            p.kill()
    for process in tree.values():
        if process.is_running():  # still the same process, not a new one that got its pid
            _signal_group(process.pid, signal.SIGKILL)  # each torchrun worker leads its own process group
            try:
                process.kill()
            except psutil.Error:
                pass
    for p in procs:
        p.wait()


def descendants(pids) -> dict[int, psutil.Process]:
    """Every living process whose chain of parents leads to one of ``pids``."""
    found = {}
    for pid in pids:
        try:
            found.update((child.pid, child) for child in psutil.Process(pid).children(recursive=True))
        except psutil.Error:  # gone already
            pass
    return found


def _signal_group(pid, sig):
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError, AttributeError):  # gone, or Windows
        pass
