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

How it works, and why (each point is a trap we measured; see the course README):

* **Start method.** ``torch.multiprocessing.spawn`` pickles ``fn`` *by name*, and a
  function defined in a notebook lives in ``__main__``, which a fresh process cannot
  import. On Linux we therefore ``fork``: the child is a copy of the kernel, so ``fn``
  (closures included) is simply there, and starting a rank costs milliseconds because
  torch is already imported. On macOS and Windows, where fork is unsafe or missing, we
  ``spawn`` and send ``fn`` by value with ``cloudpickle`` (slower: each rank imports
  torch). Pass ``start_method=`` to choose yourself.
* **Imports.** Forked ranks inherit the notebook's imported modules; ``launch`` imports
  the one DDP loads lazily (``torch._dynamo``, seconds) before forking, once per kernel.
* **Threads.** OpenMP is not fork-safe: once the kernel has run a multi-threaded torch
  op, a forked child that uses more than one intra-op thread hangs forever. So forked
  ranks run ``torch.set_num_threads(1)`` first thing (which also keeps N ranks from
  oversubscribing the cores); spawned ranks share the cores (``threads=`` to choose).
* **Rendezvous.** The ranks meet through a ``FileStore`` in a fresh temporary
  folder: no TCP port (no clashes between two notebooks), nothing created in the
  parent before the fork. gloo is pinned to the loopback interface.
* **Output.** Each rank's file descriptors 1 and 2 (so Python *and* C++ output) go
  to a file; after the run the parent prints the files in rank order, each line
  prefixed with ``[rank r]``. Deterministic, so nbval can compare it.
* **Failures.** If a rank raises, the others are killed at once and
  :class:`WorkerError` names the rank and shows its traceback. If ranks are still
  running after ``timeout`` seconds (a missing collective, a deadlock), their Python
  stacks are dumped, every rank is killed and :class:`WorkerTimeoutError` names them.
  Workers die with the notebook kernel too (Linux): no process outlives a launch.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
import warnings
from multiprocessing.connection import wait
from pathlib import Path

BACKENDS = ("gloo", "nccl")  # built in; also any name registered with dist.Backend.register_backend
START_METHODS = ("fork", "spawn")
_RELEASE_GRACE = 10.0  # seconds a finished rank gets to tear down its process group


class WorkerError(RuntimeError):
    """A rank failed. ``rank`` is the rank whose failure came first; ``traceback`` is
    its traceback as text; ``failed`` maps every rank that failed to a one-line reason."""

    def __init__(self, message, rank=None, traceback="", failed=None):
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback
        self.failed = failed or {}


class WorkerTimeoutError(WorkerError):
    """Some ranks had not finished when the launch's ``timeout`` ran out.
    ``ranks`` lists them; ``stacks`` maps each one to where its Python code was stuck."""

    def __init__(self, message, ranks, stacks):
        super().__init__(message, rank=ranks[0], failed={r: "timed out" for r in ranks})
        self.ranks = ranks
        self.stacks = stacks


