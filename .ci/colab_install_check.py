"""Colab's install path, checked (run by .ci/old-torch, in a venv that had only torch and
torchvision before the course was installed from git, as Colab has).

    python .ci/colab_install_check.py notebooks/02_manual_scatter.ipynb

Checks that ``course`` is imported from the installed package (not from a checkout), that
the package carries its data (course/checks/solutions.json, for ``check.X.solution()``), then
runs the notebook top to bottom in a fresh kernel from a folder outside the repository.
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

notebook = Path(sys.argv[1]).resolve()
with tempfile.TemporaryDirectory() as tmp:
    os.chdir(tmp)  # nothing of the checkout is importable from here
    os.environ.pop("PYTHONPATH", None)
    where = subprocess.run(
        [sys.executable, "-c", "import course, course.checks.nb02; from course.classroom.exercises import SOLUTIONS_FILE as f; "
         "print(course.__file__); print(f.is_file() and f.stat().st_size)"],
        check=True, capture_output=True, text=True,
    ).stdout.split()
    print("course imported from", where[0])
    assert "site-packages" in where[0], f"course is not the installed package: {where[0]}"
    assert where[1] not in ("False", "0"), "the installed package lacks course/checks/solutions.json"

    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(notebook, as_version=4)
    shutil.copy(notebook, tmp)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": tmp}}).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    print(f"{notebook.name}: {len(code)} code cells ran without error in the installed course")
