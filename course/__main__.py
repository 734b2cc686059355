"""Command line: ``python -m course doctor``, ``build``, ``site``, ``grade`` (instructors) and ``progress`` (students)."""

import argparse
import signal
import sys


def begin():
    """The command begins: Ctrl-C is its own to handle again (KeyboardInterrupt; each command stops
    cleanly, in one line). Until now it ended the process at once (course/__init__.py)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m course", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="check this machine can run the course (versions, cores, a real 2-rank launch)")
    build = sub.add_parser("build", help="re-execute solutions/ (storing outputs) and regenerate notebooks/")
    build.add_argument("names", nargs="*", help="only notebooks whose file name contains one of these")
    build.add_argument("--no-execute", action="store_true", help="only regenerate the student notebooks")
    site = sub.add_parser("site", help="build the course's website from solutions/ and their stored outputs")
    site.add_argument("--out", default=None, help="the folder to write it to (default: build/site)")
    grade = sub.add_parser("grade", help="grade students' notebooks: each exercise's verdict, judged by the course's checks")
    grade.add_argument("submissions", nargs="+", help="student notebooks, or folders of them (one folder per student)")
    grade.add_argument("--csv", help="write one row per student and exercise to this file (and NAME-students.csv, "
                                     "NAME-answers/: each student's totals, the source of their correct answers)")
    grade.add_argument("--no-sandbox", action="store_true",
                       help="run the submissions without a sandbox (not isolated: only for notebooks you trust)")
    grade.add_argument("--cpu-limit", type=int, default=600,
                       help="CPU seconds each process of a sandbox may use, its kernel's over the whole notebook (default 600)")
    progress = sub.add_parser("progress", help="your verdicts: run your saved notebooks and judge each exercise")
    progress.add_argument("notebooks", nargs="*", help="notebooks or folders (default: notebooks/)")
    for command in (grade, progress):
        command.add_argument("--cell-timeout", type=float, default=120, help="seconds one cell may run (default 120)")
        command.add_argument("--notebook-timeout", type=float, default=900, help="seconds a notebook may run (default 900)")
        command.add_argument("--check-timeout", type=float, default=180, help="seconds to judge one exercise (default 180)")
        command.add_argument("--jobs", type=int, default=1, help="notebooks run at once (default 1; each runs its own ranks)")
    args = parser.parse_args(argv)

    if args.command in ("grade", "progress"):
        from course.classroom import grading  # seconds (torch): a Ctrl-C meanwhile is one line (course/__init__.py)

        limits = grading.Limits(cell=args.cell_timeout, notebook=args.notebook_timeout, check=args.check_timeout)
        begin()
        if args.command == "grade":
            return grading.grade(args.submissions, args.csv, limits, args.jobs, sealed=not args.no_sandbox,
                                 resources=grading.sandbox.Resources(cpu=args.cpu_limit))
        return grading.progress(args.notebooks, limits, args.jobs)
    if args.command == "doctor":
        from course.classroom.doctor import doctor

        begin()
        return doctor()
    if args.command == "site":
        from course.classroom import site

        begin()
        try:
            site.build(args.out or site.OUT)
        except site.SiteError as e:
            print(f"python -m course site: {e}", file=sys.stderr)
            return 1
        return 0
    from course.classroom.notebooks import build as build_notebooks

    begin()
    build_notebooks(args.names, run=not args.no_execute)
    return 0


if __name__ == "__main__":
    code = main()
    # Done: a later Ctrl-C (a second press; one that arrives while Python shuts down, after it has
    # given SIGINT back to the system's default, would end the process by the signal, status -2,
    # instead of 130) changes nothing now.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)
