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
    return "".join(c["text"] for _, kind, c in messages if kind == "stream")


def _ranks_alive(km):
    kernel = psutil.Process(km.provisioner.process.pid)
    return [p for p in kernel.children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]


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
    updates = [c["data"] for _, kind, c in messages if kind == "update_display_data"]
    assert updates[-1] == {}  # the live display was emptied: its lines are not shown a second time
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
    plain, rich = result["text/plain"], result["text/markdown"]
    assert plain.startswith("❌ Exercise 2 (ring all-reduce): not yet: a rank failed: TypeError: Invalid function argument.")
    assert "but got <class 'list'> instead." in plain
    assert re.search(rf"\(rank [01], in your code at Cell In\[{count}\], line 4, in ring\)", plain), plain
    assert rich.startswith("❌ **Exercise 2 (ring all-reduce)**:") and "\\<class 'list'\\>" in rich and "`tensor`" in rich


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
