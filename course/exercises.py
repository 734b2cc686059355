"""Feedback for the notebooks' exercises: correct, wrong (with a hint), or not attempted.

A check function returns a :class:`Feedback`; as the last line of a cell it shows as one
line of text. Student notebooks start with stubs: an answer of ``...`` (or ``None``)
or a function whose body is only ``...``, and every check reports those as
"not attempted yet" instead of failing, so an untouched notebook runs top to bottom.
"""

from __future__ import annotations

from dataclasses import dataclass

ICONS = {"correct": "✅", "wrong": "❌", "todo": "✏️"}


@dataclass(frozen=True)
class Feedback:
    exercise: str
    status: str  # "correct", "wrong" or "todo"
    message: str

    def __repr__(self) -> str:
        return f"{ICONS[self.status]} {self.exercise}: {self.message}"

    def __bool__(self) -> bool:
        return self.status == "correct"


def correct(exercise, message="correct!"):
    return Feedback(exercise, "correct", message)


def wrong(exercise, hint):
    return Feedback(exercise, "wrong", f"not yet. Hint: {hint}")


def todo(exercise):
    return Feedback(exercise, "todo", "not attempted yet — replace the `...` with your answer.")


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
