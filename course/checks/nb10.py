"""Checks for notebook 10 (data parallelism from scratch: collectives by hand, then your own DDP)."""

import contextlib
import functools
import threading
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course.observe import tracing, wire
from course.parallel import collectives
from course.parallel.data_parallel import trainable
from course.classroom.exercises import correct, exercise, is_stub, replaced, todo, wrong
from course.runtime.launcher import WorkerError, WorkerTimeoutError, launch

PREDICT_RANKS = 4
PREDICT_NUMEL = 250_000  # float32: 1,000,000 bytes


def _bytes_of_both(rank, world_size, numel):
    sent = []
    for all_reduce in (collectives.naive_all_reduce, collectives.ring_all_reduce):
        collectives.reset_counts()
        all_reduce(torch.ones(numel))
        sent.append(collectives.bytes_sent())
    return sent


@functools.cache
def _counted_bytes():
    """(rank 0's bytes in the naive all-reduce, every rank's in the ring), counted on PREDICT_RANKS ranks once per
    kernel: the answer does not change them."""
    measured = launch(_bytes_of_both, PREDICT_RANKS, PREDICT_NUMEL, show=None, timeout=60)
    naive, ring = measured[0][0], measured[0][1]
    assert all(r[1] == ring for r in measured)
    return naive, ring


@exercise(
    "Exercise 1 (predict the bytes)",
    hint="naive: rank 0 sends the whole tensor to each of the other ranks. Ring: 2(N-1) steps, and at each step every rank sends one chunk, 1/N of the tensor.",
)
def predicted_bytes(naive_rank0, ring_per_rank):
    """Exercise 1: bytes rank 0 sends in the naive all-reduce, and each rank in the ring, for 1 MB on 4 ranks."""
    if not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in (naive_rank0, ring_per_rank)):
        return wrong("answer with two numbers of bytes, e.g. 1_000_000.")
    naive, ring = _counted_bytes()
    size = 4 * PREDICT_NUMEL
    if naive_rank0 == naive and ring_per_rank == ring:
        return correct(
            f"counted: rank 0 sends {naive:,} bytes in the naive version, every rank {ring:,} in the ring, "
            f"2(N-1)/N = {ring / size} times the tensor."
        )
    # Say something about each of the two numbers: a student who got one right must know which.
    return wrong(f"your first number (naive, rank 0) {_naive_hint(naive_rank0, naive, size)}; "
                 f"your second (ring, every rank) {_ring_hint(ring_per_rank, ring, size)}")


def _naive_hint(answer, naive, size):
    if answer == naive:
        return "is right"
    if answer == size:
        return "is not: rank 0 sends the sum back to *each* of the other 3 ranks, not once"
    if answer == 2 * naive:
        return "is not: count only what rank 0 sends; what it receives is what the others send"
    return "is not: in the naive version rank 0 receives the tensor from every other rank and sends the sum back to each of them"


def _ring_hint(answer, ring, size):
    if answer == ring:
        return "is right."
    if answer == ring / 2:
        return "is not: that is only the reduce-scatter; the finished chunks still have to go around once more (all-gather)."
    if answer == 2 * (PREDICT_RANKS - 1) * size:
        return "is not: in the ring a rank never sends the whole tensor; each step it sends one chunk, a quarter of it."
    if answer == 2 * size:
        return "is close: count the steps. Each phase takes N - 1 steps, not N."
    return "is not: the ring has 2(N - 1) steps, and at each step every rank sends one chunk, 1/N of the tensor."


# ------------------------------------------------------------------ Exercise 2: the ring all-reduce

RING_RANKS = (2, 3)
RING_SIZES = (1001, 7, 2, 1)  # large, uneven, shorter than the world size (the large one is judged first)
# How long Exercise 2's ranks may run before the check calls the answer hung (blocking sends, the
# usual mistake, hang forever). A correct answer takes milliseconds; what the bound must cover is
# the launch around it: joining the process group and the 4 tensors (the launch's timeout counts from
# when every rank has started, so a spawned rank's torch import does not count). Measured on the
# 2-core reference machine: about 0.3 s of CPU, 0.9-2.2 s of wall time (10 launches, fork included)
# while 8-10 other processes kept both cores busy. 5 s is more than twice that worst case and tells
# a student with a hang after 5 s, not a minute.
RING_HANG_BOUND_S = 5


def _values(rank, n):
    # Integer values: any order of additions gives exactly the same float32 sum.
    g = torch.Generator().manual_seed(10 * n + rank)
    return torch.randint(-100, 100, (n,), generator=g).float()


