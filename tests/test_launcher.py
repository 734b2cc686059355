"""course.launch: results, output order, failures, hangs, cleanup, bad arguments."""

import ast
import functools
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

import course
from course import WorkerError, WorkerTimeoutError, launch
from course.runtime.launcher import choose_start_method, default_start_method, default_threads
from course.runtime.worker import pack

ROOT = Path(__file__).resolve().parents[1]


# Started once per process by multiprocessing, they end with it: spawn's resource tracker, and
# the forkserver (with its tracker), which serves every forkserver launch of this process.
LONG_LIVED_HELPERS = ("resource_tracker", "multiprocessing.forkserver")

# The start methods the failure and clean-up tests run under (spawn: one script, below).
FORKING = ["fork", "forkserver"]


def _children():
    """Live descendants of this process, except multiprocessing's long-lived helpers: its own
    children that run them. A forkserver's ranks are forks of the server (with its command line)
    but its children, not ours: they count."""
    me = psutil.Process()
    helpers = {p.pid for p in me.children() if any(h in " ".join(p.cmdline()) for h in LONG_LIVED_HELPERS)}
    return [p for p in me.children(recursive=True) if p.pid not in helpers and p.status() != psutil.STATUS_ZOMBIE]


def _forkservers(pid):
    return [p for p in psutil.Process(pid).children() if "multiprocessing.forkserver" in " ".join(p.cmdline())]


@pytest.fixture(autouse=True)
def no_processes_left_behind():
    """Every test: no worker (or anything a worker started) outlives the launch."""
    yield
    assert _children() == [], "processes left behind"


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pids, seconds=5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


# ---------------------------------------------------------------- results and state


def test_results_come_back_in_rank_order_even_when_ranks_finish_in_reverse():
    def job(rank, world_size, scale):
        time.sleep(0.05 * (world_size - rank))  # rank 3 finishes first
        return {"rank": rank, "value": scale * rank}

    assert launch(job, 4, 10, show=None) == [{"rank": r, "value": 10 * r} for r in range(4)]


def test_each_rank_has_an_initialised_gloo_process_group_and_launcher_env():
    def job(rank, world_size):
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        return (
            dist.get_rank(),
            dist.get_world_size(),
            dist.get_backend(),
            t.item(),
            os.environ["RANK"],
            os.environ["LOCAL_RANK"],
            os.environ["WORLD_SIZE"],
            torch.get_num_threads(),
        )

    # A forked rank runs 1 thread; a forkserver's rank (the default with a CUDA GPU) its share of the cores.
    threads = 1 if default_start_method() == "fork" else default_threads(3)
    assert launch(job, 3, show=None) == [(r, 3, "gloo", 6.0, str(r), str(r), "3", threads) for r in range(3)]


def test_closures_and_tensor_arguments_work():
    offset = torch.arange(4.0)

    def job(rank, world_size, weights):
        return (weights * rank + offset).sum().item()

    assert launch(job, 2, torch.ones(4), show=None) == [6.0, 10.0]


def test_process_group_is_destroyed_and_the_same_launch_can_run_again():
    def job(rank, world_size):
        dist.barrier()
        return dist.is_initialized()

    for _ in range(3):
        assert launch(job, 2, show=None) == [True, True]
    assert not dist.is_initialized()  # nothing leaked into the parent


def test_a_world_of_one_works():
    assert launch(lambda rank, ws: (rank, ws), 1, show=None) == [(0, 1)]


# ---------------------------------------------------------------- output


def _chatty(rank, world_size):
    time.sleep(0.05 * (world_size - rank))  # reverse order in time
    print(f"hello from {rank}")
    print(f"warning from {rank}", file=sys.stderr)
    os.write(1, f"raw fd write from {rank}\n".encode())  # what C++ code does
    print("last line", rank)
    return rank


@pytest.mark.parametrize("start_method", FORKING)
def test_output_of_all_ranks_is_replayed_grouped_in_rank_order(capsys, start_method):
    launch(_chatty, 3, start_method=start_method)
    expected = "".join(
        f"[rank {r}] hello from {r}\n[rank {r}] warning from {r}\n"
        f"[rank {r}] raw fd write from {r}\n[rank {r}] last line {r}\n"
        for r in range(3)
    )
    assert capsys.readouterr().out == expected


@pytest.mark.parametrize("show, ranks", [(0, [0]), ([2, 1], [1, 2]), (None, [])])
def test_show_selects_whose_output_is_replayed(capsys, show, ranks):
    launch(_chatty, 3, show=show)
    out = capsys.readouterr().out
    assert [line.split("]")[0] for line in out.splitlines()] == [f"[rank {r}" for r in ranks for _ in range(4)]


