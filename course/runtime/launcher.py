"""Run a function on N real ``torch.distributed`` ranks, from inside a notebook.

    >>> def hello(rank, world_size):
    ...     t = torch.tensor([rank])
    ...     dist.all_reduce(t)              # the process group is ready to use
    ...     print("sum of ranks:", t.item())
    ...     return t.item()
    >>> course.launch(hello, 2)
    [rank 0] sum of ranks: 1
    [rank 1] sum of ranks: 1
    [1, 1]

How it works, and why (each point is a trap we measured; see the course README). What a
rank does once started is :mod:`course.runtime.worker`'s; this module starts and stops processes.

* **Start method.** ``torch.multiprocessing.spawn`` pickles ``fn`` *by name*, and a
  function defined in a notebook lives in ``__main__``, which a fresh process cannot
  import. On Linux without a GPU we therefore ``fork``: the child is a copy of the
  kernel, so ``fn`` (closures included) is simply there, and starting a rank costs
  milliseconds because torch is already imported. On a Linux machine with a CUDA GPU,
  forked ranks break once the notebook has run a backward pass (see
  :func:`default_start_method`), so we use a ``forkserver``: a process started once per
  kernel, that imports torch and never runs anything else, forks each rank; ``fn`` is
  sent by value with ``cloudpickle``. After the first launch (the server imports torch,
  ~1.5 s) a launch costs about what a fork does. On macOS and Windows we ``spawn``
  (each rank is a fresh interpreter that imports torch: seconds per launch) and send
  ``fn`` the same way. Pass ``start_method=`` to choose yourself, or set the
  ``COURSE_START_METHOD`` environment variable to change the default of every launch.
* **Environment.** A forkserver's ranks are forks of a process started earlier, so each
  rank takes the notebook's environment as it is at the launch (``os.environ``) before
  anything else. Variables torch reads once, at ``import torch`` (such as
  ``TORCH_DISTRIBUTED_DEBUG``), take effect only in spawned ranks: a forked rank's torch
  was imported before the launch, by the notebook or by the forkserver. And in a script
  only if its main module does not import torch at its top: spawn re-runs the main
  module in each rank, importing torch before ``env=`` is applied (``os.environ`` set
  before the launch is inherited in time).
* **Imports.** Forked ranks inherit the notebook's imported modules; ``launch`` imports
  the one DDP loads lazily (``torch._dynamo``, seconds) before forking, once per kernel.
* **Threads.** OpenMP is not fork-safe: once the kernel has run a multi-threaded torch
  op, a forked child that uses more than one intra-op thread hangs forever. So forked
  ranks run ``torch.set_num_threads(1)`` first thing (which also keeps N ranks from
  oversubscribing the cores); spawned ranks share the cores (``threads=`` to choose).
* **Rendezvous.** The ranks meet through a ``FileStore`` in a fresh temporary
  folder: no TCP port (no clashes between two notebooks), nothing created in the
  parent before the fork. gloo is pinned to the loopback interface. Code that
  initialises its own process group (``init_process_group=False``, e.g. PyTorch's DDP
  tutorial) gets ``MASTER_ADDR``/``MASTER_PORT`` on a port that was free a moment ago.
* **Output.** Each rank's file descriptors 1 and 2 (so Python *and* C++ output) go
  to a file; after the run the parent prints the files in rank order, each line
  prefixed with ``[rank r]``, without the lines torch itself adds on some versions
  (gloo's "connected to peer ranks", the same warning from every rank). Deterministic,
  so nbval can compare it. In Jupyter, a live display shows the newest lines while the
  ranks run and is emptied (or cleared) at the end (:mod:`course.runtime.live` explains
  why nbval is unaffected).
* **Failures.** If a rank raises, the others are killed at once and
  :class:`WorkerError` names the rank and shows its traceback. If ranks are still
  running after ``timeout`` seconds (a missing collective, a deadlock), their Python
  stacks are dumped, every rank is killed and :class:`WorkerTimeoutError` names them.
* **Interrupts.** Kernel > Interrupt (SIGINT) can land anywhere: in a fork's after-fork hooks
  Python would ignore the ``KeyboardInterrupt`` (the press is lost), in the cleanup it would
  leave a traceback and unreaped ranks. So while a launch runs, a press is only noted
  (:mod:`course.runtime.interrupts`) and acted on at the next safe point (between two forks,
  while waiting for the ranks): every rank is killed and reaped, their output replayed once,
  and :class:`LaunchInterrupted` raised, which Jupyter shows as one line, not a traceback
  through here. A second press while it cleans up is noted too. Jupyter signals the kernel's
  whole process group, and a new rank is in it until it makes its own: ranks start with
  SIGINT blocked, and drop a press that arrived before they left the group.
* **The end.** A rank that has returned waits: one that left early would make its peers
  fail with "connection closed" instead of showing who really hung. Once every rank has
  reported, the parent kills them all at once (their process groups die with them:
  nothing is left to tear down, and gloo's teardown cannot abort). No process outlives
  a launch, and on Linux workers die with the notebook kernel too (a forkserver's ranks,
  which are the server's children, watch a pipe that ends with the kernel; the server
  itself exits once the kernel and its ranks are gone).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import warnings
from multiprocessing.connection import wait
from pathlib import Path

from course.runtime import interrupts, live
from course.runtime.worker import (
    Job,
    Report,
    WorkerError,
    WorkerTimeoutError,
    check_backend,
    check_world_size,
    collect,
    pack,
    ranks_to_show,
    read_output,
    replay_output,
    run_rank,
)

__all__ = ["launch", "WorkerError", "WorkerTimeoutError", "LaunchInterrupted", "default_threads", "default_start_method",
           "choose_start_method"]

START_METHODS = ("fork", "forkserver", "spawn")
START_METHOD_VARIABLE = "COURSE_START_METHOD"  # overrides the default start method of every launch
# What a forkserver imports once, so that its ranks (its forks) start with them imported.
FORKSERVER_PRELOAD = [
    "course.runtime.in_forkserver",  # first: SIGINT ignored in the server, so its ranks are born ignoring it
    "torch", "torch.distributed", "torch._dynamo", "cloudpickle", "course.runtime.launcher"]
STARTUP_LIMIT = 120  # seconds a rank may take to start (import torch...) before the timeout counts anyway
STARTUP_POLL = 0.02  # seconds between looks for the ranks' "started" files

# A press outside noted() in launch's first and last bytecodes finds no rank running; in a Jupyter
# kernel, a press between launches ends in one line too (see course.runtime.interrupts), and each
# cell's outputs are counted (a live display that is a cell's only output is cleared, see live).
interrupts.no_ranks_in(__file__)
if live.in_jupyter():
    from IPython import get_ipython

    interrupts.watch_cells(get_ipython())
    live.count_outputs(get_ipython())


def default_threads(world_size: int) -> int:
    """Intra-op threads per rank so that all ranks together use the available cores once."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


