"""The worker protocol: what every rank runs, and how its report comes home, whoever started it.

A launcher only decides how rank processes start and stop (:mod:`course.runtime.launcher` forks or
spawns them, :mod:`course.runtime.mpi` lets ``mpirun`` start them). Everything else is here, once:

* :class:`Job`: what every rank of one launch needs to know (world size, backend, folder, ...).
* :func:`pack` / :func:`unpack`: ``fn``, its arguments and a registered backend as bytes, for
  processes that do not inherit them (spawn, mpirun).
* :func:`run_rank`, in the rank's process: output to ``rankN.out``, environment, threads,
  process group, ``fn(rank, world_size, *args)``, and one :class:`Report` to send home.
* :func:`collect`, in the launcher: the results in rank order, or a :class:`WorkerError` that
  names the rank whose failure came first.
* :func:`replay_output`: what the ranks printed, grouped in rank order, prefixed ``[rank r]``,
  without the lines torch itself adds on some versions (:class:`NoiseFilter`).

A new launcher starts ``world_size`` processes that each call :func:`run_rank` and send the
:class:`Report` back by any means (a pipe, a file), then calls :func:`collect`.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import io
import linecache
import os
import pickle
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path


class WorkerError(RuntimeError):
    """A rank failed. ``rank`` is the rank whose failure came first; ``traceback`` is
    its traceback as text; ``failed`` maps every rank that failed to a one-line reason.
    About the first failure: ``reason`` is its whole message (``TypeError: ...``, every line),
    ``where`` the line of the caller's own code it failed in (``Cell In[5], line 3, in ring``;
    ``""`` if unknown), and ``last_lines`` what a rank that died without a Python exception
    (killed by a signal) printed last."""

    def __init__(self, message, rank=None, traceback="", failed=None, reason="", where="", last_lines=""):
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback
        self.failed = failed or {}
        self.reason = reason or self.failed.get(rank, "")
        self.where = where
        self.last_lines = last_lines


class WorkerTimeoutError(WorkerError):
    """Some ranks had not finished when the launch's ``timeout`` ran out.
    ``ranks`` lists them; ``stacks`` maps each one to where its Python code was stuck."""

    def __init__(self, message, ranks, stacks):
        super().__init__(message, rank=ranks[0], failed={r: "timed out" for r in ranks})
        self.ranks = ranks
        self.stacks = stacks


@dataclass(frozen=True)
class Job:
    """What every rank of one launch needs to know."""

    world_size: int
    workdir: str  # a fresh folder: rankN.out (output), the FileStore, ...
    backend: str = "gloo"
    timeout: float = 60.0  # the launch's; collectives get a minute more
    threads: int = 1  # torch intra-op threads per rank
    env: dict = field(default_factory=dict)  # set in each rank before anything else
    init_process_group: bool = True  # False: fn calls init_process_group itself (env://)
    launcher: str = "course.launch"  # COURSE_LAUNCHER in the ranks, read by course.runtime.distenv
    # The launcher's whole environment, for ranks forked by a server started earlier
    # (forkserver): it replaces what they inherited. None: they inherited the right one.
    environ: dict | None = None
    # Callables each rank calls before it unpickles its function: what the hooks registered with
    # course.runtime.launcher.on_launch returned (the classroom's guards, for one).
    setup: tuple = ()

    def output_path(self, rank: int) -> Path:
        return Path(self.workdir, f"rank{rank}.out")

    def started_path(self, rank: int) -> Path:
        """Exists once the rank has started: imports done, ``fn`` unpickled (spawn takes seconds)."""
        return Path(self.workdir, f"rank{rank}.started")


@dataclass
class Report:
    """One rank's outcome: its pickled result, or why it failed."""

    rank: int
    result: bytes | None = None  # pickled return value; None if the rank failed
    summary: str = ""  # the failure in one line, e.g. "ValueError: bad batch"
    traceback: str = ""
    time: float = 0.0  # time.monotonic() of the failure: the earliest is the cause
    consequence: bool = False  # it failed because a peer had died ("Connection closed by peer")
    hint: str = ""  # what to do about it, when we know
    reason: str = ""  # the whole exception message, every line (``summary`` is its first line)
    frame: tuple | None = None  # (file, line, function) of the caller's own code where it failed
    last_lines: str = ""  # the end of what a rank that died without a word printed

    @property
    def ok(self) -> bool:
        return self.result is not None

    @classmethod
    def from_exception(cls, rank, e):
        reason = f"{type(e).__name__}: {e}".strip() if str(e) else type(e).__name__
        summary = reason.splitlines()[0]
        return cls(
            rank,
            summary=summary,
            traceback="".join(traceback.format_exception(type(e), e, e.__traceback__)),
            time=time.monotonic(),
            consequence=any(text in summary for text in PEER_GONE),
            hint=_hint(e),
            reason=reason,
            frame=callers_frame(e.__traceback__),
        )

    @classmethod
    def from_exit_code(cls, rank, code, output=""):
        """A process that died without a word (killed, ``os._exit``); ``output``: what it printed."""
        import signal

        how = f"was killed by signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited with code {code}"
        noise = NoiseFilter() if output else None
        kept = [line for line in output.splitlines() if line.strip() and noise.keep(line)] if output else []
        return cls(rank, summary=f"process {how} without a Python exception", time=time.monotonic(),
                   last_lines="\n".join(kept[-LAST_LINES:]))


