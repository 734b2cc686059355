"""Notebook 10's checks reject plausible wrong answers with a useful hint."""

import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed import all_reduce  # as a notebook may import it: the check must see it too

from course.parallel import collectives
from course.checks import nb10
from course.parallel.data_parallel import OverlapPerParameter, replicate, trainable

# The judges' own reasons, with wrong answers built on the course's finished code: course.classroom.guard off
# (it would refuse them first; tests/test_guard.py tries it).
pytestmark = pytest.mark.usefixtures("judges_only")


@pytest.mark.parametrize(
    "naive, ring, hint",
    [
        (1_000_000, 1_500_000, "to *each* of the other 3 ranks"),
        (6_000_000, 1_500_000, "count only what rank 0 sends"),
        (3_000_000, 750_000, "only the reduce-scatter"),
        (3_000_000, 6_000_000, "never sends the whole tensor"),
        (3_000_000, 2_000_000, "Each phase takes N - 1 steps"),
        (3_000_000, 1_000_000, "2(N - 1) steps"),
        ("3 MB", 1_500_000, "two numbers"),
    ],
)
def test_predicted_bytes_rejects_wrong_answers(naive, ring, hint):
    feedback = nb10.predicted_bytes(naive, ring)
    assert feedback.status == "wrong" and hint in feedback.message, feedback
    if naive == 3_000_000:  # the feedback says which of the two numbers is right
        assert "first number (naive, rank 0) is right" in feedback.message, feedback
    elif ring == 1_500_000 and isinstance(naive, int):
        assert "second (ring, every rank) is right" in feedback.message, feedback


def test_predicted_bytes_addresses_both_numbers_when_both_are_wrong():
    feedback = nb10.predicted_bytes(1_000_000, 750_000)
    assert feedback.status == "wrong"
    assert "to *each* of the other 3 ranks" in feedback.message and "only the reduce-scatter" in feedback.message


# ------------------------------------------------------------------ plausible wrong ring all-reduces


def _split(tensor):
    return torch.tensor_split(tensor, dist.get_world_size())


