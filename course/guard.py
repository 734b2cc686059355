"""While a check runs, the course's own finished version of the answer refuses to work for it.

The package holds the finished code of many exercises (``course.context_parallel.ring_forward``
is Exercise 2 of notebook 14, derived there step by step). An answer that *is* it, or wraps it,
would pass its check while teaching nothing, so a check names the finished versions of its answer
(``@exercise(..., finished=["course.context_parallel.ring_forward"])``) and, while it judges:

* an answer that is one of them, a copy of its code, a ``functools.partial`` of it, a subclass
  of it, or a function that keeps it in a default value or a closure is refused at once;
* every name bound to one of them (the module's attribute, ``from course... import name`` in the
  notebook or anywhere else) is bound to a guard instead. The guard serves the check itself and
  course code the check runs, but raises :class:`FinishedVersionUsed` when the call comes from the
  answer's code, however it got there (a wrapper, a helper of the student's, course code the
  answer called).

"Comes from the answer": walking up the calling frames, the first one outside the course's
package, Python's own library and the installed packages (torch...) is the student's code, not
the check's. The ranks of a launch started during a check install the same guards before they
unpickle their function (:func:`install`; a forked rank inherits them anyway).

What it cannot see: an answer that copies the finished code's text is a derivation by another
name, and deliberate obfuscation (rebuilding the function from its bytecode by hand) goes further
than a check should chase. The course's promise is about the plausible wrong answers.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import sysconfig
from pathlib import Path

_COURSE = str(Path(__file__).resolve().parent)
_CHECKS = str(Path(_COURSE, "checks"))
_LIBRARIES = tuple(
    {str(Path(p).resolve()) for key in ("stdlib", "platstdlib", "purelib", "platlib") if (p := sysconfig.get_paths().get(key))}
)
_active: dict = {}  # dotted name -> (original, guard) while guarded in this process


class FinishedVersionUsed(RuntimeError):
    """The answer called the course's own finished version of itself."""


def resolve(dotted: str):
    """``"course.context_parallel.ring_forward"`` -> (the module, "ring_forward")."""
    module_name, _, name = dotted.rpartition(".")
    return importlib.import_module(module_name), name


def message(dotted: str) -> str:
    """What a student reads when their answer uses ``dotted``."""
    return (f"your answer uses the course's own finished version, {dotted}: the check runs *your* code, "
            "so write it yourself (the notebook derives it step by step).")


def refused(answer, dotted_names) -> str | None:
    """Why ``answer`` is one of the finished versions in another form, or None."""
    for dotted in dotted_names:
        module, name = resolve(dotted)
        original = _active.get(dotted, (getattr(module, name), None))[0]
        if _holds(answer, original, depth=2):
            return message(dotted)
    return None


def _holds(obj, original, depth) -> bool:
    if obj is original:
        return True
    if isinstance(original, type) and isinstance(obj, type) and issubclass(obj, original):
        return True
    if getattr(obj, "__code__", None) is not None and obj.__code__ is getattr(original, "__code__", None):
        return True
    if depth == 0:
        return False
    inner = []
    if isinstance(obj, functools.partial):
        inner += [obj.func, *obj.args, *obj.keywords.values()]
    inner += list(getattr(obj, "__defaults__", None) or ())
    inner += list((getattr(obj, "__kwdefaults__", None) or {}).values())
    for cell in getattr(obj, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # an empty cell
            inner.append(cell.cell_contents)
    inner += [getattr(obj, "__wrapped__", None)]
    return any(x is not None and _holds(x, original, depth - 1) for x in inner)


def called_from_an_answer(frame) -> bool:
    """True if, going up from ``frame``, the student's code comes before the check's."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_CHECKS):
            return False
        if not (filename.startswith((_COURSE, *_LIBRARIES)) or filename.startswith("<frozen")):
            return True
        frame = frame.f_back
    return False


def _guarded(original, dotted):
    if isinstance(original, type):
        def __init__(self, *args, **kwargs):
            if called_from_an_answer(sys._getframe(1)):
                raise FinishedVersionUsed(message(dotted))
            original.__init__(self, *args, **kwargs)

        return type(original.__name__, (original,), {"__init__": __init__, "__module__": original.__module__,
                                                      "__qualname__": original.__qualname__})

    @functools.wraps(original)
    def guard(*args, **kwargs):
        if called_from_an_answer(sys._getframe(1)):
            raise FinishedVersionUsed(message(dotted))
        return original(*args, **kwargs)

    return guard


def _namespaces(answers) -> list:
    """Every loaded module's namespace, and the answers' own (a function's globals need not be a
    module's: code run by ``exec``, a function a rank unpickled)."""
    spaces = [vars(m) for m in list(sys.modules.values()) if m is not None]
    for answer in answers:
        space = getattr(answer, "__globals__", None)
        if space is not None and all(space is not known for known in spaces):
            spaces.append(space)
    return spaces


def install(dotted_names, answers=()) -> list:
    """Bind every name that holds one of the finished versions, in every loaded module and in the
    answers' globals, to its guard. Returns what to undo (see :func:`uninstall`); names already
    guarded are left alone."""
    undo = []
    for dotted in dotted_names:
        if dotted in _active:
            continue
        module, name = resolve(dotted)
        original = getattr(module, name)
        guard = _guarded(original, dotted)
        _active[dotted] = (original, guard)
        for space in _namespaces(answers):
            for key, value in list(space.items()):
                if value is original:
                    space[key] = guard
                    undo.append((space, key, original))
        undo.append((None, dotted, None))
    return undo


def uninstall(undo):
    for space, key, original in reversed(undo):
        if space is None:
            _active.pop(key, None)
        else:
            space[key] = original


@contextlib.contextmanager
def guarding(dotted_names, answers=()):
    """The finished versions are guarded inside the block (see the module's docstring)."""
    undo = install(dotted_names, answers)
    try:
        yield
    finally:
        uninstall(undo)


def active() -> tuple:
    """The finished versions guarded in this process now (a launch hands them to its ranks)."""
    return tuple(_active)
