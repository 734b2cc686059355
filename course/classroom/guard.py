"""While a check runs, the course's own finished version of the answer refuses to work for it.

The package holds the finished code of many exercises (``course.parallel.context_parallel.ring_forward``
is Exercise 2 of notebook 14, derived there step by step). An answer that *is* it, or wraps it,
would pass its check while teaching nothing, so a check names the finished versions of its answer
(``@exercise(..., finished=["course.parallel.context_parallel.ring_forward"])``) and, while it judges:

* an answer that is one of them, a ``functools.partial`` of it, a subclass of it, or a function
  that keeps it in a default value, a closure or ``__wrapped__`` is refused at once;
* the finished function itself (for a class: each of its methods) runs a guard in place of its
  code: every reference to it, wherever it is kept (an imported name, a list, a closure, a class
  attribute, a borrowed method), reaches the guard. The guard refuses with
  :class:`FinishedVersionUsed` unless course code that a check runs is calling it.

Who is calling: going up the frames from the call, past the libraries (Python's, torch...):
the student's code (any file outside the course package) before a check's means the answer
reached it, perhaps through course code; a check's own frame first means the check called it
*as the answer* (a borrowed method, a staticmethod in the answer's class...); course code on
the way to a check is course code the check runs, which may use it; no check on the stack (a
thread the answer started) is refused too. A check that wants the finished version itself, as
its reference, calls :func:`original`. Code Python generates (a dataclass's ``__init__``, file
``<string>``) counts as the student's.

The ranks of a launch started during a check install the same guards before they unpickle
their function (:func:`install`; a forked rank inherits them anyway).

What it cannot see: an answer that copies the finished code's text is a derivation by another
name, and deliberate obfuscation (a function rebuilt from the finished code object before the
check and hidden in a container, a module reloaded to get fresh functions) goes further than a
check should chase. The course's promise is
about the plausible wrong answers.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
import sysconfig
import types
from pathlib import Path

from course.runtime import launcher

_COURSE = os.path.realpath(Path(__file__).parents[1]) + os.sep  # the whole package
_CHECKS = _COURSE + "checks" + os.sep
_LIBRARIES = tuple(
    {os.path.realpath(p) + os.sep for key in ("stdlib", "platstdlib", "purelib", "platlib") if (p := sysconfig.get_paths().get(key))}
)
_PACKAGE_FOLDERS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")  # also the system's (Colab)
_active: dict = {}  # dotted name -> the functions guarded for it, in this process
_saved: dict = {}  # a guarded function -> (its own code, an unguarded copy of it, dotted name)


class FinishedVersionUsed(RuntimeError):
    """The answer called the course's own finished version of itself."""


def resolve(dotted: str):
    """``"course.parallel.context_parallel.ring_forward"`` -> (the module, "ring_forward")."""
    module_name, _, name = dotted.rpartition(".")
    return importlib.import_module(module_name), name


def message(dotted: str) -> str:
    """What a student reads when their answer uses ``dotted``."""
    return (f"your answer uses the course's own finished version, {dotted}: the check runs *your* code, "
            "so write it yourself (the notebook derives it step by step).")


# ------------------------------------------------------------------ answers that are it in another form


def refused(answer, dotted_names) -> str | None:
    """Why ``answer`` is one of the finished versions in another form, or None."""
    for dotted in dotted_names:
        if _holds(answer, getattr(*resolve(dotted)), depth=2):
            return message(dotted)
    return None


def _holds(obj, original, depth) -> bool:
    if obj is original:
        return True
    if isinstance(original, type) and isinstance(obj, type) and issubclass(obj, original):
        return True
    if getattr(obj, "__code__", None) is not None and obj.__code__ in {_own_code(f) for f in _functions(original)}:
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
    inner.append(getattr(obj, "__wrapped__", None))  # functools.wraps(finished): taken at its word
    if isinstance(obj, type):  # a class that borrows the finished class's methods
        inner += [v for cls in obj.__mro__[:-1] for v in vars(cls).values()]
    return any(x is not None and _holds(x, original, depth - 1) for x in inner)


def _functions(obj) -> list:
    """The Python functions whose code makes ``obj`` run: itself, or a class's own methods."""
    if isinstance(obj, types.FunctionType):
        return [obj]
    if isinstance(obj, type):
        found = []
        for value in vars(obj).values():
            value = getattr(value, "__func__", value)  # staticmethod, classmethod
            if isinstance(value, types.FunctionType):
                found.append(value)
        return found
    return []


