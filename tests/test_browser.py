"""A student's session in a real browser: JupyterLab in headless Chromium (Debian's ``chromium``,
driven by Playwright from PyPI; no browser download). It opens a student notebook (a copy, in a
temporary folder: JupyterLab's autosave must not touch notebooks/) and checks what a student sees:

* the notebook opens unmodified (no ● on its tab) once the kernel has started;
* a launch cell shows a rank's line in the live display while the cell still runs;
* an exercise check, ``hint()`` and ``solution()`` render as Markdown: code as code, emphasis as
  emphasis, words never broken (the solution's code scrolls in a narrow window), its code highlighted;
* Kernel > Interrupt during a launch ends in one line, with each rank's output shown once; so does
  an interrupt that lands as a cell of short launches starts its next launch (issue 39);
* saved, the notebook holds no emptied live display, also where the cell showed output before it.

Skipped, saying why, where Playwright or Chromium is missing (``.ci/run`` installs both and sets
COURSE_REQUIRE_BROWSER, which turns the skip into an error). About a minute (the kernel imports
torch, the check launches real ranks), so ``pytest`` alone leaves it out (conftest.py) and
``.ci/run`` runs it beside: ``pytest tests/test_browser.py``.
"""

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "10_ddp_from_scratch.ipynb"
CHROMIUM = os.environ.get("COURSE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--no-first-run", "--disable-quic", "--disable-sync"]
WAIT_MS = 120_000  # for anything the kernel does: the machine may be loaded

MISSING = None
try:
    import playwright.sync_api as playwright
except ImportError:
    MISSING = "Playwright is not installed (pip install playwright; no browser download needed)"
if CHROMIUM is None:
    MISSING = ("no Chromium here (apt-get install chromium fonts-noto-color-emoji, or set COURSE_CHROMIUM "
               "to a Chromium binary)")
if MISSING and os.environ.get("COURSE_REQUIRE_BROWSER"):  # .ci/run: CI must not skip it
    raise RuntimeError(f"COURSE_REQUIRE_BROWSER is set but {MISSING}")
if MISSING:
    pytest.skip(f"{MISSING}: the browser test cannot run", allow_module_level=True)

# Cells appended to the student notebook, run by the test (the notebook's own ones run first).
SLOW_LAUNCH = """\
from pathlib import Path
print("a launch that lasts:")  # output before the live display: it must not leave an emptied one
def job(rank, world_size):
    print("step", 0, flush=True)
    deadline = time.monotonic() + 120
    while not Path({go!r}).exists() and time.monotonic() < deadline:  # the test says when to go on
        time.sleep(0.05)
    print("step", 1, flush=True)
    return rank
course.launch(job, 2, timeout=180)"""
WRONG_ANSWER = "check.predicted_bytes(1_000_000, 1_500_000)"
HINT = "check.ring_all_reduce.hint()"
SOLUTION = "check.ring_all_reduce.solution()"
LONG_LAUNCH = """\
def long_job(rank, world_size):
    print("working", flush=True)
    time.sleep(300)
course.launch(long_job, 2, timeout=600)"""
SHORT_LAUNCHES = """\
def short(rank, world_size, i):
    print("launch", i, flush=True)
    time.sleep(1)
course.launch(short, 2, 0)
course.launch(short, 2, 1)
course.launch(short, 2, 2)"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab serving a copy of notebooks/NOTEBOOK with the test's cells appended; yields
    (url of the notebook, the go file). No user settings, no news popup, nothing left running."""
    nb = nbformat.read(ROOT / "notebooks" / NOTEBOOK, as_version=4)
    go = tmp_path / "go"
    for source in (SLOW_LAUNCH.format(go=str(go)), WRONG_ANSWER, HINT, SOLUTION, LONG_LAUNCH, SHORT_LAUNCHES):
        nb.cells.append(nbformat.v4.new_code_cell(source))
    served = tmp_path / "served"
    served.mkdir()
    news = tmp_path / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text('{"fetchNews": "false"}')  # no "get notified about Jupyter news?" popup over the cells
    tracker = tmp_path / "settings" / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text('{"windowingMode": "none"}')  # every cell in the page, so that .nth(i) is cell i
    nbformat.write(nb, served / NOTEBOOK)
    port, token, log = _free_port(), uuid.uuid4().hex, tmp_path / "jupyter.log"
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("PYTEST_CURRENT_TEST", None)  # a kernel started under pytest would not capture fd output
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--port-retries=0",
         f"--IdentityProvider.token={token}", "--LabApp.news_url=None", "--LabApp.expose_app_in_browser=True", "--LabApp.check_for_updates_class="
         "jupyterlab.NeverCheckForUpdate", f"--ServerApp.root_dir={served}"] + (["--allow-root"] if os.geteuid() == 0 else []),
        env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,  # a file: a full pipe would block it
    )
    try:
        deadline = time.monotonic() + WAIT_MS / 1000
        while True:
            assert server.poll() is None, f"jupyter lab exited:\n{log.read_text()}"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "jupyter lab did not answer"
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/lab/tree/{NOTEBOOK}?token={token}", go
    finally:
        server.terminate()  # shuts its kernels down; then anything left in its session is killed
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(server.pid, 9)
        except ProcessLookupError:
            pass
        server.wait()


