"""What sealing each submission off costs: ``python -m course grade`` on a class of honest
notebook-01 submissions (solved, as a student hands it in), without and with the sandbox, in one
run on one machine.

    python benchmarks/grading_overhead.py             # 30 submissions each way (about 2 x 5 min on 2 cores)
    python benchmarks/grading_overhead.py --n 10 --jobs 2
    python benchmarks/grading_overhead.py --quick     # one tiny submission each way (the smoke test)

"not sandboxed" is today's grader run with ``--no-sandbox``: the same kernels, judge and report,
each notebook in a plain kernel; "sandboxed" adds bubblewrap (a PID, network, IPC and UTS
namespace, a read-only view, prlimit) around each kernel and the judge.

Measured 2026-11-27 on the shared 2-core machine, 30 each way: 322.4 s not sandboxed (load 2.0-6.2),
299.7 s sandboxed (load 2.3-4.6), 0.93x: less than the load moves a run (benchmarks/README.md).
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import header  # noqa: E402

from course.classroom import grading, sandbox  # noqa: E402
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
        paths.append((f"student{i:02d}", path))
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=30, help="submissions (default 30)")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks at once (default 1)")
    parser.add_argument("--quick", action="store_true", help="one tiny submission each way")
    args = parser.parse_args(argv)
    n = 1 if args.quick else args.n
    header(f"grading {n} honest notebook-01 submissions, --jobs {args.jobs}")
    why_not = sandbox.probe()
    with tempfile.TemporaryDirectory() as tmp:
        submissions = class_of(n, Path(tmp), args.quick)
        rows = []
        for label, sealed in [("not sandboxed", False), ("sandboxed", True)]:
            if sealed and why_not:
                rows.append((label, "-", f"no sandbox here: {why_not}"))
                continue
            start = time.perf_counter()
            verdicts = grading.grade_notebooks(submissions, log=lambda s: None, jobs=args.jobs, sealed=sealed)
            seconds = time.perf_counter() - start
            solved = sum(v.verdict == "correct" for v in verdicts)
            rows.append((label, f"{seconds:.1f}", f"{seconds / n:.2f} s per submission, {solved} correct"))
    print(f"{'mode':<14} {'seconds':>8}  notes")
    for label, seconds, notes in rows:
        print(f"{label:<14} {seconds:>8}  {notes}")
    if all(r[1] != "-" for r in rows):
        print(f"sandboxed / not sandboxed: {float(rows[1][1]) / float(rows[0][1]):.2f}")


if __name__ == "__main__":
    main()
