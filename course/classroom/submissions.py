"""Finding a class's submissions: which student handed in which course notebook.

A folder is one student's (named for the folder); a notebook given alone belongs to its
folder's student if it keeps the course's file name, else to the student it is named for.
Which course notebook a file is comes from its name, else from its "Open in Colab" badge.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ANSWERS_FILE = Path(__file__).parents[1] / "checks" / "answers.json"


def exercise_table() -> dict:
    """{"03": {"file": "03_distributed_sampler.ipynb", "exercises": [{"check": ..., "answers": [names],
    "check_cell": id, "answer_cells": [ids]}, ...]}}: see ``course.classroom.notebooks.exercise_answers``."""
    return json.loads(ANSWERS_FILE.read_text(encoding="utf-8"))



def number_by_name(path: Path, table: dict) -> str | None:
    """Which course notebook ``path``'s name says it is (``03_distributed_sampler.ipynb``,
    ``alice_03_distributed_sampler.ipynb``, ``03_x.ipynb``), if any."""
    for number, entry in table.items():
        if Path(entry["file"]).stem in path.stem:
            return number
    match = re.search(r"(?<![0-9])([0-9]{2})_", path.name)
    return match[1] if match and match[1] in table else None


def number_by_content(nb, table: dict) -> str | None:
    """Which course notebook ``nb`` is by its "Open in Colab" badge (its first cell), if any."""
    for cell in nb.cells[:1]:
        match = re.search(r"/(?:notebooks|solutions)/([0-9]{2})_\w+\.ipynb", cell.source)
        if match and match[1] in table:
            return match[1]
    return None


def notebook_number(path: Path, nb, table: dict) -> str | None:
    """Which course notebook ``path`` is: by its file name, else by its "Open in Colab" badge."""
    return number_by_name(path, table) or number_by_content(nb, table)


def identify(path: Path, table: dict) -> tuple[str | None, str | None]:
    """``(number, None)`` for a course notebook, else ``(None, why not)``: an empty file, a file
    that is not a notebook, a notebook whose name and badge say different notebooks, or one
    neither names."""
    import nbformat

    try:
        raw = path.read_bytes()
    except OSError as e:
        return None, f"cannot read the file ({e.strerror})"
    if not raw.strip():
        return None, "an empty file, not a notebook: hand in the .ipynb file Jupyter saved"
    try:
        nb = nbformat.reads(raw.decode("utf-8"), as_version=4)
    except Exception:
        return None, "not a notebook (not Jupyter's JSON): hand in the .ipynb file Jupyter saved"
    by_name, by_content = number_by_name(path, table), number_by_content(nb, table)
    if by_name and by_content and by_name != by_content:
        return None, (f"handed in as notebook {by_name} (its file name) but it is notebook {by_content} "
                      f"(its Colab badge): hand in {table[by_name]['file']}")
    if not (by_name or by_content):
        return None, "cannot tell which course notebook this is: keep the course's file name (03_distributed_sampler.ipynb)"
    return by_name or by_content, None


def find_submissions(paths) -> list[tuple[str, Path]]:
    """(student, notebook) for each submission: a folder is one student's (named for the
    folder; its notebooks, in subfolders too); a notebook given alone belongs to its folder's
    student if it has a course notebook's name (``alice/03_distributed_sampler.ipynb``),
    else to the student it is named for (``alice.ipynb``)."""
    table = exercise_table()
    course_names = {entry["file"] for entry in table.values()}
    found = []
    for path in map(Path, paths):
        if path.is_dir():
            student = path.resolve().name
            found += [(student, p) for p in sorted(path.rglob("*.ipynb")) if ".ipynb_checkpoints" not in p.parts]
        elif path.is_file() and path.suffix == ".ipynb":
            found.append((path.resolve().parent.name if path.name in course_names else path.stem, path))
        else:
            raise SystemExit(f"{path}: not a notebook (.ipynb) or a folder of them")
    return found

