"""Record every collective a process group runs, including the ones DDP issues from C++.

    >>> from course.observe import tracing                # registers the backend "traced"
    >>> def job(rank, world_size):
    ...     ddp = DDP(model)                       # any code: DDP, dist.all_reduce, ...
    ...     ...
    ...     print(tracing.format_trace(tracing.events()))
    >>> course.launch(job, 2, backend="traced")

Why a backend? DDP's reducer is C++: it calls the process group directly, so
patching ``torch.distributed.all_reduce`` in Python never sees its all-reduces.
Every collective, from Python or C++, ends in the process group's *backend*, the
object that moves the bytes (gloo on CPU). ``torch.distributed`` lets anyone plug a
backend in (``dist.Backend.register_backend``), so the ``"traced"`` backend is gloo
with a recorder in front: each call is written down (op, shapes, dtype, bytes, root,
when it was issued and when gloo finished it) and handed to a real gloo backend
unchanged. DDP runs exactly as on ``"gloo"``; only the name differs.

This is the layer where the classic experiment patched PyTorch's MPI backend in C++
to print each collective; here it takes one Python class and no rebuild. (Cost: a
Python call per collective, roughly 0.1 ms; see benchmarks/tracer_overhead.py.)

Older torch: a ``Backend`` can be written in Python only from torch 2.14 on (before,
its constructor is not exposed: "TracingBackend: No constructor defined!"). There the
class derives from ``dist.ProcessGroup`` instead, whose constructor every torch 2.x
exposes: ``init_process_group`` then uses the object as the whole process group, and
DDP's C++ reducer calls its Python methods just the same. (torch 2.14+ needs the
``Backend`` form: its Python API calls ops such as ``all_gather_single`` that only
reach a backend.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend

BACKEND = "traced"
SMALL = 64  # keep the values of tensors with at most this many elements

# Backend method -> (name in the trace, which argument holds this rank's data).
# These are the methods c10d calls on a backend written in Python (gloo's have the
# same names): dist.all_gather_into_tensor arrives as "all_gather_single", etc.
_OPS = {
    "allreduce": ("all_reduce", 0),
    "allreduce_coalesced": ("all_reduce_coalesced", 0),
    "broadcast": ("broadcast", 0),
    "reduce": ("reduce", 0),
    "allgather": ("all_gather", 1),
    "allgather_coalesced": ("all_gather_coalesced", 1),
    "all_gather_single": ("all_gather_into_tensor", 1),
    "_allgather_base": ("all_gather_into_tensor", 1),
    "allgather_into_tensor_coalesced": ("all_gather_into_tensor_coalesced", 1),
    "reduce_scatter": ("reduce_scatter", 1),
    "reduce_scatter_single": ("reduce_scatter_tensor", 1),
    "_reduce_scatter_base": ("reduce_scatter_tensor", 1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor_coalesced", 1),
    "gather": ("gather", 1),
    "scatter": ("scatter", 0),  # what each rank receives (only the root has inputs)
    "alltoall": ("all_to_all", 1),
    "alltoall_base": ("all_to_all_single", 1),
    "all_to_all_single": ("all_to_all_single", 1),
    "barrier": ("barrier", None),
    "monitored_barrier": ("monitored_barrier", None),
    "send": ("send", 0),
    "recv": ("recv", 0),
    "recv_anysource": ("recv", 0),
}
# Where each op's result lands (for ``values``): in place, or in the outputs (argument 0).
_RESULT_IN_OUTPUT = {"all_gather", "all_gather_coalesced", "all_gather_into_tensor", "gather"}


@dataclass
class Collective:
    """One collective, as this rank issued it."""

    seq: int  # 0, 1, 2, ... in the order this rank issued them (since the group was created)
    op: str  # "all_reduce", "broadcast", "all_gather", ...
    shapes: list  # shape of each tensor this rank passed in
    dtypes: list  # dtype of each of them, e.g. "float32"
    bytes: int  # their total size: what this rank hands to the collective
    root: int | None  # source rank of a broadcast (destination of reduce/gather), peer of send/recv
    start: float  # time.perf_counter() when it was issued
    end: float | None = None  # when gloo reported it finished (None: not yet, or gloo cannot say)
    values: list | None = None  # contents after it finished, for tensors of <= SMALL elements

    @property
    def seconds(self):
        return None if self.end is None else self.end - self.start


@dataclass
class Mark:
    """A label you put into the trace with :func:`mark` (e.g. "step 1: forward")."""

    label: str


def _python_subclass_constructible(base) -> bool:
    """Can a Python class derived from this c10d class be constructed on this torch?"""
    try:
        type("_Probe", (base,), {})(0, 1)
    except TypeError:  # "No constructor defined!"
        return False
    return True


# torch >= 2.14: a Backend written in Python; older: a whole ProcessGroup (see above).
_BASE = _C10dBackend if _python_subclass_constructible(_C10dBackend) else dist.ProcessGroup


class TracingBackend(_BASE):
    """A gloo backend with a recorder in front. ``events`` lists what it ran."""

    def __init__(self, store, rank, world_size, timeout):
        super().__init__(rank, world_size)
        self.gloo = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        self.events = []
        self.issued = 0  # collectives so far (events also holds marks)
        self.untimed = set()  # seq of ops whose gloo work cannot report its end (send, recv, ...)

    def getBackendName(self):
        return BACKEND

    # torch's C++ side asks a backend written in Python for these properties by looking
    # them up on the object (c10d::PyBackend). Left undefined, the lookup finds the base
    # class's property, which asks C++ again: a recursion that only Python's C recursion
    # limit stops (1,500 levels on Python 3.12, an error torch then works around); on
    # Python 3.13.0 the limit is 10,000 and the C stack overflows first: the rank dies with
    # SIGSEGV in init_process_group or its first collective. Defined here, each is one call:
    # gloo's options, and none of the optional capabilities (a plain backend's answer).
    if _BASE is _C10dBackend:
        options = property(lambda self: self.gloo.options)
        supports_splitting = supports_coalescing = supports_reconfigure = supports_shrinking = supports_window = \
            _supports_time_estimate = property(lambda self: False)

    def _record(self, method, args, kwargs):
        op, data = _OPS[method]
        tensors = [] if data is None or len(args) <= data else _flat(args[data])
        root = next((a.rootRank for a in (*args, *kwargs.values()) if hasattr(a, "rootRank")), None)
        if op in ("send", "recv") and len(args) > 1 and isinstance(args[1], int):
            root = args[1]  # the peer
        event = Collective(
            seq=self.issued,
            op=op,
            shapes=[tuple(t.shape) for t in tensors],
            dtypes=[str(t.dtype).removeprefix("torch.") for t in tensors],
            bytes=sum(t.numel() * t.element_size() for t in tensors),
            root=root,
            start=time.perf_counter(),
        )
        self.events.append(event)
        self.issued += 1
        work = getattr(self.gloo, method)(*args, **kwargs)
        result = _flat(args[0]) if op in _RESULT_IN_OUTPUT else tensors
        if not _when_done(work, event, result):
            self.untimed.add(event.seq)
        return work


def _flat(obj):
    """The tensors in an argument: a tensor, a list of them, or a list of lists."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _flat(item)]
    return []