def test_output_printed_before_a_failure_is_still_shown(capsys):
    def job(rank, world_size):
        print("about to fail" if rank == 1 else "fine")
        if rank == 1:
            raise RuntimeError("nope")
        return rank

    with pytest.raises(WorkerError):
        launch(job, 2)
    assert "[rank 1] about to fail" in capsys.readouterr().out


# ---------------------------------------------------------------- failures


@pytest.mark.parametrize("start_method", FORKING)
def test_an_exception_on_one_rank_raises_worker_error_naming_it_quickly(start_method):
    def job(rank, world_size):
        if rank == 2:
            raise ValueError("bad batch on rank 2")
        t = torch.ones(1)
        dist.all_reduce(t)  # the others wait here for rank 2
        time.sleep(30)  # and would then sleep: they must be stopped, not awaited
        return rank

    launch(lambda r, w: None, 1, start_method=start_method)  # a forkserver's first launch starts it: seconds
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(job, 4, timeout=60, start_method=start_method)
    assert time.monotonic() - start < 5
    err = info.value
    assert err.rank == 2
    assert "rank 2 of 4 failed: ValueError: bad batch on rank 2" in str(err)
    assert 'raise ValueError("bad batch on rank 2")' in err.traceback
    assert not isinstance(err, WorkerTimeoutError)


# spawn: the ranks are fresh interpreters that import torch (~10 s), in .ci/run's slow part; forkserver
# ranks get fn and its cell's lines the same way (by value), here.
@pytest.mark.parametrize("start_method", ["forkserver", pytest.param("spawn", marks=pytest.mark.slow)])
def test_a_traceback_from_a_rank_shows_the_notebook_cell_line_that_failed(start_method):
    # A function typed in a notebook cell: its file does not exist, only Jupyter's linecache knows
    # its lines. cloudpickle alone names every file "<dynamic-code>" (no line shown).
    import linecache

    cell = "/tmp/ipykernel_0/course_test_cell.py"
    source = "def job(rank, world_size):\n    x = 1\n    raise ValueError('from the cell')\n"
    linecache.cache[cell] = (len(source), None, source.splitlines(True), cell)  # as IPython stores a cell
    namespace = {}
    exec(compile(source, cell, "exec"), namespace)
    with pytest.raises(WorkerError) as info:
        launch(namespace["job"], 1, start_method=start_method, show=None)
    assert f'File "{cell}", line 3, in job\n    raise ValueError(\'from the cell\')' in info.value.traceback


def test_a_function_whose_code_says_ops_reaches_ranks_that_do_not_fork():
    # `torch` + an attribute named `ops` anywhere in the code: cloudpickle also sends the submodule
    # torch.ops, whose type derives from ModuleType, and failed ("cannot pickle '_Ops' object").
    def job(rank, world_size):
        class Recorder:
            def __init__(self):
                self.ops = []

        recorder = Recorder()
        recorder.ops.append(torch.ones(1).item())
        return recorder.ops

    assert launch(job, 1, start_method="forkserver", show=None) == [[1.0]]


_LOCK = threading.Lock()


def test_what_does_not_pickle_is_named_before_anything_starts():
    def uses_a_lock(rank, world_size):  # defined here, not importable: sent by value, with its globals
        with _LOCK:
            return rank

    with pytest.raises(TypeError, match=r"the global '_LOCK' that uses_a_lock uses, a lock\)\. Create it inside"):
        launch(uses_a_lock, 1, start_method="forkserver")
    with pytest.raises(TypeError, match=r"\(the argument `b`, a lock\)"):  # by the parameter it fills
        launch(lambda r, w, a, b: r, 1, 0, threading.Lock(), start_method="spawn")
    with pytest.raises(TypeError, match=r"\(argument 2 after world_size, a lock\)"):  # no name to give
        launch(lambda r, w, *rest: r, 1, 0, threading.Lock(), start_method="spawn")
    assert _children() == []


# As if typed in a notebook: functions of a module that cannot be imported are pickled by value.
_CELL = {"__name__": "a_notebook_cell", "threading": threading, "functools": functools}
exec(textwrap.dedent("""
    LOCK = threading.Lock()

    def uses_the_lock():
        with LOCK:
            return 1

    class HoldsALock:
        def __init__(self):
            self.lock = threading.Lock()

        def run(self, rank, world_size):
            return rank

    def default_lock(rank, world_size, lock=LOCK):
        return rank

    def keyword_only_default_lock(rank, world_size, *, lock=LOCK):
        return rank

    CASES = [
        (default_lock, (), "the default of `lock` in default_lock, a lock"),
        (keyword_only_default_lock, (), "the default of `lock` in keyword_only_default_lock, a lock"),
        (lambda r, w: uses_the_lock(), (), "the global 'LOCK' that uses_the_lock uses, a lock"),  # not 'uses_the_lock'
        (functools.partial(lambda r, w: uses_the_lock()), (), "the global 'LOCK' that uses_the_lock uses, a lock"),
        (functools.partial(lambda r, w, a, lock: r, 0), (LOCK,), "the argument `lock`, a lock"),
        (functools.partial(lambda r, w, a: r, LOCK), (), "argument 1 of the functools.partial, a lock"),
        (functools.partial(lambda r, w, lock: r, lock=LOCK), (), "the keyword argument `lock` of the functools.partial, a lock"),
        (HoldsALock().run, (), "the attribute `lock` of the HoldsALock that run is a method of, a lock"),
    ]
"""), _CELL)


