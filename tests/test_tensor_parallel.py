"""course.parallel.tensor_parallel: the hand-written column-, row-parallel and Megatron layers compute
what the unsplit layers compute (outputs, input gradients, parameter gradients) on 2 and 4
ranks; DTensor's ColwiseParallel/RowwiseParallel equals the hand-written MLP; a 2×2 mesh
(data × tensor parallel) trains like one process; notebook 13 derives the package's code."""

import copy
import functools
import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course import launch
from course.parallel import tensor_parallel as tp
from course.observe import tracing
from course.classroom.notebooks import SOLUTIONS, definitions

TIGHT = dict(rtol=1e-12, atol=1e-12)  # float64: only the order of additions differs
DIM, HIDDEN, HEADS, SEQ = 8, 16, 4, 5


def _full_layer(kind):
    torch.manual_seed(0)
    if kind in ("column", "column-gather", "row"):
        return nn.Linear(DIM, HIDDEN, dtype=torch.float64)
    if kind == "mlp":
        return tp.MLP(DIM, HIDDEN).double()
    return tp.SelfAttention(DIM, HEADS).double()


def _split(kind, full, group=None):
    return {
        "column": lambda: tp.ColumnParallelLinear(full, group),
        "column-gather": lambda: tp.ColumnParallelLinear(full, group, gather_output=True),
        "row": lambda: tp.RowParallelLinear(full, group),
        "mlp": lambda: tp.ParallelMLP(full, group),
        "attention": lambda: tp.ParallelSelfAttention(full, group),
    }[kind]()


def _compare_with_unsplit(rank, world_size, kind):
    full = _full_layer(kind)
    part = _split(kind, copy.deepcopy(full))
    g = torch.Generator().manual_seed(1)
    in_dim = full.in_features if isinstance(full, nn.Linear) else DIM
    x = torch.randn(3, SEQ, in_dim, generator=g, dtype=torch.float64)
    x_full = x.clone().requires_grad_()
    y_full = full(x_full)
    upstream = torch.randn(y_full.shape, generator=g, dtype=torch.float64)  # a loss that weighs every output
    (y_full * upstream).sum().backward()

    if kind == "row":  # the row-parallel layer gets this rank's slice of the input features
        x_part = x.chunk(world_size, -1)[rank].clone().requires_grad_()
        expected_x_grad = x_full.grad.chunk(world_size, -1)[rank]
    else:
        x_part = x.clone().requires_grad_()
        expected_x_grad = x_full.grad
    y_part = part(x_part)
    expected_y, expected_upstream = y_full, upstream
    if kind == "column":  # this rank's output features only
        expected_y = y_full.chunk(world_size, -1)[rank]
        expected_upstream = upstream.chunk(world_size, -1)[rank]
    (y_part * expected_upstream).sum().backward()

    torch.testing.assert_close(y_part, expected_y.detach(), **TIGHT)
    torch.testing.assert_close(x_part.grad, expected_x_grad, **TIGHT)
    checked = 0
    for (name, p_full), (_, p_part) in zip(full.named_parameters(), part.named_parameters()):
        grad = p_full.grad
        if p_part.shape != p_full.shape:  # a shard: find the dim it was split along
            dim = next(d for d in range(grad.dim()) if p_part.shape[d] != grad.shape[d])
            grad = grad.chunk(world_size, dim)[rank]
            torch.testing.assert_close(p_part, p_full.chunk(world_size, dim)[rank], **TIGHT)
        torch.testing.assert_close(p_part.grad, grad, **TIGHT, msg=name)
        checked += 1
    return checked


KINDS = ["column", "column-gather", "row", "mlp", "attention"]


def _compare_every_kind(rank, world_size):
    """_compare_with_unsplit for each kind in turn, in the same ranks. A mismatch comes back as its message,
    not raised: each kind's collectives all come before its comparisons, so the ranks stay in step."""
    results = {}
    for kind in KINDS:
        try:
            results[kind] = _compare_with_unsplit(rank, world_size, kind)
        except AssertionError as e:
            results[kind] = f"{kind}: {e}"
    return results


@functools.cache
def _compared(world_size):
    """Every kind compared on world_size ranks: one launch for the five tests of that size."""
    return launch(_compare_every_kind, world_size, show=None, timeout=120)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_split_layer_equals_the_unsplit_layer(kind, world_size):
    checked = [per_rank[kind] for per_rank in _compared(world_size)]
    assert checked == [{"mlp": 4, "attention": 8}.get(kind, 2)] * world_size


def _count_all_reduces(rank, world_size, kind):
    part = _split(kind, _full_layer(kind))
    x = torch.randn(3, SEQ, DIM, dtype=torch.float64, requires_grad=True)
    tracing.clear()
    tracing.mark("forward")
    y = part(x)
    tracing.mark("backward")
    y.sum().backward()
    tracing.wait_all()
    return [e.label if isinstance(e, tracing.Mark) else e.op for e in tracing.events()]


