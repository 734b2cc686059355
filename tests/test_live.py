"""Live output: in a real Jupyter kernel, a rank's line shows while the launch still runs, and the
stored (nbclient) and compared (nbval) outputs of a launch cell stay what they were without it.
(One kernel does both: each kernel imports torch, seconds.)"""

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def _kernel_env(start_method="fork"):
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "COURSE_START_METHOD": start_method}


SLOW_CELL = """\
from pathlib import Path
from IPython.display import Markdown, display
print("two launches:")
display(Markdown("*in a row*"))
def job(rank, world_size):
    print("step", 0, flush=True)
    deadline = time.monotonic() + 120
    while not Path({go!r}).exists() and time.monotonic() < deadline:  # the test says when to go on
        time.sleep(0.05)
    for step in (1, 2):
        print("step", step, flush=True)
    return rank
print(course.launch(job, 2, timeout=180))
def later(rank, world_size):
    print("later", flush=True)
    deadline = time.monotonic() + 120
    while not Path({go!r} + "-later").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
course.launch(later, 2)
"""
# The ranks wait after their first line until the test has seen it in the live display (shown from
# 0.5 s on, refreshed every 0.25 s: course.runtime.live.SHOW_AFTER and TICK), so the line provably arrived
# while the launch still ran. In nbval's re-run the go file already exists: the same output, at once.
# Each display comes after the cell's other outputs (a print, a Markdown display; then the first launch's
# replay): at its end the cell is cleared and they are sent again. (course is imported by the cell
# before: outputs are noted from a cell's start.)


class _Recording(NotebookClient):
    """nbclient, as the build runs it, noting the live display's updates as they arrive, and
    touching ``go`` once rank 0's first line has shown in it (``go-later``: the second launch's)."""

    def __init__(self, *args, go, **kwargs):
        super().__init__(*args, **kwargs)
        self.updates, self.go, self.cleared = [], go, 0

    def process_message(self, msg, cell, cell_index):
        self.cleared += msg["msg_type"] == "clear_output"
        if msg["msg_type"] == "update_display_data":
            self.updates.append(msg["content"]["data"])
            if "[rank 0] step 0" in msg["content"]["data"].get("text/plain", ""):
                self.go.touch()
            if "[rank 0] later" in msg["content"]["data"].get("text/plain", ""):
                Path(f"{self.go}-later").touch()
        return super().process_message(msg, cell, cell_index)


@pytest.mark.parametrize("start_method", ["fork", pytest.param("forkserver", marks=pytest.mark.slow)])  # slow: .ci/run's slow part
def test_stored_and_compared_outputs_agree_for_a_slow_launch(tmp_path, start_method):
    """The build (nbclient) stores the cell; nbval then re-runs it and compares: it must pass,
    and the stored output must hold the replay, not the live lines. With fork (Linux) and with
    a forkserver (Linux with a GPU), whose ranks are not the kernel's children."""
    go = tmp_path / "go"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import time, course"),
                                         nbformat.v4.new_code_cell(SLOW_CELL.format(go=str(go)))])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    env_before = dict(os.environ)
    os.environ.update(_kernel_env(start_method))
    try:
        client = _Recording(nb, timeout=300, kernel_name="python3", shutdown_kernel="immediate",
                            resources={"metadata": {"path": str(ROOT)}}, go=go)
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    assert go.exists(), f"the live display showed no rank's line while the launch ran: {client.updates}"
    assert client.cleared == 2  # each display taken away, with the outputs before it sent again
    outputs = nb.cells[1].outputs
    assert [o for o in outputs if o.output_type == "display_data" and not o.data] == []  # none left empty
    assert [o.output_type for o in outputs if o.output_type != "stream"] == ["display_data", "execute_result"], outputs
    assert outputs[0].text == "two launches:\n" and outputs[1].data["text/markdown"] == "*in a row*"
    text = "".join(o.get("text", "") for o in outputs[2:])
    assert text == ("".join(f"[rank {r}] step {s}\n" for r in range(2) for s in range(3)) + "[0, 1]\n"
                    + "[rank 0] later\n[rank 1] later\n")  # each launch's replay once, in order
    path = tmp_path / "slow.ipynb"
    nbformat.write(nb, path)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "-p", "conftest", "--nbval", "--nbval-current-env",
         str(path)],  # conftest: nbval applies clear_output
        capture_output=True, text=True, cwd=tmp_path, env=_kernel_env(start_method), timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_interrupt_while_a_line_is_being_shown_still_empties_the_display(tmp_path, monkeypatch):
    """Kernel > Interrupt can land inside ``update()``, after its message went out (seen once in CI:
    the replay followed a display that still showed the ranks' lines). ``close()`` must empty it."""
    import IPython.display
    from course.runtime import live

    class Handle:
        def __init__(self):
            self.sent = []

        def update(self, data, raw):
            self.sent.append(data)
            if len(self.sent) == 1:
                raise KeyboardInterrupt  # the message left; the interrupt arrives before update() returns

    class Job:
        def output_path(self, rank):
            return tmp_path / f"rank{rank}.txt"

    handle = Handle()
    monkeypatch.setattr(IPython.display, "display", lambda display_id: handle)
    (tmp_path / "rank0.txt").write_text("working on rank 0\n")
    shown = live.LiveOutput(Job(), [0])
    shown.started -= live.SHOW_AFTER
    with pytest.raises(KeyboardInterrupt):
        shown.update(running=[0])
    shown.close()
    assert handle.sent == [{"text/plain": "[rank 0] working on rank 0"}, {}]


