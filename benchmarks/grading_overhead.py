"""What sealing each submission off costs: ``python -m course grade`` on a class of honest
notebook-01 submissions (solved, as a student hands it in), this grader sandboxed against the
grader before issue 38 (``--before``) or against itself with ``--no-sandbox``, in one run on one machine.

    python benchmarks/grading_overhead.py --before 87c84f1 --rounds 2   # issue 38's comparison (about 9 min on 2 cores)
    python benchmarks/grading_overhead.py             # 30 submissions each way, --no-sandbox against sandboxed
    python benchmarks/grading_overhead.py --n 10 --jobs 2
    python benchmarks/grading_overhead.py --quick     # one tiny submission each way (the smoke test)

Each side is the command line, ``python -m course grade``, with the course of its own tree on
PYTHONPATH (run from a folder that holds no course): ``--before COMMIT`` checks COMMIT out with
``git worktree add`` (removed afterwards), so its grader, checks and notebooks judge, as they did
then. 87c84f1 is the last commit before issue 38's grader (c77d16f). "sandboxed" adds bubblewrap
(a PID, network, IPC and UTS namespace, a read-only view, prlimit) around each kernel and the judge.
``--rounds R`` grades the class in R parts, each way in turn, the order swapped every part, so a
load that drifts during the run falls on both sides (each part pays the grader's start again).

Measured 2026-11-27 on the shared 2-core machine, ``--before 87c84f1 --rounds 2``, 30 each way
(the same 30 files): before issue 38 271.8 s, sandboxed 265.5 s, 0.98x (1-minute load 1.7-7.3
during the run; each part's load in benchmarks/README.md). Earlier, against ``--no-sandbox``: 322.4 s
not sandboxed (load 2.0-6.2), 299.7 s sandboxed (load 2.3-4.6), 0.93x.
"""

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import header  # noqa: E402

from course.classroom import sandbox  # noqa: E402
from course.classroom.notebooks import ROOT  # noqa: E402


def class_of(n: int, folder: Path, quick: bool):
    import nbformat

    student = nbformat.read(ROOT / "notebooks" / "01_single_device.ipynb", as_version=4)
    solution = nbformat.read(ROOT / "solutions" / "01_single_device.ipynb", as_version=4)
    if quick:
        student.cells = [nbformat.v4.new_code_cell("def weight_grad(model, x, y):\n    return 2 * (model(x) - y).T @ x / y.numel()")]
        student.cells[0].id = "c06"
    else:
        solved = {c.id: c.source for c in solution.cells}
        for cell in student.cells:
            if "✏️ your" in cell.source:
                cell.source = solved[cell.id]
    paths = []
    for i in range(n):
        path = folder / f"student{i:02d}" / "01_single_device.ipynb"
        path.parent.mkdir(parents=True)
        nbformat.write(student, path)
        paths.append(path)
    return paths


def grade(tree: Path, paths, flags, jobs: int, work: Path) -> tuple[float, int, str]:
    """``python -m course grade`` with the course of ``tree`` (PYTHONPATH, run from a folder that
    holds no course): seconds, exercises correct, the 1-minute load before and after."""
    out = work / f"grades-{time.monotonic_ns()}.csv"
    command = [sys.executable, "-m", "course", "grade", *map(str, paths), "--csv", str(out), "--jobs", str(jobs), *flags]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    subprocess.run(command, cwd=work, env={**os.environ, "PYTHONPATH": str(tree)}, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    with open(out, newline="", encoding="utf-8") as f:
        solved = sum(r["verdict"] == "correct" for r in csv.DictReader(f))
    return seconds, solved, f"{load:.1f}-{os.getloadavg()[0]:.1f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=30, help="submissions (default 30)")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks at once (default 1)")
    parser.add_argument("--quick", action="store_true", help="one tiny submission each way")
    parser.add_argument("--before", metavar="COMMIT", help="compare with the grader of COMMIT (a git worktree of it) "
                        "instead of this grader's --no-sandbox")
    parser.add_argument("--rounds", type=int, default=1, help="grade the class in this many parts, each way in turn, "
                        "the order swapped every part (the load's drift falls on both; default 1: the whole class each way)")
    args = parser.parse_args(argv)
    n = 1 if args.quick else args.n
    rounds = max(1, min(args.rounds, n))
    header(f"grading {n} honest notebook-01 submissions, --jobs {args.jobs}, {rounds} part(s) each way")
    why_not = sandbox.probe()
    if why_not:
        print(f"no sandbox here: {why_not}: the sandboxed side runs not isolated")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        paths = class_of(n, tmp / "class", args.quick)
        sides = [("sandboxed", ROOT, [])]
        if args.before:
            commit = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=ROOT, check=True,
                                    capture_output=True, text=True).stdout.strip()
            subprocess.run(["git", "worktree", "add", "--detach", str(tmp / "before"), commit], cwd=ROOT, check=True,
                           capture_output=True)
            sides.insert(0, (f"before ({commit})", tmp / "before", []))
        else:
            sides.insert(0, ("not sandboxed", ROOT, ["--no-sandbox"]))
        try:
            totals = {label: [0.0, 0, []] for label, _, _ in sides}
            for part in range(rounds):
                for label, tree, flags in (sides if part % 2 == 0 else sides[::-1]):
                    seconds, solved, load = grade(tree, paths[part::rounds], flags, args.jobs, tmp)
                    print(f"part {part + 1}: {label:<18} {seconds:7.1f} s, {solved} correct, load {load}", flush=True)
                    totals[label][0] += seconds
                    totals[label][1] += solved
                    totals[label][2].append(load)
        finally:
            if args.before:
                subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "before")], cwd=ROOT, check=False)
    print(f"{'grader':<18} {'seconds':>8}  notes")
    for label, (seconds, solved, loads) in totals.items():
        print(f"{label:<18} {seconds:8.1f}  {seconds / n:.2f} s per submission, {solved} correct, load {', '.join(loads)}")
    (first, (a, _, _)), (_, (b, _, _)) = totals.items()
    print(f"sandboxed / {first}: {b / a:.2f}")


if __name__ == "__main__":
    main()