def default_threads(world_size: int) -> int:
    """Intra-op threads per rank so that all ranks together use the available cores once."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


def default_start_method(backend: str = "gloo") -> str:
    """``fork`` on Linux (fast, works with notebook functions), ``spawn`` elsewhere.
    Also ``spawn`` when this process has already initialised CUDA, which fork cannot copy."""
    if sys.platform != "linux":
        return "spawn"
    if backend == "nccl":
        import torch

        if torch.cuda.is_initialized():
            return "spawn"
    return "fork"


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
):
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their results.

    Each rank is a separate process with the default process group initialised
    (``dist.get_rank()`` works, DDP works) and destroyed after ``fn`` returns. The
    return values come back as a list in rank order, so they must be picklable
    (return ``tensor.detach()``, numbers, dicts, ...).

    Options:
        timeout:      seconds before unfinished ranks are killed (default 60).
        show:         whose printed output to replay: ``"all"``, one rank (``0``),
                      a list of ranks, or ``None`` for nobody.
        threads:      torch intra-op threads per rank. Always 1 with fork (OpenMP
                      hangs otherwise); with spawn, default cores // world_size.
        backend:      ``"gloo"`` (CPU tensors), ``"nccl"`` (one CUDA GPU per rank), or a
                      name registered with ``torch.distributed.Backend.register_backend``
                      (e.g. ``"traced"``, from :mod:`course.tracing`).
        start_method: ``"fork"`` (default on Linux) or ``"spawn"`` (default on macOS
                      and Windows; ``fn`` is sent with cloudpickle; in a script, as
                      always with spawn, call launch under ``if __name__ == "__main__":``).
        env:          extra environment variables set in each rank before it starts.

    Raises :class:`WorkerError` if a rank raises or dies, and
    :class:`WorkerTimeoutError` if ranks are still running after ``timeout``.
    """
    show_ranks = _check_arguments(fn, world_size, timeout, show, threads, backend, start_method, env)
    start_method = start_method or default_start_method(backend)
    if start_method == "fork" and threads not in (None, 1):
        raise ValueError(
            f"threads={threads} needs start_method='spawn': a forked rank with more than one "
            "intra-op thread can hang in OpenMP once the notebook has used several threads."
        )
    threads = threads or (1 if start_method == "fork" else default_threads(world_size))
    ctx = multiprocessing.get_context(start_method)
    if start_method == "fork":
        _import_lazy_modules()
    # A registered backend: forked ranks inherit the registration, spawned ones redo it.
    plugin = None if backend in BACKENDS else registered_backend(backend)
    payload = (fn, args, plugin) if start_method == "fork" else _pickle_by_value(fn, args, plugin)

    with tempfile.TemporaryDirectory(prefix="course-launch-") as workdir:
        config = {
            "world_size": world_size,
            "workdir": workdir,
            "threads": threads,
            "backend": backend,
            "timeout": timeout,
            "env": dict(env or {}),
            "parent_pid": os.getpid(),
        }
        release = ctx.Event()
        procs, readers = [], []
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_worker, args=(rank, config, payload, writer, release), daemon=True
                )
                with warnings.catch_warnings():
                    # Python >= 3.12 warns that forking a multi-threaded process (any
                    # Jupyter kernel) may deadlock. The child never touches the parent's
                    # threads' locks (no store is created before the fork), so silence it.
                    warnings.filterwarnings("ignore", "This process .* is multi-threaded")
                    proc.start()
                writer.close()  # keep only the child's copy: EOF on ``reader`` == child gone
                procs.append(proc)
                readers.append(reader)
            results = _supervise(procs, readers, release, timeout, workdir)
        finally:
            _kill_all(procs)
            _replay_output(workdir, show_ranks, world_size)
    return results


def _check_arguments(fn, world_size, timeout, show, threads, backend, start_method, env):
    """Fail early, in the notebook, with a message that says what to do."""
    if not callable(fn):
        raise TypeError(f"launch() needs a function to run on each rank, got {fn!r}.")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1 (the number of ranks), got {world_size!r}.")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a whole number >= 1 or None (automatic), got {threads!r}.")
    if env is not None and not (
        isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        raise TypeError("env must be a dict of str -> str, e.g. {'NCCL_DEBUG': 'INFO'}.")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a name such as 'gloo', got {backend!r}.")
    if start_method is not None:
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS} or None (automatic), got {start_method!r}.")
        if start_method not in multiprocessing.get_all_start_methods():
            raise ValueError(f"start_method={start_method!r} is not available on {sys.platform}; use 'spawn'.")

    import torch
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("This PyTorch build has no torch.distributed; install the official wheels.")
    if backend not in BACKENDS and registered_backend(backend) is None:
        raise ValueError(
            f"Unknown backend {backend!r}. Use 'gloo' for CPU tensors, 'nccl' for CUDA GPUs, or a name "
            "registered with torch.distributed.Backend.register_backend (for the course's 'traced' "
            "backend, `import course.tracing` first)."
        )
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


def _import_lazy_modules():
    """DDP imports ``torch._dynamo`` the first time it wraps a model: seconds of work. Done
    in forked ranks, every rank of every launch would pay it again; done once here, in the
    notebook, all forked ranks inherit it."""
    import torch._dynamo  # noqa: F401


def registered_backend(name):
    """``(name, creator, extended_api, devices)`` of a backend registered with
    ``dist.Backend.register_backend`` in this process, or None if there is none."""
    import torch.distributed as dist

    plugin = getattr(dist.Backend, "_plugins", {}).get(name.upper())
    if plugin is None:
        return None
    devices = dist.Backend.backend_capability.get(name.lower())
    return (name.lower(), plugin.creator_fn, plugin.extended_api, devices)