LAST_LINES = 5  # lines of a dead rank's output its report keeps (a C++ abort says why in its last ones)
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
DOUBLE_INIT = "trying to initialize the default process group twice"


def _library_dirs():
    """Folders of code that is not the caller's: the course's, Python's own, installed packages."""
    import sysconfig

    paths = sysconfig.get_paths()
    return tuple(os.path.join(os.path.realpath(d), "") for d in {
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), paths["stdlib"], paths["purelib"], paths["platlib"]})


def callers_frame(tb):
    """(file, line, function) of the innermost frame of ``tb`` in the caller's own code (a notebook
    cell, a script): the line a student wrote that failed, below which only libraries ran."""
    found = None
    for frame in traceback.extract_tb(tb):
        if is_callers_code(frame.filename):
            found = (frame.filename, frame.lineno, frame.name)
    return found


def is_callers_code(filename: str) -> bool:
    """True for code of the caller's own (a notebook cell, a script), False for the course's,
    Python's and installed packages'."""
    if filename.startswith("<frozen"):
        return False
    path = os.path.realpath(filename) if not filename.startswith("<") else filename
    return not path.startswith(_library_dirs())


def describe_frame(frame) -> str:
    """``Cell In[5], line 3, in ring`` for code from a notebook cell (as IPython names it), else
    ``file.py, line 3, in ring``; ``""`` for None."""
    if frame is None:
        return ""
    filename, line, name = frame
    label = None
    try:
        from IPython import get_ipython

        shell = get_ipython() if "IPython" in sys.modules else None
        label = shell.compile.format_code_name(filename) if shell is not None else None
    except Exception:  # an old IPython, or none
        pass
    place = f"{label[0]} {label[1]}" if label else filename
    return f"{place}, line {line}, in {name}"


def _hint(e):
    if DOUBLE_INIT in str(e):
        return (
            "course.launch already initialised the process group; pass init_process_group=False "
            "to course.launch (your code then does it, with RANK, WORLD_SIZE, MASTER_ADDR and "
            "MASTER_PORT set for env://), or remove init_process_group from your function."
        )
    return ""


# --------------------------------------------------------------------------- backends and payloads


@dataclass(frozen=True)
class RegisteredBackend:
    """A backend registered with ``dist.Backend.register_backend`` (e.g. course.observe.tracing's "traced")."""

    name: str
    creator: object  # creator_fn(store, rank, world_size, timeout) -> ProcessGroup backend
    extended_api: bool
    devices: list | None

    def register(self):
        """In a fresh (spawned, mpirun) process: register it as the parent had."""
        import torch.distributed as dist

        if registered_backend(self.name) is None:
            dist.Backend.register_backend(self.name, self.creator, extended_api=self.extended_api, devices=self.devices)


def registered_backend(name: str) -> RegisteredBackend | None:
    """The backend registered under ``name`` in this process, or None."""
    import torch.distributed as dist

    plugin = getattr(dist.Backend, "_plugins", {}).get(name.upper())
    if plugin is None:
        return None
    devices = dist.Backend.backend_capability.get(name.lower())
    return RegisteredBackend(name.lower(), plugin.creator_fn, plugin.extended_api, devices)