def default_start_method(backend: str = "gloo") -> str:
    """The start method a launch gets when it does not name one: see :func:`choose_start_method`."""
    return choose_start_method()[0]


def choose_start_method() -> tuple[str, str]:
    """``(start method, why)`` for this machine: ``$COURSE_START_METHOD`` if set; else ``fork``
    on Linux without a CUDA GPU, ``forkserver`` on Linux with one, ``spawn`` on macOS and Windows.

    A fork copies the process but not its threads, and CUDA's driver state cannot be
    used in a forked child. With a GPU visible, the parent's first ``backward()`` starts
    autograd's per-GPU threads and initialises the driver; from then on every forked
    rank fails in its own backward ("Unable to handle autograd's threading in
    combination with fork-based multiprocessing") or at its first CUDA call (measured
    on torch 2.11 with one H100: most notebooks of this course broke that way). A
    forkserver's ranks are forks of a process that only imported torch, which is safe.
    On macOS forking a process that has loaded system frameworks is unsafe (Python's
    own default there is spawn); the course keeps spawn there, untested with forkserver."""
    chosen = os.environ.get(START_METHOD_VARIABLE, "").strip()
    if chosen:
        if chosen not in START_METHODS or chosen not in multiprocessing.get_all_start_methods():
            raise ValueError(
                f"{START_METHOD_VARIABLE}={chosen!r} is not a start method this machine has: use one of "
                f"{[m for m in START_METHODS if m in multiprocessing.get_all_start_methods()]}, or unset it."
            )
        return chosen, f"set by {START_METHOD_VARIABLE}"
    if sys.platform != "linux":
        return "spawn", f"{sys.platform}: fork is unsafe or missing here (macOS, Windows)"
    import torch

    if torch.cuda.is_available():
        return "forkserver", "Linux with a CUDA GPU: forked ranks would break after the notebook's first backward()"
    return "fork", "Linux without a CUDA GPU: a fork is the fastest start"


