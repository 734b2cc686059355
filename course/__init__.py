"""Helpers for the DDP course: run real torch.distributed ranks from a notebook."""

from course.launcher import WorkerError, WorkerTimeoutError, launch

__all__ = ["launch", "WorkerError", "WorkerTimeoutError"]
