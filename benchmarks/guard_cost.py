"""What does course.classroom.guard add to a check? (A benchmark, not a test.)

    python benchmarks/guard_cost.py [--repeats 30]

Per exercise that names finished versions (notebooks 11 on): the time of what ``Exercise.__call__`` does
around the judge, ``guard.refused`` (the answer and what its code names) and entering and
leaving ``guard.guarding`` (the finished versions, the copies kept where the answer and the
notebook can reach them, the reload finder), median over repeats, as wall time and as this
process's CPU time (on a loaded machine the wall time is mostly waiting for a core). ``__main__`` holds what a
notebook does by then: tensors, models, lists of per-rank results, helper functions, an
``Out`` history. The answer is a small wrapper; the judge itself is not timed.
"""

import argparse
import inspect
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import torch  # noqa: E402

import course.checks  # noqa: E402
from course.classroom.exercises import Exercise  # noqa: E402
from course.classroom import guard  # noqa: E402


NEW = "answers" in inspect.signature(guard.guarding).parameters  # also runs with the guard before issue 37


def _notebook_state():
    main = vars(sys.modules["__main__"])
    for i in range(40):
        main[f"t{i}"] = torch.randn(64, 64)
        main[f"model{i}"] = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        main[f"results{i}"] = [{"rank": r, "loss": torch.randn(3), "ops": ["a", "b"]} for r in range(4)]
        exec(compile(f"def helper{i}(x):\n    return x * {i}", "/tmp/ipykernel_1/1.py", "exec"), main)
    main["Out"] = {i: [torch.randn(2)] * 10 for i in range(100)}
    exec(compile("def answer(*a):\n    return helper1(*a)", "/tmp/ipykernel_1/2.py", "exec"), main)
    return main["answer"]


def _guarded_exercises():
    """Every exercise of every check module that names the course's finished versions."""
    import importlib
    import pkgutil

    for info in sorted(pkgutil.iter_modules(course.checks.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"course.checks.{info.name}")
        for ex in list(vars(module).values()):  # a copy: judging an exercise may add names to its module
            if isinstance(ex, Exercise) and ex.finished:
                yield ex


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    common.header("course.classroom.guard: refused + guarding per check")
    answer = _notebook_state()
    rows = []
    for ex in _guarded_exercises():
        answers = (answer,)

        def around_the_judge():
            assert all(guard.refused(a, ex.finished) is None for a in answers)
            with guard.guarding(ex.finished, answers) if NEW else guard.guarding(ex.finished):
                pass

        wall = common.timed(around_the_judge, args.repeats, warmup=3)
        cpu = common.timed(around_the_judge, args.repeats, clock=time.process_time)
        rows.append((f"nb{ex.notebook} {ex.__name__}", len(ex.finished),
                     f"{common.median(wall) * 1e3:.2f}", f"{common.median(cpu) * 1e3:.2f}"))
    common.table(["exercise", "finished versions", "wall ms", "CPU ms"], rows)


if __name__ == "__main__":
    main()
