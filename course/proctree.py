"""Run launcher commands (torchrun, mpirun, ...) as process trees: bounded in time, leaving nothing behind.

    >>> result = course.proctree.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
    ...                               "--nproc-per-node=2", "-m", "course.train"], timeout=120)
    >>> result.returncode, result.output.splitlines()[0]

Why not ``subprocess.run(..., timeout=...)``? On timeout it kills the process it started,
and only that one. ``torchrun`` starts its workers in sessions of their own
(``start_new_session=True``), so they would live on, orphaned, holding ports and CPU. Following
parent links does not find them reliably either: a process whose parent has died is re-parented
(to init) and no longer looks like part of the tree. So :func:`run_all` marks the commands'
environment (``COURSE_PROCTREE=<token>``), which every process they start inherits. On timeout
it asks the commands to stop (``SIGTERM``: torchrun then stops its workers itself) and waits a
grace period; then, timeout or not, it kills every process that still carries the token
(``psutil`` reads it).

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
    still running after ``timeout`` seconds are stopped; no process they started outlives the call.
    """
    if not commands or not all(isinstance(c, (list, tuple)) and c for c in commands):
        raise TypeError("commands must be a list of commands, each a list of arguments like ['torchrun', ...].")
    token = uuid.uuid4().hex
    env = dict(os.environ if env is None else env)
    env[MARK] = " ".join(filter(None, [env.get(MARK), token]))  # a run inside a run keeps the outer token
    procs, files = [], []
    try:
        for args in commands:
            out = tempfile.TemporaryFile(mode="w+b")
            files.append(out)
            procs.append(subprocess.Popen([str(a) for a in args], stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, cwd=cwd, start_new_session=True))
        _wait(procs, until=time.monotonic() + timeout)
        timed_out = [p.poll() is None for p in procs]
    finally:
        _stop(procs, token, grace)
    results = []
    for args, proc, out, late in zip(commands, procs, files, timed_out):
        out.seek(0)
        text = out.read().decode("utf-8", errors="replace")
        out.close()
        results.append(Result(list(args), None if late else proc.returncode, text, late))
    return results


def marked(token: str) -> list[psutil.Process]:
    """Every living process whose environment carries ``token`` (see :func:`run_all`)."""
    found = []
    for process in psutil.process_iter():
        try:
            if token in process.environ().get(MARK, "").split():
                found.append(process)
        except psutil.Error:  # gone, a zombie, or not ours to read
            pass
    return found


def _wait(procs, until):
    for p in procs:
        try:
            p.wait(max(0.0, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            return


def _stop(procs, token, grace):
    running = [p for p in procs if p.poll() is None]
    for p in running:
        _signal_group(p.pid, signal.SIGTERM)  # torchrun stops its workers on SIGTERM
    _wait(running, until=time.monotonic() + grace)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    for _ in range(20):  # look again after each round: a process may start another one before it dies
        left = marked(token)
        if not left:
            break
        for process in left:
            try:
                process.kill()  # psutil checks it is still the same process, not a new one with its pid
            except psutil.Error:
                pass
        time.sleep(0.05)


def _signal_group(pid, sig):
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError, AttributeError):  # gone, or Windows
        pass
