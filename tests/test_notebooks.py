"""The notebooks: one source (solutions/), generated student versions, stub handling."""

import json
import re

import nbformat
import pytest

from course.classroom import notebooks
from course.classroom.notebooks import STUDENT, SOLUTIONS, make_student, set_header, student_source

SOLUTION_PATHS = notebooks.solution_paths()
NAMES = [p.name for p in SOLUTION_PATHS]


def test_the_course_has_its_notebooks():
    assert NAMES[:2] == ["01_single_device.ipynb", "02_manual_scatter.ipynb"]
    assert sorted(p.name for p in STUDENT.glob("*.ipynb")) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_student_notebook_is_exactly_what_the_generator_makes(name):
    solution = nbformat.read(SOLUTIONS / name, as_version=4)
    expected = nbformat.writes(make_student(solution, name)) + "\n"
    committed = (STUDENT / name).read_text(encoding="utf-8")
    assert committed == expected, f"notebooks/{name} is stale: run `python -m course build --no-execute`"


def test_notebooks_carry_the_kernelspec_jupyterlab_writes():
    """JupyterLab writes the kernel's own kernelspec (name, display name, language) into a notebook
    when it starts the kernel; a different one stored makes the notebook open as modified (●). The
    browser test (tests/test_browser.py) sees the opened notebook unmodified."""
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("python3")
    written = {"display_name": spec.display_name, "language": spec.language, "name": "python3"}
    assert notebooks.KERNELSPEC == written
    for path in [*SOLUTION_PATHS, *(STUDENT / name for name in NAMES)]:
        assert nbformat.read(path, as_version=4).metadata["kernelspec"] == written, path


@pytest.mark.parametrize("name", NAMES)
def test_solution_notebook_starts_with_badge_and_colab_install(name):
    nb = nbformat.read(SOLUTIONS / name, as_version=4)
    fresh = set_header(nbformat.from_dict(nb), "solutions", name)
    for cell, expected in zip(nb.cells[:2], fresh.cells[:2]):
        assert (cell.cell_type, cell.id, cell.source) == (expected.cell_type, expected.id, expected.source)
    assert f"blob/main/solutions/{name}" in nb.cells[0].source
    student = nbformat.read(STUDENT / name, as_version=4)
    assert f"blob/main/notebooks/{name}" in student.cells[0].source