@pytest.mark.parametrize("fn, args, named", _CELL["CASES"], ids=[named.split(",")[0] for _, _, named in _CELL["CASES"]])
def test_what_does_not_pickle_is_found_where_pickling_fn_takes_it(fn, args, named):
    with pytest.raises(TypeError, match=re.escape(f"({named}). Create it inside")):
        pack(fn, args)


@pytest.mark.parametrize("start_method, attempt", [("fork", 0), ("fork", 1), ("fork", 2), ("forkserver", 0)])
def test_a_rank_killed_during_a_collective_is_named_not_the_peers_that_noticed(start_method, attempt):
    def job(rank, world_size):
        if rank == 1:
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(torch.ones(1))  # ranks 0 and 2 wait here, then lose their peer
        time.sleep(30)

    with pytest.raises(WorkerError) as info:
        launch(job, 3, timeout=60, start_method=start_method)
    assert info.value.rank == 1
    assert str(info.value).startswith("rank 1 of 3 failed: process was killed by signal SIGKILL")
    assert info.value.failed[1].startswith("process was killed by signal SIGKILL")


def test_a_rank_that_calls_sys_exit_is_a_failure_too():
    def job(rank, world_size):
        sys.exit(3)

    with pytest.raises(WorkerError, match="SystemExit: 3"):
        launch(job, 1)


def test_an_unpicklable_result_gives_a_clear_error():
    def job(rank, world_size):
        return lambda: None  # functions made in the worker cannot be sent back

    with pytest.raises(WorkerError, match="cannot be sent back to the notebook"):
        launch(job, 2)


@pytest.mark.parametrize("start_method", FORKING)
def test_a_missing_collective_times_out_naming_the_stuck_ranks_and_where_they_are(start_method):
    def job(rank, world_size):
        if rank != 1:  # rank 1 "forgets" the all_reduce
            dist.all_reduce(torch.ones(1))
        return rank

    launch(lambda r, w: None, 1, start_method=start_method)  # a forkserver's first launch starts it: seconds
    start = time.monotonic()
    with pytest.raises(WorkerTimeoutError) as info:
        launch(job, 3, timeout=2, start_method=start_method)
    elapsed = time.monotonic() - start
    assert 2 <= elapsed < 6
    err = info.value
    assert err.ranks == [0, 2]
    assert "rank(s) 0, 2 did not finish within timeout=2 s" in str(err)
    for r in (0, 2):
        assert "in job" in err.stacks[r] and err.stacks[r].rstrip().endswith("in all_reduce")


@pytest.mark.parametrize("start_method", FORKING)
def test_workers_and_their_children_are_killed_on_timeout(tmp_path, start_method):
    def job(rank, world_size):
        child = subprocess.Popen(["sleep", "60"])
        Path(tmp_path, f"pids{rank}").write_text(f"{os.getpid()} {child.pid}")
        time.sleep(60)

    with pytest.raises(WorkerTimeoutError):
        launch(job, 2, timeout=1.5, start_method=start_method)
    pids = [int(p) for r in range(2) for p in Path(tmp_path, f"pids{r}").read_text().split()]
    assert _wait_gone(pids, 1) == []


def _sum_of_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _timed_launches(n):
    """``n`` launches of 4 ranks; the (start, end) of each, in time.time() (the same clock in every process)."""
    spans = []
    for _ in range(n):
        start = time.time()
        assert launch(_sum_of_ranks, 4, show=None, timeout=60) == [6.0] * 4
        spans.append((start, time.time()))
    return spans


