"""Exercises: a check that answers correct / wrong (with a hint) / not attempted yet,
plus ``hint()`` and ``solution()``.

A check module (``course/checks/nbNN.py``) defines each exercise as a function that
judges a *real attempt* and returns :func:`correct` or :func:`wrong`::

    @exercise("Exercise 2 (average_gradients)",
              hint="all_reduce every parameter's .grad, then divide by the world size.")
    def average_gradients(fn):
        results = launch(run_with, 4, fn, show=None)
        if ...:
            return wrong("each rank still has only its own gradient.")
        return correct("4 ranks, one step: the same weights as one device.")

and the notebook uses it::

    check.average_gradients(average_gradients)   # ✅ / ❌ (with a hint) / ✏️ not attempted
    check.average_gradients.hint()
    check.average_gradients.solution()

:class:`Exercise` does what every check needs, so the checks don't repeat it:

* an untouched stub (``...``, ``None``, or a function whose body is ``...``) gives
  "not attempted yet", so a student notebook runs top to bottom;
* a rank that fails inside the check's :func:`course.launch` (a
  :class:`course.WorkerError`) is reported as a wrong answer naming the rank's error;
* an answer that raises when the check calls it (a typo's ``NameError``) is a wrong answer
  too: the exception, the student's line and the hint, without the course's own frames;
* the feedback carries the exercise's name.

What a check, ``hint()`` and ``solution()`` return shows as plain text in a terminal and as
Markdown in Jupyter (``_repr_markdown_``: `code` as code, *emphasis* as emphasis, the solution
highlighted). Feedback and hints are written with those two markers only; everything else in
them is shown as it is (:func:`markdown`). A Jupyter output keeps both forms; nbval compares the
plain one (``conftest.py``).

``solution()`` shows the solution notebook's own code for the exercise (the notebooks
are the single source): ``python -m course build`` copies each exercise's solution cell
into ``course/checks/solutions.json``, and a test keeps that file up to date.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import sys
import textwrap
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

from course.runtime import interrupts

ICONS = {"correct": "✅", "wrong": "❌", "todo": "✏️"}
LINE = 100  # characters a printed line may take: JupyterLab's output area breaks wider ones mid-word
SOLUTIONS_FILE = Path(__file__).parents[1] / "checks" / "solutions.json"


@dataclass(frozen=True)
class Feedback:
    exercise: str
    status: str  # "correct", "wrong" or "todo"
    message: str
    details: str = ""  # preformatted lines shown under the message (what a failed rank printed last)

    def __repr__(self) -> str:
        text = f"{ICONS[self.status]} {self.exercise}: {self.message}"
        if self.status == "wrong":  # a hint is prose: cut between words into lines that fit
            text = "\n".join(_fit(line) for line in text.split("\n"))
        return text + "".join(f"\n    {line}" for line in self.details.splitlines())

    def _repr_markdown_(self) -> str:
        return f"{ICONS[self.status]} **{markdown(self.exercise)}**: {markdown(self.message)}" + code_block(self.details, "text")

    def __bool__(self) -> bool:
        return self.status == "correct"


def _fit(line: str) -> str:
    """``line`` cut between words into lines of at most :data:`LINE` characters (a word longer
    than that, a path say, stays whole); "all-gather" is one word."""
    if len(line) <= LINE:
        return line
    return textwrap.fill(line, width=LINE, break_long_words=False, break_on_hyphens=False)


def correct(message="correct!") -> Feedback:
    return Feedback("", "correct", message)


def wrong(hint) -> Feedback:
    return Feedback("", "wrong", f"not yet. Hint: {hint}")


def todo() -> Feedback:
    return Feedback("", "todo", "not attempted yet — replace the `...` with your answer.")


class Text(str):
    """A string that shows as itself (not as a quoted repr) at the end of a cell, and in
    Jupyter as the Markdown ``markdown`` (the same text, formatted)."""

    def __new__(cls, text: str, markdown: str | None = None):
        self = super().__new__(cls, text)
        self.markdown = markdown
        return self

    def __repr__(self) -> str:
        return str(self)

    def _repr_markdown_(self) -> str | None:
        return self.markdown


CODE_SPAN = re.compile(r"(`+)(.+?)\1")
EMPHASIS = re.compile(r"\*(\S(?:[^*]*\S)?)\*")
SPECIAL = re.compile(r"([\\`*_\[\]<>&|~$])")  # markup anywhere in a line
LINE_START = re.compile(r"^(\s*)([-+#>=]|\d+[.)])", re.M)  # markup at the start of a line: lists, headings, quotes


def _escape(text: str) -> str:
    return SPECIAL.sub(r"\\\1", text)


def _code_span(code: str) -> str:
    ticks = "`" * (max(map(len, re.findall("`+", code)), default=0) + 1)
    pad = " " if code.startswith("`") or code.endswith("`") else ""
    return f"{ticks}{pad}{code}{pad}{ticks}"


def markdown(text: str) -> str:
    """``text`` as Markdown that shows exactly it: `code` spans and *emphasis* are kept, every
    other character Markdown or HTML would take as markup (``<class 'list'>``, ``__init__``,
    ``2 * 3``, a leading ``1.``) is escaped; a line break stays a line break."""
    parts = []
    for i, piece in enumerate(CODE_SPAN.split(text)):  # text, backticks, code, text, ...
        if i % 3 == 2:
            parts.append(_code_span(piece))
        elif i % 3 == 0:
            for j, span in enumerate(EMPHASIS.split(piece)):  # text, emphasised, text, ...
                parts.append(f"*{_escape(span)}*" if j % 2 else _escape(span))
    out = LINE_START.sub(lambda m: m.group(1) + m.group(2)[:-1] + "\\" + m.group(2)[-1], "".join(parts))
    return out.replace("\n", "  \n")


# JupyterLab breaks the lines of every <pre> in an output anywhere, mid-word ("word-break:
# break-all; white-space: pre-wrap"). Code blocks sit in a <div> this rule changes: code
# scrolls sideways instead, a log's lines wrap between words. (A notebook opened untrusted
# drops the <style>: its blocks wrap as before, nothing worse.)
NO_MID_WORD_BREAKS = (  # !important: JupyterLab's own rules for <pre> and <code> are more specific
    "<style>.course-code pre, .course-code pre code "
    "{white-space: pre !important; word-break: normal !important; overflow-wrap: normal !important; overflow-x: auto}\n"
    ".course-log pre, .course-log pre code "
    "{white-space: pre-wrap !important; word-break: normal !important; overflow-wrap: anywhere !important}</style>"
)


def code_block(code: str, language: str = "python") -> str:
    """``code`` as a fenced Markdown block (highlighted in Jupyter; never broken mid-word), after
    a blank line; "" for no code. ``language="text"`` is a log: its long lines wrap."""
    if not code.strip():
        return ""
    fence = "`" * max(3, max(map(len, re.findall("`+", code)), default=0) + 1)
    kind = "course-log" if language == "text" else "course-code"
    return f'\n\n{NO_MID_WORD_BREAKS}\n<div class="{kind}">\n\n{fence}{language}\n{code.rstrip()}\n{fence}\n\n</div>'


# A check runs its launches one after another: a press between them (in the check module's code,
# below Exercise.__call__) finds no rank running, and in Jupyter ends in one line, not a traceback
# through the course's frames. A press in the student's own function is theirs: the usual traceback.
interrupts.no_ranks_in(__file__)


class Exercise:
    """One exercise: call it with the student's answer(s) to check them."""

    def __init__(self, judge, name: str, hint: str, finished=()):
        functools.update_wrapper(self, judge)
        self.judge = judge
        self.name = name
        self._hint = hint
        self.finished = tuple(finished)  # the course's own versions of the answer (course.classroom.guard)
        self.notebook = judge.__module__.rsplit(".nb", 1)[-1]  # "course.checks.nb02" -> "02"

    def __call__(self, *answers, **options) -> Feedback:
        from course.classroom import guard
        from course.runtime.launcher import WorkerError

        if any(is_stub(a) for a in answers):
            feedback = todo()
        elif why := next(filter(None, (guard.refused(a, self.finished) for a in answers)), None):
            feedback = Feedback("", "wrong", f"not yet: {why}")
        else:
            try:
                with guard.guarding(self.finished, answers):
                    feedback = self.judge(*answers, **options)
            except guard.FinishedVersionUsed as e:  # raised in this process, outside the ranks
                feedback = Feedback("", "wrong", f"not yet: {e}")
            except WorkerError as e:  # the student's code failed on a rank
                feedback = rank_failed(e)
            except Exception as e:  # raised here, in the check's process: by the answer, or a bug of the check's
                feedback = answer_raised(e, self._hint)
                if feedback is None:
                    raise
            if isinstance(feedback, Feedback) and (why := next(
                    (guard.message(d) for d in self.finished if guard.message(d) in feedback.message), None)):
                feedback = Feedback("", "wrong", f"not yet: {why}")  # whatever else the judge made of it
        if not isinstance(feedback, Feedback):
            raise TypeError(f"{self.name}'s check returned {feedback!r}, not correct(...) or wrong(...).")
        return replace(feedback, exercise=self.name)

    def hint(self) -> Text:
        return Text(f"💡 {self.name}: {self._hint}", f"💡 **{markdown(self.name)}**: {markdown(self._hint)}")

    def solution(self) -> Text:
        code = solutions().get(self.notebook, {}).get(self.__name__)
        if code is None:
            text = f"{self.name}: no stored solution; see solutions/ in the course repository."
            return Text(text, markdown(text))
        return Text(f"💡 {self.name}, a solution:\n\n{code}", f"💡 **{markdown(self.name)}**, a solution:" + code_block(code))

    def __repr__(self) -> str:
        return f"<exercise {self.name}: call it with your answer; .hint(), .solution()>"


