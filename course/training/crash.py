"""Crash experiments: a ``torch.save`` that dies halfway, as a machine going down mid-save would.

Notebook 07 (before its Exercise 2) and that exercise's check use it to kill a save at its worst
moment; ``tests/test_checkpoint.py`` to show that ``course.training.checkpoint``'s saves survive it. It lives
apart from ``course/training/checkpoint.py``, which holds Exercise 2's answer.
"""

import io
import os
import signal


def die_halfway(real_save):
    """For crash experiments: a ``torch.save`` that writes the first half of the bytes, flushes
    them, and then SIGKILLs its own process, as a machine going down mid-save would.
    Install it in one worker only: ``torch.save = die_halfway(torch.save)``."""

    def save(obj, f, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer)
        data = buffer.getvalue()
        out = open(f, "wb") if isinstance(f, (str, os.PathLike)) else f
        out.write(data[: len(data) // 2])
        out.flush()
        os.kill(os.getpid(), signal.SIGKILL)  # killed in the middle of the save

    return save
