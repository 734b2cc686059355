"""What a student sees in a Jupyter kernel (the messages JupyterLab renders), for the rough edges
of a launch and a check: an interrupt ends in one line, with the ranks' output shown once; a hang
inside a check shows which ranks still run after a second; a failing rank in a check names the
notebook cell's line; a verdict comes as Markdown beside its plain text. One kernel for all
(each kernel imports torch: seconds); and nbval compares a verdict's plain text only."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from jupyter_client.manager import start_new_kernel

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 120  # seconds for any one cell: the machine may be loaded


def _kernel_env():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("PYTEST_CURRENT_TEST", None)  # a kernel started under pytest would not capture fd output
    return env


@pytest.fixture(scope="module")
def kernel():
    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=TIMEOUT, env=_kernel_env(), cwd=str(ROOT))
    try:
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def _run(kernel, code, when=None):
    """Execute ``code``; return its iopub messages as (seconds since sent, type, content).
    ``when(message)`` is called on each one as it arrives (to interrupt, say)."""
    km, kc = kernel
    msg_id = kc.execute(code)
    sent, messages = time.monotonic(), []
    while True:
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        item = (time.monotonic() - sent, msg["msg_type"], msg["content"])
        messages.append(item)
        if when is not None:
            when(item)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return messages


def _streams(messages):
    """The text the cell shows in the end, as a frontend (and nbclient) shows it: ``clear_output``
    applied, ``wait=True`` at the next output (a live display is taken away so, and the cell's
    earlier outputs sent again: course.runtime.live)."""
    shown, pending = [], False
    for _, kind, c in messages:
        if kind == "clear_output":
            shown, pending = ([], False) if not c.get("wait") else (shown, True)
        elif kind in ("stream", "display_data", "execute_result", "error"):
            if pending:
                shown, pending = [], False
            if kind == "stream":
                shown.append(c["text"])
    return "".join(shown)


def _unwrapped(plain):
    """A wrong verdict's plain text with the line breaks that fit it to 100 characters undone."""
    return plain.replace("\n", " ")


def _kernel_children(km):
    """Every process under the kernel, zombies included, but multiprocessing's long-lived helpers: the
    kernel's children that run them. A forkserver's ranks are forks of the server (with its command
    line) but its children, not the kernel's: they count."""
    kernel = psutil.Process(km.provisioner.process.pid)
    helpers = {p.pid for p in kernel.children()
               if any(h in " ".join(p.cmdline() or [""]) for h in ("resource_tracker", "multiprocessing.forkserver"))}
    return [p for p in kernel.children(recursive=True) if p.pid not in helpers]


def _ranks_alive(km):
    """The kernel's live children but multiprocessing's long-lived helpers (a forkserver, the default
    with a CUDA GPU, and its resource tracker outlive every launch)."""
    return [p for p in _kernel_children(km) if p.status() != psutil.STATUS_ZOMBIE]


def test_interrupt_ends_in_one_line_and_shows_the_ranks_output_once(kernel):
    km, _ = kernel
    code = (
        "import time, course\n"
        "def job(rank, world_size):\n"
        "    print('working on rank', rank, flush=True)\n"
        "    time.sleep(300)\n"
        "course.launch(job, 2, timeout=600)\n"
    )
    interrupted = []

    def interrupt_once_both_ranks_show(item):
        _, kind, content = item
        text = content.get("data", {}).get("text/plain", "") if kind == "update_display_data" else ""
        if not interrupted and "[rank 0] working" in text and "[rank 1] working" in text:
            interrupted.append(True)
            km.interrupt_kernel()  # Kernel > Interrupt

    messages = _run(kernel, code, interrupt_once_both_ranks_show)
    assert interrupted, "the live display never showed both ranks' lines"
    errors = [c for _, kind, c in messages if kind == "error"]
    assert len(errors) == 1 and len(errors[0]["traceback"]) == 1, errors  # one line, no traceback
    line = errors[0]["traceback"][0]
    assert re.fullmatch(r"⏹ KeyboardInterrupt: interrupted after \d+\.\d s: course\.launch stopped all 2 ranks\.", line), line
    assert "launcher.py" not in line and errors[0]["ename"] == "LaunchInterrupted"
    shown = _streams(messages)
    assert shown == "[rank 0] working on rank 0\n[rank 1] working on rank 1\n"  # once, in rank order
    last = [(kind, c) for _, kind, c in messages if kind in ("update_display_data", "clear_output")][-1]
    assert last == ("clear_output", {"wait": False}) or last[1]["data"] == {}  # its lines not shown twice: the live
    # display was cleared (the cell's only output) or, in the cell that imported course (outputs not counted), emptied
    deadline = time.monotonic() + 10
    while _ranks_alive(km) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _ranks_alive(km) == []
    assert "ok" in _streams(_run(kernel, "print('ok')"))  # the kernel goes on


