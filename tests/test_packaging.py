"""README, CI script, pyproject.toml, environment.yml and constraints.txt agree."""

import json
import re
from pathlib import Path

import pytest
import yaml

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement):
    return re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0].lower()


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _environment_pip():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    return [r for r in pip if not r.startswith("-e")]


def _constraints():
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def _version(text):
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


def test_environment_yml_describes_the_same_packages_as_pyproject():
    project = _pyproject()
    declared = project["dependencies"] + project["optional-dependencies"]["dev"]
    env = _environment_pip()
    assert sorted(map(_name, env)) == sorted(map(_name, declared))
    pins = _constraints()
    for requirement in env:
        name = _name(requirement)
        if name in pins:  # the tested pair: pinned exactly, as in constraints.txt
            assert requirement == f"{name}=={pins[name]}"
        else:  # everything else: the very same specifier as pyproject
            assert requirement in declared, requirement


def test_pinned_torch_pair_satisfies_the_package_and_is_not_pinned_in_it():
    declared = {_name(r): r for r in _pyproject()["dependencies"]}
    for name, version in _constraints().items():
        lower = declared[name].split(">=")[1]
        assert _version(version) >= _version(lower)
        assert "==" not in declared[name]  # Colab brings its own torch


def _readme_commands():
    readme = (ROOT / "README.md").read_text()
    found = {}
    for label in ("Install", "Run the course:", "Test"):
        match = re.search(rf"\*\*{re.escape(label)}.*?```bash\n(.+?)\n```", readme, re.S)
        assert match, f"README has no '{label}' command"
        assert "\n" not in match.group(1), f"README's {label} is not one command"
        found[label] = match.group(1)
    return found


def test_ci_runs_the_readme_install_and_test_commands():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = _readme_commands()
    test = [line for line in ci if line.split(" | tee ")[0] == commands["Test"]]  # its output also kept in a log
    assert commands["Install"] in ci and test
    assert ci.index(commands["Install"]) < ci.index(test[0])


# ---------------------------------------------------------------- the supported range


def _pins(path):
    lines = (ROOT / path).read_text().splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def test_the_oldest_pair_ci_tests_is_exactly_the_floor_pyproject_declares():
    declared = {_name(r): r for r in _pyproject()["dependencies"]}
    oldest = _pins("constraints-oldest.txt")
    assert sorted(oldest) == ["torch", "torchvision"]
    for name, version in oldest.items():
        assert declared[name] == f"{name}>={version}"  # what is declared is what is tested
    ci = (ROOT / ".ci" / "old-torch").read_text()
    assert "-c constraints-oldest.txt torch torchvision" in ci and "pytest notebooks/ tests/ " in ci
    assert ".ci/old-torch" in (ROOT / ".ci" / "run").read_text()


def _needs_torchvision_or_part_two(notebook):
    """True if a student notebook's code uses torchvision (directly, or through course.training.data or course.training.train,
    which load CIFAR-10 with it) or is one of the notebooks that declare torch >= PART_II_TORCH (11-13)."""
    cells = json.loads(notebook.read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    code = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("#", "%pip")))
    return int(notebook.name[:2]) >= 11 or re.search(r"torchvision|course\.training\.(data|train)\b|from course\.training import .*\b(data|train)\b", code)


def test_the_no_nccl_ci_runs_every_notebook_that_a_cpu_only_torch_can():
    # A CPU-only torch has no NCCL (default_pg_nccl_timeout is None there) and PyPI's torchvision cannot load
    # beside it: .ci/no-nccl runs every student notebook that needs neither torchvision nor torch >= 2.15.
    ci = (ROOT / ".ci" / "no-nccl").read_text()
    listed = sorted(re.findall(r"notebooks/(\d\d_\w+\.ipynb)", ci))
    expected = sorted(nb.name for nb in (ROOT / "notebooks").glob("*.ipynb") if not _needs_torchvision_or_part_two(nb))
    assert listed == expected
    assert "torch==2.13.0+cpu" in ci and "default_pg_nccl_timeout is None" in ci
    assert "bash .ci/no-nccl" in (ROOT / ".ci" / "run").read_text()


# ---------------------------------------------------------------- one repository URL


def test_the_colab_links_come_from_the_repository_url_in_pyproject():
    from course.classroom import notebooks

    url = _pyproject()["urls"]["Repository"]
    assert notebooks.repository_url() == url and notebooks.REPO == url.removeprefix("https://github.com/")
    assert f"git+{url}" in notebooks.COLAB_INSTALL
    assert f"colab.research.google.com/github/{notebooks.REPO}/blob/main/" in notebooks.colab_badge("notebooks", "x.ipynb")
    # no other copy of the URL in the package: a fork changes pyproject.toml only
    for path in (ROOT / "course").rglob("*.py"):
        assert notebooks.REPO not in path.read_text(encoding="utf-8"), path


@pytest.mark.parametrize(
    "line, expected",
    [
        ('Repository = "https://github.com/someone/my-ddp-course"', "https://github.com/someone/my-ddp-course"),
        ('Repository = "https://github.com/someone/my-ddp-course.git"', "https://github.com/someone/my-ddp-course"),
        ('Repository = "https://gitlab.com/someone/course"', "not https://github.com/OWNER/NAME"),
    ],
)
def test_a_fork_changes_one_line(tmp_path, line, expected):
    from course.classroom import notebooks

    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(f'[project]\nname = "ddp-course"\n\n[project.urls]\n{line}\n')
    if expected.startswith("https://"):
        assert notebooks.repository_url(pyproject) == expected
    else:
        with pytest.raises(ValueError, match=expected):
            notebooks.repository_url(pyproject)