def _reduce_scatter_only(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    parts = _split(tensor)
    for step in range(n - 1):
        received = torch.empty_like(parts[(rank - 2 - step) % n])
        req = dist.isend(parts[(rank - 1 - step) % n], (rank + 1) % n)
        dist.recv(received, (rank - 1) % n)
        req.wait()
        parts[(rank - 2 - step) % n].add_(received)


def _ring(tensor, add_index=lambda rank, step, n: (rank - 2 - step) % n):
    rank, n = dist.get_rank(), dist.get_world_size()
    parts = _split(tensor)
    for step in range(n - 1):
        send_i, recv_i = (rank - 1 - step) % n, add_index(rank, step, n)
        received = torch.empty_like(parts[(rank - 2 - step) % n])
        req = dist.isend(parts[send_i], (rank + 1) % n)
        dist.recv(received, (rank - 1) % n)
        req.wait()
        parts[recv_i][: len(received)].add_(received[: len(parts[recv_i])])
    for step in range(n - 1):
        req = dist.isend(parts[(rank - step) % n], (rank + 1) % n)
        dist.recv(parts[(rank - 1 - step) % n], (rank - 1) % n)
        req.wait()


def _wrong_chunk(tensor):
    _ring(tensor, add_index=lambda rank, step, n: (rank - 1 - step) % n)  # adds into the chunk it just sent


def _averages(tensor):
    _ring(tensor)
    tensor /= dist.get_world_size()


def _out_of_place(tensor):
    result = tensor.clone()
    _ring(result)
    return result


def _naive(tensor):
    collectives.naive_all_reduce(tensor)


def _uses_all_reduce(tensor):
    dist.all_reduce(tensor)


def _chunk_instead_of_tensor_split(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    parts = tensor.chunk(n)
    for step in range(n - 1):
        received = torch.empty_like(parts[(rank - 2 - step) % n])
        req = dist.isend(parts[(rank - 1 - step) % n], (rank + 1) % n)
        dist.recv(received, (rank - 1) % n)
        req.wait()
        parts[(rank - 2 - step) % n].add_(received)
    for step in range(n - 1):
        req = dist.isend(parts[(rank - step) % n], (rank + 1) % n)
        dist.recv(parts[(rank - 1 - step) % n], (rank - 1) % n)
        req.wait()


def _assigns_into_the_tuple(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    parts = _split(tensor)
    for step in range(n - 1):
        received = torch.empty_like(parts[(rank - 2 - step) % n])
        req = dist.isend(parts[(rank - 1 - step) % n], (rank + 1) % n)
        dist.recv(received, (rank - 1) % n)
        req.wait()
        parts[(rank - 2 - step) % n] += received  # TypeError: tensor_split returns a tuple


def _direct_exchange(tensor):
    """A ring's bytes, but every rank talks to every other: chunk j goes straight to rank j, summed there,
    then rank j sends the sum of chunk j straight to everyone."""
    rank, n = dist.get_rank(), dist.get_world_size()
    parts = _split(tensor)
    others = [r for r in range(n) if r != rank]
    sends = [dist.isend(parts[r], r) for r in others]
    for r in others:
        received = torch.empty_like(parts[rank])
        dist.recv(received, r)
        parts[rank].add_(received)
    for req in sends:
        req.wait()
    sends = [dist.isend(parts[rank], r) for r in others]
    for r in others:
        dist.recv(parts[r], r)
    for req in sends:
        req.wait()


def _blocking_sends(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(tensor)
    dist.send(tensor, (rank + 1) % n)  # everyone sends first: nobody receives
    dist.recv(received, (rank - 1) % n)


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_reduce_scatter_only, "that is the reduce-scatter"),
        (_wrong_chunk, "some sums are wrong"),
        (_averages, "those are averages"),
        (_out_of_place, "work in place"),
        (_naive, "rank 0 sent 8,008 bytes for a 4,004-byte tensor"),
        (_uses_all_reduce, "send and recv only; your function also called all_reduce"),
        (_chunk_instead_of_tensor_split, "torch.tensor_split always returns N"),
        (_assigns_into_the_tuple, "change a chunk in place"),
        (_blocking_sends, "waited forever in a send"),
        (_direct_exchange, "In a ring a rank sends only to its right neighbour"),
        (42, "write a function"),
    ],
)
def test_ring_all_reduce_rejects_wrong_answers(answer, hint):
    feedback = nb10.ring_all_reduce(answer)  # a hang is reported after nb10.RING_HANG_BOUND_S
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_ring_all_reduce_accepts_the_packages_ring():
    assert nb10.ring_all_reduce(collectives.ring_all_reduce).status == "correct"


# ------------------------------------------------------------------ plausible wrong overlapped DPs


class _AfterBackward:
    def __init__(self, model):
        replicate(model)
        self.model = model

    def finish(self):
        for p in trainable(self.model):
            p.grad /= dist.get_world_size()
            dist.all_reduce(p.grad)


class _Blocking:
    def __init__(self, model):
        replicate(model)
        for p in trainable(model):
            p.register_post_accumulate_grad_hook(self.grad_ready)

    def grad_ready(self, p):
        p.grad /= dist.get_world_size()
        dist.all_reduce(p.grad)

    def finish(self):
        pass


class _WaitsInTheHook(_Blocking):
    def grad_ready(self, p):
        p.grad /= dist.get_world_size()
        dist.all_reduce(p.grad, async_op=True).wait()  # async in name only: backward waits here


class _WaitsForTheFutureInTheHook(_Blocking):
    def grad_ready(self, p):
        p.grad /= dist.get_world_size()
        dist.all_reduce(p.grad, async_op=True).get_future().wait()  # the same, through the future


class _NoWait:
    start = staticmethod(replicate)  # how the ranks come to hold rank 0's model

    def __init__(self, model):
        self.start(model)
        self.pending = []
        for p in trainable(model):
            p.register_post_accumulate_grad_hook(self.grad_ready)

    def grad_ready(self, p):
        p.grad /= dist.get_world_size()
        self.pending.append(dist.all_reduce(p.grad, async_op=True))

    def finish(self):
        self.pending.clear()


class _NoAverage(_NoWait):
    def grad_ready(self, p):
        self.pending.append(dist.all_reduce(p.grad, async_op=True))

    def finish(self):
        for work in self.pending:
            work.wait()
        self.pending.clear()


class _HookTwice(_NoAverage):
    def __init__(self, model):
        super().__init__(model)
        for p in trainable(model):
            p.register_post_accumulate_grad_hook(self.grad_ready)


class _OnlyWeights(_NoAverage):
    def __init__(self, model):
        replicate(model)
        self.pending = []
        for name, p in model.named_parameters():
            if name.endswith("weight"):
                p.register_post_accumulate_grad_hook(self.grad_ready)

    def grad_ready(self, p):
        p.grad /= dist.get_world_size()
        self.pending.append(dist.all_reduce(p.grad, async_op=True))


class _AllAtTheLastGradient(_NoAverage):
    """Async all-reduces started from a hook, during backward, but only once every gradient is ready."""

    def __init__(self, model):
        super().__init__(model)
        self.params, self.ready = trainable(model), []

    def grad_ready(self, p):
        self.ready.append(p)
        if len(self.ready) == len(self.params):
            for q in self.ready:
                q.grad /= dist.get_world_size()
                self.pending.append(dist.all_reduce(q.grad, async_op=True))
            self.ready = []


class _HooksEveryParameter(_NoAverage):
    def __init__(self, model):
        replicate(model)
        self.pending = []
        for p in model.parameters():  # the frozen one too
            p.register_post_accumulate_grad_hook(self.grad_ready)


class _NoReplicate(OverlapPerParameter):
    def __init__(self, model):
        self.pending = []
        for p in trainable(model):
            p.register_post_accumulate_grad_hook(self.grad_ready)


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_AfterBackward, "started after backward had returned"),
        (_Blocking, "pass async_op=True"),
        (_WaitsInTheHook, "during backward (in the hook)"),
        (_WaitsForTheFutureInTheHook, "during backward (in the hook)"),
        (_AllAtTheLastGradient, "started only after later gradients were ready"),
        (_HooksEveryParameter, "a frozen parameter (requires_grad=False)"),
        (_NoReplicate, "begin __init__ with replicate(model)"),
        (_NoWait, "must wait() for every all-reduce"),
        (_NoAverage, "divide each gradient by the world size"),
        (_HookTwice, "register the hook once per parameter"),
        (_OnlyWeights, "one all-reduce per trainable parameter per step"),
        ("OverlapPerParameter", "write a class"),
    ],
)
def test_overlap_per_parameter_rejects_wrong_answers(answer, hint):
    feedback = nb10.overlap_per_parameter(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


class _WaitsForTheFuturesInFinish(_NoWait):
    def grad_ready(self, p):
        p.grad /= dist.get_world_size()
        self.pending.append(dist.all_reduce(p.grad, async_op=True).get_future())

    def finish(self):
        torch.futures.wait_all(self.pending)
        self.pending.clear()


class _FutureOfTheWorkInFinish(_NoWait):
    def finish(self):
        for work in self.pending:
            work.get_future().wait()
        self.pending.clear()


@pytest.mark.parametrize("answer", [OverlapPerParameter, _WaitsForTheFuturesInFinish, _FutureOfTheWorkInFinish])
def test_overlap_per_parameter_accepts_right_answers(answer):
    assert nb10.overlap_per_parameter(answer).status == "correct"


class _Stub:
    def __init__(self, model):
        replicate(model)
        ...

    def finish(self):
        ...


def test_overlap_per_parameter_says_not_attempted_for_the_stub():
    assert nb10.overlap_per_parameter(_Stub).status == "todo"


class _ImportedAllReduce(_NoAverage):  # its finish() waits for every handle
    def grad_ready(self, p):
        p.grad /= dist.get_world_size()
        self.pending.append(all_reduce(p.grad, async_op=True))


class _ImportedBlocking(_Blocking):
    def grad_ready(self, p):
        p.grad /= dist.get_world_size()
        all_reduce(p.grad)


def test_overlap_per_parameter_watches_an_all_reduce_imported_by_name():
    assert nb10.overlap_per_parameter(_ImportedAllReduce).status == "correct"
    feedback = nb10.overlap_per_parameter(_ImportedBlocking)
    assert feedback.status == "wrong" and "pass async_op=True" in feedback.message, feedback


# ------------------------------------------------------------------ the built-in, on another process group


def _all_reduce_on_a_new_group(tensor):
    dist.all_reduce(tensor, group=dist.new_group())  # the "traced" backend: its own recorder, not WORLD's


def _all_reduce_on_a_gloo_group(tensor):
    dist.all_reduce(tensor, group=dist.new_group(backend="gloo"))  # no recorder at all


@pytest.mark.parametrize("answer", [_all_reduce_on_a_new_group, _all_reduce_on_a_gloo_group])
def test_ring_all_reduce_rejects_the_built_in_on_another_group(answer):
    feedback = nb10.ring_all_reduce(answer)
    assert feedback.status == "wrong" and "another process group (dist.new_group)" in feedback.message, feedback


def _ring_on_a_subgroup(tensor):
    """A correct ring, but on a group of its own: the spec asks for the default group."""
    group = dist.new_group()
    n, rank = dist.get_world_size(), dist.get_rank()
    chunks = torch.tensor_split(tensor, n)
    for step in range(2 * (n - 1)):
        send, receive = (rank - step) % n, (rank - step - 1) % n
        request = dist.isend(chunks[send].clone(), (rank + 1) % n, group=group)
        received = torch.empty_like(chunks[receive])
        dist.recv(received, (rank - 1) % n, group=group)
        request.wait()
        chunks[receive].add_(received) if step < n - 1 else chunks[receive].copy_(received)


_CACHED = {}


def _ring_of_zeros_and_a_cached_group(tensor):
    """Ring-shaped sends of zeros on the default group; the real sum by an all-reduce on a cached group."""
    if "group" not in _CACHED:
        _CACHED["group"] = dist.new_group()
    n, rank = dist.get_world_size(), dist.get_rank()
    zeros = torch.tensor_split(torch.zeros_like(tensor), n)
    for step in range(2 * (n - 1)):
        request = dist.isend(zeros[(rank - step) % n].clone(), (rank + 1) % n)
        dist.recv(torch.empty_like(zeros[(rank - step - 1) % n]), (rank - 1) % n)
        request.wait()
    dist.all_reduce(tensor, group=_CACHED["group"])


@pytest.mark.parametrize("answer", [_ring_on_a_subgroup, _ring_of_zeros_and_a_cached_group])
def test_ring_all_reduce_rejects_another_group_without_course_wire(monkeypatch, answer):
    monkeypatch.setattr(nb10.wire, "available", lambda: False)  # as where the sockets cannot be read
    feedback = nb10.ring_all_reduce(answer)
    assert feedback.status == "wrong" and "created another process group" in feedback.message, feedback
    assert nb10.ring_all_reduce(collectives.ring_all_reduce).status == "correct"


# ------------------------------------------------------------------ Exercise 3: waits in disguise, buffers


class _PollsInTheHook(_NoAverage):
    def grad_ready(self, p):
        p.grad /= dist.get_world_size()
        work = dist.all_reduce(p.grad, async_op=True)
        while not work.is_completed():  # a wait by another name
            time.sleep(0.001)
        self.pending.append(work)


def _broadcast_parameters(model):
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, src=0)