@pytest.mark.slow  # two interpreters launching 4 ranks again and again: in .ci/run's slow part
def test_two_notebooks_launching_at_the_same_time_never_collide(tmp_path):
    # This process and another one (two notebook kernels) launch 4 ranks each, over and over, at the
    # same time: each waits for the other before its first timed launch, and the test checks that
    # their launches really overlapped (an overlap that did not happen would prove nothing).
    other = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(
            f"""
            import json, time
            from pathlib import Path
            import course
            from tests.test_launcher import _sum_of_ranks, _timed_launches
            course.launch(_sum_of_ranks, 4, show=None, timeout=60)  # one-time imports, before the race
            Path({str(tmp_path)!r}, "other").touch()
            while not Path({str(tmp_path)!r}, "this").exists():
                time.sleep(0.01)
            print(json.dumps(_timed_launches(6)))
            """
        )],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / "other").exists():
        assert other.poll() is None and time.monotonic() < deadline, "the other process did not get ready"
        time.sleep(0.01)
    (tmp_path / "this").touch()
    ours = _timed_launches(6)
    out = other.communicate(timeout=120)[0]
    assert other.returncode == 0, out
    theirs = json.loads(out)
    overlapping = [(a, b) for a in ours for b in theirs if a[0] < b[1] and b[0] < a[1]]
    assert len(overlapping) >= 3, f"the two processes' launches hardly overlapped: {ours} {theirs}"


def _run_script(body, tmp_path, **kwargs):
    path = tmp_path / "main.py"
    path.write_text(textwrap.dedent(body))
    return subprocess.Popen([sys.executable, str(path)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


@pytest.fixture(scope="module")
def launched_from_a_script(tmp_path_factory):
    """A script launches a function defined in its ``__main__`` with fork, then with spawn; the
    spawn launch also uses a backend the script registered, ``threads=2``, and a 2 s timeout that
    its ranks' start-up must not count: importing torch, unpickling an argument that takes 2 s
    (``SlowToUnpickle``), importing what DDP loads lazily (torch._dynamo: the function takes one
    DDP step). Every spawned rank imports torch (seconds), so these tests share this one launch."""
    proc = _run_script(
        """
        import os, time
        import course, torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        BASE = 100
        class SlowToUnpickle:  # start-up time, like importing torch
            def __reduce__(self):
                return (sleep_then_make, (2.0,))
        def sleep_then_make(seconds):
            time.sleep(seconds)
            return "unpickled"
        def job(rank, world_size, extra):
            DDP(torch.nn.Linear(2, 2))(torch.ones(1, 2)).sum().backward()  # DDP's lazy import: seconds
            t = torch.tensor([rank + 1.0])
            dist.all_reduce(t)
            return BASE + rank + dist.get_world_size(), dist.get_backend(), t.item(), torch.get_num_threads(), extra
        def plain_gloo(store, rank, world_size, timeout):  # a backend creator, as register_backend expects
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)
        def environment(rank, world_size):
            return tuple(os.environ.get(name) for name in ("COURSE_TEST_GONE", "COURSE_TEST_NEW", "COURSE_TEST_OPTION"))
        if __name__ == "__main__":  # a script needs this guard for spawn; a notebook does not
            dist.Backend.register_backend("scriptgloo", plain_gloo, devices=["cpu"])
            print(course.launch(job, 2, "plain", start_method="fork", show=None))
            print(course.launch(job, 2, SlowToUnpickle(), start_method="spawn", backend="scriptgloo", threads=2,
                                timeout=2, show=None))
            os.environ["COURSE_TEST_GONE"] = "then"  # in the server's environment: it starts now
            print(course.launch(job, 2, "served", start_method="forkserver", backend="scriptgloo", show=None))
            del os.environ["COURSE_TEST_GONE"]
            os.environ["COURSE_TEST_NEW"] = "now"
            print(course.launch(environment, 2, start_method="forkserver", env={"COURSE_TEST_OPTION": "x"}, show=None))
        """,
        tmp_path_factory.mktemp("script"),
    )
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    results = [ast.literal_eval(line) for line in out.splitlines()[-4:]]  # printed lists of tuples
    return dict(zip(["fork", "spawn", "forkserver", "forkserver environment"], results))


@pytest.mark.slow  # the script's spawned ranks each import torch: in .ci/run's slow part
def test_functions_defined_in_main_work_with_every_start_method(launched_from_a_script):
    # A notebook's functions live in __main__: exactly what mp.spawn cannot pickle.
    for start_method in ("fork", "spawn", "forkserver"):
        assert [r[0] for r in launched_from_a_script[start_method]] == [102, 103], start_method


@pytest.mark.slow  # a script of its own plays the kernel (an interpreter importing torch): in .ci/run's slow part
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_workers_die_with_the_kernel(tmp_path, start_method):
    """The stop button (SIGINT: the kernel lives on, and runs the cell again), then the kernel
    killed (SIGKILL): no orphans either time, and no forkserver. One script plays the kernel."""
    proc = _run_script(
        f"""
        import faulthandler, os, signal, time, course
        from pathlib import Path
        faulthandler.register(signal.SIGUSR1)  # the test asks where the script is if it fails
        # ipykernel runs each cell under signal.default_int_handler (kernelbase.pre_handler_hook),
        # whatever it inherited. Python installs that handler only if SIGINT was not ignored at
        # start-up, and a non-interactive shell starts background jobs (`pytest &`, as CI may)
        # with SIGINT ignored: without this line the interrupt did nothing there.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        def job(rank, world_size, attempt):
            Path({str(tmp_path)!r}, f"pid{{attempt}}-{{rank}}").write_text(str(os.getpid()))
            time.sleep(60)
        if __name__ == "__main__":  # a forkserver's rank imports a script again, as spawn's do
            try:
                course.launch(job, 2, 0, timeout=60, start_method={start_method!r})
            except KeyboardInterrupt:
                print("interrupted", flush=True)
            course.launch(job, 2, 1, timeout=60, start_method={start_method!r})
        """,
        tmp_path,
    )

    def rank_pids(attempt):
        files = [tmp_path / f"pid{attempt}-{r}" for r in range(2)]
        deadline = time.monotonic() + 60
        while not all(f.exists() and f.read_text() for f in files):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
            time.sleep(0.05)
        return [int(f.read_text()) for f in files]

    servers = []
    try:
        first = rank_pids(0)
        proc.send_signal(signal.SIGINT)
        left = _wait_gone(first, seconds=10)
        if left:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1)
            proc.kill()
            pytest.fail(f"ranks {left} outlived the interrupt; the script:\n{proc.communicate(timeout=30)[0]}")
        second = rank_pids(1)  # the "kernel" survived the interrupt and launched again
        servers = [p.pid for p in _forkservers(proc.pid)]
        assert len(servers) == (start_method == "forkserver")  # one server served both launches
        proc.send_signal(signal.SIGKILL)
        out = proc.communicate(timeout=30)[0]
        assert "interrupted" in out and _wait_gone(second) == [] and _wait_gone(servers) == []
    finally:  # a failure must not leave a sleeping script or ranks behind for the next tests
        proc.kill()
        for pid in [int(text) for text in (f.read_text() for f in tmp_path.glob("pid*")) if text]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        for server in servers:
            if _alive(server):
                os.kill(server, signal.SIGKILL)


# ---------------------------------------------------------------- interrupts land anywhere

main_thread_only = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                      reason="only the main thread handles SIGINT")


