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

Between launches, in a Jupyter kernel, :func:`watch_cells` (installed when ``course`` is imported
there) handles a press outside any launch. Python would raise it wherever it lands; a press in the
kernel's own code around a cell's lines (between two of them, before the first) is then lost or
shown as a traceback through IPython. Instead it is raised as the cell's next line starts, and a
press in the cell's own top-level lines, in course.launch's first and last bytecodes or in an
exercise's check between its launches (no rank runs there) ends in one line that says where,
:class:`CellInterrupted`. A press anywhere else (a student's function, torch called by the cell) is
the usual ``KeyboardInterrupt``, raised at once, with its traceback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
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
        interrupts.close()
        if installed:  # None: a handler set outside Python, which cannot be put back
            signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)


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


# ------------------------------------------------------------------ a Jupyter kernel, between launches


class CellInterrupted(KeyboardInterrupt):
    """Interrupted while no rank was running, at a place the message names: Jupyter shows the one
    line (IPython shows what ``_render_traceback_`` returns), and Run All stops as usual."""

    def __init__(self, where):
        super().__init__(f"interrupted at {where} while no rank was running.")

    def _render_traceback_(self):
        return [f"⏹ KeyboardInterrupt: {self}"]


_NO_RANKS_IN = {os.path.normcase(os.path.abspath(__file__))}  # see no_ranks_in
_waiting = []  # a press seen in the kernel's own code: [shell] until the cell's next line raises it
_watched = []  # the shells watch_cells has hooked


def no_ranks_in(path):
    """Tell :func:`watch_cells` that a press landing in the code of ``path`` (a module's ``__file__``),
    or in code it calls (but for a notebook cell's), outside :func:`noted` finds no rank running: the
    one line is honest there. The launcher says it of itself (its first and last bytecodes, around
    :func:`noted`), the exercises of their checks (between a check's launches)."""
    _NO_RANKS_IN.add(os.path.normcase(os.path.abspath(path)))


def watch_cells(shell):
    """In a Jupyter kernel (``shell``: IPython's), handle SIGINT while a cell runs (see the module's
    doc): the kernel's hook that sets Python's handler before each request sets ours after it, and
    a press the cell's lines never saw stops Run All at the cell's end. Once per kernel."""
    kernel = getattr(shell, "kernel", None)
    hooks = all(hasattr(kernel, hook) for hook in ("pre_handler_hook", "post_handler_hook"))
    if not hooks or not hasattr(shell.compile, "format_code_name") or any(watched is shell for watched in _watched):
        return  # not a kernel, one older than these hooks (Python's handler stays), or hooked already
    _watched.append(shell)
    before, after = kernel.pre_handler_hook, kernel.post_handler_hook

    def pre_handler_hook():
        before()  # saves the idle handler (SIG_IGN), sets Python's
        _forget()
        _install(shell)

    def post_handler_hook():
        _forget()
        after()

    kernel.pre_handler_hook, kernel.post_handler_hook = pre_handler_hook, post_handler_hook
    shell.events.register("post_run_cell", lambda result: _at_cell_end(shell, result))
    _install(shell)  # this very cell: the kernel set Python's handler before it ran


def _install(shell):
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, lambda signum, frame: _on_press(shell, frame))


def _cell_of(shell, frame):
    """``"Cell In[7]"`` if ``frame`` runs code of a notebook cell, else None."""
    named = shell.compile.format_code_name(frame.f_code.co_filename)
    return " ".join(named) if named else None


def _where(shell, frame):
    """``"Cell In[7], line 3"``: the line ``frame`` (a cell's) runs, or is about to begin."""
    return f"{_cell_of(shell, frame)}, line {frame.f_lineno or frame.f_code.co_firstlineno}"


def _on_press(shell, frame):
    """Where did the press land? Walk out from the innermost frame to the first cell's frame."""
    inner, in_launch = frame, False
    while frame is not None and _cell_of(shell, frame) is None:
        in_launch = in_launch or os.path.normcase(os.path.abspath(frame.f_code.co_filename)) in _NO_RANKS_IN
        frame = frame.f_back
    if frame is None:  # the kernel's own code, before or between the cell's lines: raised by the next one
        if sys.gettrace() is None:
            _waiting.append(shell)
            sys.settrace(_at_next_cell_line)
            return
        raise KeyboardInterrupt  # a debugger traces this thread: no way to wait, raise where it is
    if in_launch or (frame is inner and frame.f_code.co_name == "<module>"):
        raise CellInterrupted(_where(shell, frame))
    raise KeyboardInterrupt  # the student's own function, or a library's: the traceback says where


def _at_next_cell_line(frame, event, arg):
    """sys.settrace's function while a press waits: trace the next cell frame, raise at its first line."""
    if event == "call" and _waiting and _cell_of(_waiting[0], frame) is not None:
        shell = _waiting[0]

        def raise_here(frame, event, arg):
            _forget()
            raise CellInterrupted(_where(shell, frame))

        return raise_here
    return None


def _forget():
    _waiting.clear()
    if sys.gettrace() is _at_next_cell_line:
        sys.settrace(None)


def _at_cell_end(shell, result):
    """A press that came after the cell's last line began (or in a cell without lines): shown once,
    and the cell fails, so Run All stops; unless the cell failed anyway."""
    if not _waiting:
        return
    _forget()
    if result is not None and not (result.error_before_exec or result.error_in_exec):
        stop = CellInterrupted(f"the end of Cell In[{result.execution_count}]")
        result.error_in_exec = stop
        shell.showtraceback((CellInterrupted, stop, None))