def test_a_hang_inside_a_check_shows_the_running_ranks_after_a_second(kernel):
    code = (
        "import time, course\n"
        "def hang(rank, world_size):\n"
        "    time.sleep(60)\n"
        "try:\n"
        "    course.launch(hang, 2, timeout=4, show=None)  # as a check launches: nobody's output shown\n"
        "except course.WorkerTimeoutError:\n"
        "    print('timed out')\n"
    )
    messages = _run(kernel, code)
    status = [(t, c["data"]["text/plain"]) for t, kind, c in messages
              if kind == "update_display_data" and "still running" in c["data"].get("text/plain", "")]
    assert status, "nothing showed that the ranks were still running"
    finished = messages[-1][0]
    first_time, first_text = status[0]
    assert first_text.startswith("… 1 s, still running: rank(s) 0, 1"), first_text
    assert first_time < finished - 2  # seen seconds before the 4 s timeout ended the cell
    assert _streams(messages) == "timed out\n"


def test_a_failing_rank_in_a_check_names_the_cell_line_and_renders_as_markdown(kernel):
    define = "import torch.distributed as dist\ndef ring(tensor):\n    x = tensor\n    dist.all_reduce([x])\n    return x\n"
    messages = _run(kernel, define)
    count = next(c["execution_count"] for _, kind, c in messages if kind == "execute_input")
    messages = _run(kernel, "from course.checks import nb10\nnb10.ring_all_reduce(ring)")
    result = next(c["data"] for _, kind, c in messages if kind == "execute_result")
    plain, rich = _unwrapped(result["text/plain"]), result["text/markdown"]
    assert plain.startswith("❌ Exercise 2 (ring all-reduce): not yet: a rank failed: TypeError: Invalid function argument.")
    assert "but got <class 'list'> instead." in plain
    assert re.search(rf"\(rank [01], in your code at Cell In\[{count}\], line 4, in ring\)", plain), plain
    assert rich.startswith("❌ **Exercise 2 (ring all-reduce)**:") and "\\<class 'list'\\>" in rich and "`tensor`" in rich


def test_an_answer_that_raises_inside_a_check_is_a_verdict_with_the_cell_line(kernel):
    """Notebook 16's bytes_sent with a typo: the check calls it in the kernel (not on a rank). A ❌
    verdict with the NameError, the cell's line and the hint; not a traceback through the course."""
    define = ("def bytes_sent(send_counts, rank, dim):\n"
              "    to_others = send_counts[rank].sum() - send_counts[rank, rank]\n"
              "    return int(to_other) * dim * 4\n")
    messages = _run(kernel, define)
    count = next(c["execution_count"] for _, kind, c in messages if kind == "execute_input")
    messages = _run(kernel, "from course.checks import nb16\nnb16.bytes_sent(bytes_sent)")
    assert not [c for _, kind, c in messages if kind == "error"]
    plain = _unwrapped(next(c["data"] for _, kind, c in messages if kind == "execute_result")["text/plain"])
    assert plain.startswith("❌ Exercise 4 (bytes sent): not yet: your code raised NameError: name 'to_other' is not "
                            f"defined (in your code at Cell In[{count}], line 3, in bytes_sent). Hint: "), plain
    assert not any(internal in plain for internal in ("exercises.py", "nb16.py", "guard", "Traceback")), plain


@pytest.mark.slow  # a second pytest session running nbval: in .ci/run's slow part
def test_nbval_compares_a_verdicts_plain_text_not_its_markdown(tmp_path):
    """A stored verdict made before verdicts had a Markdown form (text/plain only, as every solution
    notebook's) still compares equal; a different plain text still fails."""
    source = "from course.classroom.exercises import Feedback\nFeedback('Exercise 1 (x)', 'correct', 'the *same* weights')"
    for plain, passes in (("✅ Exercise 1 (x): the *same* weights", True), ("✅ Exercise 1 (x): other", False)):
        cell = nbformat.v4.new_code_cell(source, execution_count=1, outputs=[
            nbformat.v4.new_output("execute_result", {"text/plain": plain}, execution_count=1)])
        nb = nbformat.v4.new_notebook(cells=[cell])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        path = tmp_path / "verdict.ipynb"
        nbformat.write(nb, path)
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "conftest", "-n", "0", "-p", "no:cacheprovider", "--nbval",
             "--nbval-current-env", str(path)],
            capture_output=True, text=True, cwd=tmp_path, env=_kernel_env(), timeout=300,
        )
        assert (result.returncode == 0) == passes, result.stdout + result.stderr


