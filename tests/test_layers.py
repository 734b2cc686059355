"""course/ is five layers, each importing only the layers below it (course/__init__.py's docstring)."""

import ast
from pathlib import Path

import course
from course.runtime import launcher

COURSE = Path(course.__file__).parent
# What each folder may import, besides itself (checks/ belongs to the classroom).
MAY_IMPORT = {
    "runtime": set(),
    "observe": {"runtime"},
    "training": {"observe", "runtime"},
    "parallel": {"observe", "runtime"},
    "classroom": {"checks", "parallel", "training", "observe", "runtime"},
    "checks": {"classroom", "parallel", "training", "observe", "runtime"},
}


def _course_imports(path):
    """Every course folder a module imports, at its top or inside a function: (line, folder)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" if node.module == "course" else node.module for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "course" and len(parts) > 1:
                yield node.lineno, parts[1]


def test_every_module_lives_in_a_layer_folder():
    loose = sorted(p.name for p in COURSE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert loose == []
    assert {p.name for p in COURSE.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == set(MAY_IMPORT)


def test_no_layer_imports_a_layer_above_it():
    upward = []
    for folder, allowed in MAY_IMPORT.items():
        for path in sorted((COURSE / folder).glob("*.py")):
            for line, other in _course_imports(path):
                if other != folder and other not in allowed:
                    upward.append(f"course/{folder}/{path.name}:{line} imports course.{other}")
    assert upward == []


def test_the_layer_test_sees_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from course.classroom import guard\n    import course.observe.wire\n")
    assert list(_course_imports(bad)) == [(2, "classroom"), (3, "observe")]


def test_each_folder_has_a_readme_saying_what_it_may_import():
    for folder in MAY_IMPORT:
        if folder != "checks":
            assert "May import" in (COURSE / folder / "README.md").read_text(), folder


def _record(rank, world_size):
    import os

    return os.environ.get("COURSE_TEST_SETUP")


def _set_marker(value):
    import os

    os.environ["COURSE_TEST_SETUP"] = value


def test_a_layer_above_reaches_every_rank_through_an_on_launch_hook():
    import functools

    hook = launcher.on_launch(lambda: functools.partial(_set_marker, "set before fn"))
    try:
        for method in ("fork", "forkserver"):
            assert course.launch(_record, 2, start_method=method) == ["set before fn"] * 2
    finally:
        launcher._launch_hooks.remove(hook)
    assert course.launch(_record, 2) == [None, None]
