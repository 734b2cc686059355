"""course.runtime.worker: the protocol every launcher shares, the noise filter, and how course/ is put together."""

import ast
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from course import launch
from course.runtime import worker
from course.runtime.worker import NoiseFilter, Report, WorkerError, collect

ROOT = Path(__file__).resolve().parents[1]
TORCH_FILE = os.path.join(os.path.dirname(torch.__file__), "distributed", "distributed_c10d.py")


# ---------------------------------------------------------------- the noise torch adds


def test_gloo_connected_line_is_dropped_and_nothing_like_it():
    noise = NoiseFilter()
    assert not noise.keep("[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3")
    # Precise pattern: a user's line that merely looks similar stays.
    assert noise.keep("[Gloo] Rank 1 is connected to 3 peer ranks.")
    assert noise.keep("rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3")


def test_a_torch_warning_is_kept_once_with_its_source_line_and_user_warnings_always():
    noise = NoiseFilter()
    warning = f"{TORCH_FILE}:123: FutureWarning: `foo` is deprecated, use `bar`"
    lines = [warning, "  warnings.warn(", "fine", warning, "  warnings.warn(", "fine"]
    assert [line for line in lines if noise.keep(line)] == [warning, "  warnings.warn(", "fine", "fine"]
    mine = "/home/me/train.py:3: FutureWarning: my own"
    assert noise.keep(mine) and noise.keep(mine)  # not torch's: every copy stays


def test_cpp_warnings_are_compared_without_their_time_and_pid():
    noise = NoiseFilter()
    first = "[W1123 04:00:00.123456 4567 torch/csrc/distributed/c10d/Foo.cpp:12] Warning: bar is deprecated (function f)"
    again = "[W1123 04:00:01.654321 4568 torch/csrc/distributed/c10d/Foo.cpp:12] Warning: bar is deprecated (function f)"
    other = "[W1123 04:00:01.654321 4568 torch/csrc/distributed/c10d/Foo.cpp:13] Warning: baz (function g)"
    assert [noise.keep(x) for x in (first, again, other)] == [True, False, True]


def _noisy(rank, world_size):
    print(f"[Gloo] Rank {rank} is connected to {world_size - 1} peer ranks. "
          f"Expected number of connected peer ranks is : {world_size - 1}", flush=True)
    # What warnings.warn prints from torch's own code (pytest records warnings instead of printing them).
    sys.stderr.write(warnings.formatwarning("old API", FutureWarning, TORCH_FILE, 7, line="warnings.warn("))
    print("mine", rank)
    return rank


def test_launch_shows_each_rank_without_torchs_noise(capsys):
    launch(_noisy, 3)
    warning = f"{TORCH_FILE}:7: FutureWarning: old API"
    assert capsys.readouterr().out == (
        f"[rank 0] {warning}\n[rank 0]   warnings.warn(\n[rank 0] mine 0\n[rank 1] mine 1\n[rank 2] mine 2\n")


# ---------------------------------------------------------------- reports and records


def test_collect_names_the_first_cause_not_the_peers_that_noticed():
    reports = {
        0: Report(0, summary="RuntimeError: Connection closed by peer", time=1.0, consequence=True),
        1: Report(1, summary="ValueError: bad", time=2.0, traceback="tb"),
        2: Report(2, result=b"\x80\x04K\x02."),
    }
    with pytest.raises(WorkerError) as info:
        collect(reports, 3)
    assert info.value.rank == 1 and str(info.value).startswith("rank 1 of 3 failed: ValueError: bad")
    assert info.value.failed == {0: "RuntimeError: Connection closed by peer", 1: "ValueError: bad"}
    with pytest.raises(WorkerError, match=r"rank\(s\) 1 sent no result. mpirun said so"):
        collect({0: reports[2]}, 2, missing="mpirun said so")
    assert collect({0: reports[2], 1: reports[2]}, 2) == [2, 2]


def _gloo(store, rank, world_size, timeout):
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def test_registered_backend_is_a_named_record():
    if worker.registered_backend("coursetestrecord") is None:
        dist.Backend.register_backend("coursetestrecord", _gloo, devices=["cpu"])
    record = worker.registered_backend("coursetestrecord")
    assert (record.name, record.creator, record.extended_api, record.devices) == ("coursetestrecord", _gloo, False, ["cpu"])
    assert worker.registered_backend("nosuchone") is None


# ---------------------------------------------------------------- how course/ is put together


def _course_modules():
    return sorted((ROOT / "course").rglob("*.py"))


@pytest.mark.parametrize("path", _course_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_another_modules_private_names(path):
    tree = ast.parse(path.read_text())
    private = [
        f"{node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("course")
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert private == []


def test_distenv_reads_the_environment_without_importing_torch():
    code = "import sys, course.runtime.distenv; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