@pytest.mark.parametrize("name", NAMES)
def test_solutions_have_stored_outputs_and_every_check_passed(name):
    nb = nbformat.read(SOLUTIONS / name, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"][1:]  # all but the Colab cell
    assert all(c.execution_count for c in code), "run `python -m course build` to store outputs"
    checks = [c for c in code if re.search(r"^check\.\w+\(", c.source, re.M)]
    assert len(checks) >= 2, "each notebook has at least two exercises with checks"
    for cell in checks:
        shown = "".join(o.get("data", {}).get("text/plain", "") for o in cell.outputs)
        assert shown.startswith("✅"), f"stored check output is not a pass: {shown!r}"
        # nbval compares it (so a run of the notebook proves the check accepts the answer):
        assert "NBVAL_" not in cell.source and "nbval-ignore-output" not in cell.metadata.get("tags", []), cell.source


@pytest.mark.parametrize("name", NAMES)
def test_every_nbval_marker_is_one_nbval_reads(name):
    """nbval obeys `# NBVAL_IGNORE_OUTPUT` only as a whole line: `# NBVAL_IGNORE_OUTPUT: why` is
    silently an ordinary comment, and the cell's output is compared after all."""
    from nbval.plugin import comment_markers

    for cell in nbformat.read(SOLUTIONS / name, as_version=4).cells:
        for line in re.findall(r"^\s*#.*NBVAL_.*$", cell.source, re.M):
            assert line.strip().lstrip("#").strip() in comment_markers, f"put the marker on a line of its own: {line!r}"


def test_numbers_marked_with_a_tilde_are_compared_as_n_and_nothing_else_is(pytestconfig):
    """A measurement that changes with the CPU is printed as ``~0.88``; nbval (given
    tests/nbval_sanitize.cfg by conftest.py) compares it as ``~N``. Unmarked numbers, and a
    tilde in prose, are still compared exactly."""
    from nbval.plugin import get_sanitize_patterns

    path = pytestconfig.getoption("nbval_sanitize_with")
    assert path and path.endswith("nbval_sanitize.cfg")
    with open(path) as f:
        patterns = get_sanitize_patterns(f.read())

    def sanitize(text):
        for regex, replace in patterns:
            text = re.sub(regex, replace, text)
        return text

    assert sanitize("test loss ~0.88, accuracy ~77.0%, ~1.3e-07") == "test loss ~N, accuracy ~N, ~N"
    assert sanitize("test loss ~-1,234.5 and 0.32") == "test loss ~N and 0.32"
    assert sanitize("differ by 1.3e-07; ~ 3 s; a~b") == "differ by 1.3e-07; ~ 3 s; a~b"


@pytest.mark.parametrize("name", NAMES)
def test_student_notebooks_contain_no_solutions_and_no_outputs(name):
    solution = nbformat.read(SOLUTIONS / name, as_version=4)
    student = nbformat.read(STUDENT / name, as_version=4)
    text = "\n".join(c.source for c in student.cells)
    assert "SOLUTION" not in text
    assert text.count("✏️ your") == sum(
        c.source.count("# BEGIN SOLUTION") + len(re.findall(r"#\s*SOLUTION\s*$", c.source, re.M))
        for c in solution.cells
    )
    assert all(not c.get("outputs") for c in student.cells if c.cell_type == "code")


def test_stub_generation_rules():
    source = "\n".join(
        [
            "def f(x):",
            "    y = 1",
            "    # BEGIN SOLUTION",
            "    return x + y",
            "    # END SOLUTION",
            "answer = [1, 2]  # SOLUTION",
            "kept = 3",
        ]
    )
    assert student_source(source).splitlines() == [
        "def f(x):",
        "    y = 1",
        "    ...  # ✏️ your code here",
        "answer = ...  # ✏️ your answer",
        "kept = 3",
    ]
    for broken in ["# BEGIN SOLUTION\nx = 1", "x = 1\n# END SOLUTION", "# BEGIN SOLUTION\n# BEGIN SOLUTION"]:
        with pytest.raises(ValueError):
            student_source(broken)


def test_cells_tagged_solution_are_dropped():
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("keep"),
        nbformat.v4.new_markdown_cell("worked answer", metadata={"tags": ["solution"]}),
    ]
    student = make_student(nb, "x.ipynb")
    assert [c.source for c in student.cells[2:]] == ["keep"]


def test_stored_solutions_are_what_the_build_writes():
    from course.classroom.exercises import SOLUTIONS_FILE

    stored = json.loads(SOLUTIONS_FILE.read_text(encoding="utf-8"))
    assert stored == notebooks.all_solutions(), "course/checks/solutions.json is stale: run `python -m course build --no-execute`"


@pytest.mark.parametrize("name", NAMES)
def test_every_exercise_has_a_hint_and_a_stored_solution(name):
    import importlib

    nb = nbformat.read(SOLUTIONS / name, as_version=4)
    checks = importlib.import_module(f"course.checks.nb{name[:2]}")
    called = {m for c in nb.cells if c.cell_type == "code" for m in re.findall(r"^check\.(\w+)\(", c.source, re.M)}
    assert called
    for exercise_name in called:
        ex = getattr(checks, exercise_name)
        assert ex.hint().startswith("💡") and len(ex.hint()) > 30
        solution = ex.solution()
        assert "a solution:" in solution
        # the solution shown is the notebook's own solution code, markers removed
        assert "SOLUTION" not in solution


def test_solution_code_strips_markers():
    source = "def f(x):\n    # BEGIN SOLUTION\n    return x\n    # END SOLUTION\nanswer = 3  # SOLUTION"
    assert notebooks.solution_code(source) == "def f(x):\n    return x\nanswer = 3"