def _broadcast_parameters_and_buffers_once(model):  # not again before each forward, as DDP does
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)


class _BroadcastsOnlyTheParameters(_NoAverage):
    start = staticmethod(_broadcast_parameters)
    grad_ready = _NoWait.grad_ready  # averages


class _BuffersOnlyAtTheStart(_BroadcastsOnlyTheParameters):
    start = staticmethod(_broadcast_parameters_and_buffers_once)


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_PollsInTheHook, "you poll is_completed() during backward"),
        (_BroadcastsOnlyTheParameters, "different weights or buffers"),
        (_BuffersOnlyAtTheStart, "weights or buffers differ from DDP's"),
    ],
)
def test_overlap_per_parameter_rejects_hidden_waits_and_unsynchronised_buffers(answer, hint):
    feedback = nb10.overlap_per_parameter(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_a_slow_backward_is_no_wait_but_a_pending_future_is(monkeypatch):
    monkeypatch.setattr(nb10, "FUTURE_WAIT_BOUND_S", 0.0005)  # every backward outlasts the bound
    assert nb10.overlap_per_parameter(OverlapPerParameter).status == "correct"
    feedback = nb10.overlap_per_parameter(_WaitsForTheFutureInTheHook)
    assert feedback.status == "wrong" and "during backward (in the hook)" in feedback.message, feedback
