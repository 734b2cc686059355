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

ROOT = Path(__file__).resolve().parents[2]
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


def colab_url(folder: str, name: str) -> str:
    """Where Colab opens ``folder/name`` of the course's repository (its main branch)."""
    return f"https://colab.research.google.com/github/{REPO}/blob/main/{folder}/{name}"


def colab_badge(folder: str, name: str) -> str:
    url = colab_url(folder, name)
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


# What JupyterLab writes into a notebook's metadata when it starts the kernel (ipykernel >= 6
# names its kernel "Python 3 (ipykernel)"): stored the same, a notebook opens unmodified. The
# language_info beside it is the kernel's (nbclient stores it when the build executes), so it
# matches wherever the Python version is the build's.
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def set_metadata(nb):
    """The kernelspec JupyterLab would write (see KERNELSPEC)."""
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
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
        if cell.cell_type == "code":  # a live display only emptied (course.runtime.live: the cell that imports course)
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
# run; leaving them out of the student run is what keeps the suite fast. The analysis
# goes statement by statement: a statement that mutates an object (``model.eval()``,
# ``x[0] = 1``, ``f(x)``) counts as binding that name; one that calls a function of the
# notebook's also reads what that function reads and changes what it changes; and a name
# that a statement rebinds from values that do not depend on a stub no longer depends on it
# (``from course.parallel.zero import zero1_step`` after the exercise: the cells after it use the
# course's version). It errs on the side of running a cell.


def _cell_names(source: str):
    """What a code cell does with global names, statement by statement; None if it cannot
    be parsed. For each top-level statement: ``reads``, the globals it loads that the cell
    has not surely bound before it (also inside the functions it defines); ``binds``, every
    name it binds; ``sure``, those it surely binds (assignment, def, class, import);
    ``stored``, objects it stores into (``x.a = ..``, ``x[i] = ..``); ``passed``, objects
    whose method it calls or that it passes to a call (``x.f()``, ``f(x)``: may change x).
    ``functions``: for each function or class the cell defines, the globals it uses and
    those of them it may change when called (``log.append(e)``)."""
    import builtins
    import symtable

    from IPython.core.inputtransformer2 import TransformerManager

    code = TransformerManager().transform_cell(source)
    try:
        tree, table = ast.parse(code), symtable.symtable(code, "<cell>", "exec")
    except SyntaxError:
        return None
    if any(isinstance(x, ast.ImportFrom) and any(a.name == "*" for a in x.names) for x in ast.walk(tree)):
        return None

    def globals_in(scope):  # the global names a scope and the scopes inside it use
        own = {s.get_name() for s in scope.get_symbols()
               if s.is_global() or (scope.get_type() == "module" and s.is_referenced())}
        return own.union(*(globals_in(child) for child in scope.get_children())) - set(dir(builtins))

    def base_name(node):
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    def own_code(*nodes):  # the statements' own code, not the bodies of functions they define
        for node in nodes:
            yield node
            yield from own_code(*(c for c in ast.iter_child_nodes(node)
                              if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef))))

    def loads(*nodes):  # every name loaded, also in function bodies
        return {x.id for node in nodes for x in ast.walk(node) if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Load)}

    def names_in(*targets):
        return {x.id for t in targets if t is not None for x in ast.walk(t) if isinstance(x, ast.Name)}

    def literal(node):  # a number, string, ... or a tuple of them: nothing a call could change
        if isinstance(node, ast.Tuple):
            return all(map(literal, node.elts))
        if isinstance(node, (ast.UnaryOp, ast.BinOp)):
            return all(literal(c) for c in ast.iter_child_nodes(node) if isinstance(c, ast.expr))
        return isinstance(node, ast.Constant)

    def mutations(nodes):
        stored, passed = set(), set()
        for node in nodes:
            if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del)):
                stored.add(base_name(node.value))
            elif isinstance(node, ast.Call):
                passed |= {base_name(a) for a in [*node.args, *(k.value for k in node.keywords)]}
                if isinstance(node.func, ast.Attribute):
                    passed.add(base_name(node.func.value))
        return stored - {None}, passed - {None}

    global_names = globals_in(table)
    scopes = {child.get_name(): child for child in table.get_children()}
    n = {"statements": [], "functions": {}, "imports": set()}
    surely_bound = set()
    for stmt in tree.body:
        if isinstance(stmt, (ast.For, ast.AsyncFor)):  # the loop variable is bound before the body reads it
            reads = loads(stmt.iter, *stmt.orelse) | (loads(*stmt.body) - names_in(stmt.target))
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            reads = loads(*(w.context_expr for w in stmt.items)) | (loads(*stmt.body) - names_in(*(w.optional_vars for w in stmt.items)))
        else:
            reads = loads(stmt) | ({base_name(stmt.target)} if isinstance(stmt, ast.AugAssign) else set())
        imports = {(a.asname or a.name).split(".")[0] for x in own_code(stmt) if isinstance(x, (ast.Import, ast.ImportFrom)) for a in x.names}
        binds = imports | {x.id for x in own_code(stmt) if isinstance(x, ast.Name) and isinstance(x.ctx, (ast.Store, ast.Del))}
        if isinstance(stmt, ast.Assign):
            sure = names_in(*stmt.targets)
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            sure = names_in(stmt.target)
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            sure = {stmt.name}
            uses = globals_in(scopes[stmt.name])
            n["functions"][stmt.name] = {"uses": uses, "changes": set().union(*mutations(ast.walk(stmt))) & uses}
        else:
            sure = imports if isinstance(stmt, (ast.Import, ast.ImportFrom)) else set()
        binds |= sure
        stored, passed = mutations(own_code(stmt))
        defines = stmt.name if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else None
        constants = names_in(*stmt.targets) if isinstance(stmt, ast.Assign) and literal(stmt.value) else set()
        n["statements"].append({"reads": reads & global_names - surely_bound, "binds": binds, "sure": sure,
                                "stored": stored, "passed": passed, "imports": imports, "defines": defines,
                                "constants": constants})
        n["imports"] |= imports
        surely_bound |= sure
    n["reads"] = set().union(*(s["reads"] for s in n["statements"]))
    n["kills"] = surely_bound
    return n