def _when_done(work, event, result):
    """Note when gloo finishes the work (on gloo's thread) and keep small results.
    Returns False if this kind of work cannot tell when it is done."""

    def done(_future):
        event.end = time.perf_counter()
        if sum(t.numel() for t in result) <= SMALL:
            event.values = [t.tolist() for t in result]

    try:
        work.get_future().add_done_callback(done)
    except RuntimeError:  # "Work::getFuture not implemented" (send, recv, ...): start only
        return False
    return True


# The same op under an older gloo name (torch 2.13's Python API calls all_gather_single,
# its gloo only has _allgather_base): recorded under the same name in the trace.
_OLDER_GLOO_NAMES = {
    "all_gather_single": "_allgather_base",
    "reduce_scatter_single": "_reduce_scatter_base",
    "all_to_all_single": "alltoall_base",
}


def _forwarder(method):
    def call(self, *args, **kwargs):
        if not hasattr(self.gloo, method) and method in _OLDER_GLOO_NAMES:
            return self._record(_OLDER_GLOO_NAMES[method], args, kwargs)
        return self._record(method, args, kwargs)

    call.__name__ = method
    call.__doc__ = f"Record, then run gloo's ``{method}``."
    return call


for _method in _OPS:
    setattr(TracingBackend, _method, _forwarder(_method))


