"""What grading reports: one verdict per student and exercise (the CSV), each student's totals
(a table and a second CSV), the source of each correct answer (a file per student), and the
students who handed in byte-identical answers."""

from __future__ import annotations

import csv
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ICONS = {"correct": "✅", "wrong": "❌", "not attempted": "✏️", "error": "💥"}
COLUMNS = ["student", "notebook", "exercise", "title", "verdict", "feedback", "file", "course", "isolation"]


@dataclass
class Verdict:
    student: str
    notebook: str  # "03"
    exercise: str  # the check's name: rank_indices
    title: str  # "Exercise 1 (rank_indices)"
    verdict: str  # correct, wrong, not attempted or error
    feedback: str
    file: str
    course: str = ""  # the version of the course that judged: a hash of its files
    isolation: str = ""  # "sandboxed", or "NOT ISOLATED: why"
    source: str = field(default="", repr=False)  # the answer's source, as the notebook defined it

    def row(self) -> dict:
        return {c: getattr(self, c) for c in COLUMNS}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_MODE = 0o666 & ~_umask()  # a file's mode as open() would make it (a temporary file is 0600)


def write_rows(path, columns, rows):
    """A CSV written whole or not at all: a temporary file beside it, then renamed over it."""
    path = Path(path)
    with tempfile.NamedTemporaryFile("w", newline="", encoding="utf-8", dir=path.parent, prefix=f".{path.name}.",
                                     delete=False) as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    os.chmod(f.name, _MODE)
    os.replace(f.name, path)


def write_csv(verdicts, path):
    write_rows(path, COLUMNS, (v.row() for v in verdicts))


def _table(rows) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def summary(verdicts) -> str:
    """How many students solved each exercise, and how the others did."""
    rows = [("notebook", "exercise", "solved", "wrong", "not attempted", "error")]
    exercises = sorted(dict.fromkeys((v.notebook, v.title) for v in verdicts if v.exercise), key=lambda e: e[0])
    for notebook, title in exercises:
        these = [v.verdict for v in verdicts if (v.notebook, v.title) == (notebook, title)]
        rows.append((notebook, title, f"{these.count('correct')}/{len(these)}", these.count("wrong"),
                     these.count("not attempted"), these.count("error")))
    return _table(rows)


def progress_table(verdicts) -> str:
    rows = [("notebook", "exercise", "verdict", "feedback")]
    rows += [(Path(v.file).stem, v.title, f"{ICONS[v.verdict]} {v.verdict}", v.feedback) for v in verdicts]
    solved = sum(v.verdict == "correct" for v in verdicts if v.exercise)
    return _table(rows) + f"\n\n{solved} of {sum(bool(v.exercise) for v in verdicts)} exercises solved."


def identical_answers(verdicts) -> dict:
    """{(notebook, exercise): [[students], ...]}: groups of two or more students whose answer to an
    exercise (one judged correct or wrong) has byte-identical source."""
    groups = {}
    for v in verdicts:
        if v.verdict in ("correct", "wrong") and v.source.strip():
            groups.setdefault((v.notebook, v.exercise, v.source), []).append(v.student)
    found = {}
    for (notebook, exercise, _), students in groups.items():
        if len(set(students)) > 1:
            found.setdefault((notebook, exercise), []).append(sorted(set(students)))
    return found


def totals(verdicts) -> list[dict]:
    """One row per student: each notebook's solved/total, the total, and with whom they share an
    identical answer."""
    notebooks = sorted({v.notebook for v in verdicts if v.exercise})
    shared = {}
    for groups in identical_answers(verdicts).values():
        for students in groups:
            for s in students:
                shared.setdefault(s, set()).update(set(students) - {s})
    rows = []
    for student in sorted({v.student for v in verdicts}):
        mine = [v for v in verdicts if v.student == student and v.exercise]
        row = {"student": student}
        for n in notebooks:
            these = [v for v in mine if v.notebook == n]
            row[n] = f"{sum(v.verdict == 'correct' for v in these)}/{len(these)}"
        row["total"] = f"{sum(v.verdict == 'correct' for v in mine)}/{len(mine)}"
        row["identical answers with"] = " ".join(sorted(shared.get(student, ())))
        row["not graded"] = "; ".join(f"{Path(v.file).name}: {v.feedback}" for v in verdicts
                                       if v.student == student and not v.exercise)
        rows.append(row)
    return rows


def student_table(verdicts) -> str:
    """Student × notebook: solved/total, and each student's total."""
    rows = totals(verdicts)
    if not rows:
        return ""
    columns = [c for c in rows[0] if c not in ("identical answers with", "not graded")]
    table = [tuple(columns)] + [tuple(r[c] for c in columns) for r in rows]
    return _table(table)


def write_totals(verdicts, path):
    rows = totals(verdicts)
    write_rows(path, list(rows[0]) if rows else ["student", "total"], rows)


def write_answers(verdicts, folder):
    """``folder/STUDENT.py``: the source of each of the student's correct answers."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for student in sorted({v.student for v in verdicts}):
        correct = [v for v in verdicts if v.student == student and v.verdict == "correct"]
        text = "".join(f"# notebook {v.notebook}, {v.title}: correct ({v.file})\n{v.source.rstrip()}\n\n\n" for v in correct)
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", student) or "_"
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=folder, prefix=f".{name}.", delete=False) as f:
            f.write(text)
        os.chmod(f.name, _MODE)
        os.replace(f.name, folder / f"{name}.py")


def flags(verdicts) -> str:
    """What an instructor should look at: identical answers, lines for the terminal."""
    lines = []
    for (notebook, exercise), groups in sorted(identical_answers(verdicts).items()):
        for students in groups:
            lines.append(f"identical answers to notebook {notebook}'s {exercise}: {', '.join(students)}")
    return "\n".join(lines)
