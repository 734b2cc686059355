"""The classroom: exercises and the verdicts of their checks (``course.checks`` holds one module
of checks per notebook), the guard that keeps the finished code from answering, grading a class,
building the notebooks, and ``doctor``. May import every other layer."""

import importlib.util
import sys
import types


def _defer_iri_parser() -> None:
    """Make ``import nbformat`` take 0.2 s instead of 3.

    nbformat imports jsonschema, whose format checkers import rfc3987-syntax when it is installed
    (Jupyter's jupyter-events installs it, through jsonschema[format-nongpl]). Version 1.1.0 builds
    an Earley parser of RFC 3987 on import: 2-3 s, in every process that reads a notebook
    (jsonschema issue 1392; the fork rfc3987-syntax2 builds it lazily). A notebook holds no IRI to
    check, so stand in a module that imports the real one on first use."""
    name = "rfc3987_syntax"
    if name in sys.modules or importlib.util.find_spec(name) is None:
        return

    def is_valid_syntax(term, value):
        del sys.modules[name]  # the stand-in steps aside for the real module, once
        real = importlib.import_module(name)
        stand_in.is_valid_syntax = real.is_valid_syntax
        return real.is_valid_syntax(term, value)

    stand_in = types.ModuleType(name, "Loads rfc3987_syntax when first used (course.classroom).")
    stand_in.is_valid_syntax = is_valid_syntax
    sys.modules[name] = stand_in


_defer_iri_parser()