# ---------------------------------------------------------------- Interrupt wherever it lands

# A cell as Part III's are: short launches in a row, then one that runs until interrupted (so that
# every press lands in a launch, not in the cell's own lines after it).
SHORT_LAUNCHES = (
    "import time, course\n"
    "def short(rank, world_size, i):\n"
    "    print(f'launch {{i}} rank {{rank}}', flush=True)\n"
    "    time.sleep(0.1 * rank)\n"
    "    return i\n"
    "def long(rank, world_size):\n"
    "    print('long', flush=True)\n"
    "    time.sleep(300)\n"
    "course.launch(short, 2, 0, start_method={m!r})\n"
    "course.launch(short, 3, 1, start_method={m!r})\n"
    "course.launch(short, 2, 2, start_method={m!r})\n"
)
ONE_LINE = re.compile(r"⏹ KeyboardInterrupt: (interrupted after \d+\.\d s: course\.launch stopped "
                      r"(all [23] ranks( before they started)?|rank\(s\) [0-9, ]+ of [23] \(the others had finished\))"
                      r"|interrupted at (Cell In\[\d+\], line \d+|the end of Cell In\[\d+\]) while no rank was running)\.")


# A press made at a chosen instant: SIGINT sent by the kernel to itself from code that is not a cell's
# (compiled under a file name of its own), as a press landing in the kernel's or the course's code.
PRESS_AT = """
import os, signal
from course.runtime import interrupts
def press(*args):
    os.kill(os.getpid(), signal.SIGINT)
def once(event, after=0):  # a press at the event, once, after it has passed ``after`` times
    def press_once(*args):
        nonlocal after
        after -= 1
        if after < 0:
            get_ipython().events.unregister(event, press_once)
            press()
    get_ipython().events.register(event, press_once)
def press_in_transform_cell():  # ipykernel's do_execute calls it before the cell's first line, once
    transform = get_ipython().transform_cell
    def pressing(code):
        get_ipython().transform_cell = transform
        press()
        return transform(code)
    get_ipython().transform_cell = pressing
class PressedAsLaunchBegins(interrupts.Interrupts):  # created by course.launch before its handler is in
    def __init__(self):
        press()
        super().__init__()
from course.classroom.exercises import correct, exercise
@exercise("Exercise 9 (twice)", hint="-")
def twice(fn):  # a check module's judge: a press between its two launches
    course.launch(fn, 2, show=None)
    press()
    course.launch(fn, 2, show=None)
    return correct()
"""


