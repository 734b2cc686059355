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

from course.runtime.launcher import WorkerError, WorkerTimeoutError, launch

__all__ = ["launch", "WorkerError", "WorkerTimeoutError"]
