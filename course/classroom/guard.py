"""While a check runs, the course's own finished version of the answer refuses to work for it.

The package holds the finished code of many exercises (``course.parallel.context_parallel.ring_forward``
is Exercise 2 of notebook 15, derived there step by step). An answer that *is* it, or wraps it,
would pass its check while teaching nothing, so a check names the finished versions of its answer
(``@exercise(..., finished=["course.parallel.context_parallel.ring_forward"])``) and, while it judges:

* an answer that is one of them, a ``functools.partial`` of it, a subclass of it, a function
  that keeps it in a default value, a closure or ``__wrapped__``, or an answer whose code names a
  *copy* of its code (:func:`_is_copy`: the same instructions, names and constants, from the
  finished version's file or from ``exec``'s ``<string>``: a code object relined or rebuilt with
  ``types.FunctionType``, a function kept from before ``importlib.reload``, ``exec`` of
  ``inspect.getsource``) is refused at once;
* the finished function itself (for a class: each of its methods) runs a guard in place of its
  code: every reference to it, wherever it is kept (an imported name, a list, a closure, a class
  attribute, a borrowed method), reaches the guard. So does each copy kept as a function in the
  answer's module or the notebook's, however the answer reaches it (``globals()[...]``). The
  guard refuses with :class:`FinishedVersionUsed` unless course code that a check runs is calling it;
* ``importlib.reload`` of the finished version's module, from the answer, is refused (it would
  make fresh, unguarded functions).

Who is calling: going up the frames from the call, past the libraries (Python's, torch...):
the student's code (any file outside the course package) before a check's means the answer
reached it, perhaps through course code; a check's own frame first means the check called it
*as the answer* (a borrowed method, a staticmethod in the answer's class...); course code on
the way to a check is course code the check runs, which may use it; no check on the stack (a
thread the answer started) is refused too. A check that wants the finished version itself, as
its reference, calls :func:`original`, which answers a check only: the answer asking, or
calling a check's helper that asks, is refused. Code Python generates (a dataclass's ``__init__``, file
``<string>``) counts as the student's.

The ranks of a launch started during a check install the same guards before they unpickle
their function (:func:`install`; a forked rank inherits them anyway).

What it cannot see: the finished code's *text* typed again, pasted (``solution()`` shows it) or
run by ``exec`` under another file name is the same code a derivation that ends where the
course's does compiles to (notebook 17's solution is, instruction for instruction): it passes.
Nor does it chase deliberate digging: a copy kept outside the answer's module and the notebook's
and reached by a name the answer's code does not spell (``getattr(torch, "f" + "n")``), this
module's private state, ``gc``. The course's promise is about the plausible wrong answers and
every way to hand in the package's own code (README's paragraph on checks says what is not refused).
"""

from __future__ import annotations

import contextlib
import dis
import functools
import importlib
import itertools
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
        finished = getattr(*resolve(dotted))
        if _holds(answer, finished, depth=2) or any(_is_copy(x, finished) for x in _named(answer)):
            return message(dotted)
    return None


def _holds(obj, original, depth) -> bool:
    if obj is original or _is_copy(obj, original):
        return True
    if isinstance(original, type) and isinstance(obj, type) and issubclass(obj, original):
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


# ------------------------------------------------------------------ copies of its code


def _body(code) -> tuple:
    """What code does, not where it was written: its instructions with the names and constants
    they use (nested code compared the same way), without its file, lines or local names. A
    method call on a module reads the same compiled with its imports or without them (as
    ``exec`` of one function's source compiles it: ``LOAD_METHOD``, not ``LOAD_ATTR``)."""
    if code not in _bodies:
        _bodies[code] = tuple(
            (_SAME.get(i.opname, i.opname),
             None if i.opcode in _JUMPS else i.arg if i.opcode in _LOCALS
             else _body(i.argval) if isinstance(i.argval, types.CodeType) else (type(i.argval), i.argval))
            for i in dis.get_instructions(code))
    return _bodies[code]


_bodies: dict = {}  # code -> its _body (code objects are immutable)
_SAME = {"LOAD_METHOD": "LOAD_ATTR"}
_JUMPS = frozenset(dis.hasjrel + dis.hasjabs)  # their targets move with the instructions' sizes
_LOCALS = frozenset(dis.haslocal + dis.hasfree)


def _is_copy(obj, finished) -> bool:
    """``obj`` (a function, a method or a code object) runs the code of ``finished`` (a function,
    or one of a class's methods), but is not it: its code object rebuilt or relined
    (``code.replace``, ``types.FunctionType``), kept from before ``importlib.reload``, or its
    source run by ``exec`` (file ``<string>``). The same text in a notebook cell is the
    student's own: a derivation that ends where the course's does."""
    obj = getattr(obj, "__func__", obj)
    if isinstance(obj, types.FunctionType):
        if obj in _saved:  # guarded: a finished version itself
            return False
        code = obj.__code__
    elif isinstance(obj, types.CodeType):
        code = obj
    else:
        return False
    for function in _functions(finished):
        own = _own_code(function)
        if (obj is not function and _kind(own.co_filename) == "course"  # not code Python generated (a dataclass's)
                and code.co_filename in (own.co_filename, "<string>") and _body(code) == _body(own)):
            return True
    return False


def _names(code) -> set:
    """Every name ``code`` (with the code nested in it) looks up: globals and attributes alike."""
    return set(code.co_names).union(*(_names(c) for c in code.co_consts if isinstance(c, types.CodeType)))


