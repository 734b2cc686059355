"""Run launcher commands (torchrun, mpirun, ...) as process trees: bounded in time, leaving nothing behind.

    >>> result = course.runtime.proctree.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
    ...                               "--nproc-per-node=2", "-m", "course.training.train"], timeout=120)
    >>> result.returncode, result.output.splitlines()[0]

Why not ``subprocess.run(..., timeout=...)``? On timeout it kills the process it started,
and only that one. ``torchrun`` starts its workers in sessions of their own
(``start_new_session=True``), so they would live on, orphaned, holding ports and CPU.
:func:`run_all` finds the whole tree two ways, with ``psutil``:

* it remembers every descendant of each command while they run (a look every 0.2 s);
* it marks the commands' environment (``COURSE_PROCTREE=<token>``), which every process they start
  inherits. This finds a process whose parent died before a look, re-parented to init. (Since Big
  Sur, macOS seldom shows another process's environment, psutil issue 2084: there the looks do it.)

On timeout it asks the commands to stop (``SIGTERM``: torchrun then stops its workers itself) and
waits a grace period; then, timeout or not, it kills every process of the tree still there.

``run_all`` runs several commands at the same time (two ``torchrun`` agents that
rendezvous with each other, for example) and returns when all have finished.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass

import psutil

MARK = "COURSE_PROCTREE"  # the environment variable that marks the processes of a run


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
    env = dict(os.environ if env is None else env)
    token = uuid.uuid4().hex  # a run inside a run also keeps the outer run's tokens:
    env[MARK] = " ".join({*os.environ.get(MARK, "").split(), *env.get(MARK, "").split(), token})
    procs, files, tree = [], [], {}
    try:
        for args in commands:
            out = tempfile.TemporaryFile(mode="w+b")
            files.append(out)
            procs.append(subprocess.Popen([str(a) for a in args], stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, cwd=cwd, start_new_session=True))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            tree.update(descendants([p.pid for p in procs]))
            time.sleep(0.2)  # a scan of all processes takes ~1 ms per 100 of them
        timed_out = [p.poll() is None for p in procs]
    finally:
        _stop(procs, tree, token, grace)
    results = []
    for args, proc, out, late in zip(commands, procs, files, timed_out):
        out.seek(0)
        text = out.read().decode("utf-8", errors="replace")
        out.close()
        results.append(Result(list(args), None if late else proc.returncode, text, late))
    return results


def descendants(pids) -> dict[int, psutil.Process]:
    """Every living process whose chain of parents leads to one of ``pids``."""
    found = {}
    for pid in pids:
        try:
            found.update((child.pid, child) for child in psutil.Process(pid).children(recursive=True))
        except psutil.Error:  # gone already
            pass
    return found


def marked(token: str) -> dict[int, psutil.Process]:
    """Every living process whose environment carries ``token`` (see :func:`run_all`)."""
    found = {}
    for process in psutil.process_iter():
        try:
            if token in process.environ().get(MARK, "").split():
                found[process.pid] = process
        except psutil.Error:  # gone, a zombie, or not ours to read
            pass
    return found


def _stop(procs, tree, token, grace):
    tree.update(descendants([p.pid for p in procs]))  # and look again while they shut down
    running = [p for p in procs if p.poll() is None]
    for p in running:
        _signal_group(p.pid, signal.SIGTERM)  # torchrun stops its workers on SIGTERM
    end = time.monotonic() + grace
    while any(p.poll() is None for p in running) and time.monotonic() < end:
        tree.update(descendants([p.pid for p in running]))
        time.sleep(0.05)
    tree.update(descendants([p.pid for p in procs]))
    for p in procs:
        if p.poll() is None:  # not yet reaped, so its process group id cannot have been reused
            _signal_group(p.pid, signal.SIGKILL)
            p.kill()
        p.wait()
    for _ in range(20):  # look again after each round: a process may start another one before it dies
        left = {**tree, **marked(token)}
        left.update(descendants(list(left)))  # before they die: then their children are re-parented
        left = [process for process in left.values() if _alive(process)]
        if not left:
            break
        for process in left:
            _signal_group(process.pid, signal.SIGKILL)  # each torchrun worker leads its own process group
            try:
                process.kill()
            except psutil.Error:
                pass
        time.sleep(0.05)


def _alive(process):
    try:  # is_running: still the same process, not a new one that got its pid
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal_group(pid, sig):
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError, AttributeError):  # gone, or Windows
        pass
