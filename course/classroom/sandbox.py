"""Each submission sealed off: its kernel, its ranks and whatever they start run in a sandbox.

The sandbox is bubblewrap (``bwrap``, Debian's and most distributions' package ``bubblewrap``),
which uses Linux namespaces; nothing here is hand-rolled. A sandboxed command gets

* its own PID namespace: it sees only its own processes, and when the sandbox's first process
  dies the kernel kills every other one (nothing outlives it, nothing outside can be signalled);
* no network: a network namespace of its own, with only its own loopback (ranks still meet there);
* a read-only view of the machine, minus the folders the grader hides (the other submissions,
  the CSV's folder, the grader's temporary folder): there it sees an empty folder; its own scratch
  folder, if it has one, is the only place it can write (and a private ``/tmp``);
* a user of its own: when the grader is root, a fresh uid per scratch folder (root could undo the
  read-only view); else the grader's user, in a user namespace of its own;
* limits (``prlimit``): CPU seconds, address space and file size per process, and processes.

What the limits bound (measured on Linux 6.18 with bubblewrap 0.8 and util-linux 2.38's prlimit):

* ``cpu`` is per process: a process past it gets SIGXCPU (Python dies of it), SIGKILL if it
  ignores that and uses 10 s more.
  A busy child the notebook started and left running is stopped by it, not only by the end of
  its notebook. The kernel's own count runs over the whole notebook, so the limit is sized well
  above an honest notebook's (see :class:`Resources`).
* ``processes`` (RLIMIT_NPROC) counts the processes and threads of the sandbox's *real uid*, in
  its user namespace: a fork fails (EAGAIN) once the count reaches it. That bounds a whole
  sandbox only because each sandbox has a uid (as root) or a user namespace (not root) of its
  own: two sandboxes that ran as one uid, as ``nobody``, shared one count (a fork bomb in one
  stopped the forks of the other and of every other ``nobody`` process on the machine).
* ``memory`` is each process's address space, not the sandbox's: 8 ranks may each take it.
  A limit on a whole sandbox's memory needs a cgroup (systemd's delegation, or a cgroupfs root
  may write); the grader makes none: many machines (containers, CI) have no cgroup it could use.

Where bubblewrap is missing or cannot make namespaces (macOS, a kernel without user namespaces),
:func:`probe` says why and the grader runs submissions as before, saying loudly that they were
not isolated.
"""

from __future__ import annotations

import itertools
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534  # the user a sandbox without a scratch folder (the judge) runs as when the grader is root
FIRST_USER = 1_900_000_000  # the users scratch folders are given to, when the grader is root: no real user's uids
_users = itertools.count(FIRST_USER + os.getpid() % 100_000 * 1000)  # 1,000 per grader, by its pid: rarely shared


@dataclass(frozen=True)
class Resources:
    """What one sandbox may use (``prlimit``'s limits, per process except ``processes``)."""

    processes: int = 2048  # processes and threads of the sandbox's own user
    memory: int = 16 << 30  # bytes of address space per process (torch maps ~3 GiB it never touches)
    file_size: int = 1 << 30  # bytes, the largest file it may write
    cpu: int | None = 600  # CPU seconds per process (the heaviest solution's kernel used 31 s); None: none


def probe() -> str | None:
    """None if sandboxes work here, else why not (one line)."""
    if not sys.platform.startswith("linux"):
        return f"no sandbox on {sys.platform} (bubblewrap needs Linux namespaces)"
    for tool in ("bwrap", "prlimit", *(["setpriv"] if os.geteuid() == 0 else [])):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (install the `bubblewrap` package)"
    with tempfile.TemporaryDirectory() as scratch:  # as the judge would run, then as a kernel
        try:
            give_to_sandbox(Path(scratch))
            for done in (subprocess.run(Sandbox([], []).command(["true"], folder), capture_output=True, timeout=30)
                         for folder in (None, Path(scratch))):
                if done.returncode != 0:
                    return f"bubblewrap cannot make namespaces here: {done.stderr.decode(errors='replace').strip()[:200]}"
        except (OSError, subprocess.TimeoutExpired) as e:  # as root in a user namespace: no user of its own to give
            return f"bubblewrap does not start: {e}"
    return None