def rank_failed(e) -> Feedback:
    """The feedback for a check whose launch failed in the student's code (a
    :class:`course.WorkerError` the check did not handle): which rank, the whole error, the
    student's line, and what a rank that died without a Python exception printed last."""
    from course.runtime.launcher import WorkerTimeoutError

    if isinstance(e, WorkerTimeoutError):
        stuck = "\n".join(f"rank {r}:\n{e.stacks[r]}" for r in e.ranks if e.stacks.get(r))
        return replace(wrong(str(e).split("\n")[0]), details=stuck)
    reason = " ".join(e.reason.split())  # torch's messages go on in indented lines: one paragraph
    if reason.startswith("FinishedVersionUsed: "):  # course.classroom.guard: not a crash, a verdict
        return Feedback("", "wrong", "not yet: " + reason.removeprefix("FinishedVersionUsed: "))
    where = f", in your code at {e.where}" if e.where else ""
    message = f"not yet: a rank failed: {reason} (rank {e.rank}{where})"
    if e.last_lines:
        message += ". What it printed last:"
    return Feedback("", "wrong", message, details=e.last_lines)


def answer_raised(e: Exception, hint: str) -> Feedback | None:
    """The feedback for an answer that raised when the check called it (not on a rank): the
    exception, the student's own lines where it happened (``Cell In[12], line 4``), the hint;
    none of the course's frames. None if no frame is the student's (a bug of the check's)."""
    from course.runtime.worker import callers_frame, describe_frame, is_callers_code

    frames = [f for f in traceback.extract_tb(e.__traceback__) if is_callers_code(f.filename)]
    if not frames:
        return None
    reason = " ".join(f"{type(e).__name__}: {e}".split()) if str(e) else type(e).__name__
    where = describe_frame(callers_frame(e.__traceback__))
    details = "\n".join(describe_frame((f.filename, f.lineno, f.name)) + (f"\n    {f.line}" if f.line else "")
                        for f in frames)
    return Feedback("", "wrong", f"not yet: your code raised {reason} (in your code at {where}). Hint: {hint}",
                    details=details)