def _own_code(function):
    """A function's code, also while it is guarded (then its ``__code__`` is the guard's)."""
    return _saved[function][0] if function in _saved else function.__code__


# ------------------------------------------------------------------ who is calling


@functools.lru_cache(maxsize=None)
def _kind(filename: str) -> str:
    """"check", "course", "library" or "student", for a code object's file."""
    if filename.startswith("<frozen"):
        return "library"
    path = os.path.realpath(filename)  # a checkout or a venv reached through a symbolic link
    if path.startswith(_CHECKS):
        return "check"
    if path.startswith(_COURSE):
        return "course"
    if path.startswith(_LIBRARIES) or any(folder in path for folder in _PACKAGE_FOLDERS):
        return "library"
    return "student"


def called_from_an_answer(frame) -> bool:
    """True unless course code that a check runs made this call (see the module's docstring)."""
    nearest = True  # no course frame seen yet between the call and the frame looked at
    while frame is not None:
        kind = _kind(frame.f_code.co_filename)
        if kind == "student":
            return True
        if kind == "check":
            return nearest  # straight from a check: the answer is the finished code in disguise
        if kind == "course":
            nearest = False
        frame = frame.f_back
    return True  # no check on the stack: a thread the answer started


def _call(index, args, kwargs):
    """What a guarded function's code does instead of its own (``index``: which function)."""
    _, copy, dotted = _saved[_guarded[index]]
    if called_from_an_answer(sys._getframe(2)):  # 0: here, 1: the guarded function, 2: its caller
        raise FinishedVersionUsed(message(dotted))
    return copy(*args, **kwargs)


def _guard_code(function, index):
    """Code for ``function`` that calls :func:`_call` (with the same free variables, so that it
    fits the function's closure, e.g. ``__class__`` of a method that calls ``super()``)."""
    free = function.__code__.co_freevars
    source = "def make():\n"
    source += "".join(f"    {name} = None\n" for name in free)
    source += "    def guarded(*args, **kwargs):\n"
    source += "".join(f"        {name}\n" for name in free)
    source += f"        return __course_guard__({index}, args, kwargs)\n    return guarded\n"
    space = {}
    exec(compile(source, __file__, "exec"), space)
    code = space["make"]().__code__
    if code.co_freevars != free:
        raise RuntimeError(f"cannot guard {function.__qualname__}: free variables {free} came out as {code.co_freevars}")
    return code.replace(co_name=function.__code__.co_name)


def original(function):
    """The unguarded finished version, for a check's own reference (``function`` itself when it
    is not guarded)."""
    return _saved[function][1] if function in _saved else function


# ------------------------------------------------------------------ installing


def install(dotted_names, undo: list):
    """Guard each finished version (see the module's docstring); append to ``undo`` what
    :func:`uninstall` must put back, as it goes. Names already guarded are left alone."""
    for dotted in dotted_names:
        if dotted in _active:
            continue
        _active[dotted] = []
        undo.append(dotted)
        for function in _functions(getattr(*resolve(dotted))):
            if function in _saved:  # the same function under two names
                continue
            copy = types.FunctionType(function.__code__, function.__globals__, function.__name__,
                                      function.__defaults__, function.__closure__)
            copy.__kwdefaults__, copy.__qualname__ = function.__kwdefaults__, function.__qualname__
            function.__globals__["__course_guard__"] = _call  # the name the guard's code calls
            if function not in _guarded:
                _guarded.append(function)
            _saved[function] = (function.__code__, copy, dotted)
            _active[dotted].append(function)
            function.__code__ = _guard_code(function, _guarded.index(function))


_guarded: list = []  # every function guarded so far in this process; its guard's code names its index


def uninstall(undo: list):
    for dotted in reversed(undo):
        for function in _active.pop(dotted, []):
            function.__code__ = _saved.pop(function)[0]


@contextlib.contextmanager
def guarding(dotted_names):
    """The finished versions are guarded inside the block (see the module's docstring)."""
    undo = []
    try:
        install(dotted_names, undo)
        yield
    finally:
        uninstall(undo)


def active() -> tuple:
    """The finished versions guarded in this process now (a launch hands them to its ranks)."""
    return tuple(_active)


@launcher.on_launch
def _guard_the_ranks():
    """Each rank of a launch made while a check judges guards the same names, for its life,
    before it unpickles its function (forkserver and spawn ranks import the answer then)."""
    return functools.partial(install, tuple(_active), []) if _active else None