def _closure(names, functions, key) -> set:
    """For the notebook's functions among ``names`` and those they call: the union of their
    ``key`` ("uses": the globals they use, "changes": those they may change)."""
    seen, todo, found = set(), [x for x in names if x in functions], set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            found |= functions[name][key]
            todo += [x for x in functions[name]["uses"] if x in functions]
    return found


def student_cells_to_run(solution_nb, student_nb) -> list[str]:
    """Ids of the student notebook's code cells that a student run must execute."""
    solution = {c.get("id"): c.source for c in solution_nb.cells if c.cell_type == "code"}
    cells = [(i, c) for i, c in enumerate(student_nb.cells) if c.cell_type == "code"]
    names = {i: _cell_names(c.source) for i, c in cells}
    modules = set().union(*(n["imports"] for n in names.values() if n))
    defined = set().union(*(n["functions"] for n in names.values() if n))

    # What a statement may change: what it binds or stores into, and what it passes to a
    # call, except a module (torch.manual_seed(0), course.launch(...) change no object of
    # the notebook's) or a function or class of the notebook's (launch(train, 2)).
    # Nor does passing a name bound to a literal change it (P, M = 4, 8; f(P, M)).
    def changes(s, constants=frozenset()):
        return s["binds"] | s["stored"] | (s["passed"] - modules - defined - constants)

    # forward: which statements depend on a stub. One that reads a dependent name, directly
    # or through a function it calls, may change whatever it changes and whatever those
    # functions change; one that does not, rebinds its names to the solution run's values.
    # A cell that differs from the solution depends on the stub, and so does all it reads but the
    # notebook's functions (calling one changes what the function changes, as above).
    # What a statement imports is the same object in both versions (from course.checks import nb03 as check).
    # A function's or class's description holds from its definition until its name is rebound
    # (RingAttention = context_parallel.RingAttention: the course's class, not the notebook's).
    tainted, dependent, functions, current, constants = set(), set(), {}, {}, set()
    for i, cell in cells:
        n = names[i]
        if n is None:
            dependent.add(i)
            continue
        differs = (solution.get(cell.get("id")) or "").rstrip() != cell.source.rstrip()  # the build drops trailing newlines
        for s in n["statements"]:
            if differs or (s["reads"] | _closure(s["reads"], current, "uses")) & tainted:
                dependent.add(i)
                tainted |= changes(s, constants) - s["imports"]
                tainted |= _closure(s["reads"], current, "changes") - modules - defined - constants
                tainted |= s["reads"] - modules - set(current) if differs else set()  # reading a function changes nothing
            else:
                tainted -= s["sure"]
            for name in s["binds"]:
                current.pop(name, None)
            constants = (constants - s["binds"]) | s["constants"]
            if s["defines"]:
                current[s["defines"]] = n["functions"][s["defines"]]
        functions.update(n["functions"])
    # backward: keep the dependent cells and whatever they (or the functions they call) need
    needed, keep = set(), []
    for i, cell in reversed(cells):
        n = names[i]
        if n is None or i in dependent or set().union(*map(changes, n["statements"])) & needed:
            keep.append(i)
            if n is not None:
                needed = (needed - n["kills"]) | n["reads"] | _closure(n["reads"], functions, "uses")
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


