"""Time every notebook under nbval, one at a time, and optionally the whole test suite.

Targets for the course on a 2-core machine: each notebook <= 25 s alone (on a quiet machine), the suite <= 6 min.

    python benchmarks/notebook_times.py [--suite] [--only 01 02] [--skip-alone] [NOTEBOOK ...]

``--suite`` also runs the README's test command (``pytest``) once and reports, besides its
wall time, how long each notebook took inside it (the sum of its cells' times, from
pytest's JUnit report): the student notebooks there run only the cells that the solution
run has not already executed in the same state (see conftest.py).
"""

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_LIMIT_S, SUITE_LIMIT_S = 25, 360


def run_pytest(args, env=None):
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, **(env or {})})
    return time.perf_counter() - start, done.returncode == 0


def workers(timeline):
    """Each xdist worker's busy seconds, when it finished (from the suite's start) and its last
    files, from the lines conftest.py appends to ``COURSE_TEST_TIMELINE``: where the wall time went
    when one worker still runs and the other has nothing left."""
    runs = [json.loads(line) for line in Path(timeline).read_text().splitlines()]
    if not runs:
        return []
    t0 = min(r["start"] for r in runs)
    rows = []
    for worker in sorted({r["worker"] for r in runs}):
        mine = sorted((r for r in runs if r["worker"] == worker), key=lambda r: r["start"])
        files = list(dict.fromkeys(r["file"] for r in mine))
        spans = {f: sum(r["end"] - r["start"] for r in mine if r["file"] == f) for f in files[-3:]}
        rows.append([worker, f"{sum(r['end'] - r['start'] for r in mine):.0f}", f"{mine[-1]['end'] - t0:.0f}",
                     ", ".join(f"{f} {s:.0f} s" for f, s in spans.items())])
    return rows


def failures(junit_xml):
    """The test cases of a JUnit report that failed or errored, as 'classname::name'."""
    return [
        f"{case.get('classname')}::{case.get('name')}"
        for case in ET.parse(junit_xml).iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]


def seconds_per_file(junit_xml):
    """{file: seconds} summed over the test cases of a JUnit report (nbval: one per cell)."""
    totals = collections.Counter()
    for case in ET.parse(junit_xml).iter("testcase"):
        classname = case.get("classname", "")  # "solutions.02_x.ipynb" or "tests.test_launcher"
        name = classname.replace(".", "/", 1) if classname.endswith(".ipynb") else classname
        totals[name] += float(case.get("time", 0))
    return totals


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", action="store_true", help="also time the README's test command (pytest)")
    parser.add_argument("notebooks", nargs="*", help="notebook files to time (default: all of the course's)")
    parser.add_argument("--only", nargs="*", default=(), help="notebooks whose path contains one of these, e.g. 03 or solutions/")
    parser.add_argument("--skip-alone", action="store_true", help="with --suite: do not time each notebook alone first")
    args = parser.parse_args(argv)
    if not (args.suite and args.skip_alone):
        time_alone(args.only, args.notebooks)
    if args.suite:
        time_suite()


def time_alone(only, paths=()):
    common.header("Notebooks under nbval (solutions: --nbval, notebooks: lax), one process each")
    paths = [Path(p).resolve() for p in paths] or sorted(ROOT.glob("solutions/*.ipynb")) + sorted(ROOT.glob("notebooks/*.ipynb"))
    if only:
        paths = [p for p in paths if any(o in str(p.relative_to(ROOT)) for o in only)]
    rows, slow = [], []
    for path in paths:
        name = str(path.relative_to(ROOT)) if ROOT in path.parents else str(path)
        # the README's addopts without xdist: -p course.classroom defers rfc3987-syntax's parser build (2-4 s)
        seconds, ok = run_pytest(["-o", "addopts=--nbval --nbval-current-env -p course.classroom", str(path)])
        rows.append([name, f"{seconds:.1f}", "pass" if ok else "FAIL"])
        if seconds > NOTEBOOK_LIMIT_S:
            slow.append(path.name)
    common.table(["notebook", "seconds", "nbval"], rows)
    print(f"\nevery notebook <= {NOTEBOOK_LIMIT_S} s: {'met' if not slow else 'MISSED: ' + ', '.join(slow)}")


def time_suite():
    common.header("The whole suite: pytest (README's test command)")
    with tempfile.TemporaryDirectory() as tmp:
        report, timeline = Path(tmp, "junit.xml"), Path(tmp, "timeline.jsonl")
        timeline.touch()
        seconds, ok = run_pytest([f"--junitxml={report}"], env={"COURSE_TEST_TIMELINE": str(timeline)})
        per_file = seconds_per_file(report) if report.exists() else {}
        failed = failures(report) if report.exists() else []
        per_worker = workers(timeline)
    notebooks = sorted(f for f in per_file if f.endswith(".ipynb"))
    rows = [[f, f"{per_file[f]:.1f}"] for f in notebooks]
    rest = sum(t for f, t in per_file.items() if not f.endswith(".ipynb"))
    rows.append(["tests/ (all other tests)", f"{rest:.1f}"])
    common.table(["inside the suite", "seconds"], rows)
    print()
    common.table(["worker", "busy s", "done at s", "its last files"], per_worker)
    verdict = "met" if seconds <= SUITE_LIMIT_S else "MISSED"
    for name in failed:
        print(f"FAILED {name}")
    print(f"\nwhole suite (pytest): {seconds:.0f} s wall, {'passed' if ok else 'FAILED'} (target <= {SUITE_LIMIT_S} s: {verdict})")


if __name__ == "__main__":
    main()