def _press():
    """Kernel > Interrupt, as the kernel sees it: SIGINT to this process."""
    os.kill(os.getpid(), signal.SIGINT)


def _zombies():
    return [p for p in psutil.Process().children(recursive=True) if p.status() == psutil.STATUS_ZOMBIE]


def _nap(rank, world_size):
    time.sleep(0.2)
    return rank


_press_after_fork = []  # os.register_at_fork cannot be undone: the hook presses only while a test asks


@pytest.fixture(scope="module")
def press_in_an_after_fork_hook():
    def hook():
        if _press_after_fork:
            _press_after_fork.pop()
            _press()

    os.register_at_fork(after_in_parent=hook)


@main_thread_only
def test_a_press_inside_an_after_fork_hook_is_not_lost(press_in_an_after_fork_hook):
    """Python ignores an exception raised in an after-fork hook ("Exception ignored in
    <function _releaseLock>"): a KeyboardInterrupt raised there was lost and the cell ran on."""
    _press_after_fork.append(True)
    with pytest.raises(course.runtime.launcher.LaunchInterrupted) as e:
        launch(_nap, 3, start_method="fork")
    assert _press_after_fork == [] and "course.launch stopped all 3 ranks" in str(e.value)
    assert _zombies() == []


@main_thread_only
@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_a_press_while_a_rank_starts_stops_the_launch_there(monkeypatch, start_method):
    """A press inside ``Process.start`` (a fork, a request to the forkserver, a fork and exec)
    is acted on after it: no more ranks start, those started are stopped and reaped."""
    import multiprocessing

    process = type(multiprocessing.get_context(start_method).Process())
    original = process._Popen

    def pressed_while_starting(process_object):
        _press()
        return original(process_object)

    monkeypatch.setattr(process, "_Popen", staticmethod(pressed_while_starting))
    with pytest.raises(course.runtime.launcher.LaunchInterrupted) as e:
        launch(_nap, 3, start_method=start_method)
    assert "course.launch stopped all 3 ranks" in str(e.value)
    assert _zombies() == []


@main_thread_only
@pytest.mark.parametrize("start_method", FORKING)
def test_a_second_press_during_the_cleanup_does_not_break_it(monkeypatch, start_method):
    """The first press while the ranks run; the second inside the cleanup (kill, join, waitpid),
    where a KeyboardInterrupt left a raw traceback and unreaped ranks."""
    from course.runtime import launcher

    original, cleanups = launcher._kill_all, []

    def pressed_while_cleaning_up(procs):
        cleanups.append(len(procs))
        _press()
        original(procs)

    def sleeper(rank, world_size):
        print("working", flush=True)
        time.sleep(60)

    monkeypatch.setattr(launcher, "_kill_all", pressed_while_cleaning_up)
    timer = threading.Timer(1.0, _press)
    timer.start()
    try:
        with pytest.raises(launcher.LaunchInterrupted) as e:
            launch(sleeper, 2, timeout=120, start_method=start_method)
    finally:
        timer.cancel()
    assert cleanups == [2] and "stopped all 2 ranks" in str(e.value) and e.value.seconds < 30
    assert _zombies() == []