def test_a_launch_with_nothing_to_show_yet_creates_no_display(tmp_path, monkeypatch):
    """A quick launch (done before SHOW_AFTER) leaves no output at all, not even an empty display
    in the notebook a student saves; the display appears, empty, with the first line to show."""
    import IPython.display
    from course.runtime import live

    created = []

    class Handle:
        def update(self, data, raw):
            created.append(data)

    def display(display_id):
        created.append("display")
        return Handle()

    class Job:
        def output_path(self, rank):
            return tmp_path / f"rank{rank}.txt"

    monkeypatch.setattr(IPython.display, "display", display)
    (tmp_path / "rank0.txt").write_text("working on rank 0\n")
    quick = live.LiveOutput(Job(), [0])
    quick.update(running=[0])  # before SHOW_AFTER
    quick.close()
    assert created == []
    slow = live.LiveOutput(Job(), [0])
    slow.started -= live.SHOW_AFTER
    slow.update(running=[0])
    slow.close()
    assert created == ["display", {"text/plain": "[rank 0] working on rank 0"}, {}]


def test_closing_sends_the_earlier_outputs_again_or_only_empties_what_it_cannot(tmp_path, monkeypatch):
    """close(): the cell cleared (wait=True) and its earlier outputs, streams and displays, sent again
    in their order; the live display itself not.
    An earlier output it cannot send again as it was (an execute_result) or outputs not known: the
    display is only emptied."""
    import io

    import IPython.display
    from course.runtime import live

    sent = []

    class Handle:
        display_id = "live"

        def update(self, data, raw):
            sent.append(("update", data))

    class Out(io.StringIO):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def write(self, text):
            sent.append((self.name, text))

    class Job:
        def output_path(self, rank):
            return tmp_path / f"rank{rank}.txt"

    monkeypatch.setattr(IPython.display, "display", lambda display_id: Handle())
    def clear_output(wait=False):  # noted as the kernel's counted Session.send notes it (count_outputs)
        sent.append(("clear", wait))
        live.CELL.sent("clear_output", {"wait": wait})

    monkeypatch.setattr(IPython.display, "clear_output", clear_output)
    monkeypatch.setattr(IPython.display, "publish_display_data",
                        lambda data, metadata=None, transient=None: sent.append(("display", data, transient)))
    monkeypatch.setattr(live.sys, "stdout", Out("stdout"))
    monkeypatch.setattr(live.sys, "stderr", Out("stderr"))
    (tmp_path / "rank0.txt").write_text("working on rank 0\n")
    earlier = [("stream", {"name": "stdout", "text": "a\n"}),
               ("display_data", {"data": {"text/plain": "old"}, "transient": {"display_id": "mine"}}),
               ("stream", {"name": "stderr", "text": "b\n"}),
               ("display_data", {"data": {}, "transient": {"display_id": "live"}})]  # the live display
    for outputs, expected in [
        (earlier, [("clear", True), ("stdout", "a\n"), ("display", {"text/plain": "old"}, {"display_id": "mine"}),
                   ("stderr", "b\n")]),
        ([], [("clear", False)]),  # the display was the cell's only output
        ([("execute_result", {"data": {"text/plain": "1"}})], [("update", {})]),
        (None, [("update", {})]),  # not known: the cell that imported course
    ]:
        monkeypatch.setattr(live, "CELL", live.CellOutputs([(k, dict(c)) for k, c in outputs]
                                                           if outputs is not None else None))
        shown = live.LiveOutput(Job(), [0])
        shown.started -= live.SHOW_AFTER
        shown.update(running=[])
        sent.clear()
        shown.close()
        assert sent == expected, (outputs, sent)
        if sent[0][0] == "clear":  # what it sends again is noted again, from nothing (not "not known")
            assert live.CELL.outputs == [], live.CELL.outputs


def test_the_outputs_noted_hold_a_displays_latest_data(monkeypatch):
    """count_outputs notes what goes through the kernel's Session.send, a display's updates applied
    (what close() would send again is what the cell shows now); a clear starts afresh."""
    from types import SimpleNamespace

    from course.runtime import live

    session = SimpleNamespace(send=lambda stream, msg_or_type, content=None, *a, **k: None)
    hooks = []
    shell = SimpleNamespace(kernel=SimpleNamespace(session=session), display_pub=SimpleNamespace(session=session),
                            events=SimpleNamespace(register=lambda event, f: hooks.append(f)))
    monkeypatch.setattr(live.sys, "stdout", SimpleNamespace(session=session))
    monkeypatch.setattr(live.sys, "stderr", SimpleNamespace(session=session))
    monkeypatch.setattr(live, "_counting", [])
    monkeypatch.setattr(live, "CELL", live.CellOutputs())
    live.count_outputs(shell)
    hooks[0](None)  # pre_run_cell
    session.send(None, "stream", {"name": "stdout", "text": "a\n"})
    session.send(None, "display_data", {"data": {"text/plain": "0 %"}, "transient": {"display_id": "bar"}})
    session.send(None, "update_display_data", {"data": {"text/plain": "100 %"}, "transient": {"display_id": "bar"}})
    assert live.CELL.outputs == [("stream", {"name": "stdout", "text": "a\n"}),
                                  ("display_data", {"data": {"text/plain": "100 %"}, "metadata": {},
                                                    "transient": {"display_id": "bar"}})]
    session.send(None, {"header": {"msg_type": "clear_output"}, "content": {"wait": False}})
    assert live.CELL.outputs == []
