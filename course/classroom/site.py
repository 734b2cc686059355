"""``python -m course site``: the course as a static website, with every notebook's stored outputs.

The site is built with Sphinx, MyST-NB and the Sphinx Book Theme (configured in ``site/conf.py``),
from ``solutions/`` with the outputs stored there: the ones nbval compares, never re-run here. This
module writes the pages Sphinx reads into a staging folder, then runs Sphinx:

* the landing page (``site/index.md``) with one section per part, each notebook a chapter, found
  by its file name (``NN_*.ipynb``: 01-09 Part I, 10-14 Part II, 15 on Part III);
* each chapter is its solution notebook, changed only for the reader: the Colab header cells give
  way to links to the *student* version (Open in Colab, Download), each exercise's cell shows the
  student's stub and hides the solution in a collapsed block (the cells ``python -m course build``
  takes out of the student version), and very long outputs are trimmed;
* a page for instructors (README's grading section) and the ``course`` package's API (autodoc).

Sphinx runs with warnings as errors (``-W -n``): a broken link or cross-reference fails the build.
After it, each chapter's page and its images must fit in ``CHAPTER_BUDGET``.
"""

from __future__ import annotations

import copy
import os
import pkgutil
import re
import shutil
import time
from pathlib import Path

import nbformat

from course.classroom.notebooks import ROOT, SOLUTIONS, STUDENT, colab_url, student_source

SITE = ROOT / "site"  # conf.py, the landing page and the stylesheet
OUT = ROOT / "build" / "site"  # git-ignored, like every build output
PARTS = (  # (caption, first notebook, last notebook or None)
    ("Part I — DDP", 1, 9),
    ("Part II — beyond DDP", 10, 14),
    ("Part III — the rest of modern training, built by hand", 15, None),
)
API_FOLDERS = ("runtime", "observe", "training", "parallel", "classroom")  # the layers, bottom up
CHAPTER_BUDGET = 2 * 1024 * 1024  # bytes: a chapter's page and its images
MAX_OUTPUT_LINES = 60  # an output longer than this shows its first and last lines
SOLUTION_PROMPTS = {"code_prompt_show": "Show the solution", "code_prompt_hide": "Hide the solution"}
CHAPTERS_MARKER = "<!-- the parts and chapters: written by course/classroom/site.py -->"


class SiteError(Exception):
    """The site could not be built: Sphinx's warnings, or a chapter over its budget."""


def chapters(solutions: Path = SOLUTIONS) -> list[Path]:
    """The course's notebooks, in order: every ``NN_*.ipynb`` in ``solutions``."""
    return sorted(solutions.glob("[0-9][0-9]_*.ipynb"))


def part_of(notebook: Path) -> str:
    """The caption of the part a notebook belongs to, from its number."""
    number = int(notebook.name[:2])
    for caption, first, last in PARTS:
        if first <= number and (last is None or number <= last):
            return caption
    raise ValueError(f"{notebook.name}: no part holds notebook {number}")


def is_solution(cell) -> bool:
    """A cell the student version leaves out (tagged ``solution``) or replaces by a stub."""
    if "solution" in cell.get("metadata", {}).get("tags", []):
        return True
    return cell.cell_type == "code" and student_source(cell.source) != "\n".join(cell.source.splitlines())