@pytest.mark.parametrize("start_method", FORKING)
def test_ranks_take_sigint_as_python_does_once_they_have_their_own_process_group(start_method):
    """Ranks start with SIGINT blocked (Jupyter interrupts the kernel's whole process group, which
    a new rank belongs to at first) and let it through once they have left that group."""

    def how_sigint_is_handled(rank, world_size):
        blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        return blocked, signal.getsignal(signal.SIGINT) is signal.default_int_handler, os.getpgrp() == os.getpid()

    assert launch(how_sigint_is_handled, 2, start_method=start_method) == [(False, True, True)] * 2
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # nor is it blocked here afterwards


@pytest.mark.skipif(sys.platform != "linux", reason="fork is the default on Linux only")
def test_a_machine_with_a_cuda_gpu_starts_ranks_with_a_forkserver(monkeypatch):
    # Measured on one H100 (torch 2.11): after one backward() in the parent, forked ranks fail in
    # their own backward ("autograd's threading in combination with fork-based multiprocessing").
    monkeypatch.delenv("COURSE_START_METHOD", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_start_method("gloo") == "fork"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_start_method("gloo") == default_start_method("nccl") == "forkserver"
    assert "CUDA GPU" in choose_start_method()[1]
    monkeypatch.setattr(sys, "platform", "darwin")
    assert choose_start_method() == ("spawn", "darwin: fork is unsafe or missing here (macOS, Windows)")


def test_course_start_method_changes_the_default_of_every_launch(monkeypatch):
    monkeypatch.setenv("COURSE_START_METHOD", "forkserver")
    assert choose_start_method() == ("forkserver", "set by COURSE_START_METHOD")
    parents = launch(lambda r, w: os.getppid(), 2, show=None)
    assert parents[0] == parents[1] == _forkservers(os.getpid())[0].pid  # forked by the server
    assert launch(lambda r, w: os.getppid(), 1, start_method="fork", show=None) == [os.getpid()]  # the argument wins
    monkeypatch.setenv("COURSE_START_METHOD", "vfork")
    with pytest.raises(ValueError, match="COURSE_START_METHOD='vfork' is not a start method.*or unset it"):
        launch(lambda r, w: r, 1)
    assert _children() == []


def test_forkserver_ranks_may_use_several_threads():
    def job(rank, world_size):
        torch.ones(500, 500) @ torch.ones(500, 500)  # OpenMP threads: a forked rank would hang here
        return torch.get_num_threads()

    torch.ones(500, 500) @ torch.ones(500, 500)  # the notebook has used several threads
    assert launch(job, 2, start_method="forkserver", threads=2, show=None, timeout=30) == [2, 2]


@pytest.mark.slow  # launched_from_a_script
def test_forkserver_ranks_see_the_environment_of_the_launch_not_of_the_server(launched_from_a_script):
    # The script started its server with COURSE_TEST_GONE set, then unset it and set COURSE_TEST_NEW.
    assert launched_from_a_script["forkserver environment"] == [(None, "now", "x")] * 2


@pytest.mark.slow  # launched_from_a_script
def test_the_timeout_counts_from_when_every_rank_has_started(launched_from_a_script):
    # Spawned ranks on a busy machine take seconds to start; the script's 2 s timeout did not count that ...
    assert [r[4] for r in launched_from_a_script["spawn"]] == ["unpickled"] * 2
    with pytest.raises(WorkerTimeoutError) as stuck:  # ... but once started, the timeout holds (the same
        launch(lambda r, w: time.sleep(30), 2, timeout=1, start_method="fork", show=None)  # code for fork)
    assert stuck.value.ranks == [0, 1] and stuck.value.stacks[0].strip().endswith("in <lambda>")  # in fn, not starting


@pytest.mark.slow  # launched_from_a_script
def test_threads_above_one_are_refused_with_fork_but_work_with_spawn(launched_from_a_script):
    with pytest.raises(ValueError, match="start_method='spawn'"):
        launch(lambda r, w: None, 1, threads=2, start_method="fork")
    assert [r[3] for r in launched_from_a_script["spawn"]] == [2, 2]  # threads=2
    assert [r[3] for r in launched_from_a_script["fork"]] == [1, 1]


# ---------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        ((None, 2), {}, TypeError, "needs a function"),
        ((lambda r, w: r, 0), {}, ValueError, "world_size must be a whole number >= 1"),
        ((lambda r, w: r, 2.0), {}, ValueError, "world_size must be a whole number"),
        ((lambda r, w: r, True), {}, ValueError, "world_size must be a whole number"),
        ((lambda r, w: r, 2), {"backend": "mpi"}, ValueError, "Unknown backend 'mpi'"),
        ((lambda r, w: r, 2), {"timeout": 0}, ValueError, "timeout must be a positive number"),
        ((lambda r, w: r, 2), {"show": 5}, ValueError, "show must be"),
        ((lambda r, w: r, 2), {"start_method": "vfork"}, ValueError, "start_method must be"),
        ((lambda r, w: r, 2), {"threads": 0}, ValueError, "threads must be"),
        ((lambda r, w: r, 2), {"env": {"A": 1}}, TypeError, "env must be a dict"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        launch(*args, **kwargs)
    assert _children() == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_nccl_without_a_gpu_says_to_use_gloo():
    with pytest.raises(ValueError, match="use backend='gloo' on CPU"):
        launch(lambda r, w: r, 2, backend="nccl")


# ---------------------------------------------------------------- registered backends


def _plain_gloo(store, rank, world_size, timeout):
    """A backend creator, as dist.Backend.register_backend expects: here simply gloo."""
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


@pytest.fixture
def registered_backend_name():
    name = "coursetestgloo"
    if getattr(dist.Backend, name.upper(), None) != name:
        dist.Backend.register_backend(name, _plain_gloo, devices=["cpu"])
    return name


def _backend_and_sum(rank, world_size):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return dist.get_backend(), t.item()


def test_a_backend_registered_with_register_backend_can_be_launched(registered_backend_name):
    # Forked ranks inherit the registration (spawned ones: the next test).
    results = launch(_backend_and_sum, 2, backend=registered_backend_name, start_method="fork", show=None)
    assert results == [(registered_backend_name, 3.0)] * 2


@pytest.mark.slow  # launched_from_a_script
def test_spawned_and_forkserver_ranks_register_the_backend_again_before_init(launched_from_a_script):
    # The script registered "scriptgloo" in its __main__: spawned ranks get the creator by value,
    # and so do a forkserver's (the server started before the registration, and never runs it).
    for start_method in ("spawn", "forkserver"):
        assert [r[1:3] for r in launched_from_a_script[start_method]] == [("scriptgloo", 3.0)] * 2


def test_an_unknown_backend_name_says_how_to_register_one():
    with pytest.raises(ValueError, match="Unknown backend 'nosuchbackend'.*register_backend"):
        launch(lambda r, w: r, 2, backend="nosuchbackend")
    with pytest.raises(TypeError, match="backend must be a name"):
        launch(lambda r, w: r, 2, backend=None)
    assert _children() == []


def test_env_option_reaches_the_ranks():
    assert launch(lambda r, w: os.environ["COURSE_TEST"], 2, env={"COURSE_TEST": "yes"}, show=None) == ["yes", "yes"]


@pytest.mark.skipif(sys.platform != "linux", reason="loopback is 'lo' on Linux")
def test_gloo_is_pinned_to_loopback():
    assert launch(lambda r, w: os.environ.get("GLOO_SOCKET_IFNAME"), 2, show=None) == ["lo", "lo"]


def test_public_names():
    assert course.launch is launch and issubclass(WorkerTimeoutError, WorkerError)


# ---------------------------------------------------------------- code that makes its own process group

# PyTorch's DDP tutorial (pytorch/tutorials, intermediate_source/ddp_tutorial.rst, "Basic Use Case"),
# pasted as it is. Only its three GPU placements are taken out below, to run on a CPU.
DDP_TUTORIAL = '''
def setup(rank, world_size):
    os.environ['MASTER_ADDR'] = 'localhost'
    os.environ['MASTER_PORT'] = '12355'

    # initialize the process group
    dist.init_process_group("gloo", rank=rank, world_size=world_size)

def cleanup():
    dist.destroy_process_group()

class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(rank, world_size):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)

    # create model and move it to GPU with id rank
    model = ToyModel().to(rank)
    ddp_model = DDP(model, device_ids=[rank])

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5).to(rank)
    loss_fn(outputs, labels).backward()
    optimizer.step()

    cleanup()
'''
ON_CPU = {"ToyModel().to(rank)": "ToyModel()", "device_ids=[rank]": "device_ids=None", "torch.randn(20, 5).to(rank)": "torch.randn(20, 5)"}


def _tutorial():
    source = DDP_TUTORIAL
    for gpu, cpu in ON_CPU.items():
        assert source.count(gpu) == 1
        source = source.replace(gpu, cpu)
    namespace = {"os": os, "torch": torch, "dist": dist, "nn": torch.nn, "optim": torch.optim,
                 "DDP": torch.nn.parallel.DistributedDataParallel}
    exec(source, namespace)
    return namespace


def test_the_ddp_tutorials_demo_basic_runs_unchanged_with_init_process_group_false(capsys):
    tutorial = _tutorial()

    def job(rank, world_size):
        ours = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], os.environ["RANK"], os.environ["WORLD_SIZE"]
        initialised_by_launch = dist.is_initialized()
        tutorial["demo_basic"](rank, world_size)
        return initialised_by_launch, ours, os.environ["MASTER_PORT"], dist.is_initialized()

    results = launch(job, 2, init_process_group=False, timeout=120)
    for rank, (initialised_by_launch, (addr, port, env_rank, env_world), port_after, still) in enumerate(results):
        assert not initialised_by_launch and not still  # the tutorial's setup() made it, its cleanup() ended it
        assert (addr, env_rank, env_world) == ("127.0.0.1", str(rank), "2") and int(port) > 0
        assert port_after == "12355"  # the tutorial's own values win
    assert results[0][1][1] == results[1][1][1]  # every rank got the same free port
    assert capsys.readouterr().out == "[rank 0] Running basic DDP example on rank 0.\n[rank 1] Running basic DDP example on rank 1.\n"


def test_env_init_works_with_only_what_launch_sets():
    def job(rank, world_size):
        dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        return dist.get_rank(), t.item()

    assert launch(job, 3, init_process_group=False, show=None) == [(0, 6.0), (1, 6.0), (2, 6.0)]


def test_initialising_twice_names_the_fix():
    tutorial = _tutorial()
    with pytest.raises(WorkerError) as info:
        launch(tutorial["demo_basic"], 2, show=None)
    assert "trying to initialize the default process group twice" in str(info.value)
    assert ("course.launch already initialised the process group; pass init_process_group=False "
            "to course.launch") in str(info.value)
    assert "or remove init_process_group from your function" in str(info.value)
    with pytest.raises(TypeError, match="init_process_group must be True or False"):
        launch(lambda r, w: r, 2, init_process_group="no")


@pytest.mark.parametrize("start_method, world_size", [("fork", 1), ("fork", 2), ("forkserver", 2)])
def test_a_rank_that_dies_alone_is_reported_at_once_not_at_the_timeout(start_method, world_size):
    def job(rank, world_size):
        if rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(30)

    launch(lambda r, w: None, 1, start_method=start_method)  # a forkserver's first launch starts it: seconds
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(job, world_size, timeout=60, show=None, start_method=start_method)
    assert time.monotonic() - start < 10
    assert info.value.failed[0].startswith("process was killed by signal SIGKILL")


def test_a_press_noted_just_before_the_launch_began_reads_as_at_its_start():
    """The kernel's hooks may note a press a moment before ``launch`` records its start: the line
    must not say "after -0.0 s" (seen once in 50 presses)."""
    message = str(course.runtime.launcher.LaunchInterrupted(2, None, -1e-9))
    assert message == "interrupted after 0.0 s: course.launch stopped all 2 ranks before they started."


def test_a_forkservers_ranks_are_born_ignoring_sigint_and_nothing_else_changes(tmp_path):
    """course.runtime.in_forkserver, preloaded first by the forkserver course.launch starts: its forks
    start with SIGINT ignored (a press to the kernel's group cannot raise in multiprocessing's start-up
    code); imported anywhere else it leaves SIGINT alone. Checked in a bare forkserver (no torch)."""
    import signal
    import subprocess
    import textwrap

    import course.runtime.in_forkserver as in_forkserver

    assert not in_forkserver.in_a_forkserver()
    assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
    script = textwrap.dedent("""
        import multiprocessing as mp, signal
        def child(q):
            q.put(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)
        if __name__ == "__main__":
            for preload in ([], ["course.runtime.in_forkserver"]):
                ctx = mp.get_context("forkserver")
                ctx.set_forkserver_preload(preload)
                q = ctx.Queue()
                p = ctx.Process(target=child, args=(q,))
                p.start()
                print(preload, q.get())
                p.join()
                from multiprocessing import forkserver
                forkserver._forkserver._stop()  # the next preload list needs a new server
    """)
    (tmp_path / "fs.py").write_text(script)  # a file: the forkserver imports the child's function from it
    root = os.path.dirname(os.path.dirname(os.path.abspath(in_forkserver.__file__ + "/..")))
    done = subprocess.run([sys.executable, str(tmp_path / "fs.py")], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=root))
    assert done.stdout.split("\n")[:2] == ["[] False", "['course.runtime.in_forkserver'] True"], done.stderr
    from course.runtime.launcher import FORKSERVER_PRELOAD

    assert FORKSERVER_PRELOAD[0] == "course.runtime.in_forkserver"  # before anything that could take long