def _pair(*sources):
    """A solution notebook from cell sources, and its student version."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s, id=f"c{i}") for i, s in enumerate(sources)]
    nb = set_header(nb, "solutions", "x.ipynb")
    return nb, make_student(nb, "x.ipynb")


def test_student_run_keeps_what_depends_on_a_stub_and_what_feeds_it():
    solution, student = _pair(
        "import torch\nimport course",                          # c0: needed by c3 and c5
        "results = course.launch(job, 2)\nassert results",      # c1: a demo nothing depends on
        "assert torch.equal(results[0], results[1])",           # c2: reads only c1's result
        "model = torch.nn.Linear(2, 2)",                        # c3: feeds the payoff cell
        "def f(m):\n    # BEGIN SOLUTION\n    return m\n    # END SOLUTION",  # c4: the exercise
        "out = f(model)",                                       # c5: payoff: uses the stub
        "print(model.weight.sum())",                            # c6: model may have been changed by f
        "print(torch.ones(1))",                                 # c7: independent
    )
    assert notebooks.student_cells_to_run(solution, student) == ["c0", "c3", "c4", "c5", "c6"]


def test_student_run_keeps_mutations_and_unparsable_cells():
    solution, student = _pair(
        "import torch\nmodel = torch.nn.Linear(2, 2)",
        "model.eval()",                     # changes model, which the payoff cell reads
        "x = 1",                            # overwritten before anyone reads it
        "x = 2",
        "x +* 2",                           # cannot be analysed: always run
        "answer = 3  # SOLUTION",
        "print(answer, model.training, x)",
    )
    kept = notebooks.student_cells_to_run(solution, student)
    assert kept == ["c0", "c1", "c3", "c4", "c5", "c6"]


def test_student_run_of_a_notebook_without_exercises_is_empty():
    solution, student = _pair("import torch", "print(torch.ones(2))")
    assert notebooks.student_cells_to_run(solution, student) == []


def test_student_run_follows_statements_and_functions():
    solution, student = _pair(
        "import course\nlog = []",                                       # c0
        "def note(x):\n    log.append(x)\n    return twice()",              # c1: changes log; calls twice
        "def twice():\n    return 2 * answer",                              # c2: reads the answer when called
        "answer = 3  # SOLUTION",                                          # c3: the exercise
        "steps = 10\nprint(steps)",                                         # c4: binds, then reads: no stub
        "def hello():\n    return 1",                                       # c5
        "result = note(5)\ncourse.launch(hello, 2)",                        # c6: the stub, through note and twice
        "print(log)",                                                       # c7: note changed log
        "print(hello(), steps)",                                            # c8: passing hello did not change it
        "answer = 4\nprint(answer)",                                        # c9: rebinds: no stub any more
        "print(answer + 1)",                                                # c10
    )
    kept = notebooks.student_cells_to_run(solution, student)
    assert kept == ["c0", "c1", "c2", "c3", "c5", "c6", "c7"]


def test_a_function_rebound_to_the_courses_no_longer_reads_the_stub():
    # Notebook 15: the notebook's RingAttention calls the stub ring_forward; then the cell rebinds
    # RingAttention to the course's class, and the cells after it use that one.
    solution, student = _pair(
        "import course",
        "def ring(x):\n    # BEGIN SOLUTION\n    return x\n    # END SOLUTION",       # c1: the exercise
        "class Ring:\n    def apply(x):\n        return ring(x)\n\n\nRing = course.Ring",  # c2
        "print(Ring.apply(1))",                                                    # c3: the course's Ring
        "class Mine:\n    def apply(x):\n        return ring(x)",                     # c4
        "print(Mine.apply(1))",                                                    # c5: still the stub
        "Mine = 1\nprint(Mine)",                                                    # c6: rebound
    )
    assert notebooks.student_cells_to_run(solution, student) == ["c0", "c1", "c2", "c4", "c5"]


def test_an_exercise_that_calls_a_notebook_function_does_not_change_it():
    # Notebook 10: the OverlapPerParameter stub keeps replicate(model); the later cells that call
    # replicate call the same function in both runs. What the exercise reads otherwise may change.
    solution, student = _pair(
        "def replicate(m):\n    return m\nmodel = [1]",
        "def f(m):\n    replicate(model)\n    # BEGIN SOLUTION\n    return m\n    # END SOLUTION",  # c1
        "print(replicate(2))",                                     # c2: the same function in both runs
        "print(model)",                                            # c3: the exercise read model: may change it
    )
    assert notebooks.student_cells_to_run(solution, student) == ["c0", "c1", "c3"]


def test_passing_a_number_to_the_stub_does_not_change_it():
    # Notebook 17: yours = interleaved_1f1b(P, M, V) cannot change P, M or V, bound to numbers.
    solution, student = _pair(
        "P, M = 4, 2 ** 3\nlog = []",
        "def f(*a):\n    # BEGIN SOLUTION\n    return a\n    # END SOLUTION",  # c1: the exercise
        "yours = f(P, M, log)",                                               # c2: calls the stub
        "print(P * M)",                                                       # c3: the same numbers
        "print(log)",                                                         # c4: a list f may change
    )
    assert notebooks.student_cells_to_run(solution, student) == ["c0", "c1", "c2", "c4"]


def test_a_loop_or_with_target_is_bound_before_its_body_reads_it():
    solution, student = _pair(
        "answer = 3  # SOLUTION",
        "for answer in range(2):\n    print(answer)",   # reads only range: independent of the stub
        "with open('f') as answer:\n    print(answer)",
    )
    assert notebooks.student_cells_to_run(solution, student) == ["c0"]
    solution, student = _pair("answer = 3  # SOLUTION", "answer += 1")  # reads the stub's answer
    assert notebooks.student_cells_to_run(solution, student) == ["c0", "c1"]


def test_a_trailing_newline_does_not_make_a_cell_differ():
    # The build writes each student cell without trailing newlines; the solution's may have one.
    solution, student = _pair("answer = 3  # SOLUTION", "import time\ntime.sleep(9)\n")
    sources = [({c.id: c.source for c in nb.cells})["c1"] for nb in (solution, student)]
    assert sources == ["import time\ntime.sleep(9)\n", "import time\ntime.sleep(9)"]  # the build dropped it ...
    assert notebooks.student_cells_to_run(solution, student) == ["c0"]  # ... and it is still the same cell


def test_definitions_are_the_code_a_student_sees_with_decorators_and_without_markers(tmp_path):
    from course.classroom.notebooks import definitions

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("%pip install course", id="colab-install"),
        nbformat.v4.new_code_cell("import dataclasses\n\n@dataclasses.dataclass\nclass Point:\n    x: int\n\nPOINT = Point(1)"),
        nbformat.v4.new_code_cell("def answer(x):\n    # BEGIN SOLUTION\n    return x + 1  # SOLUTION\n    # END SOLUTION\n"),
        nbformat.v4.new_markdown_cell("def not_code():"),
    ]
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, path)
    assert definitions(path) == {
        "Point": "@dataclasses.dataclass\nclass Point:\n    x: int",
        "answer": "def answer(x):\n    return x + 1",
    }


WIDTH = 100  # JupyterLab breaks a stdout line mid-word past ~103 characters (1280 px, file browser open)


@pytest.mark.parametrize("name", NAMES)
def test_printed_lines_fit_the_output_area(name):
    """Every stdout line a solution notebook stores is at most WIDTH characters: wider ones break
    mid-word in JupyterLab ("conv|ert"); a wider table belongs in rich output (HTML), which scrolls."""
    nb = nbformat.read(SOLUTIONS / name, as_version=4)
    wide = [(cell.get("id"), len(line), line) for cell in nb.cells if cell.cell_type == "code"
            for output in cell.outputs if output.output_type == "stream" and output.name == "stdout"
            for line in output.text.splitlines() if len(line) > WIDTH]
    assert wide == [], f"{len(wide)} printed line(s) wider than {WIDTH} characters"


@pytest.mark.parametrize("name", NAMES)
def test_solutions_carry_no_empty_outputs(name):
    """course.launch's live display is created only when it has something to show and emptied at
    the end; the build drops an emptied one (notebooks.execute): none is stored."""
    nb = nbformat.read(SOLUTIONS / name, as_version=4)
    empty = [cell.get("id") for cell in nb.cells if cell.cell_type == "code"
             for output in cell.outputs if output.output_type == "display_data" and not output.get("data")]
    assert empty == []


def test_reading_notebooks_does_not_build_the_iri_parser_and_iris_are_still_checked():
    """course.classroom defers rfc3987-syntax's 2-3 s parser build (pyproject's `-p course.classroom`
    loads it before nbval imports nbformat); jsonschema's IRI check must still work when used."""
    import subprocess
    import sys

    code = (
        "import sys, course.classroom, nbformat, jsonschema\n"
        "nbformat.validate(nbformat.v4.new_notebook())\n"
        "print('lark' in sys.modules)\n"
        "check = jsonschema.FormatChecker()\n"
        "print(check.conforms('https://example.org/a', 'iri'), check.conforms('ht tp://a b', 'iri'),\n"
        "      check.conforms('ht tp://a b', 'iri-reference'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    pytest.importorskip("rfc3987_syntax")
    assert out == ["False", "True", "False", "False"]
