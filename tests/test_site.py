"""The course's website (``python -m course site``): the build fails on a broken link, and the built
site works in a real browser, headless Chromium (Debian's ``chromium``, driven by Playwright from
PyPI, as tests/test_browser.py): the landing page lists every chapter by part, a chapter's plot
loads, a search for a word of one chapter only finds that chapter, and an exercise's solution stays
folded until it is clicked.

It reads the site in ``$COURSE_SITE`` when set (``.ci/run`` builds it just before), else builds it
(one to three minutes on 2 cores). Skipped, saying why, where Sphinx (``pip install -e ".[site]"``),
Playwright or Chromium is missing; COURSE_REQUIRE_BROWSER (``.ci/run``) turns the skip into an
error. ``pytest`` alone leaves it out (conftest.py): ``pytest tests/test_site.py``.
"""

import functools
import html
import os
import re
import shutil
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import nbformat
import pytest

from course.classroom import site
from course.classroom.notebooks import KERNELSPEC

CHROMIUM = os.environ.get("COURSE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]
WAIT_MS = 30_000

MISSING = None
try:
    import myst_nb  # noqa: F401
    import sphinx_book_theme  # noqa: F401
except ImportError:
    MISSING = 'the site\'s tools are not installed (pip install -e ".[site]" -c constraints.txt)'
try:
    import playwright.sync_api as playwright
except ImportError:
    MISSING = MISSING or "Playwright is not installed (pip install playwright; no browser download needed)"
if CHROMIUM is None:
    MISSING = MISSING or "no Chromium here (apt-get install chromium, or set COURSE_CHROMIUM to a Chromium binary)"
if MISSING and os.environ.get("COURSE_REQUIRE_BROWSER"):  # .ci/run: CI must not skip it
    raise RuntimeError(f"COURSE_REQUIRE_BROWSER is set but {MISSING}")
if MISSING:
    pytest.skip(f"{MISSING}: the site test cannot run", allow_module_level=True)


def _tiny_course(folder: Path, text: str):
    """A course of one notebook whose Markdown is ``text``, with an exercise; (solutions, students)."""
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell(f"# 01 · A tiny chapter\n\n(tiny-section)=\n## A section\n\n{text}"),
        nbformat.v4.new_code_cell("answer = 42  # SOLUTION"),
    ], metadata={"kernelspec": KERNELSPEC, "language_info": {"name": "python"}})
    for name in ("solutions", "notebooks"):
        (folder / name).mkdir(parents=True)
        nbformat.write(nb, folder / name / "01_tiny.ipynb")
    return folder / "solutions", folder / "notebooks"


BROKEN = {"02_missing.ipynb": "[the next chapter](02_missing.ipynb)", "no-such-section": "{ref}`no-such-section`"}


def test_a_broken_link_fails_the_build(tmp_path, capfd):
    good = _tiny_course(tmp_path / "good", "Back to {ref}`tiny-section`; the [landing page](../index.md).")
    sizes = site.build(tmp_path / "good" / "site", *good, jobs=1, quiet=True)
    assert list(sizes) == ["01_tiny.ipynb"]
    assert 'href="#tiny-section"' in (tmp_path / "good" / "site" / "chapters" / "01_tiny.html").read_text()
    capfd.readouterr()
    bad = _tiny_course(tmp_path / "bad", "See " + " and ".join(BROKEN.values()) + ".")
    with pytest.raises(site.SiteError, match="warnings"):
        site.build(tmp_path / "bad" / "site", *bad, jobs=1, quiet=True)
    warnings = [line for line in capfd.readouterr().err.splitlines() if "WARNING" in line]
    for target in BROKEN:  # each broken link is reported, and nothing else
        assert sum(target in line for line in warnings) == 1, warnings
    assert len(warnings) == len(BROKEN), warnings
    assert not (tmp_path / "bad" / "site").exists()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The folder of the built site (``$COURSE_SITE``, or built here)."""
    if os.environ.get("COURSE_SITE"):
        return Path(os.environ["COURSE_SITE"]).resolve()
    out = tmp_path_factory.mktemp("site") / "site"
    site.build(out, quiet=True)
    return out


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):  # one line per request is noise in a failure's report
        pass


@pytest.fixture(scope="module")
def served(built):
    """The site over HTTP (search loads its index with a script), as GitHub Pages serves it."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(built)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