def check_backend(backend: str) -> RegisteredBackend | None:
    """``None`` for the built-in backends, the registration for a registered one; else a clear error."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a name such as 'gloo', got {backend!r}.")
    if backend in ("gloo", "nccl"):
        return None
    plugin = registered_backend(backend)
    if plugin is None:
        raise ValueError(
            f"Unknown backend {backend!r}. Use 'gloo' for CPU tensors, 'nccl' for CUDA GPUs, or a name "
            "registered with torch.distributed.Backend.register_backend (for the course's 'traced' "
            "backend, `import course.observe.tracing` first)."
        )
    return plugin


def check_world_size(world_size):
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1 (the number of ranks), got {world_size!r}.")


def pack(fn, args, backend: RegisteredBackend | None = None) -> bytes:
    """``fn`` (even one defined in a notebook), its arguments and a backend, as bytes, by value."""
    try:
        import cloudpickle
    except ImportError as e:
        raise RuntimeError("Starting ranks that do not fork needs cloudpickle: pip install cloudpickle") from e
    try:
        buffer = io.BytesIO()
        _keep_source_pickler()(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump((fn, args, backend))
        return buffer.getvalue()
    except Exception as e:
        raise TypeError(f"fn and its arguments must be picklable to start ranks that do not fork: {e}"
                        f"{_unpicklable_part(fn, args)}") from e


def _unpicklable_part(fn, args):
    """What cannot be pickled, named for the error message: an argument of ``launch``, or what
    pickling ``fn`` by value takes along (see :func:`_parts`)."""
    import inspect

    try:  # the parameter of fn each argument fills: "argument 2" would be ambiguous
        parameters = list(inspect.signature(fn).bind(0, 1, *args).signature.parameters.values())
    except (TypeError, ValueError):
        parameters = []
    names = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][2:]
    arguments = [(f"the argument `{names[i]}`" if i < len(names) else f"argument {i + 1} after world_size", a)
                 for i, a in enumerate(args)]
    for what, value in [*arguments, *_parts(fn)]:
        found = _culprit(what, value)
        if found is not None:
            what, value = found
            return (f" ({what}, a {type(value).__name__}). Create it inside the function instead, or pass"
                    " something that pickles (a name, numbers, tensors).")
    return ""


def _culprit(what, value, depth=1):
    """``(what, value)`` if ``value`` does not pickle, or, for a function, the part of it that does
    not (``depth`` levels down: 'the global LOCK that helper uses'); None if it pickles."""
    try:
        _keep_source_pickler()(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(value)
        return None
    except Exception:
        pass
    for part in _parts(value) if depth else ():
        found = _culprit(*part, depth - 1)
        if found is not None:
            return found
    return what, value


def _parts(fn):
    """``(description, value)`` for what pickling ``fn`` by value takes along: a function's
    defaults and the global and closed-over variables it uses, a ``functools.partial``'s
    function and arguments, a bound method's object and its attributes."""
    import inspect

    if isinstance(fn, functools.partial):
        yield from _parts(fn.func)
        yield from ((f"argument {i + 1} of the functools.partial", a) for i, a in enumerate(fn.args))
        yield from ((f"the keyword argument `{k}` of the functools.partial", v) for k, v in fn.keywords.items())
    elif inspect.ismethod(fn):
        yield from _parts(fn.__func__)
        owner = f"the {type(fn.__self__).__name__} that {fn.__name__} is a method of"
        yield from ((f"the attribute `{k}` of {owner}", v) for k, v in getattr(fn.__self__, "__dict__", {}).items())
        yield owner, fn.__self__
    elif inspect.isfunction(fn):
        code, defaults = fn.__code__, fn.__defaults__ or ()
        positional = code.co_varnames[:code.co_argcount]
        defaulted = {**dict(zip(positional[len(positional) - len(defaults):], defaults)), **(fn.__kwdefaults__ or {})}
        yield from ((f"the default of `{name}` in {fn.__name__}", v) for name, v in defaulted.items())
        variables = inspect.getclosurevars(fn)
        yield from ((f"the global {name!r} that {fn.__name__} uses", v) for name, v in variables.globals.items())
        yield from ((f"the variable {name!r} that {fn.__name__} closes over", v) for name, v in variables.nonlocals.items())