def _run_ring(rank, world_size, fn):
    out = []
    groups = tracing.process_groups()  # the default group: the tracer sees nothing on any other
    for n in RING_SIZES:
        x = _values(rank, n)
        original = x.clone()
        dist.barrier()  # the other ranks' earlier messages are not counted as this call's
        tracing.clear()
        with wire.measure() if wire.available() else _unmeasured() as on_wire:
            returned = fn(x)
        ops = [e.op for e in tracing.collectives()]
        sent = sum(e.bytes for e in tracing.collectives() if e.op == "send")
        sent_to = sorted({e.root for e in tracing.collectives() if e.op == "send"})
        returned = returned.detach().clone() if isinstance(returned, torch.Tensor) else None
        out.append({"n": n, "in": original, "after": x.clone(), "returned": returned, "ops": ops, "sent": sent,
                    "sent_to": sent_to, "messages": ops.count("send"), "wire": on_wire.sent,
                    "new_groups": tracing.process_groups() - groups})
    return out


class _Unmeasured:
    sent = None  # where course.observe.wire cannot read the sockets (not Linux)


def _unmeasured():
    return contextlib.nullcontext(_Unmeasured())


# What gloo adds to each message it sends, at most (measured: ~140 B per message, torch 2.15, Linux), and
# to the call as a whole (a delayed acknowledgement, the barrier's last bytes).
WIRE_PER_MESSAGE, WIRE_SLACK = 256, 1024


def _hidden_traffic(row):
    """Bytes this rank put on the wire that its traced sends on the default group do not explain
    (a collective or a send on another process group), or 0."""
    if row["wire"] is None:
        return 0
    extra = row["wire"] - row["sent"] - WIRE_PER_MESSAGE * row["messages"] - WIRE_SLACK
    return max(extra, 0)


def _expected(world_size, n):
    return sum(_values(rank, n) for rank in range(world_size))


