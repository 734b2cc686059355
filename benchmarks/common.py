"""Small helpers shared by the benchmark scripts: a header, medians, a table."""

import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def header(title: str):
    print(f"# {title}")
    print(
        f"# {cores()} cores, {platform.machine()}, Python {platform.python_version()}, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
    )


def timed(fn, repeats: int, warmup: int = 1, clock=time.perf_counter):
    """Run ``fn`` warmup + repeats times; return the repeats' times in seconds (wall times, or
    ``clock=time.process_time``: this process's CPU time)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return times


def median(xs):
    return statistics.median(xs)


def table(columns, rows):
    widths = [max(len(str(c)), *(len(str(r[i])) for r in rows)) for i, c in enumerate(columns)]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    print(line(columns))
    print(line("-" * w for w in widths))
    for row in rows:
        print(line(row))
    sys.stdout.flush()


def save_plot(fig, name: str, folder=None) -> Path:
    folder = Path(folder or RESULTS)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"plot saved to {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")
    return path
