"""Smoke test: each benchmark script runs with tiny sizes and prints its table.
(The figures themselves are not tested: see benchmarks/README.md.)"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    "launch_overhead.py": (["--quick"], "course.launch (fork)"),
    "allreduce_bandwidth.py": (["--quick", "--out", "{tmp}"], "busbw GB/s"),
    "ddp_step_vs_bucket.py": (["--quick", "--out", "{tmp}"], "bucket_cap_mb=0.25"),
    "tracer_overhead.py": (["--quick"], "traced ms/step"),
    "notebook_times.py": (["--only", "solutions/01_"], "solutions/01_single_device.ipynb"),
}


def test_every_benchmark_script_is_smoke_tested():
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")} - {"common.py"}
    assert scripts <= set(CASES), f"add a smoke test for {scripts - set(CASES)}"


@pytest.mark.parametrize("script", sorted(CASES))
def test_benchmark_runs_and_prints_its_table(script, tmp_path):
    args, expected = CASES[script]
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    done = subprocess.run([sys.executable, f"benchmarks/{script}", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert expected in done.stdout
    assert "torch " in done.stdout.splitlines()[1]  # the header names the torch version
    if "--out" in args:
        assert list(tmp_path.glob("*.png"))
