"""`python -m course doctor`: passes here, and fails clearly where the course cannot work."""

import pytest

from course.classroom import doctor
from course.observe import tracing


def test_doctor_passes_here_and_runs_a_traced_ddp_launch(capsys):
    assert doctor.doctor() == 0
    out = capsys.readouterr().out
    assert "[ok  ] traced backend sees DDP's collectives (notebooks 04, 05): all_gather, broadcast, broadcast, all_reduce" in out
    assert out.rstrip().endswith("All good: the course runs here.")
    assert "[info] start method of course.launch: " in out


def test_the_start_method_and_why(capsys, monkeypatch):
    monkeypatch.setenv("COURSE_START_METHOD", "forkserver")
    assert doctor.doctor() == 0
    assert "[info] start method of course.launch: forkserver (set by COURSE_START_METHOD;" in capsys.readouterr().out
    monkeypatch.setenv("COURSE_START_METHOD", "fastest")
    assert doctor.doctor() == 1
    assert "[FAIL] start method: COURSE_START_METHOD='fastest' is not a start method" in capsys.readouterr().out


def test_a_torch_older_than_the_declared_floor_fails_with_the_install_command(capsys, monkeypatch):
    monkeypatch.setattr(doctor, "oldest_supported", lambda package="torch": "99.0")
    assert doctor.doctor() == 1
    assert 'older than the course supports (torch>=99.0): pip install "torch>=99.0"' in capsys.readouterr().out


def test_a_traced_backend_that_cannot_be_built_fails_clearly(capsys, monkeypatch, forked_ranks):
    def broken(self, *args):  # what torch < 2.14 said to a Python Backend
        raise TypeError("TracingBackend: No constructor defined!")

    monkeypatch.setattr(tracing.TracingBackend, "__init__", broken)  # forked ranks inherit it
    assert doctor.doctor() == 1
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "traced backend" in line)
    assert line.startswith("[FAIL]") and "No constructor defined" in line and "cannot run course.observe.tracing" in line
    assert "Python 3." in line and "see README.md, Supported versions" in line  # this torch is not too old
    assert out.rstrip().endswith("Something above failed: see README.md, Troubleshooting.")


def test_the_floor_is_read_from_the_installed_package_metadata():
    floor = doctor.oldest_supported()
    if floor is None:
        pytest.skip("the course is not installed (running from a checkout on PYTHONPATH)")
    assert doctor._version(floor) >= (2, 8)


def test_require_torch_names_the_version_and_the_fix():
    import torch

    from course.classroom.doctor import PART_II_TORCH, require_torch, torch_at_least

    require_torch("2.0", "Notebook X")  # older than any supported torch: fine
    with pytest.raises(RuntimeError, match=r"Notebook X needs torch >= 99\.0.*pip install -U"):
        require_torch("99.0", "Notebook X")
    assert torch_at_least(torch.__version__.split("+")[0]) and not torch_at_least("99.0")
    assert isinstance(PART_II_TORCH, str)
