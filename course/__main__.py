"""Command line: ``python -m course doctor`` and ``python -m course build``."""

import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m course", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="check this machine can run the course (versions, cores, a real 2-rank launch)")
    build = sub.add_parser("build", help="re-execute solutions/ (storing outputs) and regenerate notebooks/")
    build.add_argument("names", nargs="*", help="only notebooks whose file name contains one of these")
    build.add_argument("--no-execute", action="store_true", help="only regenerate the student notebooks")
    args = parser.parse_args(argv)

    if args.command == "doctor":
        from course.doctor import doctor

        return doctor()
    from course.notebooks import build as build_notebooks

    build_notebooks(args.names, run=not args.no_execute)
    return 0


if __name__ == "__main__":
    sys.exit(main())
