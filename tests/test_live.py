"""Live output: in a real Jupyter kernel, a rank's line shows while the launch still runs, and the
stored (nbclient) and compared (nbval) outputs of a launch cell stay what they were without it."""

import os
import queue
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import nbformat
import pytest
from jupyter_client.manager import start_new_kernel
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def _kernel_env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


@pytest.fixture
def kernel():
    manager, client = start_new_kernel(kernel_name="python3", env=_kernel_env(), cwd=str(ROOT), startup_timeout=120)
    try:
        yield client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def test_a_ranks_line_arrives_before_the_launch_returns(kernel, tmp_path):
    go = tmp_path / "go"
    code = textwrap.dedent(f"""
        import time, course
        from pathlib import Path
        def job(rank, world_size):
            print("early line from", rank, flush=True)
            while not Path({str(go)!r}).exists():  # the test says when to finish
                time.sleep(0.05)
            return rank
        print("results:", course.launch(job, 2, timeout=120))
    """)
    msg_id = kernel.execute(code)
    updates, streams, displays, done = [], [], [], False
    deadline = time.monotonic() + 180
    while not done:
        assert time.monotonic() < deadline, "no idle kernel in time"
        try:
            msg = kernel.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "update_display_data":
            updates.append(content["data"])
            if "[rank 0] early line from 0" in content["data"].get("text/plain", ""):
                go.touch()  # only now may the ranks finish: the line came while they ran
        elif kind == "display_data":
            displays.append(content["data"])
        elif kind == "stream":
            streams.append(content["text"])
        elif kind == "error":
            pytest.fail("\n".join(content["traceback"]))
        elif kind == "status" and content["execution_state"] == "idle":
            done = True
    assert go.exists(), f"no live line arrived; updates: {updates}"
    assert displays == [{}]  # created empty ...
    assert updates[-1] == {}  # ... and emptied at the end
    assert "".join(streams) == "[rank 0] early line from 0\n[rank 1] early line from 1\nresults: [0, 1]\n"


SLOW_CELL = """\
import time, course
print("before")
def job(rank, world_size):
    for step in range(3):
        print("step", step, flush=True)
        time.sleep(0.4)
    return rank
print(course.launch(job, 2, timeout=120))
"""
# The ranks run for 1.2 s after their first line: the live display (shown from 0.5 s on, refreshed
# every 0.25 s; course.live.SHOW_AFTER and TICK) has at least 0.7 s to show it before the end.


class _Recording(NotebookClient):
    """nbclient, as the build runs it, noting the live display's updates as they arrive."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.updates = []

    def process_message(self, msg, cell, cell_index):
        if msg["msg_type"] == "update_display_data":
            self.updates.append(msg["content"]["data"])
        return super().process_message(msg, cell, cell_index)


def test_stored_and_compared_outputs_agree_for_a_slow_launch(tmp_path):
    """The build (nbclient) stores the cell; nbval then re-runs it and compares: it must pass,
    and the stored output must hold the replay, not the live lines."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(SLOW_CELL)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    env_before = dict(os.environ)
    os.environ.update(_kernel_env())
    try:
        client = _Recording(nb, timeout=300, kernel_name="python3", shutdown_kernel="immediate",
                            resources={"metadata": {"path": str(ROOT)}})
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    live = [u.get("text/plain", "") for u in client.updates]
    assert any("[rank 0] step 0" in text for text in live), f"the live display showed no rank's line: {client.updates}"
    assert client.updates[-1] == {}  # emptied at the end
    outputs = nb.cells[0].outputs
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert text == "before\n" + "".join(f"[rank {r}] step {s}\n" for r in range(2) for s in range(3)) + "[0, 1]\n"
    assert [o.data for o in outputs if o.output_type == "display_data"] == [{}]  # the live display, emptied
    path = tmp_path / "slow.ipynb"
    nbformat.write(nb, path)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "--nbval", "--nbval-current-env", str(path)],
        capture_output=True, text=True, cwd=tmp_path, env=_kernel_env(), timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
