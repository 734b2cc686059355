"""course.parallel.collectives (naive and ring all-reduce, the ring's two halves) equals torch.distributed's
collectives on uneven sizes and 2-4 ranks and sends the bytes the 2(N-1)/N law says;
course.parallel.data_parallel's three from-scratch DPs give DDP's weights on a model with several buckets,
with unused parameters handled (find_unused_parameters=True) or rejected with a clear error, and are
drop-ins for DDP (frozen parameters, tied weights, buffers, ranks initialised differently);
and notebook 10 shows the same code as the package."""

import functools
import inspect

import nbformat
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course import WorkerError, launch
from course.observe import tracing
from course.parallel import collectives, data_parallel
from course.classroom.notebooks import SOLUTIONS, solution_code

NOTEBOOK = SOLUTIONS / "10_ddp_from_scratch.ipynb"

SIZES = [0, 1, 2, 5, 12, 1001]


def _integers(rank, n, seed=0):
    # Integer values: every summation order gives exactly the same float sum.
    g = torch.Generator().manual_seed(1000 * seed + 10 * rank + n)
    return torch.randint(-100, 100, (n,), generator=g).float()


def _compare_all_reduce(rank, world_size, sizes):
    out = []
    for n in sizes:
        x = _integers(rank, n)
        expected = x.clone()
        dist.all_reduce(expected)
        row = {"n": n}
        for fn in (collectives.naive_all_reduce, collectives.ring_all_reduce):
            got = x.clone()
            collectives.reset_counts()
            returned = fn(got)
            row[fn.__name__] = (torch.equal(got, expected), returned is got, collectives.bytes_sent())
        out.append(row)
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_naive_and_ring_all_reduce_equal_dist_all_reduce_and_send_the_predicted_bytes(world_size):
    results = launch(_compare_all_reduce, world_size, SIZES, show=None, timeout=120)
    for rank, rows in enumerate(results):
        for row in rows:
            n = row["n"]
            lengths = [len(c) for c in torch.tensor_split(torch.arange(n), world_size)]
            for name in ("naive_all_reduce", "ring_all_reduce"):
                equal, in_place, _ = row[name]
                assert equal and in_place, (rank, n, name)
            naive_bytes = row["naive_all_reduce"][2]
            assert naive_bytes == 4 * n * ((world_size - 1) if rank == 0 else 1)
            # Rank r sends every chunk but its own in reduce-scatter, every chunk but r + 1's in all-gather.
            ring = 4 * (2 * n - lengths[rank] - lengths[(rank + 1) % world_size])
            assert row["ring_all_reduce"][2] == ring
            if n % world_size == 0:
                assert ring * world_size == 4 * n * 2 * (world_size - 1)  # the 2(N-1)/N law, exactly


def _halves(rank, world_size, n):
    x = _integers(rank, n, seed=1)
    full = x.clone()
    mine = collectives.ring_reduce_scatter(full).clone()
    expected_shard = torch.empty(n // world_size)
    dist.reduce_scatter_tensor(expected_shard, x.clone())
    shard = _integers(rank, n // world_size, seed=2)
    buffer = torch.zeros(n)
    collectives.chunks(buffer, world_size)[rank].copy_(shard)
    collectives.ring_all_gather(buffer)
    expected_full = torch.empty(n)
    dist.all_gather_into_tensor(expected_full, shard)
    return torch.equal(mine, expected_shard), torch.equal(buffer, expected_full)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_halves_equal_reduce_scatter_tensor_and_all_gather_into_tensor(world_size):
    assert launch(_halves, world_size, 12 * world_size, show=None, timeout=120) == [(True, True)] * world_size


def test_chunks_split_unevenly_and_refuse_non_contiguous_tensors():
    assert [len(c) for c in collectives.chunks(torch.zeros(10), 4)] == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="contiguous"):
        collectives.chunks(torch.zeros(4, 3).T, 2)


# ------------------------------------------------------------------ data parallelism from scratch


class Net(nn.Module):
    """Five Linear(64, 64) and a head: 21,060 parameters, 84 kB: 3 buckets at a 0.02 MB cap."""

    def __init__(self, extra_head=False):
        super().__init__()
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(5)])
        self.head = nn.Linear(64, 4)
        self.extra = nn.Linear(64, 4) if extra_head else None  # used only when the batch asks

    def forward(self, x, use_extra=False):
        h = self.body(x)
        out = self.head(h)
        return out + self.extra(h) if use_extra else out