def _blocked(path: Path) -> Path | None:
    """The topmost folder above ``path`` that the sandbox's user could not enter, if any."""
    if os.geteuid() != 0:
        return None  # the sandbox runs as the grader's own user: what it can reach, the sandbox can
    for folder in reversed(path.parents):
        try:
            mode = folder.stat().st_mode
        except OSError:
            return None
        if not mode & stat.S_IXOTH:
            return folder
    return None


class Sandbox:
    """How to run a command sealed off: ``Sandbox(hidden, needed).command(argv, scratch)``.

    ``hidden``: folders the command must not see (shown empty). ``needed``: paths it must read
    even if they lie in a hidden folder or one its user cannot enter (the interpreter, the
    course's copy). ``scratch``: the one folder it may write."""

    def __init__(self, hidden, needed, resources: Resources = Resources()):
        self.hidden = [Path(p).resolve() for p in hidden]
        needed = {Path(p).resolve() for p in needed}
        self.needed = sorted(p for p in needed if not any(p != q and p.is_relative_to(q) for q in needed))
        self.resources = resources

    def command(self, argv, scratch: Path | None = None, unset=(), cpu: bool = True) -> list[str]:
        """``argv`` sealed off, writing only ``scratch``, without the variables ``unset``; ``cpu=False``
        drops the CPU-time limit (a process that lives as long as the grader, as the judge)."""
        root = os.geteuid() == 0
        blocked = {b for p in self.needed if (b := _blocked(p))}
        masks = sorted({*self.hidden, *blocked}, key=lambda p: len(p.parts))
        # As root, no user namespace: the mounts are made as root, then the command runs as nobody
        # (without capabilities it can undo none of them). Else a user namespace makes them.
        spaces = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"] if root else ["--unshare-all"]
        args = ["bwrap", *spaces, "--die-with-parent", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                "--perms", "01777", "--tmpfs", "/tmp", "--perms", "01777", "--tmpfs", "/dev/shm"]
        for folder in masks:
            args += ["--tmpfs", str(folder)]
        made = set()
        tmp = Path("/tmp").resolve()  # a private, empty /tmp: what is needed there is bound back in
        for path in self.needed:
            mask = next((m for m in reversed(masks) if path.is_relative_to(m)), tmp if path.is_relative_to(tmp) else None)
            if path.exists() and mask is not None and path != mask:
                for folder in reversed(path.parents):  # the folders down to it, enterable (bwrap makes them 0700)
                    if folder.is_relative_to(mask) and folder != mask and folder not in made:
                        args += ["--perms", "0755", "--dir", str(folder)]
                        made.add(folder)
                args += ["--ro-bind", str(path), str(path)]
        if scratch is not None:
            args += ["--bind", str(scratch), str(scratch), "--chdir", str(scratch)]
        for name in unset:
            args += ["--unsetenv", name]
        args.append("--")
        if root:  # the scratch folder's user (given by give_to_sandbox), else nobody; never root
            user = scratch.stat().st_uid if scratch is not None and scratch.exists() else 0
            user = user or NOBODY
            args += ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", "--"]
        r = self.resources
        limits = [f"--nproc={r.processes}", f"--as={r.memory}", f"--fsize={r.file_size}"]
        if cpu and r.cpu is not None:
            limits.append(f"--cpu={r.cpu}:{r.cpu + 10}")  # SIGXCPU, then SIGKILL if that was ignored
        return [*args, "prlimit", *limits, "--", *argv]


def give_to_sandbox(folder: Path, like: Path | None = None):
    """Let a sandbox write ``folder``, its scratch folder: when the grader is root, the folder gets
    a user of its own, never used before by this grader, the sandbox runs as (a fork bomb in it
    then counts against its own process limit, no one else's). ``like``: give ``folder`` (a file in
    the scratch folder) to the user who has ``like``."""
    if os.geteuid() != 0:
        return
    if like is not None:
        user = Path(like).stat().st_uid
    else:
        user = next(_users)
    os.chown(folder, user, user)
