"""Kernel > Interrupt (SIGINT) noted, not raised, while processes are being started and stopped.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be when SIGINT
arrives. During a launch that is often a bad place (measured in JupyterLab, issue 39):

* inside ``os.fork``'s after-fork hooks (``logging``'s ``_releaseLock``, ``threading``'s
  ``_after_fork``): Python prints "Exception ignored in ..." and goes on, the press is lost;
* inside the cleanup (kill, ``join``, ``waitpid``): a raw traceback, and ranks never reaped
  stay as zombies.

So for the duration of a launch :func:`noted` replaces the SIGINT handler with one that only
notes the press (and wakes whoever waits on :attr:`Interrupts.fileno`); the launcher looks
at the note at its safe points and stops everything there. A second press while it cleans up
is noted too, and breaks nothing. A forked child inherits the handler: there it does nothing
(Jupyter signals the kernel's whole process group, which a new rank belongs to until it
leaves it).

Only the main thread can set a signal handler: elsewhere :func:`noted` changes nothing (and
SIGINT, delivered to the main thread, is that thread's business).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time


class Interrupts:
    """The presses seen since :func:`noted` began: ``bool(it)``; ``it.first``: time.monotonic() of the first."""

    def __init__(self):
        self.first = None
        self.count = 0
        self._pid = os.getpid()
        self._read, self._write = os.pipe() if hasattr(os, "set_blocking") else (None, None)
        if self._write is not None:
            os.set_blocking(self._write, False)

    def __bool__(self) -> bool:
        return self.count > 0

    def fileno(self):
        """A file descriptor that becomes readable at the first press (for ``select``/``wait``), or None."""
        return self._read

    def note(self, signum=None, frame=None):
        """The SIGINT handler: remember the press. Raises nothing, whatever it interrupted."""
        if os.getpid() != self._pid:  # a forked child, before it left the kernel's process group
            return
        self.count += 1
        if self.first is None:
            self.first = time.monotonic()
        if self._write is not None and self.count == 1:
            with contextlib.suppress(OSError):
                os.write(self._write, b"!")

    def close(self):
        for fd in (self._read, self._write):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._read = self._write = None


@contextlib.contextmanager
def noted():
    """Inside the block, SIGINT is noted in the :class:`Interrupts` it yields instead of raising
    ``KeyboardInterrupt``; the previous handler is back afterwards. The caller acts on it."""
    interrupts = Interrupts()
    installed, previous = threading.current_thread() is threading.main_thread(), None
    if installed:
        previous = signal.signal(signal.SIGINT, interrupts.note)
    try:
        yield interrupts
    finally:
        if installed:  # None: a handler set outside Python, which cannot be put back
            signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
        interrupts.close()


@contextlib.contextmanager
def held_back():
    """SIGINT blocked in this thread inside the block (Unix). A process started in it (a fork, or a
    fork and exec: a spawned rank, a forkserver) starts with SIGINT blocked too, so that Jupyter's
    interrupt, which signals the kernel's whole process group, cannot raise in it before it has
    left that group; it then calls :func:`let_through`. This process misses nothing: the signal
    reaches another thread, or waits until the block ends."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def let_through():
    """In a process started under :func:`held_back`, once it is in a process group of its own:
    forget a SIGINT that arrived meanwhile (it was the kernel's), then take SIGINT as Python does."""
    if hasattr(signal, "pthread_sigmask"):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a pending signal that is ignored is dropped
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)