def register():
    """Make ``"traced"`` a backend name ``init_process_group`` (and ``course.launch``)
    accept. Importing this module already did it; calling it again does nothing."""
    if getattr(dist.Backend, BACKEND.upper(), None) != BACKEND:
        dist.Backend.register_backend(BACKEND, TracingBackend, devices=["cpu"])


register()


def tracer(group=None) -> TracingBackend:
    """The recorder behind ``group`` (default: the default process group)."""
    if not dist.is_initialized():
        raise RuntimeError("No process group yet: run this inside a rank started with course.launch(..., backend='traced').")
    group = group or dist.group.WORLD
    backend = group if isinstance(group, TracingBackend) else group._get_backend(torch.device("cpu"))
    if not isinstance(backend, TracingBackend):
        raise RuntimeError(
            f"This process group runs on {dist.get_backend(group)!r}, not {BACKEND!r}: "
            f"start the ranks with course.launch(fn, n, backend={BACKEND!r}) to record collectives."
        )
    return backend


def process_groups() -> int:
    """How many process groups this process has created: 1 (the default group) unless some code
    made others (``dist.new_group``, a DeviceMesh, ...). A tracer records only its own group, so
    a collective on another group never shows in :func:`events`; this count shows that one exists."""
    return len(dist.distributed_c10d._world.pg_map)


def events(group=None) -> list:
    """Every :class:`Collective` (and :class:`Mark`) this rank recorded, oldest first."""
    return list(tracer(group).events)


def collectives(group=None) -> list:
    """Only the :class:`Collective` entries (no marks)."""
    return [e for e in events(group) if isinstance(e, Collective)]


def mark(label: str, group=None):
    """Write ``label`` into the trace, to see where collectives happen."""
    tracer(group).events.append(Mark(label))


def clear(group=None):
    """Forget what was recorded so far."""
    tracer(group).events.clear()


def wait_all(group=None, timeout: float = 10.0):
    """Wait until gloo has reported every recorded collective as finished (those
    it can report: send, recv and a few others have no completion to listen to)."""
    backend = tracer(group)
    deadline = time.monotonic() + timeout
    while any(isinstance(e, Collective) and e.end is None and e.seq not in backend.untimed for e in backend.events):
        if time.monotonic() > deadline:
            raise TimeoutError("some recorded collectives never finished")
        time.sleep(0.001)


def describe(event, values: bool = False) -> str:
    """One line for an event; no times, so that it is the same on every run."""
    if isinstance(event, Mark):
        return f"-- {event.label}"
    tensors = ", ".join(f"{d}[{','.join(map(str, s))}]" for s, d in zip(event.shapes, event.dtypes))
    line = f"{event.op:<11} {tensors:<22} {event.bytes:>9,} B"
    if event.root is not None:
        line += f"  {'peer' if event.op in ('send', 'recv') else 'root'} {event.root}"
    if values and event.values:
        line += f"  = {event.values[0] if len(event.values) == 1 else event.values}"
    return line.rstrip()


def format_trace(events, values: bool = False) -> str:
    """The events as text, one per line (see :func:`describe`)."""
    return "\n".join(describe(e, values) for e in events)
