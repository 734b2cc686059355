"""The pages ``python -m course site`` gives Sphinx (course/classroom/site.py), without running Sphinx:
what a chapter keeps of its solution notebook, what it hides, where its links go. The build itself,
and the site in a browser, are tests/test_site.py's."""

from pathlib import Path

import nbformat
import pytest

from course.classroom import site
from course.classroom.notebooks import REPO, SOLUTIONS, STUDENT

NOTEBOOKS = site.chapters()


def test_every_notebook_is_a_chapter_of_its_part():
    assert [nb.name for nb in NOTEBOOKS] == sorted(p.name for p in SOLUTIONS.glob("[0-9][0-9]_*.ipynb"))
    assert site.part_of(Path("01_x.ipynb")) == site.part_of(Path("09_x.ipynb")) == "Part I — DDP"
    assert site.part_of(Path("10_x.ipynb")) == site.part_of(Path("14_x.ipynb")) == "Part II — beyond DDP"
    assert site.part_of(Path("15_x.ipynb")) == site.part_of(Path("18_x.ipynb")) == site.PARTS[2][0]
    page = site.landing_page(NOTEBOOKS)
    for nb in NOTEBOOKS:  # each chapter once, under its own part's caption
        assert page.count(f"chapters/{nb.stem}\n") == 1
        caption = page.index(f":caption: {site.part_of(nb)}")
        assert page.index(f"chapters/{nb.stem}\n") > caption
        assert all(page.index(f"chapters/{nb.stem}\n") < later for later in
                   (page.find(":caption:", caption + 1),) if later != -1)
    assert "api/index" in page and "instructors" in page and site.CHAPTERS_MARKER not in page


@pytest.mark.parametrize("solution", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_a_chapter_hides_every_solution_and_links_the_student_version(solution, tmp_path):
    page = tmp_path / "chapters" / solution.name
    nb = site.chapter(solution, (STUDENT / solution.name).resolve(), page)
    original = nbformat.read(solution, as_version=4)
    assert not any(c.get("id") in ("colab-badge", "colab-install") for c in nb.cells)
    links = next(c.source for c in nb.cells if c.cell_type == "markdown")
    assert f"https://colab.research.google.com/github/{REPO}/blob/main/notebooks/{solution.name}" in links
    download = links.split("(path:")[1].split(")")[0]
    assert (page.parent / download).resolve() == (STUDENT / solution.name).resolve()
    hidden = [c for c in nb.cells if "solution" in c.metadata.get("tags", [])]
    solutions = [c for c in original.cells if site.is_solution(c)]
    assert solutions, "a notebook with no exercise"
    assert [c.source for c in hidden] == [c.source for c in solutions]
    for cell in hidden:
        assert "hide-cell" in cell.metadata.tags and cell.metadata.mystnb == site.SOLUTION_PROMPTS
    shown = [c.source for c in nb.cells if "solution" not in c.metadata.get("tags", [])]
    assert not any("# SOLUTION" in s or "BEGIN SOLUTION" in s for s in shown)  # the answers stay folded
    stubs = [c for c in nb.cells if c.cell_type == "markdown" and "{admonition} ✏️ Exercise" in c.source]
    assert len(stubs) == sum(1 for c in solutions if "solution" not in c.metadata.get("tags", []))
    assert all("# ✏️ your" in c.source for c in stubs)
    # Everything else is the notebook's, outputs included (as nbval compares them; long ones trimmed).
    kept = [c for c in nb.cells if c not in hidden and c not in stubs]
    others = [c for c in original.cells if not site.is_solution(c) and c.get("id") not in ("colab-badge", "colab-install")]
    for cell in others:
        site.trim_outputs(cell)
    assert [c.source for c in kept[1:]] == [c.source for c in others[1:]]  # the first: links added
    assert [c.get("outputs") for c in kept] == [c.get("outputs") for c in others]


def test_a_long_output_shows_its_first_and_last_lines():
    text = "".join(f"line {i}\n" for i in range(1000))
    short = site.trim(text, limit=10)
    assert short.splitlines() == [f"line {i}" for i in range(5)] + [
        "… 990 lines left out here (the notebook shows them all) …"] + [f"line {i}" for i in range(995, 1000)]
    assert site.trim("a\nb\n", limit=10) == "a\nb\n"


def test_the_instructors_page_is_the_readme_s():
    page = site.instructors_page()
    assert "python -m course grade submissions/*/ --csv grades.csv" in page
    assert "python -m course doctor" in page
    with pytest.raises(site.SiteError, match="no section"):
        site.readme_section("No such section")


def test_the_api_pages_document_every_module():
    pages = site.api_pages()
    for folder in site.API_FOLDERS:
        for module in (Path(site.ROOT) / "course" / folder).glob("[a-z]*.py"):
            assert f"\n.. automodule:: course.{folder}.{module.stem}\n" in pages[f"api/{folder}.md"]


def test_a_notebook_without_a_title_is_refused(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("no heading here")])
    nbformat.write(nb, tmp_path / "01_untitled.ipynb")
    with pytest.raises(site.SiteError, match="01_untitled.ipynb has no title"):
        site.chapter(tmp_path / "01_untitled.ipynb", tmp_path / "01_untitled.ipynb", tmp_path / "page.ipynb")