def _words(page: Path) -> str:
    """A built page's text, lowercased, without its navigation (every page lists every chapter)."""
    text = page.read_text(encoding="utf-8")
    main = re.search(r"<main.*?</main>", text, re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", main[0] if main else text)).lower()


def _unique_word(chapter: Path, built: Path) -> str:
    """A word of ``chapter``'s own prose that no other page of the site has, not even its stem."""
    import snowballstemmer  # Sphinx's search stems words with it

    stem = snowballstemmer.stemmer("english").stemWord
    others = [_words(p) for p in built.rglob("*.html") if p != chapter and p.name not in ("search.html", "genindex.html")]
    nb = nbformat.read(site.SOLUTIONS / f"{chapter.stem}.ipynb", as_version=4)
    prose = " ".join(re.sub(r"`[^`]*`|\([^)]*\)", " ", c.source) for c in nb.cells if c.cell_type == "markdown")
    for word in sorted(set(re.findall(r"\b[a-z]{9,}\b", prose))):
        if word in _words(chapter) and not any(stem(word) in text for text in others):
            return word
    raise AssertionError(f"no word of {chapter.name} is absent from every other page")


def test_the_site_in_a_browser(built, served, tmp_path):
    notebooks = site.chapters()
    with_plot = next(nb for nb in notebooks if any(
        "image/png" in o.get("data", {}) for c in nbformat.read(nb, as_version=4).cells for o in c.get("outputs", [])))
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        try:
            _landing(page, served, notebooks)
            _chapter(page, served, with_plot)
            _search(page, served, built / "chapters" / f"{with_plot.stem}.html")
        finally:  # what the reader saw last, for whoever reads a failure
            page.screenshot(path=str(tmp_path / "last.png"))
            print(f"screenshot: {tmp_path / 'last.png'}")
            browser.close()


def _landing(page, url, notebooks):
    page.goto(f"{url}/index.html")
    assert page.locator("main h1").first.inner_text().startswith("DDP, by running it")
    nav = page.locator("nav.bd-docs-nav")
    for caption, *_ in site.PARTS:
        if any(site.part_of(nb) == caption for nb in notebooks):
            assert nav.get_by_text(caption, exact=True).count() == 1, caption
    links = [a.get_attribute("href") for a in nav.locator("a[href^='chapters/']").all()]
    assert links == [f"chapters/{nb.stem}.html" for nb in notebooks]
    for name in ("instructors.html", "api/index.html"):
        assert nav.locator(f"a[href='{name}']").count() == 1, name


def _chapter(page, url, notebook):
    page.goto(f"{url}/chapters/{notebook.stem}.html")
    colab = page.locator(".chapter-links a", has_text="Open in Colab")
    assert colab.get_attribute("href").endswith(f"/blob/main/notebooks/{notebook.name}")
    download = page.locator(".chapter-links a", has_text="Download the notebook")
    with page.expect_download() as got:
        download.click()
    saved = got.value.path()
    assert Path(saved).read_bytes() == (site.STUDENT / notebook.name).read_bytes()  # the student version

    plots = page.locator(".cell_output img")
    assert plots.count() > 0
    for i in range(plots.count()):
        plots.nth(i).scroll_into_view_if_needed()
        page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=plots.nth(i).element_handle(),
                               timeout=WAIT_MS)

    # A check's verdict: its Markdown rendered, as in JupyterLab (bold, no ** shown).
    verdict = page.locator(".cell_output", has_text="✅").first
    assert verdict.locator("strong").first.inner_text().startswith("Exercise")
    assert "**" not in verdict.inner_text()

    # An exercise: its stub shown, its solution folded until clicked.
    stub = page.locator("div.admonition.exercise").first
    assert "# ✏️ your" in stub.inner_text()
    folded = page.locator(".cell.tag_solution > details").first
    code = folded.locator(".cell_input")
    assert not code.is_visible()
    summary = folded.locator("summary")
    assert summary.inner_text().strip() == "Show the solution"
    summary.click()
    code.wait_for(state="visible", timeout=WAIT_MS)
    assert re.search(r"#\s*(BEGIN )?SOLUTION", code.inner_text())
    assert summary.inner_text().strip() == "Hide the solution"


def _search(page, url, chapter):
    word = _unique_word(chapter, chapter.parent.parent)
    page.goto(f"{url}/search.html?q={word}")
    results = page.locator("#search-results ul.search li a")
    results.first.wait_for(timeout=WAIT_MS)
    page.locator("#search-results .search-summary").wait_for(timeout=WAIT_MS)
    found = {a.get_attribute("href").split("?")[0].split("#")[0] for a in results.all()}
    assert found == {f"chapters/{chapter.name}"}, (word, found)
    results.first.click()
    page.wait_for_url(re.compile(re.escape(f"/chapters/{chapter.name}")), timeout=WAIT_MS)