def trim(text: str, limit: int = MAX_OUTPUT_LINES) -> str:
    """``text`` with at most ``limit`` lines: its first and last ones, and how many were left out."""
    lines = text.splitlines(keepends=True)
    if len(lines) <= limit:
        return text
    head, tail = lines[: limit // 2], lines[len(lines) - limit // 2 :]
    note = f"… {len(lines) - len(head) - len(tail)} lines left out here (the notebook shows them all) …\n"
    return "".join(head + [note] + tail)


def trim_outputs(cell):
    """Trim a code cell's long text outputs in place (see ``trim``)."""
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            output.text = trim(output.text)
        elif "text/plain" in output.get("data", {}) and len(output.data) == 1:
            output.data["text/plain"] = trim(output.data["text/plain"])


def exercise_stub(cell) -> nbformat.NotebookNode:
    """A Markdown cell that shows what the student notebook has in place of this solution cell."""
    return nbformat.v4.new_markdown_cell(
        "````{admonition} ✏️ Exercise: your code goes here\n:class: exercise\n\n"
        "The student notebook has this cell; fill it in and run the check below it.\n\n"
        f"```python\n{student_source(cell.source)}\n```\n````"
    )


def hidden_solution(cell) -> list:
    """The solution cell, collapsed until the reader opens it (a Markdown cell: in <details>)."""
    cell = copy.deepcopy(cell)
    tags = cell.metadata.setdefault("tags", [])
    if "solution" not in tags:
        tags.append("solution")
    if cell.cell_type == "markdown":
        show = SOLUTION_PROMPTS["code_prompt_show"]
        cell.source = f'<details class="hide solution">\n<summary>{show}</summary>\n\n{cell.source}\n\n</details>'
    else:
        tags.append("hide-cell")
        cell.metadata["mystnb"] = dict(SOLUTION_PROMPTS)
    return [cell]


def chapter(solution: Path, student: Path, page: Path) -> nbformat.NotebookNode:
    """The chapter of ``solution`` (a solution notebook), to be written at ``page``: its stored
    outputs, links to the student version, exercises with their solutions hidden."""
    nb = nbformat.read(solution, as_version=4)
    cells = [c for c in nb.cells if c.get("id") not in ("colab-badge", "colab-install")]
    title = next((c for c in cells if c.cell_type == "markdown" and c.source.startswith("# ")), None)
    if title is None:
        raise SiteError(f"{solution.name} has no title: a Markdown cell that starts with '# '")
    download = Path(os.path.relpath(student, page.parent)).as_posix()
    heading, _, rest = title.source.partition("\n")
    title.source = (f"{heading}\n\n:::{{container}} chapter-links\n"
                    f"The student version, with the exercises to fill in: [Open in Colab]({colab_url('notebooks', student.name)})"
                    f" · [Download the notebook](path:{download})\n:::\n{rest}")
    out = []
    for cell in cells:
        if cell.cell_type == "code":
            trim_outputs(cell)
        if not is_solution(cell):
            out.append(cell)
            continue
        if cell.cell_type == "code" and "solution" not in cell.metadata.get("tags", []):
            out.append(exercise_stub(cell))
        out.extend(hidden_solution(cell))
    nb.cells = out
    return nb


def readme_section(heading: str, readme: Path = ROOT / "README.md") -> str:
    """The text of README.md's section ``## heading``, up to the next section of that level."""
    text = readme.read_text(encoding="utf-8")
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    if not match:
        raise SiteError(f"README.md has no section '## {heading}'")
    return match[1].strip()


def instructors_page(readme: Path = ROOT / "README.md") -> str:
    install = readme_section("Install, run, test", readme)
    doctor = re.search(r"^\*\*Instructors:\*\*.*?(?=\n\n)", install, re.M | re.S)
    grading = readme_section("Grading a class (instructors) and progress (students)", readme)
    return (f"# For instructors\n\n{doctor[0] if doctor else ''}\n\n"
            f"## Grading a class (instructors) and progress (students)\n\n{grading}\n")


def api_pages(course_dir: Path = ROOT / "course") -> dict[str, str]:
    """``api/index.md`` and one page per folder of the package: its README, then each module's
    docstrings (autodoc, in reStructuredText as the docstrings are written)."""
    import course  # only its names: `course.launch` is `course.runtime.launcher.launch`

    shortcuts = "".join(
        f".. py:{'exception' if isinstance(obj, type) else 'function'}:: {name}\n   :module: course\n\n"
        f"   :py:{'exc' if isinstance(obj, type) else 'func'}:`{obj.__module__}.{obj.__qualname__}`,"
        f" importable from ``course`` itself.\n\n" for name, obj in ((n, getattr(course, n)) for n in course.__all__))
    pages = {"api/index.md": "# The `course` package\n\n```{eval-rst}\n.. automodule:: course\n   :no-members:\n\n"
                             f"{shortcuts}```\n\n```{{toctree}}\n" + "\n".join(API_FOLDERS) + "\n```\n"}
    for folder in API_FOLDERS:
        text = (course_dir / folder / "README.md").read_text(encoding="utf-8").strip()
        for module in sorted(pkgutil.iter_modules([str(course_dir / folder)]), key=lambda m: m.name):
            if not module.name.startswith("_"):
                name = f"course.{folder}.{module.name}"
                text += f"\n\n## `{name}`\n\n```{{eval-rst}}\n.. automodule:: {name}\n```\n"
        pages[f"api/{folder}.md"] = text + "\n"
    return pages


def landing_page(notebooks: list[Path], site: Path = SITE) -> str:
    """``site/index.md`` with one toctree per part (its chapters) and one for the reference pages."""
    text = (site / "index.md").read_text(encoding="utf-8")
    if CHAPTERS_MARKER not in text:
        raise SiteError(f"{site / 'index.md'} lacks the line {CHAPTERS_MARKER}")
    trees = []
    for caption, *_ in PARTS:
        names = [f"chapters/{nb.stem}" for nb in notebooks if part_of(nb) == caption]
        if names:
            trees.append(f"```{{toctree}}\n:caption: {caption}\n:maxdepth: 1\n\n" + "\n".join(names) + "\n```")
    trees.append("```{toctree}\n:caption: Reference\n:maxdepth: 1\n\ninstructors\napi/index\n```")
    return text.replace(CHAPTERS_MARKER, "\n\n".join(trees))


def stage(folder: Path, solutions: Path = SOLUTIONS, students: Path = STUDENT) -> list[Path]:
    """Write every page Sphinx reads into ``folder`` (emptied first); return the chapters' notebooks."""
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "chapters").mkdir(parents=True)
    notebooks = chapters(solutions)
    if not notebooks:
        raise SiteError(f"no notebooks NN_*.ipynb in {solutions}")
    for nb in notebooks:
        page = folder / "chapters" / nb.name
        student = students / nb.name
        if not student.exists():
            raise SiteError(f"{student} is missing: run python -m course build --no-execute")
        nbformat.write(chapter(nb, student.resolve(), page), page)
    pages = {"index.md": landing_page(notebooks), "instructors.md": instructors_page(), **api_pages()}
    for name, text in pages.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text, encoding="utf-8")
    return notebooks


