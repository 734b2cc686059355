"""Build the course's notebooks: solutions are the single source, student versions are made.

``python -m course build`` re-executes every notebook in ``solutions/`` (storing the
outputs that nbval compares) and then writes ``notebooks/`` from them:

* a line ``name = value  # SOLUTION`` becomes ``name = ...  # ✏️ your answer``;
* the lines between ``# BEGIN SOLUTION`` and ``# END SOLUTION`` become one line
  ``...  # ✏️ your code here`` at the same indentation (a function body of ``...``
  returns None, which the checks report as "not attempted yet");
* cells tagged ``solution`` are dropped (worked answers, discussion);
* outputs and execution counts are cleared, and the Colab badge points at the
  student version.

Every notebook begins with the same two cells, written here: the "Open in Colab" badge
and a cell that installs the course when (and only when) it runs on Colab.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "solutions"
STUDENT = ROOT / "notebooks"


def repository_url(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """The course's GitHub URL, from ``Repository`` in pyproject's ``[project.urls]``:
    the one place to change when you fork the course (then run the build)."""
    text = pyproject.read_text(encoding="utf-8")
    try:
        import tomllib  # Python 3.11+

        url = tomllib.loads(text)["project"]["urls"]["Repository"]
    except ImportError:  # Python 3.10: the line is simple enough to read directly
        url = re.search(r'^Repository\s*=\s*"([^"]+)"', text, re.M)[1]
    match = re.fullmatch(r"https://github\.com/([\w.-]+/[\w.-]+?)(?:\.git)?/?", url)
    if not match:
        raise ValueError(f"pyproject.toml: Repository = {url!r} is not https://github.com/OWNER/NAME (Colab opens GitHub)")
    return f"https://github.com/{match[1]}"


# owner/name, for the Colab links (None in an installed copy, which has no pyproject.toml and no notebooks)
REPO = repository_url().removeprefix("https://github.com/") if (ROOT / "pyproject.toml").exists() else None

_LINE = re.compile(r"^(?P<lhs>\s*[^=#]+?=)\s*(?P<rhs>.*?)\s*#\s*SOLUTION\s*$")
_BEGIN = re.compile(r"^(?P<indent>\s*)#\s*BEGIN SOLUTION\s*$")
_END = re.compile(r"^\s*#\s*END SOLUTION\s*$")

COLAB_INSTALL = f"""\
# On Colab, install the course package (Colab already has torch and torchvision).
# Anywhere else this cell does nothing: install the course as the README says.
import sys

if "google.colab" in sys.modules:
    %pip install --quiet "ddp-course @ git+https://github.com/{REPO}"
"""


def colab_badge(folder: str, name: str) -> str:
    url = f"https://colab.research.google.com/github/{REPO}/blob/main/{folder}/{name}"
    return f'<a href="{url}" target="_parent"><img src="https://colab.research.google.com/assets/colab-badge.svg" alt="Open In Colab"/></a>'


def student_source(source: str) -> str:
    """Replace the solution parts of one code cell's source by stubs."""
    out, inside = [], False
    for line in source.splitlines():
        begin = _BEGIN.match(line)
        if begin:
            if inside:
                raise ValueError(f"nested '# BEGIN SOLUTION' in:\n{source}")
            inside = True
            out.append(f"{begin['indent']}...  # ✏️ your code here")
        elif _END.match(line):
            if not inside:
                raise ValueError(f"'# END SOLUTION' without BEGIN in:\n{source}")
            inside = False
        elif not inside:
            single = _LINE.match(line)
            out.append(f"{single['lhs']} ...  # ✏️ your answer" if single else line)
    if inside:
        raise ValueError(f"'# BEGIN SOLUTION' without END in:\n{source}")
    return "\n".join(out)


def set_header(nb, folder: str, name: str):
    """Make the first two cells the badge and the Colab install cell."""
    badge = nbformat.v4.new_markdown_cell(colab_badge(folder, name), id="colab-badge")
    install = nbformat.v4.new_code_cell(COLAB_INSTALL, id="colab-install")
    has_header = len(nb.cells) >= 2 and nb.cells[0].get("id") == "colab-badge"
    if has_header and [c.source for c in nb.cells[:2]] == [badge.source, install.source]:
        return nb  # unchanged: keep its stored output and execution count
    nb.cells[: 2 if has_header else 0] = [badge, install]
    return nb


def make_student(solution_nb, name: str):
    nb = nbformat.from_dict(solution_nb)  # a deep copy
    nb.cells = [c for c in nb.cells if "solution" not in c.get("metadata", {}).get("tags", [])]
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.source = student_source(cell.source)
            cell.outputs = []
            cell.execution_count = None
    return set_header(nb, "notebooks", name)


def execute(nb, cwd: Path, timeout: int = 600):
    """Run every cell in a fresh kernel and store the outputs (no timing metadata)."""
    from nbclient import NotebookClient

    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    return nb


def solution_paths(names=()):
    paths = sorted(SOLUTIONS.glob("[0-9][0-9]_*.ipynb"))
    if names:
        paths = [p for p in paths if any(n in p.name for n in names)]
    return paths


_CHECK_CALL = re.compile(r"^check\.(?P<exercise>\w+)\((?P<args>.*)\)\s*$", re.M)


def solution_code(source: str) -> str:
    """One code cell's source with the solution markers removed: what ``solution()`` shows."""
    lines = [line for line in source.splitlines() if not (_BEGIN.match(line) or _END.match(line))]
    return "\n".join(re.sub(r"\s*#\s*SOLUTION\s*$", "", line) for line in lines).strip()


def exercise_solutions(nb) -> dict:
    """{exercise: solution code} for one solution notebook. An exercise is a call
    ``check.NAME(answer, ...)``; its solution is the marked cell that defines the answers."""
    marked = [c.source for c in nb.cells if c.cell_type == "code" and "SOLUTION" in c.source]
    found = {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for call in _CHECK_CALL.finditer(cell.source):
            names = re.findall(r"\b([A-Za-z_]\w*)\b", call["args"])
            defines = [
                src for src in marked
                if any(re.search(rf"^(def {n}\(|{n}\s*(,[^=]*)?=)", src, re.M) for n in names)
            ]
            if defines:
                found[call["exercise"]] = "\n\n".join(solution_code(src) for src in defines)
    return found


def all_solutions() -> dict:
    """{notebook number: {exercise: solution code}} for every solution notebook."""
    return {
        path.name[:2]: exercise_solutions(nbformat.read(path, as_version=4)) for path in solution_paths()
    }


def write_solutions(path: Path):
    path.write_text(json.dumps(all_solutions(), indent=1, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")


def write(nb, path: Path):
    nbformat.validate(nb)
    path.write_text(nbformat.writes(nb) + "\n", encoding="utf-8")


def build(names=(), run: bool = True):
    """Execute the solutions (if ``run``) and regenerate the student notebooks."""
    STUDENT.mkdir(exist_ok=True)
    for path in solution_paths(names):
        nb = set_header(nbformat.read(path, as_version=4), "solutions", path.name)
        if run:
            print(f"executing {path.relative_to(ROOT)} ...", flush=True)
            execute(nb, path.parent)
        write(nb, path)
        write(make_student(nb, path.name), STUDENT / path.name)
        print(f"wrote {(STUDENT / path.name).relative_to(ROOT)}")
    from course.exercises import SOLUTIONS_FILE

    write_solutions(SOLUTIONS_FILE)