@exercise(
    "Exercise 2 (ring all-reduce)",
    hint="cut the tensor with torch.tensor_split(tensor, N) (views, so adding into them changes the tensor); reduce-scatter for N - 1 steps (isend one chunk right, recv one from the left, add it into your copy of that chunk), then all-gather for N - 1 steps (pass the finished chunks on, copying instead of adding).",
    finished=("course.parallel.collectives.ring_all_reduce", "course.parallel.collectives.ring_reduce_scatter", "course.parallel.collectives.ring_all_gather"),
)
def ring_all_reduce(fn, timeout=None):
    """Exercise 2: sum a tensor over all ranks, in place, with a ring of sends and receives."""
    if not callable(fn):
        return wrong("write a function `ring_all_reduce(tensor)`.")
    timeout = timeout or RING_HANG_BOUND_S
    for world_size in RING_RANKS:
        try:
            results = launch(_run_ring, world_size, fn, backend="traced", show=None, timeout=timeout)
        except WorkerError as e:
            if not isinstance(e, WorkerTimeoutError):
                failure = e.failed.get(e.rank, str(e))
                if "IndexError" in failure:
                    return wrong(
                        f"a rank failed with N = {world_size}: {failure}. Did you cut the tensor with tensor.chunk? It can "
                        "return fewer than N chunks (torch.arange(1).chunk(2) has one); torch.tensor_split always returns N."
                    )
                if "'tuple' object does not support item assignment" in failure:
                    return wrong(
                        f"a rank failed: {failure}. torch.tensor_split returns a tuple of views: change a chunk in place "
                        "(chunk.add_(received), chunk.copy_(...)) instead of assigning to chunks[i]."
                    )
                raise
            if any("send" in stack for stack in e.stacks.values()):
                return wrong(
                    f"with {world_size} ranks every rank waited forever in a send: gloo's send returns only once the "
                    "receiver has posted its recv, so if everyone sends first, nobody receives. Start the send with "
                    "dist.isend (or the counting isend of course.parallel.collectives), then recv, then wait() for the send."
                )
            return wrong(f"with {world_size} ranks some ranks waited forever: every send needs a matching recv of the same size on the neighbour.")
        for rows in zip(*results):  # the same size on every rank
            n = rows[0]["n"]
            expected = _expected(world_size, n)
            if any(r["new_groups"] for r in rows):  # found without course.observe.wire too
                return wrong(
                    f"your function created another process group (dist.new_group) (N = {world_size}): the tracer "
                    "sees only the default group, so build the ring from dist.isend/dist.send and dist.recv on the "
                    "default group (no group= argument)."
                )
            others = sorted({op for row in rows for op in row["ops"]} - {"send", "recv"})
            if others:
                return wrong(f"build it from send and recv only; your function also called {', '.join(others)}.")
            hidden = max(_hidden_traffic(r) for r in rows)
            if hidden or (n >= world_size and not all(r["sent"] for r in rows)):
                seen = (f"your ranks put {hidden:,} bytes more on the wire (measured on the sockets with course.observe.wire) "
                        "than their sends on the default process group carry" if hidden else
                        "your ranks sent nothing on the default process group")
                return wrong(
                    f"{seen} (N = {world_size}, {n} elements): build the ring from dist.isend/dist.send and dist.recv "
                    "on the default group (no group= argument), with no other communication."
                )
            where = f"(N = {world_size} ranks, a tensor of {n} elements)"
            if all(torch.equal(r["in"], r["after"]) for r in rows) and all(
                r["returned"] is not None and torch.equal(r["returned"], expected) for r in rows
            ):
                return wrong(f"the sums are right but the tensor you were given is unchanged {where}: like dist.all_reduce, work in place.")
            if all(torch.allclose(r["after"], expected / world_size) for r in rows) and n > 1:
                return wrong(f"those are averages {where}: all_reduce's default is a sum; don't divide.")
            if not all(torch.equal(r["after"], expected) for r in rows):
                right = [(r["after"] == expected).float().mean().item() for r in rows]
                if n >= 100 and all(abs(f - 1 / world_size) < 0.05 for f in right):
                    return wrong(
                        f"each rank has the full sum of just one chunk {where}: that is the reduce-scatter. "
                        "Now pass the finished chunks around the ring once more (all-gather), copying instead of adding."
                    )
                return wrong(
                    f"some sums are wrong {where}. At each step a rank must add what it receives into the same chunk "
                    "its left neighbour sent; write down for N = 3 which chunk each rank sends at each step."
                )
            size = 4 * n
            limit = 4 * 2 * (world_size - 1) * -(-n // world_size)
            for rank, row in enumerate(rows):
                if row["sent"] > limit:
                    return wrong(
                        f"the sums are right, but rank {rank} sent {row['sent']:,} bytes for a {size:,}-byte tensor {where}. "
                        f"In a ring every rank sends only one chunk (1/N of the tensor) per step, 2(N - 1) steps: at most "
                        f"{limit:,} bytes here."
                    )
                right = (rank + 1) % world_size
                others = [peer for peer in row["sent_to"] if peer != right]
                if others:  # the bytes alone cannot tell a ring from a direct exchange
                    return wrong(
                        f"the sums and the bytes are right, but rank {rank} also sent to rank(s) "
                        f"{', '.join(map(str, others))} {where}. In a ring a rank sends only to its right "
                        f"neighbour, (rank + 1) % N (here {right}), and receives only from its left one."
                    )
    return correct("the sums of dist.all_reduce on 2 and 3 ranks, for lengths 1001, 7, 2 and 1, with a ring's bytes "
                   "per rank, each sent to the right neighbour.")


# ------------------------------------------------------------------ Exercise 3: overlap per parameter


def exercise_model(seed=0):
    """What a real model has: a frozen parameter, a weight shared by two layers, and buffers
    (BatchNorm's running statistics, which differ between ranks initialised with different seeds)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    model[0].bias.requires_grad_(False)  # frozen: it gets no gradient
    model[5].weight = model[3].weight  # tied: one tensor, one gradient
    with torch.no_grad():  # as if loaded from a checkpoint: rank 0's must reach every rank
        model[1].running_mean.normal_()
        model[1].running_var.uniform_(0.5, 2)
    return model


# How long a future handed out during backward may stay pending while backward runs before the check
# calls it "waited in backward" (it is completed only once backward has returned, so an answer that
# waits for it inside a hook would wait forever). Backward of this model takes milliseconds.
FUTURE_WAIT_BOUND_S = 3


class _Watched:
    """An all-reduce's Work, which notes whether someone waited for it during backward."""

    def __init__(self, work, log):
        self.work, self.log = work, log
        self.polls = 0

    def is_completed(self):
        # Asked once, it is a harmless question; asked again and again during backward, it is a wait.
        self.polls += self.log["in backward"]
        if self.polls > 1:
            self.log["problem"] = self.log["problem"] or "polled in backward"
        return self.work.is_completed()

    def wait(self, *args, **kwargs):
        self.log["waited"] += 1
        if self.log["in backward"]:  # backward stops here until the all-reduce is done
            self.log["problem"] = self.log["problem"] or "waited in backward"
        return self.work.wait(*args, **kwargs)

    def get_future(self):
        # A future of our own, completed when backward has returned: fut.wait() or fut.value() inside a
        # hook would wait for it (found by the watcher below); fut.then(...) and torch.futures.wait_all work.
        self.log["waited"] += 1
        if not self.log["in backward"]:  # in finish(): the real one
            return self.work.get_future()
        future = torch.futures.Future()
        self.log["futures"].append((self.work, future, time.monotonic()))
        return future

    def __getattr__(self, name):
        return getattr(self.work, name)


def _complete_futures(state):
    """After backward: complete the futures handed out during it with their all-reduces' results."""
    for work, future, _ in state["futures"]:
        if not future.done():
            work.wait()
            future.set_result(work.get_future().value())
    state["futures"].clear()


def _fail_waiting_futures(state, backward_done):
    """While backward runs: a future handed out during it and still pending after the bound is one a
    hook waits for (only backward's return completes it), so fail it. A slow backward is no fault."""
    while not backward_done.wait(min(FUTURE_WAIT_BOUND_S, 0.05)):
        now = time.monotonic()
        for _, future, since in list(state["futures"]):
            if now - since > FUTURE_WAIT_BOUND_S and not future.done():
                state["problem"] = state["problem"] or "waited in backward"
                future.set_exception(RuntimeError("waited for an all-reduce during backward"))


def _run_overlap(rank, world_size, cls, steps=3):
    data = torch.Generator().manual_seed(rank)  # each rank its own data
    batches = [(torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)) for _ in range(steps)]
    state = {"in backward": False, "launched": 0, "waited": 0, "problem": None, "futures": [], "ready": 0,
             "launched in backward": 0, "late": 0}

    def train(model, forward, finish):
        opt = torch.optim.SGD(trainable(model), lr=0.1, momentum=0.9)
        grads = None
        for x, y in batches:
            loss = nn.functional.mse_loss(forward(x), y)
            state["in backward"], state["ready"], state["launched in backward"] = True, 0, 0
            backward_done = threading.Event()
            watcher = threading.Thread(target=_fail_waiting_futures, args=(state, backward_done))
            watcher.start()
            try:
                loss.backward()
            except RuntimeError:
                if state["problem"] != "waited in backward":
                    raise
                return None, None
            finally:
                backward_done.set()
                watcher.join()
                state["in backward"] = False
            _complete_futures(state)
            finish()
            grads = grads or [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
            opt.step()
            opt.zero_grad()
        return grads, [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]

    reference = exercise_model(seed=rank)  # ranks initialised differently: DDP broadcasts rank 0's
    ddp = DDP(reference)
    start = [t.detach().clone() for t in [*reference.parameters(), *reference.buffers()]]
    expected_grads, expected = train(reference, ddp, lambda: None)

    real_all_reduce = dist.all_reduce

    def watched_all_reduce(tensor, *args, async_op=False, **kwargs):
        if not state["in backward"]:
            state["problem"] = state["problem"] or "after backward"
        elif not async_op:
            state["problem"] = state["problem"] or "synchronous"
        elif state["ready"] > state["launched in backward"] + 1:  # more gradients ready than all-reduces started
            state["late"] += 1
        state["launched"] += 1
        state["launched in backward"] += state["in backward"]
        work = real_all_reduce(tensor, *args, async_op=async_op, **kwargs)
        return _Watched(work, state) if async_op else work

    model = exercise_model(seed=rank)
    for p in trainable(model):  # registered before the answer's hooks, so they run first
        p.register_post_accumulate_grad_hook(lambda p: state.__setitem__("ready", state["ready"] + 1))
    with replaced(dist, "all_reduce", watched_all_reduce, cls):
        try:
            dp = cls(model)
        except RuntimeError as e:
            if "does not require grad" in str(e) or "doesn't require gradient" in str(e):
                return {"problem": "frozen"}
            raise
        same_start = all(torch.equal(p, q) for p, q in zip([*model.parameters(), *model.buffers()], start))
        grads, weights = train(model, model, dp.finish)
    return {"grads": grads, "expected_grads": expected_grads, "weights": weights, "expected": expected,
            "problem": state["problem"], "launched": state["launched"], "waited": state["waited"],
            "per_step": len(trainable(model)) * steps, "late": state["late"], "same_start": same_start}


def _untouched(cls):
    """The student notebook's stub: finish() is ``...`` and __init__ only calls replicate(model)."""
    init = getattr(cls, "__init__", None)
    init_stub = is_stub(init) or getattr(getattr(init, "__code__", None), "co_names", None) == ("replicate",)
    return init_stub and is_stub(getattr(cls, "finish", None))


@exercise(
    "Exercise 3 (overlap per parameter)",
    hint="in __init__, after replicate(model), p.register_post_accumulate_grad_hook(self.grad_ready) for every p in trainable(model); in the hook, divide p.grad by the world size and keep the handle of dist.all_reduce(p.grad, async_op=True); in finish(), wait() for each handle and forget them.",
    finished=("course.parallel.data_parallel.OverlapPerParameter",),
)
def overlap_per_parameter(cls):
    """Exercise 3: a DP that starts one async all-reduce per gradient from a hook, and waits in finish()."""
    if not isinstance(cls, type):
        return wrong("write a class `OverlapPerParameter` with __init__(self, model) and finish(self).")
    if _untouched(cls):
        return todo()
    results = launch(_run_overlap, 2, cls, show=None, timeout=60)
    result = dict(next((r for r in results if r["problem"]), results[0]))
    if result["problem"] is None:
        result["late"] = sum(r["late"] for r in results)
        result["same_start"] = all(r["same_start"] for r in results)
    if result["problem"] == "frozen":
        return wrong("a frozen parameter (requires_grad=False) gets no gradient, and registering a hook on it fails: "
                     "hook only the parameters that train (trainable(model)).")
    if result["launched"] == 0:
        return wrong("no dist.all_reduce was called: start one for each gradient, from a hook registered on each parameter.")
    if result["problem"] == "after backward":
        return wrong("the all-reduces started after backward had returned: start them from a hook "
                     "(p.register_post_accumulate_grad_hook), while backward is still running.")
    if result["problem"] == "synchronous":
        return wrong("pass async_op=True: a blocking all_reduce inside the hook stops backward until it is done, so nothing overlaps.")
    if result["problem"] == "polled in backward":
        return wrong("you poll is_completed() during backward until the all-reduce is done: backward stops there "
                     "just as in wait(), so nothing overlaps. Keep the handles and wait for them in finish().")
    if result["problem"] == "waited in backward":
        return wrong("you wait() for an all-reduce during backward (in the hook): backward stops there until it is "
                     "done, so nothing overlaps. Keep the handles and wait for them in finish().")
    if result["launched"] != result["per_step"]:
        return wrong(f"expected one all-reduce per trainable parameter per step ({result['per_step']} in 3 steps), "
                     f"got {result['launched']}: register the hook once per parameter (a tied weight is one "
                     "parameter: model.parameters() lists it once).")
    if result["late"]:
        return wrong("your all-reduces started during backward, but not as each gradient became ready: "
                     f"{result['late']} of them started only after later gradients were ready (all at the last "
                     "gradient?). Start each one from its own parameter's hook, so that it travels while autograd "
                     "computes the earlier layers.")
    if not result["same_start"]:
        return wrong("the ranks start from different weights or buffers (the check initialises each rank differently): "
                     "begin __init__ with replicate(model), which broadcasts rank 0's parameters and buffers (BatchNorm's "
                     "running statistics too), as DDP does.")
    if result["waited"] < result["launched"]:
        return wrong("finish() must wait() for every all-reduce before the optimizer uses the gradients; "
                     "a gradient still being all-reduced may be half-summed.")
    pairs = list(zip(result["grads"], result["expected_grads"]))
    if any((a is None) != (b is None) for a, b in pairs):
        return wrong("after finish() the parameters that have a gradient differ from DDP's: a frozen parameter has "
                     "none, every other parameter has one.")
    got = torch.cat([a.flatten() for a, b in pairs if a is not None])
    expected = torch.cat([b.flatten() for a, b in pairs if b is not None])
    if torch.allclose(got, 2 * expected, atol=1e-6):
        return wrong("all_reduce sums: divide each gradient by the world size to average it.")
    if not (torch.allclose(got, expected, atol=1e-6) and all(  # every rank: rank 0's buffers are its own
            torch.allclose(a, b, atol=1e-6) for r in results for a, b in zip(r["weights"], r["expected"]))):
        return wrong("the gradients, weights or buffers differ from DDP's: all-reduce p.grad itself (in place) and "
                     "average it, and let replicate(model) broadcast rank 0's buffers before each forward, as DDP does.")
    return correct("one async all-reduce per gradient, each started as its gradient became ready; from ranks "
                   "initialised differently, with a frozen and a tied parameter and BatchNorm's buffers, after 3 steps the same "
                   "weights and buffers as DDP.")