@functools.cache
def _keep_source_pickler():
    """cloudpickle's Pickler, except that a function's code keeps its file name and, for code
    typed in a notebook cell, the cell's lines: cloudpickle renames every file "<dynamic-code>",
    which would leave a rank's traceback without the line that failed."""
    import types
    from collections import ChainMap

    import cloudpickle

    base = cloudpickle.CloudPickler
    reduce_code = base.dispatch_table[types.CodeType]

    def code_with_source(code):
        make, args = reduce_code(code)
        cell = linecache.cache.get(code.co_filename)
        return _rebuild_code, (make, args, code.co_filename, cell if not os.path.exists(code.co_filename) else None)

    def reducer_override(self, obj):
        # A module of a type derived from ModuleType, such as torch.ops (torch._ops._Ops), by name:
        # cloudpickle sends the submodules a function's code may reach (`torch` + an attribute `.ops`
        # anywhere in it, e.g. `self.ops`) and knows only plain modules ("cannot pickle '_Ops' object").
        if isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType and sys.modules.get(obj.__name__) is obj:
            return importlib.import_module, (obj.__name__,)
        return base.reducer_override(self, obj)

    return type("KeepSourcePickler", (base,), {
        "dispatch_table": ChainMap({types.CodeType: code_with_source}, base.dispatch_table),
        "reducer_override": reducer_override,
    })


def _rebuild_code(make, args, filename, cell):
    if cell is not None:  # a notebook cell's lines, for tracebacks
        linecache.cache.setdefault(filename, cell)
    return make(*args).replace(co_filename=filename)


def unpack(payload):
    """``(fn, args, backend)`` from :func:`pack`'s bytes (a tuple passes through: forked ranks)."""
    if isinstance(payload, tuple):
        return payload
    import cloudpickle  # noqa: F401  (registers what cloudpickle-made bytes need)

    return pickle.loads(payload)


# --------------------------------------------------------------------------- in the rank


def run_rank(rank: int, job: Job, payload, prepare=None) -> Report:
    """Run one rank: output to ``job.output_path(rank)``, environment, threads, process group,
    ``fn(rank, world_size, *args)``. Returns its :class:`Report`; never raises. Leaves the
    process group up: the launcher ends the process once every rank has reported.
    ``prepare()``, if given, runs once the environment is set, as part of starting."""
    try:
        redirect_output(job.output_path(rank))
        if job.environ is not None:
            os.environ.clear()
            os.environ.update(job.environ)
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(job.world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(job.world_size),
            OMP_NUM_THREADS=str(job.threads),
            COURSE_LAUNCHER=job.launcher,
        )
        os.environ.update(job.env)
        import torch

        torch.set_num_threads(job.threads)  # the first torch call after a fork (see course.runtime.launcher)
        for setup in job.setup:
            setup()
        fn, args, backend = unpack(payload)
        if backend is not None:
            backend.register()
        if prepare is not None:
            prepare()
        job.started_path(rank).touch()  # the launch's timeout counts from here
        if job.init_process_group:
            init_process_group(rank, job)
        result = fn(rank, job.world_size, *args)
        report = Report(rank, result=_pickle_result(result, rank))
    except BaseException as e:  # report it, whatever it is (SystemExit included)
        report = Report.from_exception(rank, e)
    flush_output()
    return report


def init_process_group(rank: int, job: Job):
    """Join the job's process group through a FileStore in its folder: no port to choose."""
    import torch
    import torch.distributed as dist

    device_id = None
    if job.backend == "nccl":
        torch.cuda.set_device(rank)
        device_id = torch.device("cuda", rank)
    dist.init_process_group(
        backend=job.backend,
        init_method=Path(job.workdir, "store").as_uri(),
        rank=rank,
        world_size=job.world_size,
        # Longer than the launch's own timeout, so that a hang is reported by the
        # launcher (naming the stuck ranks) rather than by a collective's timeout.
        timeout=datetime.timedelta(seconds=job.timeout + 60),
        device_id=device_id,
    )


def redirect_output(path):
    """Send fds 1 and 2 (Python and C/C++ output) to one file, in the order written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Replace, do not flush, the inherited streams: in a forked Jupyter kernel they
    # would send the parent's buffered text to the notebook a second time.
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr


def flush_output():
    """Flush Python's streams and C stdio's buffers (C++ ``std::cout`` shares them)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except Exception:
        pass


def _pickle_result(result, rank):
    try:
        return pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise TypeError(
            f"rank {rank} returned a value that cannot be sent back to the notebook ({e}). "
            "Return plain data: numbers, lists, dicts, or tensors with .detach()."
        ) from e


# --------------------------------------------------------------------------- in the launcher