def _named(answer, depth=4):
    """What the answer's code can reach by name: the globals and attributes it names, what its
    functions keep (defaults, closures), the items of containers, to ``depth`` steps."""
    seen, todo, names = set(), [(answer, depth)], set()
    while todo:
        obj, left = todo.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
            continue
        seen.add(id(obj))
        yield obj
        if left == 0:
            continue
        with contextlib.suppress(Exception):  # an object that will not say what it holds holds nothing here
            todo += [(x, left - 1) for x in _inside(obj, names, answer)]


def _inside(obj, names, answer) -> list:
    """What :func:`_named` looks at next from ``obj``; adds the names a function's code looks up."""
    obj = getattr(obj, "__func__", obj)  # a method, a staticmethod, a classmethod
    if isinstance(obj, types.FunctionType):
        names |= _names(obj.__code__)
        return ([obj.__globals__[n] for n in _names(obj.__code__) if n in obj.__globals__]
                + [c.cell_contents for c in obj.__closure__ or () if _full(c)]
                + list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values()))
    if isinstance(obj, functools.partial):
        return [obj.func, *obj.args, *obj.keywords.values()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(itertools.islice(obj, 1000))
    if isinstance(obj, dict):
        return list(itertools.islice(obj.values(), 1000))
    if isinstance(obj, type):  # the answer's own class: every method the check may call; another: what is named
        spaces = [vars(cls) for cls in obj.__mro__[:-1]]
        return [v for space in spaces for k, v in space.items() if obj is answer or k in names]
    space = getattr(obj, "__dict__", None)  # a module, an object: the attributes the code names
    return [space[n] for n in names if n in space] if isinstance(space, dict) else []


def _full(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


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
    is not guarded). Only a check may ask, and not on the answer's behalf: a student's frame
    between the caller and the outermost check (the answer asking, or calling a check's helper
    that asks), or no check at all, is refused with :class:`FinishedVersionUsed`."""
    if function not in _saved:
        return function
    if not _asked_by_a_check(sys._getframe(1)):
        raise FinishedVersionUsed(message(_saved[function][2]))
    return _saved[function][1]


def _asked_by_a_check(frame) -> bool:
    checks, student = False, False  # seen yet, going up
    while frame is not None:
        kind = _kind(frame.f_code.co_filename)
        if kind == "check":
            if student:
                return False
            checks = True
        elif kind == "student":
            if not checks:
                return False
            student = True  # fine if no check is above it (the notebook that called the check)
        frame = frame.f_back
    return checks


# ------------------------------------------------------------------ installing


def install(dotted_names, undo: list, answers=()):
    """Guard each finished version (see the module's docstring), and each copy of its code kept
    where the ``answers`` or the notebook can reach it (:func:`_kept`); append to ``undo`` what
    :func:`uninstall` must put back, as it goes. Names already guarded are left alone."""
    for dotted in dotted_names:
        if dotted in _active:
            continue
        _active[dotted] = []
        undo.append(dotted)
        if _NoReload not in sys.meta_path:
            sys.meta_path.insert(0, _NoReload)
        finished = getattr(*resolve(dotted))
        for function in _functions(finished) + _kept(finished, answers):
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
    if not _active and _NoReload in sys.meta_path:
        sys.meta_path.remove(_NoReload)


def _kept(finished, answers) -> list:
    """Copies of the finished code (:func:`_is_copy`) kept as functions in the answers' modules or
    the notebook's (``__main__``), or one step inside what they hold there (a container's items, a
    function's closure and defaults, a class's methods): reached by a name the answer's code does
    not spell (``globals()[...]``), they refuse too when called."""
    files = {_own_code(f).co_filename for f in _functions(finished)} | {"<string>"}  # where a copy's code says it is from
    spaces = {id(s): s for a in answers if isinstance(s := getattr(a, "__globals__", None), dict)}
    main = getattr(sys.modules.get("__main__"), "__dict__", None)
    spaces.update({id(main): main} if isinstance(main, dict) else {})
    found = []
    for space in spaces.values():
        for value in list(space.values()):
            try:
                inside = _one_step_in(value)
            except Exception:  # noqa: BLE001 - an object that will not say what it holds holds nothing here
                inside = []
            for obj in (value, *inside):
                if (type(obj) is types.FunctionType and obj.__code__.co_filename in files
                        and obj not in found and _is_copy(obj, finished)):
                    found.append(obj)
    return found


def _one_step_in(value) -> list:
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(itertools.islice(value, 1000))
    if isinstance(value, dict):
        return list(itertools.islice(value.values(), 1000))
    if isinstance(value, types.FunctionType):
        return [c.cell_contents for c in value.__closure__ or () if _full(c)] + list(value.__defaults__ or ())
    if isinstance(value, type):
        return [getattr(v, "__func__", v) for v in vars(value).values()]
    return []


class _NoReload:
    """A finder first on ``sys.meta_path`` while a check judges: ``importlib.reload`` of a module
    that holds a guarded version, from the answer, would make fresh, unguarded functions: refused."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if target is not None and sys.modules.get(name) is target:  # a reload, not an import
            for dotted in _active:
                if dotted.rpartition(".")[0] == name and called_from_an_answer(sys._getframe(1)):
                    raise FinishedVersionUsed(message(dotted))
        return None


@contextlib.contextmanager
def guarding(dotted_names, answers=()):
    """The finished versions are guarded inside the block (see the module's docstring)."""
    undo = []
    try:
        install(dotted_names, undo, answers)
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