def _cell(page, index):
    return page.locator(".jp-Notebook .jp-Cell").nth(index)


KERNEL_READY = """() => {
    const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    const kernel = panel && panel.sessionContext && panel.sessionContext.session && panel.sessionContext.session.kernel;
    return !!(kernel && panel.sessionContext.isReady && kernel.connectionStatus === "connected" && kernel.status === "idle");
}"""


def _run(page, index):
    """Select cell ``index`` and run it (Shift+Enter), as a student does. Once the cell has been
    sent its prompt says [*] (or already a number); a run pressed while JupyterLab was still
    setting up its kernel connection is dropped, leaving "[ ]" (seen once here): pressed again."""
    cell = _cell(page, index)
    for _ in range(3):
        page.wait_for_function(KERNEL_READY, timeout=WAIT_MS)
        cell.scroll_into_view_if_needed()
        cell.locator(".jp-InputArea-editor").click()
        page.keyboard.press("Shift+Enter")
        try:
            cell.locator(".jp-InputPrompt").filter(has_text=re.compile(r"\[(\*|\d+)\]")).wait_for(timeout=10_000)
            return cell
        except playwright.TimeoutError:
            continue
    raise AssertionError(f"cell {index} did not start running")


def _finished(cell):
    """Wait until the cell has run: its prompt holds a number, not '*' or nothing."""
    cell.locator(".jp-InputPrompt").filter(has_text=re.compile(r"\[\d+\]")).wait_for(timeout=WAIT_MS)


def test_a_student_session_in_jupyterlab(lab, tmp_path):
    url, go = lab
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        try:
            _session(page, url, go)
        finally:  # what the student saw last, for whoever reads a failure
            page.screenshot(path=str(tmp_path / "last.png"))
            print(f"screenshot: {tmp_path / 'last.png'}")
            browser.close()


