"""Helpers for the DDP course: run real torch.distributed ranks from a notebook.

The package is five layers; each imports only the layers below it, never one above:

    classroom   exercises and their checks' machinery, the guard, grading, building notebooks, doctor
      |   (course.checks, one module of checks per notebook, belongs to this layer)
    parallel    the parallelism a student builds: collectives, DDP, ZeRO/FSDP, TP, PP, CP, EP, 3-D
    training    what the ranks train: the data set, the reference model, the training script, checkpoints
      |   (parallel and training sit side by side: neither imports the other)
    observe     instruments that watch ranks: collectives traced, bytes on the wire, bytes in memory
    runtime     the machinery that starts ranks: launch, the worker protocol, live output, launchers

The runtime knows nothing of checks: a layer above that needs something in every rank registers
a hook (``course.runtime.launcher.on_launch``; the classroom's guard does). A test keeps the
order (tests/test_layers.py).
"""

import sys

if sys.argv[:1] == ["-m"] and getattr(sys, "orig_argv", [])[-len(sys.argv) - 1:][:2] == ["-m", "course"]:
    # `python -m course COMMAND` is starting (Python sets sys.argv[0] to "-m" while it finds
    # course/__main__.py). From here until the command begins (course/__main__.py: begin()), Ctrl-C
    # ends it at once in one line, exit status 130 (what a shell reports for Ctrl-C): nothing to
    # clean up exists yet. `_signal` is the C half of `signal`, ready at once (`import signal`
    # builds its enums first: tens of milliseconds under load). What remains: a press before this
    # line, in Python's own start-up (interpreter, site, runpy; site's imports alone took 0.05 s at
    # load 5; at load 8 presses at 0.05-0.12 s mostly landed there, at 0.2 s never), is Python's
    # KeyboardInterrupt traceback, or, before Python handles SIGINT at all, the bare signal (exit -2).
    import _signal
    import os

    def _stopped_while_starting(signum, frame, command=(sys.argv[1:] or ["course"])[0]):
        os.write(2, f"{command} stopped (Ctrl-C) before it began: nothing done\n".encode())
        os._exit(130)  # no finalization: no second signal can land in it

    _signal.signal(_signal.SIGINT, _stopped_while_starting)

from course.runtime.launcher import WorkerError, WorkerTimeoutError, launch  # noqa: E402

__all__ = ["launch", "WorkerError", "WorkerTimeoutError"]