_STRUCTURE = re.compile(r"\s*([-*+] |\.\. |:\w|\d+\. |>>> )")  # lists, directives, fields, doctests


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def literal_blocks(lines: list[str]) -> list[str]:
    """A docstring's lines, each indented block after a paragraph made a literal block (``::``).

    The course's docstrings are written to be read as text (``help()``, the source): code and
    aligned options sit in an indented block after a paragraph, as here::

        shard, optimizer = zero1_setup(model, torch.optim.Adam, lr=1e-3)

    reStructuredText would read such a block as a quotation, or refuse it (``Unexpected
    indentation``); as a literal block it shows as written. Blocks after ``::``, and lists,
    fields and directives, are left as they are. Autodoc calls it on every docstring
    (``site/conf.py``)."""
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        before = next((x for x in reversed(out) if x.strip()), None)
        if not line.strip() or before is None or _indent(line) <= _indent(before) or _STRUCTURE.match(before):
            out.append(line)
            i += 1
            continue
        end = i  # the block: every line up to the first one less indented than its first
        while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) >= _indent(line)):
            end += 1
        if not before.rstrip().endswith("::") and not _STRUCTURE.match(line):
            while not out[-1].strip():
                out.pop()
            if out[-1].rstrip().endswith(":"):
                out[-1] = out[-1].rstrip() + ":"  # "Options:" shows as "Options:", then the block
            else:
                out += ["", "::"]  # a paragraph of only "::" shows nothing
            out.append("")
        out += lines[i:end] + ([""] if end < len(lines) and lines[end - 1].strip() else [])
        i = end
    return out


def chapter_sizes(out: Path, notebooks: list[Path]) -> dict[str, int]:
    """Bytes of each chapter's page plus the images it shows."""
    sizes = {}
    for nb in notebooks:
        page = out / "chapters" / f"{nb.stem}.html"
        html = page.read_text(encoding="utf-8")
        images = {(page.parent / src).resolve() for src in re.findall(r'<img[^>]+src="([^":]+)"', html)}
        sizes[nb.name] = page.stat().st_size + sum(i.stat().st_size for i in images)
    return sizes


def build(out: Path = OUT, solutions: Path = SOLUTIONS, students: Path = STUDENT, jobs: int = 2,
          quiet: bool = False) -> dict[str, int]:
    """Build the site into ``out``; return each chapter's size in bytes. Raises SiteError when
    Sphinx warns (a broken link or reference, a bad docstring) or a chapter is over budget."""
    try:
        from sphinx.cmd.build import build_main
    except ImportError:
        raise SiteError('the site\'s tools are not installed: pip install -e ".[site]" -c constraints.txt') from None

    out = Path(out).resolve()
    work = out.parent / f"{out.name}-src"
    start = time.monotonic()
    notebooks = stage(work / "pages", solutions, students)
    html = work / "html"  # MyST-NB writes its scratch files beside it: all in `work`
    shutil.rmtree(html, ignore_errors=True)
    args = ["-b", "html", "-W", "--keep-going", "-n", "-E", "-j", str(jobs), "-c", str(SITE),
            "-d", str(work / "doctrees"), str(work / "pages"), str(html)]
    if build_main(args + (["-q"] if quiet else [])):
        raise SiteError("Sphinx reported the warnings above (each one is an error: a broken link, reference or page)")
    shutil.rmtree(out, ignore_errors=True)
    shutil.move(html, out)
    sizes = chapter_sizes(out, notebooks)
    over = {name: size for name, size in sizes.items() if size > CHAPTER_BUDGET}
    if over:
        raise SiteError(f"over the {CHAPTER_BUDGET:,}-byte budget of a chapter: {over}")
    if not quiet:
        largest = max(sizes, key=sizes.get)
        print(f"site: {len(sizes)} chapters in {out} ({time.monotonic() - start:.0f} s); the largest, {largest},"
              f" {sizes[largest] / 1024:.0f} KiB with its images. Preview: python -m http.server -d {out}")
    return sizes