def _register_backend(plugin):
    """In a fresh (spawned) rank: register the backend the parent had registered."""
    import torch.distributed as dist

    name, creator, extended_api, devices = plugin
    if registered_backend(name) is None:
        dist.Backend.register_backend(name, creator, extended_api=extended_api, devices=devices)


def _pickle_by_value(fn, args, plugin=None):
    """For spawn: send ``fn`` (even one defined in a notebook) as bytes, by value."""
    try:
        import cloudpickle
    except ImportError as e:
        raise RuntimeError("start_method='spawn' needs cloudpickle: pip install cloudpickle") from e
    try:
        return cloudpickle.dumps((fn, args, plugin))
    except Exception as e:
        raise TypeError(f"With start_method='spawn', fn and its arguments must be picklable: {e}") from e


# --------------------------------------------------------------------------- parent side


def _supervise(procs, readers, release, timeout, workdir):
    """Wait for every rank's result. Return them in rank order, or raise."""
    world_size = len(procs)
    results, errors = {}, {}
    deadline = time.monotonic() + timeout
    open_readers = dict(zip(readers, range(world_size)))
    sentinels = {p.sentinel: r for r, p in enumerate(procs)}

    def read(reader, rank):
        try:
            kind, data = reader.recv()
        except (EOFError, OSError):
            del open_readers[reader]
            return
        if kind == "result":
            results[rank] = pickle.loads(data)
        else:
            errors[rank] = data

    while len(results) < world_size and not errors:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            _raise_timeout(procs, results, workdir, timeout)
        for obj in wait(list(open_readers) + list(sentinels), timeout=remaining):
            if obj in open_readers:
                read(obj, open_readers[obj])
            elif obj in sentinels:
                rank = sentinels.pop(obj)
                reader = readers[rank]
                while reader in open_readers and reader.poll():  # its last words, if any
                    read(reader, rank)
                if rank not in results and rank not in errors:
                    errors[rank] = _death_report(procs[rank])

    if errors:
        time.sleep(0.1)  # let ranks failing at the same moment report, to find the cause
        for reader, rank in list(open_readers.items()):
            while reader in open_readers and reader.poll():
                read(reader, rank)
        for rank, proc in enumerate(procs):
            if rank not in errors and rank not in results and proc.exitcode is not None:
                errors[rank] = _death_report(proc)
        _raise_worker_error(errors, world_size)

    release.set()  # every rank is done: let them tear down the process group and exit
    wait([p.sentinel for p in procs], timeout=_RELEASE_GRACE)  # _kill_all reaps them
    return [results[r] for r in range(world_size)]


def _death_report(proc):
    noticed = time.monotonic()
    proc.join(1)
    code = proc.exitcode
    if code is not None and code < 0:
        how = f"was killed by signal {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code}"
    return {"time": noticed, "summary": f"process {how} without a Python exception", "traceback": "", "consequence": False}


def _raise_worker_error(errors, world_size):
    # The cause is the earliest failure that is not just a peer noticing another rank's
    # death ("Connection closed by peer"); a killed rank cannot say when it died.
    causes = [r for r in errors if not errors[r]["consequence"]] or list(errors)
    first = min(causes, key=lambda r: errors[r]["time"])
    info = errors[first]
    others = [r for r in sorted(errors) if r != first]
    message = f"rank {first} of {world_size} failed: {info['summary']}"
    if others:  # usually 'Connection closed by peer': a consequence, not a cause
        message += f"\n(rank(s) {', '.join(map(str, others))} then failed too; details in .failed)"
    message += "\nThe other ranks were stopped."
    if info["traceback"]:
        message += f"\n\nTraceback from rank {first}:\n{info['traceback']}"
    failed = {r: e["summary"] for r, e in errors.items()}
    raise WorkerError(message, rank=first, traceback=info["traceback"], failed=failed)