def _train(rank, world_size, kind, steps=4, unused=None, options=None):
    """``steps`` SGD steps with momentum on rank-specific data; returns the weights and all-reduce counts.
    unused: None, "everywhere" (the extra head is never used) or "rank 0" (used on rank 1 only)."""
    torch.manual_seed(0)
    model = Net(extra_head=unused is not None)
    options = options or {}
    if kind == "ddp":
        wrapped = DDP(model, find_unused_parameters=unused is not None, bucket_cap_mb=0.02)
        forward, finish = wrapped, lambda: None
    else:
        dp = getattr(data_parallel, kind)(model, **options)
        forward, finish = model, dp.finish
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rank)  # each rank its own data
    counts = []
    for step in range(steps):
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 4, generator=g)
        use_extra = unused == "rank 0" and rank == 1
        tracing.clear()
        nn.functional.mse_loss(forward(x, use_extra), y).backward()
        finish()
        counts.append([e.op for e in tracing.collectives()].count("all_reduce"))
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], counts


BUCKETED = {"bucket_cap_mb": 0.02}


@functools.cache
def _ddp_trained():
    """DDP's weights after _train: the reference of every kind (launched once per session)."""
    return launch(_train, 2, "ddp", backend="traced", show=None, timeout=120)[0][0]


# Notebook 10's check_against_ddp asserts the same of the same three classes (the package's code:
# test_notebook_derives_the_packages_code), on the same Net, data and optimizer: replicas identical,
# DDP's weights bit for bit, trained, and 12, 12 and 3 all-reduces per step; nbval compares its output.
@pytest.mark.repeats_solution_notebook
@pytest.mark.parametrize("path", [NOTEBOOK], ids=lambda p: p.stem)
@pytest.mark.parametrize(
    "kind, options, all_reduces_per_step",
    [
        ("AllReduceAfterBackward", {}, 12),  # one per parameter
        ("OverlapPerParameter", {}, 12),
        ("BucketedDataParallel", BUCKETED, 3),  # 16,640 B per layer, a 20,972 B cap: [head, 4, 3] [2, 1] [0]
    ],
)
def test_each_from_scratch_dp_gives_ddps_weights(kind, options, all_reduces_per_step, path):
    reference = _ddp_trained()
    ranks = launch(_train, 2, kind, 4, None, options, backend="traced", show=None, timeout=120)
    weights, counts = ranks[0]
    assert counts == [all_reduces_per_step] * 4
    for a, b in zip(weights, ranks[1][0]):
        assert torch.equal(a, b)  # the replicas stay identical
    for ours, ddp in zip(weights, reference):
        # Each value goes through the same float32 operations: halved (exact), then added to one other
        # value (a + b = b + a exactly). So on 2 ranks: bit for bit, as notebook 10 says.
        assert torch.equal(ours, ddp)
    assert not torch.allclose(weights[0], Net().body[0][0].weight)  # training moved the weights


def _layouts(rank, world_size):
    dp = data_parallel.BucketedDataParallel(Net(), bucket_cap_mb=0.02)
    one = data_parallel.BucketedDataParallel(Net(), bucket_cap_mb=25)
    return [[dp.names[p] for p in b.params] for b in dp.buckets], len(one.buckets)


def test_bucket_layout_follows_the_cap_in_reverse_order():
    layout, one = launch(_layouts, 1, show=None)[0]  # in a rank: the constructor broadcasts rank 0's model
    names = [n for n, _ in Net().named_parameters()]
    assert layout[0] == ["head.bias", "head.weight", "body.4.0.bias", "body.4.0.weight", "body.3.0.bias", "body.3.0.weight"]
    assert len(layout) == 3 and sum(len(b) for b in layout) == len(names)
    assert one == 1


@pytest.mark.parametrize("where", ["everywhere", "rank 0"])
def test_unused_parameters_are_handled_like_ddp_with_find_unused_parameters(where):
    reference, _ = launch(_train, 2, "ddp", 3, where, backend="traced", show=None, timeout=120)[0]
    options = {"bucket_cap_mb": 0.02, "find_unused_parameters": True}
    ranks = launch(_train, 2, "BucketedDataParallel", 3, where, options, backend="traced", show=None, timeout=120)
    for a, b in zip(ranks[0][0], ranks[1][0]):
        assert torch.equal(a, b)
    for ours, ddp in zip(ranks[0][0], reference):
        assert torch.equal(ours, ddp)  # bit for bit on 2 ranks (see above)
    torch.manual_seed(0)
    initial = Net(extra_head=True).extra.weight
    moved = not torch.equal(ranks[0][0][-2], initial)
    assert moved == (where == "rank 0")  # trained only by a rank that used it


