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

import ast
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
        if cell.cell_type == "code":  # course.launch's live display, emptied when the launch ended
            cell.outputs = [o for o in cell.outputs if not (o.output_type == "display_data" and not o.data)]
    return nb


# ------------------------------------------------------------ what a student run must execute
#
# A student notebook is its solution notebook with the answers replaced by stubs. The
# solution run (nbval, outputs compared) already executes every cell. In the student run
# a cell can only behave differently if it reads something that depends on a stub, so
# the test suite runs a student notebook's cells that (a) differ from the solution, or
# (b) read a name that depends on a stub, or (c) bind something such a cell reads later.
# The others are byte-identical cells, already executed in the same state by the solution
# run; leaving them out of the student run is what keeps the suite fast. A cell that
# mutates an object (``model.eval()``, ``x[0] = 1``) counts as binding that name.


def _cell_names(source: str):
    """What a code cell does with global names: ``reads`` (loads, also inside its
    functions), ``binds`` (assigns, defines, imports), ``kills`` (surely rebinds at top
    level without reading), ``imports``, and ``changes``: names whose object a top-level
    statement may change (``x.a = ..``, ``x[i] = ..``, ``x.f(...)``, ``f(x)``; a call of a
    module's function, ``torch.manual_seed(0)``, changes the module only).
    None if the cell cannot be parsed."""
    import builtins
    import symtable

    from IPython.core.inputtransformer2 import TransformerManager

    code = TransformerManager().transform_cell(source)
    try:
        tree, table = ast.parse(code), symtable.symtable(code, "<cell>", "exec")
    except SyntaxError:
        return None
    n = {"reads": set(), "binds": set(), "imports": set(), "changes": set(), "stored": set()}

    def visit(scope):
        for sym in scope.get_symbols():
            name = sym.get_name()
            if sym.is_referenced() and (scope.get_type() == "module" or sym.is_global()):
                n["reads"].add(name)
            if scope.get_type() == "module" and (sym.is_assigned() or sym.is_imported()):
                n["binds"].add(name)
            if scope.get_type() == "module" and sym.is_imported():
                n["imports"].add(name)
        for child in scope.get_children():
            visit(child)

    visit(table)
    if any(isinstance(x, ast.ImportFrom) and any(a.name == "*" for a in x.names) for x in ast.walk(tree)):
        return None
    n["reads"] -= set(dir(builtins))

    def base_name(node):
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    def top_level(node):  # the statement's own code, not the bodies of functions it defines
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                yield from top_level(child)

    for stmt in tree.body:
        for node in top_level(stmt):
            if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, ast.Store):
                n["stored"].add(base_name(node.value))
            elif isinstance(node, ast.Call):
                n["changes"] |= {base_name(a) for a in [*node.args, *(k.value for k in node.keywords)]}
                if isinstance(node.func, ast.Attribute):
                    n["changes"].add(base_name(node.func.value))
    n["changes"] -= {None}
    n["stored"] -= {None}
    kills, loop_vars = set(), set()
    for stmt in tree.body:
        if isinstance(stmt, (ast.For, ast.With)):
            targets = [stmt.target] if isinstance(stmt, ast.For) else [w.optional_vars for w in stmt.items if w.optional_vars]
            loop_vars |= {x.id for t in targets for x in ast.walk(t) if isinstance(x, ast.Name)}
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            kills |= {x.id for t in targets if isinstance(t, (ast.Name, ast.Tuple)) for x in ast.walk(t) if isinstance(x, ast.Name)}
        elif isinstance(stmt, (ast.For, ast.With)):  # bound before the body reads them
            kills |= loop_vars
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)):
            kills |= n["binds"] & ({getattr(stmt, "name", None)} | {(a.asname or a.name).split(".")[0] for a in getattr(stmt, "names", [])})
    n["kills"] = kills - (n["reads"] - loop_vars)
    return n


def student_cells_to_run(solution_nb, student_nb) -> list[str]:
    """Ids of the student notebook's code cells that a student run must execute."""
    solution = {c.get("id"): c.source for c in solution_nb.cells if c.cell_type == "code"}
    cells = [(i, c) for i, c in enumerate(student_nb.cells) if c.cell_type == "code"]
    names = {i: _cell_names(c.source) for i, c in cells}
    modules = set().union(*(n["imports"] for n in names.values() if n))
    # A call of a module's function (torch.manual_seed, course.launch) changes no object
    # of the notebook's except the module; x.f(...) or f(x) may change x.
    changes = {i: n["binds"] | n["stored"] | (n["changes"] - modules) for i, n in names.items() if n}
    # forward: which cells depend on a stub. A dependent cell may also have changed any
    # object it read (it may pass `model` to the student's function), except a module;
    # what it imports is the same object in both versions (`from course.checks import nb03 as check`).
    tainted, dependent = set(), set()
    for i, cell in cells:
        n = names[i]
        if solution.get(cell.get("id")) != cell.source or n is None or n["reads"] & tainted:
            dependent.add(i)
            if n is not None:
                tainted |= (changes[i] - n["imports"]) | (n["reads"] - modules)
    # backward: keep the dependent cells and whatever they (transitively) need
    needed, keep = set(), []
    for i, cell in reversed(cells):
        n = names[i]
        if n is None or i in dependent or changes[i] & needed:
            keep.append(i)
            if n is not None:
                needed = (needed - n["kills"]) | n["reads"]
    return [cell.get("id") for i, cell in cells if i in keep]


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
                if any(re.search(rf"^(def {n}\(|class {n}\b|{n}\s*(,[^=]*)?=)", src, re.M) for n in names)
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
