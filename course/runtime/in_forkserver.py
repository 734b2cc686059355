"""Imported by the forkserver that ``course.launch`` starts (``launcher.FORKSERVER_PRELOAD``), and
nowhere else: in that process, SIGINT is ignored.

Python's forkserver gives each process it forks the SIGINT handler it found after importing its
preload modules. A new rank is in the notebook kernel's process group until it makes its own, and
Jupyter's Interrupt signals that whole group: with the default handler, a press at that moment
raised ``KeyboardInterrupt`` inside multiprocessing's own start-up code (seen once in 20 presses:
"Process ForkServerProcess-377: ... util._close_stdin ... KeyboardInterrupt" in the cell's output).
Ignored from birth, the rank cannot raise there; once in its own group it takes SIGINT as Python
does (:func:`course.runtime.interrupts.let_through`). Imported anywhere else (a notebook, a
script), this module changes nothing."""

import signal
import sys


def in_a_forkserver() -> bool:
    """True while Python's forkserver is importing its preload modules: called from inside
    ``multiprocessing.forkserver.main``."""
    main = getattr(sys.modules.get("multiprocessing.forkserver"), "main", None)
    frame = sys._getframe()
    while frame is not None:
        if main is not None and frame.f_code is main.__code__:
            return True
        frame = frame.f_back
    return False


if in_a_forkserver():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