def test_unused_parameters_without_find_unused_parameters_raise_a_clear_error():
    with pytest.raises(WorkerError) as info:
        launch(_train, 2, "BucketedDataParallel", 2, "everywhere", BUCKETED, backend="traced", show=None, timeout=120)
    message = info.value.failed[info.value.rank]
    assert "got no gradient" in message and "extra.weight" in message and "extra.bias" in message
    assert "find_unused_parameters=True" in message


# ------------------------------------------------------------------ a drop-in for DDP on real models


class DropIn(nn.Module):
    """A model with one of what a real model has: a frozen parameter, a weight shared by two
    layers, or buffers (BatchNorm's running statistics)."""

    def __init__(self, feature):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)
        if feature == "frozen":
            self.a.weight.requires_grad_(False)
        if feature == "tied":
            self.b.weight = self.a.weight
        self.norm = nn.BatchNorm1d(8) if feature == "buffers" else nn.Identity()

    def forward(self, x):
        return self.head(torch.tanh(self.b(self.norm(torch.tanh(self.a(x))))))


def _drop_in(rank, world_size, kind, feature):
    torch.manual_seed(rank)  # ranks initialised differently: only rank 0's values may survive
    model = DropIn(feature)
    if kind == "ddp":
        forward, finish = DDP(model), lambda: None
    else:
        forward, finish = model, getattr(data_parallel, kind)(model).finish
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own data
    states = []  # after each step: every parameter and buffer
    for step in range(3):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
        nn.functional.mse_loss(forward(x), y).backward()
        finish()
        opt.step()
        opt.zero_grad()
        if step == 0:  # a forward without gradients (train mode: BatchNorm still updates its statistics) ...
            with torch.no_grad():
                forward(torch.randn(16, 8, generator=g))  # ... after which DDP skips the next buffer broadcast
        states.append([t.detach().clone() for t in model.state_dict().values()])
    return states


DROP_IN_KINDS = ["AllReduceAfterBackward", "OverlapPerParameter", "BucketedDataParallel"]
DROP_IN_FEATURES = ["frozen", "tied", "buffers"]


def _every_drop_in(rank, world_size):
    """_drop_in for DDP and each kind, on each feature, one after the other in the same ranks (each a new model)."""
    return {(kind, feature): _drop_in(rank, world_size, kind, feature)
            for feature in DROP_IN_FEATURES for kind in ["ddp"] + DROP_IN_KINDS}


@functools.cache
def _drop_ins():
    """What the ranks hold after each step of _drop_in, for DDP (the reference) and every kind: one launch."""
    per_rank = launch(_every_drop_in, 2, show=None, timeout=120)
    return {key: [states[key] for states in per_rank] for key in per_rank[0]}


@pytest.mark.parametrize("feature", DROP_IN_FEATURES)
@pytest.mark.parametrize("kind", DROP_IN_KINDS)
def test_each_from_scratch_dp_is_a_drop_in_for_ddp_on_ranks_initialised_differently(kind, feature):
    reference = _drop_ins()[("ddp", feature)]
    ours = _drop_ins()[(kind, feature)]
    for rank in range(2):  # every parameter and buffer of every rank after every step, bit for bit (2 ranks: see above)
        for step in range(3):
            assert all(torch.equal(a, b) for a, b in zip(ours[rank][step], reference[rank][step])), (rank, step)
    torch.manual_seed(0)
    initial = DropIn(feature).state_dict()
    assert not torch.equal(ours[0][-1][1], initial["a.bias"])  # it trained
    if feature == "frozen":
        assert torch.equal(ours[1][-1][0], initial["a.weight"])  # rank 0's frozen weight, on rank 1 too
    if feature == "buffers":  # after step 1 the ranks' statistics differ: no broadcast after the no_grad forward
        mean = list(initial).index("norm.running_mean")
        assert not torch.equal(ours[0][1][mean], ours[1][1][mean])


# ------------------------------------------------------------------ the notebook shows the package's code



def _defining_cell(nb, name):
    for cell in nb.cells:
        source = solution_code(cell.source) if cell.cell_type == "code" else ""
        if source.startswith((f"def {name}(", f"class {name}:", f"class {name}(")):
            return source
    raise AssertionError(f"no cell of {NOTEBOOK.name} defines {name}")


@pytest.mark.parametrize(
    "obj",
    [
        collectives.naive_all_reduce,
        data_parallel.replicate,
        data_parallel.trainable,
        data_parallel.AllReduceAfterBackward,
        data_parallel.OverlapPerParameter,
        data_parallel.Bucket,
        data_parallel.BucketedDataParallel,
    ],
    ids=lambda o: o.__name__,
)
def test_notebook_derives_the_packages_code(obj):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert _defining_cell(nb, obj.__name__) == inspect.getsource(obj).strip()
