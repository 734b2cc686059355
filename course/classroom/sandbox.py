"""Each submission sealed off: its kernel, its ranks and whatever they start run in a sandbox.

The sandbox is bubblewrap (``bwrap``, Debian's and most distributions' package ``bubblewrap``),
which uses Linux namespaces; nothing here is hand-rolled. A sandboxed command gets

* its own PID namespace: it sees only its own processes, and when the sandbox's first process
  dies the kernel kills every other one (nothing outlives it, nothing outside can be signalled);
* no network: a network namespace of its own, with only its own loopback (ranks still meet there);
* a read-only view of the machine, minus the folders the grader hides (the other submissions,
  the CSV's folder, the grader's temporary folder): there it sees an empty folder; its own scratch
  folder, if it has one, is the only place it can write (and a private ``/tmp``);
* limits (``prlimit``) on its processes, each process's memory and the size of a file it writes;
* when the grader runs as root, the user ``nobody`` (root could undo the read-only view).

Where bubblewrap is missing or cannot make namespaces (macOS, a kernel without user namespaces),
:func:`probe` says why and the grader runs submissions as before, saying loudly that they were
not isolated.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534  # the unprivileged user a sandbox runs as when the grader is root


@dataclass(frozen=True)
class Resources:
    """What one sandbox may use (``prlimit``'s limits, per process except ``processes``)."""

    processes: int = 2048  # processes and threads of its user (as root: of nobody, shared by the sandboxes running)
    memory: int = 16 << 30  # bytes of address space per process (torch maps ~3 GiB it never touches)
    file_size: int = 1 << 30  # bytes, the largest file it may write


def probe() -> str | None:
    """None if sandboxes work here, else why not (one line)."""
    if not sys.platform.startswith("linux"):
        return f"no sandbox on {sys.platform} (bubblewrap needs Linux namespaces)"
    for tool in ("bwrap", "prlimit", *(["setpriv"] if os.geteuid() == 0 else [])):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (install the `bubblewrap` package)"
    try:
        done = subprocess.run(Sandbox(hidden=[], needed=[]).command(["true"]), capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bubblewrap does not start: {e}"
    if done.returncode != 0:
        return f"bubblewrap cannot make namespaces here: {done.stderr.decode(errors='replace').strip()[:200]}"
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

    def command(self, argv, scratch: Path | None = None, unset=()) -> list[str]:
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
        if root:
            args += ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]
        r = self.resources
        return [*args, "prlimit", f"--nproc={r.processes}", f"--as={r.memory}", f"--fsize={r.file_size}", "--", *argv]


def give_to_sandbox(folder: Path):
    """Let the sandbox's user write ``folder`` (when the grader is root, the sandbox is ``nobody``)."""
    if os.geteuid() == 0:
        os.chown(folder, NOBODY, NOBODY)