@pytest.mark.parametrize("kind", ["mlp", "attention"])
def test_a_megatron_block_all_reduces_once_in_forward_and_once_in_backward(kind):
    traces = launch(_count_all_reduces, 2, kind, backend="traced", show=None, timeout=120)
    assert traces == [["forward", "all_reduce", "backward", "all_reduce"]] * 2


def _uneven(rank, world_size):
    with pytest.raises(ValueError, match="split evenly"):
        tp.ColumnParallelLinear(nn.Linear(4, 3))
    with pytest.raises(ValueError, match="heads do not split evenly"):
        tp.ParallelSelfAttention(tp.SelfAttention(6, 3))
    return True


def test_uneven_splits_are_refused_with_a_clear_error():
    assert launch(_uneven, 2, show=None) == [True, True]


# ------------------------------------------------------------------ DTensor equals the hand-written MLP


def _dtensor_vs_hand_written(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    full = tp.MLP(DIM, HIDDEN).double()
    hand = tp.ParallelMLP(copy.deepcopy(full))
    dtensor = parallelize_module(
        copy.deepcopy(full), init_device_mesh("cpu", (world_size,)), {"up": ColwiseParallel(), "down": RowwiseParallel()}
    )
    x = torch.randn(3, SEQ, DIM, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x_hand, x_dtensor = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_hand, y_dtensor = hand(x_hand), dtensor(x_dtensor)
    y_hand.pow(2).sum().backward()
    y_dtensor.pow(2).sum().backward()
    torch.testing.assert_close(y_dtensor, y_hand, **TIGHT)
    torch.testing.assert_close(x_dtensor.grad, x_hand.grad, **TIGHT)
    for layer in ("up", "down"):
        for name in ("weight", "bias"):
            p_hand = getattr(getattr(hand, layer), name)
            p_dtensor = getattr(getattr(dtensor, layer), name)
            torch.testing.assert_close(p_dtensor.to_local(), p_hand.detach(), **TIGHT)  # the same shard
            torch.testing.assert_close(p_dtensor.grad.to_local(), p_hand.grad, **TIGHT)
    return [repr(dtensor.up.weight.placements[0]), repr(dtensor.down.weight.placements[0])]


def test_dtensor_tensor_parallel_equals_the_hand_written_mlp():
    placements = launch(_dtensor_vs_hand_written, 2, show=None, timeout=120)
    assert placements == [["Shard(dim=0)", "Shard(dim=1)"]] * 2


# ------------------------------------------------------------------ 2-D: data × tensor parallel


def _model():
    torch.manual_seed(0)
    return nn.Sequential(tp.MLP(DIM, HIDDEN), tp.MLP(DIM, HIDDEN)).double()


def _data():
    g = torch.Generator().manual_seed(2)
    return torch.randn(8, DIM, generator=g, dtype=torch.float64), torch.randn(8, DIM, generator=g, dtype=torch.float64)


STEPS = 3


def _train_2d(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
    model = nn.Sequential(*(tp.ParallelMLP(block, tp_group) for block in _model()))
    ddp = DDP(model, process_group=dp_group)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = _data()
    dp_rank = mesh.get_local_rank("dp")
    x, y = x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]  # data parallel: a different half per dp rank
    for _ in range(STEPS):
        optimizer.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        optimizer.step()
    return {
        "groups": (dist.get_process_group_ranks(tp_group), dist.get_process_group_ranks(dp_group)),
        "up": model[1].up.weight.detach(),
        "down": model[1].down.weight.detach(),
        "bias": model[1].down.bias.detach(),
    }


def test_a_2x2_mesh_trains_like_one_process():
    results = launch(_train_2d, 4, show=None, timeout=120)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    for _ in range(STEPS):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    assert [r["groups"] for r in results] == [([0, 1], [0, 2]), ([0, 1], [1, 3]), ([2, 3], [0, 2]), ([2, 3], [1, 3])]
    for rank, r in enumerate(results):
        tp_rank = rank % 2
        torch.testing.assert_close(r["up"], model[1].up.weight.detach().chunk(2, 0)[tp_rank], **TIGHT)
        torch.testing.assert_close(r["down"], model[1].down.weight.detach().chunk(2, 1)[tp_rank], **TIGHT)
        torch.testing.assert_close(r["bias"], model[1].down.bias.detach(), **TIGHT)
    assert not torch.allclose(results[0]["bias"], _model()[1].down.bias.detach())  # it did train


# ------------------------------------------------------------------ notebook 13 derives this code


@pytest.mark.parametrize(
    "name",
    ["CopyToParallel", "ReduceFromParallel", "GatherFromParallel", "shard", "ColumnParallelLinear", "RowParallelLinear", "MLP", "ParallelMLP"],
)
def test_the_notebook_derives_the_package_code(name):
    derived = definitions(SOLUTIONS / "13_tensor_parallel.ipynb")
    assert name in derived, f"notebook 13 no longer defines {name}"
    assert derived[name] == inspect.getsource(getattr(tp, name)).rstrip(), (
        f"notebook 13's {name} differs from course/parallel/tensor_parallel.py: keep them identical"
    )