def definitions(path: Path) -> dict:
    """{name: source} of each function and class a solution notebook defines at the top level of a
    cell (with its decorators, solution markers removed). Tests compare it with
    ``inspect.getsource`` of the package's copy: the notebook shows the very code the package holds."""
    found = {}
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code" or cell.get("id") == "colab-install":  # IPython's %pip is not Python
            continue
        code = solution_code(cell.source)
        lines = code.splitlines()
        for node in ast.parse(code).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                found[node.name] = "\n".join(lines[first - 1:node.end_lineno])
    return found


def answer_cells(nb, names) -> list:
    """The cells marked ``SOLUTION`` that define any of ``names``: an exercise's answer cells."""
    return [
        c for c in nb.cells
        if c.cell_type == "code" and "SOLUTION" in c.source
        and any(re.search(rf"^(def {n}\(|class {n}\b|{n}\s*(,[^=]*)?=)", c.source, re.M) for n in names)
    ]


def exercise_solutions(nb) -> dict:
    """{exercise: solution code} for one solution notebook. An exercise is a call
    ``check.NAME(answer, ...)``; its solution is the marked cell that defines the answers."""
    found = {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for call in _CHECK_CALL.finditer(cell.source):
            defines = answer_cells(nb, re.findall(r"\b([A-Za-z_]\w*)\b", call["args"]))
            if defines:
                found[call["exercise"]] = "\n\n".join(solution_code(c.source) for c in defines)
    return found


def all_solutions() -> dict:
    """{notebook number: {exercise: solution code}} for every solution notebook."""
    return {
        path.name[:2]: exercise_solutions(nbformat.read(path, as_version=4)) for path in solution_paths()
    }


def write_solutions(path: Path):
    path.write_text(json.dumps(all_solutions(), indent=1, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")


def exercise_answers(nb) -> list:
    """For one solution notebook, in its order, each exercise's ``check`` (its name), ``answers``
    (the names its ``check.NAME(answer, ...)`` call passes), ``check_cell`` and ``answer_cells``
    (cell ids). ``python -m course grade`` reads them to know what to take out of a student's
    notebook, and when: after the check's cell (the notebook may rebind the names later)."""
    found = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for call in _CHECK_CALL.finditer(cell.source):
            args = ast.parse(f"f({call['args']})", mode="eval").body
            if args.keywords or not all(isinstance(a, ast.Name) for a in args.args):
                raise ValueError(f"check.{call['exercise']}({call['args']}): pass the answers by name only, "
                                 "so that the grader knows which names to take from a student's notebook")
            names = [a.id for a in args.args]
            found.append({"check": call["exercise"], "answers": names, "check_cell": cell.get("id"),
                          "answer_cells": [c.get("id") for c in answer_cells(nb, names)]})
    return found


def all_exercise_answers() -> dict:
    """{notebook number: {"file": its file name, "exercises": exercise_answers(...)}} for every solution notebook."""
    return {
        path.name[:2]: {"file": path.name, "exercises": exercise_answers(nbformat.read(path, as_version=4))}
        for path in solution_paths()
    }


def write_exercise_answers(path: Path):
    path.write_text(json.dumps(all_exercise_answers(), indent=1, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")


def write(nb, path: Path):
    nbformat.validate(nb)
    path.write_text(nbformat.writes(nb) + "\n", encoding="utf-8")


def build(names=(), run: bool = True):
    """Execute the solutions (if ``run``) and regenerate the student notebooks."""
    STUDENT.mkdir(exist_ok=True)
    for path in solution_paths(names):
        nb = set_metadata(set_header(nbformat.read(path, as_version=4), "solutions", path.name))
        if run:
            print(f"executing {path.relative_to(ROOT)} ...", flush=True)
            execute(nb, path.parent)
        write(nb, path)
        write(make_student(nb, path.name), STUDENT / path.name)
        print(f"wrote {(STUDENT / path.name).relative_to(ROOT)}")
    from course.classroom.exercises import SOLUTIONS_FILE

    write_solutions(SOLUTIONS_FILE)
    write_exercise_answers(SOLUTIONS_FILE.with_name("answers.json"))