def _raise_timeout(procs, results, workdir, timeout):
    stuck = [r for r in range(len(procs)) if r not in results]
    for r in stuck:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)  # faulthandler dumps its stack to a file
        except (ProcessLookupError, AttributeError):  # gone, or no SIGUSR1 (Windows)
            pass
    stacks = {r: _read_stack(Path(workdir, f"rank{r}.stack")) for r in stuck}
    names = ", ".join(str(r) for r in stuck)
    message = (
        f"rank(s) {names} did not finish within timeout={timeout:g} s "
        f"(a rank waiting for a collective that another rank never calls hangs until then). "
        f"All ranks were stopped."
    )
    for r in stuck:
        if stacks[r]:
            message += f"\n\nrank {r} was here (most recent call last):\n{stacks[r]}"
    raise WorkerTimeoutError(message, ranks=stuck, stacks=stacks)


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
    frames = [line.strip() for line in text.splitlines() if line.strip().startswith("File ")]
    frames.reverse()  # faulthandler prints the most recent call first
    inside = [i for i, f in enumerate(frames) if f.endswith(" in _worker")]
    if inside:  # keep the user's frames, below the launcher's own
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


def _replay_output(workdir, ranks, world_size):
    for rank in ranks:
        path = Path(workdir, f"rank{rank}.out")
        if not path.exists():
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        for line in text.splitlines():
            print(f"[rank {rank}] {line}".rstrip())
    sys.stdout.flush()


# --------------------------------------------------------------------------- child side


def _worker(rank, config, payload, conn, release):
    """Body of each rank's process. Never returns: ends with ``os._exit``."""
    code = 1
    try:
        _isolate(config["parent_pid"])
        out = _redirect_output(Path(config["workdir"], f"rank{rank}.out"))
        stack_file = open(Path(config["workdir"], f"rank{rank}.stack"), "w")
        if hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        _set_environment(rank, config)

        import torch

        torch.set_num_threads(config["threads"])  # first torch call after fork (see docstring)
        fn, args, plugin = payload if isinstance(payload, tuple) else _unpickle(payload)
        try:
            if plugin is not None:
                _register_backend(plugin)
            _init_process_group(rank, config)
            result = fn(rank, config["world_size"], *args)
            data = _pickle_result(result, rank)
        except BaseException as e:  # report it, whatever it is
            conn.send(("error", _error_report(e)))
            code = 1
        else:
            conn.send(("result", data))
            _wait_for_release(release, config["parent_pid"])
            _destroy_process_group()
            code = 0
    except BaseException as e:  # failed before fn ran (bad env, torch import, ...)
        try:
            conn.send(("error", _error_report(e)))
        except Exception:
            pass
    finally:
        _flush_all()
        os._exit(code)  # skip the parent's (e.g. Jupyter's) exit handlers


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


def _redirect_output(path):
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


def _set_environment(rank, config):
    world_size = config["world_size"]
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS=str(config["threads"]),
    )
    loopback = _loopback_interface()
    if loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback
    os.environ.update(config["env"])


def _loopback_interface():
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (AttributeError, OSError):
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return None


def _init_process_group(rank, config):
    import torch
    import torch.distributed as dist

    device_id = None
    if config["backend"] == "nccl":
        torch.cuda.set_device(rank)
        device_id = torch.device("cuda", rank)
    dist.init_process_group(
        backend=config["backend"],
        init_method=Path(config["workdir"], "store").as_uri(),
        rank=rank,
        world_size=config["world_size"],
        # Longer than the launch's own timeout, so that a hang is reported by the
        # launcher (naming the stuck ranks) rather than by a collective's timeout.
        timeout=datetime.timedelta(seconds=config["timeout"] + 60),
        device_id=device_id,
    )


def _unpickle(payload):
    import cloudpickle  # noqa: F401  (registers what cloudpickle-made bytes need)

    return pickle.loads(payload)


def _pickle_result(result, rank):
    try:
        return pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise TypeError(
            f"rank {rank} returned a value that cannot be sent back to the notebook ({e}). "
            "Return plain data: numbers, lists, dicts, or tensors with .detach()."
        ) from e


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _error_report(e):
    summary = f"{type(e).__name__}: {e}".splitlines()[0]
    return {
        "time": time.monotonic(),
        "summary": summary,
        "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__)),
        "consequence": any(text in summary for text in _PEER_GONE),  # another rank died first
    }


def _wait_for_release(release, parent_pid):
    """Finished ranks stay alive until all are done: a rank that left early would make
    its peers fail with 'connection closed' instead of showing who really hung."""
    while not release.wait(0.5):
        if os.getppid() != parent_pid:
            os._exit(1)


def _destroy_process_group():
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _flush_all():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)  # C stdio buffers (C++ std::cout shares them)
    except Exception:
        pass
