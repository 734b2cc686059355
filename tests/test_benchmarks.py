"""Smoke test: each benchmark script runs with its tiniest arguments and prints its table.
(The figures themselves are not tested: see benchmarks/README.md.)"""

import runpy
import sys
from pathlib import Path

import nbformat
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    "launch_overhead.py": (["--quick"], "course.launch (fork)"),
    "allreduce_bandwidth.py": (["--quick", "--out", "{tmp}"], "busbw GB/s"),
    "ddp_step_vs_bucket.py": (["--quick", "--out", "{tmp}"], "bucket_cap_mb=0.25"),
    "tracer_overhead.py": (["--quick"], "traced ms/step"),
    "notebook_times.py": (["{tmp}/tiny.ipynb"], "tiny.ipynb"),
    "grading_overhead.py": (["--quick"], "not sandboxed"),
    "guard_cost.py": (["--repeats", "1"], "finished versions"),
}


def test_every_benchmark_script_is_smoke_tested():
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")} - {"common.py"}
    assert scripts - {"gpu_memory.py"} <= set(CASES), f"add a smoke test for {scripts - set(CASES)}"


def test_gpu_memory_without_a_gpu_says_so_and_points_to_the_trace(monkeypatch):
    """benchmarks/gpu_memory.py measures on a CUDA GPU (never in CI): without one it stops with a
    message naming what to use instead, before it builds anything."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: run the script itself")
    path = ROOT / "benchmarks" / "gpu_memory.py"
    monkeypatch.setattr(sys, "argv", [str(path)])
    with pytest.raises(SystemExit, match="has none.*activation_coefficient"):
        runpy.run_path(str(path), run_name="__main__")


@pytest.mark.slow  # each script imports and runs what it measures: 30-40 s together, in .ci/run's slow part
@pytest.mark.parametrize("script", sorted(CASES))
def test_benchmark_runs_and_prints_its_table(script, tmp_path, monkeypatch, capsys):
    """The script runs as ``python benchmarks/SCRIPT ARGS`` would (runpy, as ``__main__``), but in
    this process: a fresh interpreter would spend seconds importing torch (and torch._dynamo, for
    course.launch) before the few milliseconds of work that --quick leaves."""
    args, expected = CASES[script]
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    tiny = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(1 + 1)", outputs=[nbformat.v4.new_output("stream", text="2\n")])])
    nbformat.write(tiny, tmp_path / "tiny.ipynb")
    path = ROOT / "benchmarks" / script
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts benchmarks/ in front
    threads = torch.get_num_threads()  # some scripts change this process's torch threads
    try:
        runpy.run_path(str(path), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
        sys.modules.pop("common", None)  # benchmarks/common.py, imported by the script
    out = capsys.readouterr().out
    assert expected in out
    assert "torch " in out.splitlines()[1]  # the header names the torch version
    if "--out" in args:
        assert list(tmp_path.glob("*.png"))


def test_notebook_times_sums_the_cells_of_each_file(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from notebook_times import failures, seconds_per_file

    report = tmp_path / "junit.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="solutions.02_x.ipynb" name="Cell 0" time="1.5"/>'
        '<testcase classname="solutions.02_x.ipynb" name="Cell 1" time="2.0"/>'
        '<testcase classname="notebooks.02_x.ipynb" name="Cell 0" time="0.25"/>'
        '<testcase classname="tests.test_launcher" name="test_a" time="3.0"/>'
        '<testcase classname="tests.test_launcher" name="test_b" time="0.5"><failure message="x"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert seconds_per_file(report) == {"solutions/02_x.ipynb": 3.5, "notebooks/02_x.ipynb": 0.25, "tests.test_launcher": 3.5}
    assert failures(report) == ["tests.test_launcher::test_b"]
