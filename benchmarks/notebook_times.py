"""Time every notebook under nbval, one at a time, and optionally the whole test suite.

Targets for the course on a 2-core machine: each notebook <= 60 s, the suite <= 5 min.

    python benchmarks/notebook_times.py [--suite] [--only 01 02]
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_LIMIT_S, SUITE_LIMIT_S = 60, 300


def run_pytest(args):
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT, capture_output=True, text=True)
    return time.perf_counter() - start, done.returncode == 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", action="store_true", help="also time the README's test command (pytest)")
    parser.add_argument("--only", nargs="*", default=(), help="notebooks whose path contains one of these, e.g. 03 or solutions/")
    args = parser.parse_args(argv)

    common.header("Notebooks under nbval (solutions: --nbval, notebooks: lax), one process each")
    paths = sorted(ROOT.glob("solutions/*.ipynb")) + sorted(ROOT.glob("notebooks/*.ipynb"))
    if args.only:
        paths = [p for p in paths if any(o in str(p.relative_to(ROOT)) for o in args.only)]
    rows, slow = [], []
    for path in paths:
        seconds, ok = run_pytest(["-o", "addopts=--nbval --nbval-current-env", str(path.relative_to(ROOT))])
        rows.append([str(path.relative_to(ROOT)), f"{seconds:.1f}", "pass" if ok else "FAIL"])
        if seconds > NOTEBOOK_LIMIT_S:
            slow.append(path.name)
    common.table(["notebook", "seconds", "nbval"], rows)
    print(f"\nevery notebook <= {NOTEBOOK_LIMIT_S} s: {'met' if not slow else 'MISSED: ' + ', '.join(slow)}")
    if args.suite:
        seconds, ok = run_pytest([])
        verdict = "met" if seconds <= SUITE_LIMIT_S else "MISSED"
        print(f"whole suite (pytest, -n 2): {seconds:.0f} s, {'passed' if ok else 'FAILED'} (target <= {SUITE_LIMIT_S} s: {verdict})")


if __name__ == "__main__":
    main()