def exercise(name: str, hint: str, finished=()):
    """Decorator: turn ``judge(answer, ...) -> correct(...) | wrong(...)`` into an :class:`Exercise`.
    ``finished``: dotted names of the course's own versions of the answer, which the answer may
    neither be nor call (:mod:`course.classroom.guard`)."""

    def wrap(judge):
        return Exercise(judge, name, hint, finished)

    return wrap


@functools.lru_cache(maxsize=1)
def solutions() -> dict:
    """{notebook number: {exercise name: solution code}}, written by ``python -m course build``."""
    if not SOLUTIONS_FILE.exists():
        return {}
    return json.loads(SOLUTIONS_FILE.read_text(encoding="utf-8"))


def _stub():
    ...


def _stub_with_docstring():
    """A docstring alone is not an attempt."""
    ...


def _body(fn):
    """What a function does: its bytecode and constants, with any docstring blanked."""
    code = fn.__code__
    consts = list(code.co_consts)
    if consts and isinstance(consts[0], str) and consts[0] == fn.__doc__:
        consts[0] = "<docstring>"
    return code.co_code, tuple(consts)


def is_stub(answer) -> bool:
    """True for the untouched placeholders of a student notebook: ``...``, ``None``, or
    a function whose body is only ``...`` (it compiles to the same code as ``_stub``)."""
    if answer is ... or answer is None:
        return True
    if not hasattr(answer, "__code__"):
        return False
    return _body(answer) in (_body(_stub), _body(_stub_with_docstring))


@contextlib.contextmanager
def replaced(module, name, replacement, *answers):
    """``module.name`` is ``replacement`` inside the block, also for answers whose module imported
    the original by name (``from torch.distributed import all_reduce`` in the notebook), so that a
    check can watch what an answer calls however the answer wrote the call."""
    original = getattr(module, name)
    spaces = [vars(module)]
    for answer in answers:
        space = getattr(answer, "__globals__", None)  # a function's module; for a class, look its module up
        if space is None and getattr(answer, "__module__", None) in sys.modules:
            space = vars(sys.modules[answer.__module__])
        if space is not None and all(space is not known for known in spaces):
            spaces.append(space)
    bound = [(space, key) for space in spaces for key, value in list(space.items()) if value is original]
    for space, key in bound:
        space[key] = replacement
    try:
        yield
    finally:
        for space, key in bound:
            space[key] = original