def collect(reports: dict, world_size: int, missing: str = "") -> list:
    """The ranks' results in rank order, or raise :class:`WorkerError`.

    ``reports`` maps rank -> :class:`Report`. The cause named is the earliest failure that is
    not just a peer noticing another rank's death; ``missing`` explains ranks with no report."""
    errors = {r: rep for r, rep in reports.items() if not rep.ok}
    if errors:
        causes = [r for r in errors if not errors[r].consequence] or list(errors)
        first = min(causes, key=lambda r: errors[r].time)
        cause = errors[first]
        where = describe_frame(cause.frame)
        message = f"rank {first} of {world_size} failed: {cause.summary}"
        if where:
            message += f"\n(in {where})"
        if cause.last_lines:
            message += "\nIts last lines:\n" + "\n".join("  " + line for line in cause.last_lines.splitlines())
        if cause.hint:
            message += f"\n{cause.hint}"
        others = [r for r in sorted(errors) if r != first]
        if others:  # usually 'Connection closed by peer': a consequence, not a cause
            message += f"\n(rank(s) {', '.join(map(str, others))} then failed too; details in .failed)"
        message += "\nThe other ranks were stopped."
        if cause.traceback:
            message += f"\n\nTraceback from rank {first}:\n{cause.traceback}"
        failed = {r: e.summary for r, e in errors.items()}
        raise WorkerError(message, rank=first, traceback=cause.traceback, failed=failed,
                          reason=cause.reason or cause.summary, where=where, last_lines=cause.last_lines)
    absent = [r for r in range(world_size) if r not in reports]
    if absent:
        raise WorkerError(f"rank(s) {', '.join(map(str, absent))} sent no result. {missing}".strip(), rank=absent[0])
    return [pickle.loads(reports[r].result) for r in range(world_size)]


def ranks_to_show(show, world_size):
    """``show`` ("all", None, a rank or a list of ranks) as a sorted list of ranks."""
    if show == "all":
        return list(range(world_size))
    if show is None:
        return []
    ranks = [show] if isinstance(show, int) and not isinstance(show, bool) else show
    if not isinstance(ranks, (list, tuple, range)) or not all(
        isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world_size for r in ranks
    ):
        raise ValueError(f"show must be 'all', None, a rank or a list of ranks in 0..{world_size - 1}, got {show!r}.")
    return sorted(set(ranks))


class NoiseFilter:
    """Drops the rank output that torch itself adds on some versions, by exact pattern:

    * gloo's ``[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer
      ranks is : 1`` (printed by every rank at init on torch 2.8);
    * a warning from torch's own code that another rank (or line) already showed: every rank
      prints the same ``FutureWarning``/``DeprecationWarning``/``UserWarning``; it is kept once,
      where it first appears. C++ warnings (``[W1123 04:00:00.123 4567 file.cpp:12] Warning: ...``)
      carry a time and a pid: they are compared without them.
    """

    GLOO_CONNECTED = re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of connected peer ranks is : \d+$")
    CPP_WARNING = re.compile(r"^\[W\d{4} [\d:.]+ \d+ ([^\]]+)\] (Warning: .*)$")

    def __init__(self):
        import torch

        self.torch_dir = os.path.dirname(torch.__file__) + os.sep
        self.python_warning = re.compile(
            re.escape(self.torch_dir) + r"\S*:\d+: (?:Future|Deprecation|User)Warning: .*$"
        )
        self.seen = set()
        self.skip_source_line = False

    def keep(self, line: str) -> bool:
        if self.skip_source_line:  # the source line Python prints under a warning
            self.skip_source_line = False
            if line.startswith("  "):
                return False
        if self.GLOO_CONNECTED.match(line):
            return False
        cpp = self.CPP_WARNING.match(line)
        key = cpp.group(1, 2) if cpp else line if self.python_warning.match(line) else None
        if key is None:
            return True
        if key in self.seen:
            self.skip_source_line = not cpp
            return False
        self.seen.add(key)
        return True


def read_output(job: Job, rank: int) -> str:
    path = job.output_path(rank)
    return path.read_bytes().decode("utf-8", errors="replace") if path.exists() else ""


def replay_output(job: Job, ranks):
    """Print what ``ranks`` printed, grouped in rank order, each line prefixed ``[rank r]``."""
    noise = NoiseFilter()
    for rank in ranks:
        for line in read_output(job, rank).splitlines():
            if noise.keep(line):
                print(f"[rank {rank}] {line}".rstrip())
    sys.stdout.flush()
