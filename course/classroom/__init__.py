"""The classroom: exercises and the verdicts of their checks (``course.checks`` holds one module
of checks per notebook), the guard that keeps the finished code from answering, grading a class,
building the notebooks, and ``doctor``. May import every other layer."""