def test_a_press_while_no_rank_runs_ends_in_one_line_that_says_where(kernel):
    """The instants between launches (issue 39): in the kernel's own code before a cell's first line
    (raised there, the cell does not run; with Python's handler ipykernel only logged "KeyboardInterrupt
    caught in kernel" and skipped the cell without a word or a reply, Run All went on; a press in a
    pre_run_cell callback was a traceback, and the cell ran), in the cell's own top-level
    line, in course.launch before it notes presses (no rank started), in a check's code between its
    launches, and in the kernel's code after
    the cell's last line (shown at its end). Each time one line, the cell fails (Run All stops), no
    rank left; a press inside a function of the student's is the usual traceback."""
    km, kc = kernel
    _run(kernel, "import course, time\nfrom course.runtime import interrupts\n"
                 f"exec(compile({PRESS_AT!r}, 'press_at.py', 'exec'))\n"
                 "def short(rank, world_size):\n    return rank\n")

    def run(code):
        msg_id = kc.execute(code)
        reply = kc.get_shell_msg(timeout=TIMEOUT)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = kc.get_shell_msg(timeout=TIMEOUT)
        messages = []
        while not (messages and messages[-1]["msg_type"] == "status"
                   and messages[-1]["content"]["execution_state"] == "idle"):
            msg = kc.get_iopub_msg(timeout=TIMEOUT)
            if msg["parent_header"].get("msg_id") == msg_id:
                messages.append(msg)
        errors = [m["content"]["traceback"] for m in messages if m["msg_type"] == "error"]
        shown = "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream")
        return reply["content"]["status"], reply["content"]["execution_count"], errors, shown

    for before_the_cell in ("press_in_transform_cell()", "once('pre_run_cell')"):  # Python's handler: lost
        run(before_the_cell)
        status, n, errors, shown = run("print('ran')\nprint('on')\n")
        assert (status, errors, shown) == ("error", [[f"⏹ KeyboardInterrupt: interrupted at Cell In[{n}], line 1 "
                                                       "while no rank was running."]], ""), before_the_cell
    status, n, errors, shown = run("print('ran')\nos.kill(os.getpid(), signal.SIGINT)\nprint('on')\n")
    assert (status, errors, shown) == ("error", [[f"⏹ KeyboardInterrupt: interrupted at Cell In[{n}], line 2 "
                                                   "while no rank was running."]], "ran\n")
    status, n, errors, shown = run("interrupts.Interrupts = PressedAsLaunchBegins\ntry:\n"
                                   "    course.launch(short, 2)\nfinally:\n"
                                   "    interrupts.Interrupts = PressedAsLaunchBegins.__base__\n")
    assert (status, errors, shown) == ("error", [[f"⏹ KeyboardInterrupt: interrupted at Cell In[{n}], line 3 "
                                                   "while no rank was running."]], "")
    status, n, errors, shown = run("print('ran')\ntwice(short)\n")  # in a check, between its launches
    assert (status, errors, shown) == ("error", [[f"⏹ KeyboardInterrupt: interrupted at Cell In[{n}], line 2 "
                                                   "while no rank was running."]], "ran\n")
    run("once('post_execute', after=1)")  # not at the end of this cell: the next one
    status, n, errors, shown = run("print('ran')\nprint('on')\n")
    assert (status, errors, shown) == ("error", [[f"⏹ KeyboardInterrupt: interrupted at the end of Cell In[{n}] "
                                                   "while no rank was running."]], "ran\non\n")
    status, n, errors, shown = run("def spin():\n    while True:\n        press()\nspin()\n")
    assert status == "error" and len(errors) == 1 and len(errors[0]) > 1, errors  # a traceback
    assert f"Cell In[{n}], line 3" in re.sub(r"\x1b\[[0-9;]*m", "", "".join(errors[0])), errors
    assert _kernel_children(km) == []
    assert run("print(course.launch(short, 2, show=None))")[::3] == ("ok", "[0, 1]\n")


@pytest.mark.slow
@pytest.mark.parametrize("start_method, presses", [("fork", 50), ("forkserver", 20), ("spawn", 4)])
def test_an_interrupt_anywhere_in_a_cell_of_short_launches_ends_in_one_line(kernel, start_method, presses):
    """Kernel > Interrupt (SIGINT to the kernel's process group, as jupyter_client and JupyterLab
    send it) at ``presses`` instants spread over the short launches: each time the one line, each
    rank's output at most once, no "Exception ignored" (a lost press), no rank or zombie left,
    and the next launch works."""
    km, _ = kernel
    short = SHORT_LAUNCHES.format(m=start_method)
    _run(kernel, short)  # the first run imports and starts what later ones reuse (a forkserver)
    messages = _run(kernel, short)
    took = messages[-1][0]
    cell = short + f"course.launch(long, 2, timeout=600, start_method={start_method!r})\n"
    for k in range(presses):
        delay = took * k / presses
        pressed = []

        def press(item):
            if not pressed and item[1] == "execute_input":  # the cell has started
                time.sleep(delay)
                km.interrupt_kernel()
                pressed.append(True)

        messages = _run(kernel, cell, press)
        where = f"pressed {delay:.2f} s into a {took:.2f} s run of short launches ({start_method})"
        errors = [c for _, kind, c in messages if kind == "error"]
        assert len(errors) == 1 and len(errors[0]["traceback"]) == 1, (where, errors)
        assert ONE_LINE.fullmatch(errors[0]["traceback"][0]), (where, errors[0]["traceback"])
        lines = _streams(messages).splitlines()
        assert len(lines) == len(set(lines)), (where, lines)  # each rank's output once
        assert all(line.startswith("[rank ") for line in lines), (where, lines)  # no "Exception ignored in"
        assert _kernel_children(km) == [], where  # every rank killed and reaped before the line
        after = _run(kernel, f"print(course.launch(short, 2, 9, start_method={start_method!r}, show=None))")
        assert _streams(after) == "[9, 9]\n", (where, after)