def launch(
    fn,
    world_size: int,
    *args,
    timeout: float = 60.0,
    show="all",
    threads: int | None = None,
    backend: str = "gloo",
    start_method: str | None = None,
    env: dict | None = None,
    init_process_group: bool = True,
):
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their results.

    Each rank is a separate process with the default process group initialised
    (``dist.get_rank()`` works, DDP works). The return values come back as a list in
    rank order, so they must be picklable (return ``tensor.detach()``, numbers, dicts, ...).

    Options:
        timeout:      seconds before unfinished ranks are killed (default 60), counted
                      from when every rank has started (a spawned rank imports torch first).
        show:         whose printed output to show: ``"all"``, one rank (``0``),
                      a list of ranks, or ``None`` for nobody.
        threads:      torch intra-op threads per rank. Always 1 with fork (OpenMP
                      hangs otherwise); otherwise default cores // world_size.
        backend:      ``"gloo"`` (CPU tensors), ``"nccl"`` (one CUDA GPU per rank), or a
                      name registered with ``torch.distributed.Backend.register_backend``
                      (e.g. ``"traced"``, from :mod:`course.observe.tracing`).
        start_method: ``"fork"`` (default on Linux without a GPU), ``"forkserver"``
                      (default on Linux with a CUDA GPU) or ``"spawn"`` (default on macOS
                      and Windows); ``$COURSE_START_METHOD`` changes the default (see
                      :func:`choose_start_method`). Except with fork, ``fn`` is sent by
                      value with cloudpickle; in a script, as always with spawn, call
                      launch under ``if __name__ == "__main__":``.
        env:          extra environment variables set in each rank before it starts.
        init_process_group: ``False`` leaves the process group to ``fn`` (code written for
                      ``mp.spawn`` or torchrun): ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
                      and ``MASTER_PORT`` (a free port) are set for ``env://``, and values
                      that ``fn`` sets itself win.

    Raises :class:`WorkerError` if a rank raises or dies,
    :class:`WorkerTimeoutError` if ranks are still running after ``timeout``, and
    :class:`LaunchInterrupted` (a ``KeyboardInterrupt``) once an interrupt has stopped the ranks.
    """
    procs, reports = [], {}
    # From the call to the last rank reaped, an interrupt is noted, not raised wherever it lands (in
    # a fork's after-fork hooks it would be lost, in the cleanup it would leave zombies): the
    # launch looks at it between forks and while it waits, then stops and reaps every rank.
    with interrupts.noted() as pressed:
        started = time.monotonic()
        try:
            _run(fn, world_size, args, timeout, show, threads, backend, start_method, env, init_process_group,
                 pressed, procs, reports)
        except KeyboardInterrupt:  # raised at a safe point; or by Python, off the main thread
            if not pressed:
                pressed.note()
        except WorkerError:
            if not pressed:  # an interrupt outranks the failure or timeout it cut short
                raise
    if pressed:  # acted on now, everything stopped and shown: Run All stops here
        running = [r for r in range(world_size) if r not in reports] if procs else None
        raise LaunchInterrupted(world_size, running, pressed.first - started) from None
    return collect(reports, world_size)


def _run(fn, world_size, args, timeout, show, threads, backend, start_method, env, init_process_group,
         pressed, procs, reports):
    """Start the ranks (into ``procs``), wait for their reports (into ``reports``), stop them all
    and show their output, whatever happens; a press of Interrupt raises KeyboardInterrupt here
    only at a safe point (between forks, while waiting)."""
    show_ranks = _check_arguments(fn, world_size, timeout, show, threads, backend, start_method, env, init_process_group)
    backend_plugin = check_backend(backend)  # a registered backend: spawned ranks redo the registration
    start_method = start_method or default_start_method(backend)
    if start_method == "fork" and threads not in (None, 1):
        raise ValueError(
            f"threads={threads} needs start_method='spawn': a forked rank with more than one "
            "intra-op thread can hang in OpenMP once the notebook has used several threads."
        )
    threads = threads or (1 if start_method == "fork" else default_threads(world_size))
    ctx = _context(start_method)
    if start_method == "fork":
        _import_lazy_modules()
    payload = (fn, args, backend_plugin) if start_method == "fork" else pack(fn, args, backend_plugin)
    # A forkserver started earlier, with the environment of then: its ranks take the notebook's of now.
    environ = dict(os.environ) if start_method == "forkserver" else None
    parent_pid = None if start_method == "forkserver" else os.getpid()  # the server is their parent
    # A forkserver's ranks cannot die with their parent (the server outlives us while they
    # live: each holds the server's "alive" pipe): they watch a pipe only this process writes to.
    watched, alive = ctx.Pipe(duplex=False) if start_method == "forkserver" else (None, None)

    with tempfile.TemporaryDirectory(prefix="course-launch-") as workdir:
        job = Job(world_size, workdir, backend, timeout, threads, _rank_env(env, init_process_group), init_process_group,
                  environ=environ, setup=_rank_setup())
        # In Jupyter even a launch that shows nobody's output (show=None, as checks do) shows
        # which ranks still run after a second: a hang must not look like nothing happening.
        display = live.LiveOutput(job, show_ranks) if live.in_jupyter() else None
        readers = []
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            for rank in range(world_size):
                if pressed:
                    raise KeyboardInterrupt
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_rank_process, args=(rank, job, payload, writer, parent_pid, watched), daemon=True)
                with warnings.catch_warnings(), interrupts.held_back():
                    # Python >= 3.12 warns that forking a multi-threaded process (any
                    # Jupyter kernel) may deadlock. The child never touches the parent's
                    # threads' locks (no store is created before the fork), so silence it.
                    warnings.filterwarnings("ignore", "This process .* is multi-threaded")
                    proc.start()
                procs.append(proc)
                writer.close()  # keep only the child's copy: EOF on ``reader`` == child gone
                readers.append(reader)
            if watched is not None:
                watched.close()  # the ranks have their copies
            _supervise(procs, readers, job, display, reports, pressed)
        finally:
            _kill_all(procs)
            if alive is not None:
                alive.close()
            if display is not None:
                display.close()
            replay_output(job, show_ranks)


class LaunchInterrupted(KeyboardInterrupt):
    """The launch was interrupted (Kernel > Interrupt, Ctrl-C): every rank has been stopped.
    Jupyter shows it as its one-line message, without a traceback through the launcher
    (IPython shows what ``_render_traceback_`` returns); ``ranks`` lists those that still ran."""

    def __init__(self, world_size, ranks, seconds):
        seconds = max(0.0, seconds)  # a press noted just before the launch began counts as at its start ("-0.0 s" seen)
        if ranks is None:  # pressed before the first fork
            running, ranks = f"all {world_size} ranks before they started", []
        elif len(ranks) in (0, world_size):
            running = f"all {world_size} ranks"
        else:
            running = f"rank(s) {', '.join(map(str, ranks))} of {world_size} (the others had finished)"
        super().__init__(f"interrupted after {seconds:.1f} s: course.launch stopped {running}.")
        self.ranks, self.seconds = ranks, seconds

    def _render_traceback_(self):
        return [f"⏹ KeyboardInterrupt: {self}"]


def _check_arguments(fn, world_size, timeout, show, threads, backend, start_method, env, init_process_group):
    """Fail early, in the notebook, with a message that says what to do."""
    if not callable(fn):
        raise TypeError(f"launch() needs a function to run on each rank, got {fn!r}.")
    check_world_size(world_size)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a whole number >= 1 or None (automatic), got {threads!r}.")
    if env is not None and not (
        isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        raise TypeError("env must be a dict of str -> str, e.g. {'NCCL_DEBUG': 'INFO'}.")
    if not isinstance(init_process_group, bool):
        raise TypeError(f"init_process_group must be True or False, got {init_process_group!r}.")
    if start_method is not None:
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS} or None (automatic), got {start_method!r}.")
        if start_method not in multiprocessing.get_all_start_methods():
            raise ValueError(f"start_method={start_method!r} is not available on {sys.platform}; use 'spawn'.")

    import torch
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("This PyTorch build has no torch.distributed; install the official wheels.")
    check_backend(backend)
    if backend == "gloo" and not dist.is_gloo_available():
        raise RuntimeError("This PyTorch build has no gloo backend; install the official wheels.")
    if backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not dist.is_nccl_available() or gpus == 0:
            raise ValueError("backend='nccl' needs CUDA GPUs and a PyTorch build with NCCL; use backend='gloo' on CPU.")
        if world_size > gpus:
            raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size} but {gpus} GPU(s) visible.")
        if start_method == "fork" and torch.cuda.is_initialized():
            raise ValueError("CUDA is already initialised in this process, so forked ranks cannot use it; use start_method='spawn'.")
    return ranks_to_show(show, world_size)


def _context(start_method):
    """The multiprocessing context; a forkserver's is told what to import when it starts.
    Python runs one forkserver per process: started by the first launch that uses it, it
    serves every later launch, and exits when this process does."""
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # no effect once the server runs
    return ctx


def _import_lazy_modules():
    """DDP imports ``torch._dynamo`` the first time it wraps a model: seconds of work. Done
    in forked ranks, every rank of every launch would pay it again; done once here, in the
    notebook, all forked ranks inherit it. A spawned rank imports it before it counts as
    started (the launch's timeout counts from then)."""
    import torch._dynamo  # noqa: F401


def _rank_env(env, init_process_group):
    """The variables every rank gets besides RANK & co: gloo on loopback, env:// for code
    that initialises its own process group, then the caller's ``env`` (which wins)."""
    extra = {}
    loopback = _loopback_interface()
    if loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
        extra["GLOO_SOCKET_IFNAME"] = loopback
    if not init_process_group:
        extra.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    return {**extra, **(env or {})}


def _loopback_interface():
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (AttributeError, OSError):
        return None
    return next((name for name in ("lo", "lo0") if name in names), None)


def _free_port():
    """A port the system just gave out and took back: free now, very probably free in a moment."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- parent side

# Hooks of the layers above (course.classroom.guard registers one): the runtime runs them and
# knows nothing of what they do.
_launch_hooks = []


def on_launch(hook):
    """Register ``hook()``, called in the launching process at every launch. It returns None, or
    a picklable callable that each rank calls before it unpickles its function (so spawned and
    forkserver ranks get it too)."""
    _launch_hooks.append(hook)
    return hook


def _rank_setup() -> tuple:
    return tuple(setup for setup in (hook() for hook in _launch_hooks) if setup is not None)


def _supervise(procs, readers, job, display, reports, pressed=None):
    """Wait for every rank's :class:`Report`, into ``reports``; stop at the first failure or at the timeout,
    or raise KeyboardInterrupt as soon as ``pressed`` (:class:`interrupts.Interrupts`) has noted a press."""
    world_size = len(procs)
    # The timeout counts from when every rank has started (imports done): spawned ranks take
    # seconds to import torch, forked ones milliseconds. A rank stuck starting up is given
    # STARTUP_LIMIT seconds before the clock starts anyway.
    startup_ends = time.monotonic() + STARTUP_LIMIT
    deadline = None
    pending = dict(zip(readers, range(world_size)))  # ranks that have not reported yet
    sentinels = {p.sentinel: r for r, p in enumerate(procs)}

    def receive(reader):
        rank = pending.pop(reader)
        try:
            reports[rank] = reader.recv()
        except (EOFError, OSError):  # died without a word: its sentinel will say how
            return
        sentinels.pop(procs[rank].sentinel, None)  # alive, waiting to be killed: no news there

    def failed():
        return any(not r.ok for r in reports.values())

    woken_by = [pressed.fileno()] if pressed is not None and pressed.fileno() is not None else []
    while len(reports) < world_size and not failed():
        if pressed:
            raise KeyboardInterrupt
        now = time.monotonic()
        if deadline is None and (now > startup_ends or all(
                r in reports or job.started_path(r).exists() for r in range(world_size))):
            deadline = now + job.timeout
        remaining = deadline - now if deadline is not None else STARTUP_POLL
        if remaining <= 0:
            _raise_timeout(procs, reports, job)
        ready = wait(list(pending) + list(sentinels) + woken_by, timeout=min(remaining, live.TICK) if display else remaining)
        for obj in ready:
            if obj in pending:
                receive(obj)
        for obj in ready:
            if obj in sentinels:
                rank = sentinels.pop(obj)
                if readers[rank] in pending and readers[rank].poll():  # its last words, if any
                    receive(readers[rank])
                if rank not in reports:
                    reports[rank] = _death_report(procs[rank], rank, job)
        if display is not None:
            display.update([r for r in range(world_size) if r not in reports])

    if failed():
        time.sleep(0.1)  # let ranks failing at the same moment report, to find the cause
        for reader in list(pending):
            if reader.poll():
                receive(reader)
        for rank, proc in enumerate(procs):
            if rank not in reports and proc.exitcode is not None:
                reports[rank] = _death_report(proc, rank, job)


def _death_report(proc, rank, job):
    noticed = time.monotonic()
    proc.join(1)
    report = Report.from_exit_code(rank, proc.exitcode, read_output(job, rank))
    report.time = noticed
    return report


def _raise_timeout(procs, reports, job):
    stuck = [r for r in range(len(procs)) if r not in reports]
    for r in stuck:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)  # faulthandler dumps its stack to a file
        except (ProcessLookupError, AttributeError):  # gone, or no SIGUSR1 (Windows)
            pass
    stacks = {r: _read_stack(_stack_path(job, r)) for r in stuck}
    names = ", ".join(str(r) for r in stuck)
    message = (
        f"rank(s) {names} did not finish within timeout={job.timeout:g} s "
        f"(a rank waiting for a collective that another rank never calls hangs until then). "
        f"All ranks were stopped."
    )
    for r in stuck:
        if stacks[r]:
            message += f"\n\nrank {r} was here (most recent call last):\n{stacks[r]}"
    raise WorkerTimeoutError(message, ranks=stuck, stacks=stacks)


def _stack_path(job, rank):
    return Path(job.workdir, f"rank{rank}.stack")


def _read_stack(path, wait_s=1.0):
    """Read a faulthandler dump (once it stops growing), most recent call last."""
    deadline, size = time.monotonic() + wait_s, -1
    while time.monotonic() < deadline:
        new_size = path.stat().st_size if path.exists() else 0
        if new_size and new_size == size:
            break
        size = new_size
        time.sleep(0.05)
    text = path.read_text() if path.exists() else ""
    threads = re.split(r"^(?:Current thread|Thread) 0x[0-9a-f]+ .*$", text, flags=re.MULTILINE)
    ours = [t for t in threads if f" in {run_rank.__name__}\n" in t + "\n"]  # the thread that runs fn, not a helper's
    frames = [line.strip() for line in (ours[0] if ours else text).splitlines() if line.strip().startswith("File ")]
    frames.reverse()  # faulthandler prints the most recent call first
    inside = [i for i, f in enumerate(frames) if f.endswith(f" in {run_rank.__name__}")]
    if inside:  # keep the user's frames, below the worker's own
        frames = frames[inside[-1] + 1 :]
    return "\n".join("  " + f for f in frames)


def _kill_all(procs):
    """Kill every rank and anything it started; reap them. Safe to call twice."""
    for p in procs:
        if p.pid is None:
            continue
        for kill in (lambda: os.killpg(p.pid, signal.SIGKILL), p.kill):
            try:
                kill()
            except (AttributeError, OSError):  # already gone, or no killpg (Windows)
                pass
    for p in procs:
        if p.pid is not None:
            p.join()
            p.close()


# --------------------------------------------------------------------------- child side


def _rank_process(rank, job, payload, conn, parent_pid, launcher_alive=None):
    """Body of each rank's process: report, then wait to be killed. Never returns.
    ``parent_pid`` is the launching process, or None when a forkserver forked us: then our
    parent is the server, and ``launcher_alive`` a pipe that ends when the launcher does."""
    try:
        if parent_pid is None:
            parent_pid = os.getppid()
        _isolate(parent_pid)
        interrupts.let_through()  # in our own process group now: the kernel's interrupts no longer reach us
        if launcher_alive is not None:
            threading.Thread(target=_die_with_the_launcher, args=(launcher_alive,), daemon=True).start()
        stack_file = open(_stack_path(job, rank), "w")
        if hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        conn.send(run_rank(rank, job, payload, prepare=_import_lazy_modules))
        while os.getppid() == parent_pid:  # the parent kills us once every rank has reported
            time.sleep(0.5)
    finally:
        os._exit(1)  # skip the parent's (e.g. Jupyter's) exit handlers


def _die_with_the_launcher(alive):
    """Wait until nobody can write to ``alive`` any more (the launcher is gone), then kill this
    rank and whatever it started (its own process group, see :func:`_isolate`)."""
    try:
        alive.recv()
    except (EOFError, OSError):
        pass
    if hasattr(os, "killpg") and os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(1)


def _isolate(parent_pid):
    """Own process group (so the parent can kill us and our children at once), and on
    Linux die with the parent: a restarted kernel never leaves orphans."""
    if hasattr(os, "setpgrp"):
        os.setpgrp()
    if sys.platform == "linux":
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # parent died before prctl
            os._exit(1)
