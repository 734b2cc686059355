"""README's run command, exercised: start `jupyter lab` as README says, run a student notebook's
first `course.launch` cell through the server's kernel API (REST + websocket, as the browser
does), check what the cell shows, shut the server down, and find no process left behind."""

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import nbformat
import psutil
import pytest
import websocket  # websocket-client: jupyter_server's own dependency, so jupyterlab brings it

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "02_manual_scatter.ipynb"
TIMEOUT = 120  # seconds for each wait: the machine may be loaded


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(base, token, method, path, body=None):
    request = urllib.request.Request(
        f"{base}{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"token {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read()
    return json.loads(text) if text else None


def _first_steps(path):
    """What a student runs first in a notebook: its code cells that import something (the Colab
    install cell, the imports), then its first ``course.launch`` cell. The cells in between are left
    out: in notebook 02 one of them runs torchrun, three more processes that each import torch."""
    cells = []
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        if "course.launch(" in cell.source:
            return cells + [cell.source]
        if re.search(r"^(import|from) \w", cell.source, re.M):
            cells.append(cell.source)
    raise AssertionError(f"{path.name} has no course.launch cell")


def _execute(ws, session, code):
    """Send one execute_request on the kernel's websocket; return (status, text shown)."""
    msg_id = uuid.uuid4().hex
    header = {"msg_id": msg_id, "msg_type": "execute_request", "session": session,
              "username": "test", "version": "5.3", "date": ""}
    ws.send(json.dumps({
        "header": header, "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
        "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                    "allow_stdin": False, "stop_on_error": True},
    }))
    streams, displays, status, idle = [], {}, None, False
    deadline = time.monotonic() + TIMEOUT
    while not (status and idle):
        assert time.monotonic() < deadline, f"no reply within {TIMEOUT} s to:\n{code}"
        msg = json.loads(ws.recv())
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            streams.append(content["text"])
        elif kind in ("display_data", "update_display_data", "execute_result"):
            # a display with an id may be updated while the cell runs: keep its last version
            key = content.get("transient", {}).get("display_id") or len(displays)
            displays[key] = content["data"].get("text/plain", "")
        elif kind == "error":
            streams.append("\n".join(content["traceback"]))
        elif kind == "execute_reply":
            status = content["status"]
        elif kind == "status" and content["execution_state"] == "idle":
            idle = True
    return status, "".join(streams) + "\n".join(displays.values())


def _ours(marker):
    """Every live process that inherited this test's marker variable (server, kernel, ranks)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get("COURSE_SERVER_TEST") == marker and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


@pytest.mark.slow  # a JupyterLab server and a kernel: in .ci/run's slow part
def test_readme_jupyter_lab_runs_a_notebook_launch_cell_and_leaves_nothing_behind(tmp_path):
    readme = (ROOT / "README.md").read_text()
    assert "jupyter lab notebooks/" in readme  # the command this test runs (as `python -m jupyter lab`)
    port, token, marker = _free_port(), uuid.uuid4().hex, uuid.uuid4().hex
    env = dict(os.environ, COURSE_SERVER_TEST=marker, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    env.pop("PYTEST_CURRENT_TEST", None)  # a kernel started under pytest would not capture fd output
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "notebooks/", "--no-browser", "--ip=127.0.0.1",
         f"--port={port}", "--port-retries=0", f"--IdentityProvider.token={token}"]
        + (["--allow-root"] if os.geteuid() == 0 else []),  # as root (CI, containers) lab refuses without it
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            assert server.poll() is None, f"jupyter lab exited:\n{server.stdout.read()}"
            try:
                _api(base, token, "GET", "/api/status")
                break
            except OSError:
                assert time.monotonic() < deadline, "jupyter lab did not answer"
                time.sleep(0.1)

        # What the browser does when a student opens the notebook: a session with a kernel.
        session = _api(base, token, "POST", "/api/sessions",
                       {"path": NOTEBOOK, "type": "notebook", "name": NOTEBOOK, "kernel": {"name": "python3"}})
        kernel = session["kernel"]["id"]
        ws = websocket.create_connection(
            f"ws://127.0.0.1:{port}/api/kernels/{kernel}/channels?token={token}", timeout=TIMEOUT
        )
        try:
            outputs = [_execute(ws, uuid.uuid4().hex, code) for code in _first_steps(ROOT / "notebooks" / NOTEBOOK)]
        finally:
            ws.close()
        for status, text in outputs:
            assert status == "ok", text
        shown = outputs[-1][1]
        for rank in range(4):
            assert f"[rank {rank}] I am rank {rank} of 4, backend gloo, LOCAL_RANK={rank}" in shown
        assert "returned to the notebook: [0, 10, 20, 30]" in shown
        assert any(p.pid != server.pid for p in _ours(marker)), "the kernel should be running now"

        # Shut the server down as its API offers (as File > Shut Down does).
        _api(base, token, "POST", "/api/shutdown")
        server.wait(timeout=TIMEOUT)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        log = server.stdout.read()
    deadline = time.monotonic() + 30
    while _ours(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [(p.pid, " ".join(p.cmdline())[:100]) for p in _ours(marker)]
    assert left == [], f"processes left behind: {left}"
    assert server.returncode == 0, log
    with pytest.raises(ConnectionRefusedError):  # nothing listens on the port any more
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