def _session(page, url, go):
    page.goto(url)
    page.wait_for_function(KERNEL_READY, timeout=WAIT_MS)
    page.wait_for_timeout(2000)  # JupyterLab writes the kernel's metadata once it is connected
    tabs = page.locator("#jp-main-dock-panel .lm-TabBar-tab")
    assert tabs.count() == 1 and "jp-mod-dirty" not in tabs.first.get_attribute("class"), "the notebook opened as modified"

    sources = [c.source for c in nbformat.read(Path(go.parent, "served", NOTEBOOK), as_version=4).cells]
    assert page.locator(".jp-Notebook .jp-Cell").count() == len(sources)
    first_test_cell = len(sources) - 6  # the cells the lab fixture appended
    imports = next(i for i, s in enumerate(sources) if s.startswith("import inspect"))
    check_cell = next(i for i, s in enumerate(sources) if s.startswith("from course.checks import nb10 as check"))
    for index in (imports, check_cell - 1, check_cell):  # the imports, Exercise 1's stubs, its check
        _finished(_run(page, index))

    # The untouched exercise: "not attempted", with its `...` as code.
    verdict = _cell(page, check_cell).locator(".jp-OutputArea .jp-RenderedMarkdown")
    assert verdict.inner_text().startswith("✏️ Exercise 1 (predict the bytes): not attempted yet")
    assert verdict.locator("code").first.inner_text() == "..."

    # A launch that lasts: a rank's line shows while the cell runs (the ranks wait for `go`).
    launch = _run(page, first_test_cell)
    launch.locator(".jp-OutputArea-output", has_text="[rank 0] step 0").wait_for(timeout=WAIT_MS)
    assert launch.locator(".jp-InputPrompt").inner_text().strip() == "[*]:"  # still running
    go.touch()
    _finished(launch)
    assert launch.locator(".jp-OutputArea").inner_text().count("[rank 0] step 0") == 1
    assert launch.locator(".jp-OutputArea").inner_text().count("a launch that lasts:") == 1  # shown again once
    assert "[rank 1] step 1" in launch.locator(".jp-OutputArea").inner_text()

    # A wrong answer's verdict, a hint and a solution, rendered.
    wrong = _run(page, first_test_cell + 1)
    _finished(wrong)
    shown = wrong.locator(".jp-OutputArea .jp-RenderedMarkdown")
    text = shown.inner_text()
    assert text.startswith("❌ Exercise 1 (predict the bytes): not yet."), text
    assert "*" not in text and "`" not in text  # markers rendered, not shown
    assert shown.locator("strong").inner_text() == "Exercise 1 (predict the bytes)"
    assert shown.locator("em").inner_text() == "each"
    assert shown.locator("p").evaluate("e => getComputedStyle(e).wordBreak") in ("normal", "break-word")
    assert shown.locator("p").evaluate("e => getComputedStyle(e).overflowWrap") in ("normal", "break-word", "anywhere")
    hint = _run(page, first_test_cell + 2)
    _finished(hint)
    assert hint.locator(".jp-OutputArea .jp-RenderedMarkdown strong").inner_text() == "Exercise 2 (ring all-reduce)"
    solution = _run(page, first_test_cell + 3)
    _finished(solution)
    code = solution.locator(".jp-OutputArea .jp-RenderedMarkdown pre code")
    assert "def ring_all_reduce(tensor):" in code.inner_text()
    assert code.locator("span").count() > 10, "the solution's code is not highlighted"
    keyword = code.locator("span", has_text="def").first
    assert keyword.evaluate("e => getComputedStyle(e).color") != code.evaluate("e => getComputedStyle(e).color")
    # Never broken mid-word: in a window too narrow for its longest line, the code scrolls sideways.
    page.set_viewport_size({"width": 700, "height": 900})
    pre = solution.locator(".jp-OutputArea .jp-RenderedMarkdown pre")
    for element in (pre, code):
        assert element.evaluate("e => [getComputedStyle(e).whiteSpace, getComputedStyle(e).wordBreak]") == ["pre", "normal"]
    lines = code.inner_text().rstrip("\n").count("\n") + 1
    line_height = code.evaluate("e => parseFloat(getComputedStyle(e).lineHeight)")
    assert pre.evaluate("e => e.scrollWidth > e.clientWidth"), "the window is not narrow enough to test wrapping"
    assert code.evaluate("e => e.getBoundingClientRect().height") < (lines + 0.5) * line_height  # one row a line
    page.set_viewport_size({"width": 1280, "height": 900})

    # Kernel > Interrupt during a launch: one line, the ranks' output once.
    long = _run(page, first_test_cell + 4)
    long.locator(".jp-OutputArea-output", has_text="[rank 1] working").wait_for(timeout=WAIT_MS)
    page.get_by_role("menuitem", name="Kernel", exact=True).click()
    page.get_by_role("menuitem", name="Interrupt Kernel").click()
    _finished(long)
    output = long.locator(".jp-OutputArea").inner_text()
    assert output.count("[rank 0] working") == 1 and output.count("[rank 1] working") == 1, output
    assert "⏹ KeyboardInterrupt: interrupted after" in output and "stopped all 2 ranks" in output, output
    assert "Traceback" not in output and "launcher.py" not in output, output

    # The toolbar's Interrupt the moment the first launch's output shows: the next launch is starting.
    shorts = _run(page, first_test_cell + 5)
    shorts.locator(".jp-OutputArea-output", has_text="[rank 1] launch 0").wait_for(timeout=WAIT_MS)
    page.locator("jp-button[data-command='notebook:interrupt-kernel'], button[data-command='notebook:interrupt-kernel']").first.click()
    _finished(shorts)
    output = shorts.locator(".jp-OutputArea").inner_text()
    assert output.count("[rank 0] launch 0") == 1 and output.count("[rank 1] launch 1") <= 1, output
    assert re.search(r"⏹ KeyboardInterrupt: interrupted (after|at Cell In\[\d+\], line \d+ while no rank)", output), output
    assert "Traceback" not in output and "Exception ignored" not in output, output

    # Saved (Ctrl+S), the notebook holds no emptied live display: not after the print of the slow
    # launch's cell, nor after the first of several launches in a cell (course.runtime.live).
    page.keyboard.press("Control+s")
    tab = page.locator("#jp-main-dock-panel .lm-TabBar-tab").first
    deadline = time.monotonic() + WAIT_MS / 1000
    while "jp-mod-dirty" in tab.get_attribute("class") and time.monotonic() < deadline:
        page.wait_for_timeout(100)
    saved = nbformat.read(Path(go.parent, "served", NOTEBOOK), as_version=4)
    empty = [(i, o) for i, c in enumerate(saved.cells) if c.cell_type == "code"
             for o in c.outputs if o.output_type == "display_data" and not o.get("data")]
    assert empty == [], empty
    assert "a launch that lasts:" in "".join(o.get("text", "") for o in saved.cells[first_test_cell].outputs)
