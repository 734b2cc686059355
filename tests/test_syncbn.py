"""course.parallel.syncbn.SyncBatchNorm: N ranks compute what one BatchNorm computes on the concatenated
batch (forward, input/weight/bias gradients, running statistics, eval), with uneven and empty
ranks; `convert`; and DDP training that matches single-process large-batch training."""

import functools
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course import launch
from course.parallel.syncbn import SyncBatchNorm

CHANNELS = 3
TIGHT = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5)}

# name: (per-rank batch sizes, shape after (N, C), dtype, momentum, affine, bias, track_running_stats)
CASES = {
    "1d-even": ((4, 4, 4), (), torch.float64, 0.1, True, True, True),
    "2d-uneven-with-an-empty-rank": ((5, 0, 3, 8), (2, 2), torch.float64, 0.1, True, True, True),
    "1d-sequence-momentum-none-no-affine": ((2, 7, 1), (5,), torch.float64, None, False, False, True),
    "3d-no-bias-momentum-0.3": ((3, 1), (2, 2, 2), torch.float64, 0.3, True, False, True),
    "no-running-stats": ((3, 4), (), torch.float64, 0.1, True, True, False),
    "float32-uneven": ((6, 1, 9), (3, 3), torch.float32, 0.1, True, True, True),
}
STEPS = 3
EVAL_STEP = 99


def _data(case, step):
    sizes, spatial, dtype = case[:3]
    g = torch.Generator().manual_seed(step)
    view = (1, CHANNELS) + (1,) * len(spatial)
    scale = torch.tensor([1.0, 4.0, 0.3], dtype=dtype).view(view)
    shift = torch.tensor([0.0, 20.0, -3.0], dtype=dtype).view(view)  # far from 0: catches a lossy Σx²/n - mean²
    x = torch.randn(sum(sizes), CHANNELS, *spatial, generator=g, dtype=dtype) * scale + shift
    upstream = torch.randn(sum(sizes), CHANNELS, *spatial, generator=g, dtype=dtype)
    return x, upstream


def _plain_bn(case):
    _, spatial, dtype, momentum, affine, bias, track = case
    layer = {0: nn.BatchNorm1d, 1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[len(spatial)]
    bn = layer(CHANNELS, momentum=momentum, affine=affine, track_running_stats=track, dtype=dtype)
    if affine:
        with torch.no_grad():
            bn.weight.copy_(torch.tensor([0.5, 1.5, -2.0]))
            bn.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
        if not bias:
            bn.bias = None
    return bn


def _steps(bn, case, rows):
    """Run STEPS training steps (loss = Σ upstream * y over ``rows``) and one eval forward."""
    out = {"y": [], "x_grad": [], "weight_grad": [], "bias_grad": []}
    for step in range(STEPS):
        x, upstream = _data(case, step)
        x = x[rows].clone().requires_grad_()
        y = bn(x)
        bn.zero_grad()
        (y * upstream[rows]).sum().backward()
        out["y"].append(y.detach())
        out["x_grad"].append(x.grad)
        out["weight_grad"].append(None if bn.weight is None else bn.weight.grad)
        out["bias_grad"].append(None if bn.bias is None else bn.bias.grad)
    out["running"] = [None if t is None else t.clone() for t in (bn.running_mean, bn.running_var, bn.num_batches_tracked)]
    bn.eval()
    out["eval"] = bn(_data(case, EVAL_STEP)[0][rows]).detach()
    return out


def _rank_job(rank, world_size, case):
    sizes = case[0]
    rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    bn = SyncBatchNorm.convert(_plain_bn(case))
    assert type(bn) is SyncBatchNorm
    return _steps(bn, case, rows)


def _cat(tensors):
    return torch.cat(tensors)


def _every_case_of_this_size(rank, world_size):
    """_rank_job for each case of CASES on world_size ranks, one after the other in the same ranks."""
    return {name: _rank_job(rank, world_size, case) for name, case in CASES.items() if len(case[0]) == world_size}


@functools.cache
def _cases_on(world_size):
    """Every case of CASES on world_size ranks: one launch for all of them."""
    per_rank = launch(_every_case_of_this_size, world_size, show=None, timeout=60)
    return {name: [results[name] for results in per_rank] for name in per_rank[0]}


@pytest.mark.parametrize("name", list(CASES))
def test_n_ranks_equal_one_batchnorm_on_the_concatenated_batch(name):
    case = CASES[name]
    ranks = _cases_on(len(case[0]))[name]
    ref = _steps(_plain_bn(case), case, slice(None))
    tol = TIGHT[case[2]]
    for step in range(STEPS):
        assert torch.allclose(_cat([r["y"][step] for r in ranks]), ref["y"][step], **tol), "forward output"
        assert torch.allclose(_cat([r["x_grad"][step] for r in ranks]), ref["x_grad"][step], **tol), "input gradient"
        for key in ("weight_grad", "bias_grad"):
            if ref[key][step] is None:
                assert all(r[key][step] is None for r in ranks)
            else:  # each rank holds its share; DDP's all-reduce adds them up
                assert torch.allclose(sum(r[key][step] for r in ranks), ref[key][step], **tol), key
    for r in ranks:
        for got, expected in zip(r["running"], ref["running"]):
            if expected is None:
                assert got is None
            else:
                assert torch.allclose(got, expected, **tol), "running statistics"
    if case[6]:
        assert torch.allclose(_cat([r["eval"] for r in ranks]), ref["eval"], **tol), "eval output"
    else:  # no running statistics: eval normalises each rank's batch by itself, like nn.SyncBatchNorm
        x = _data(case, EVAL_STEP)[0]
        for r, rows in zip(ranks, torch.arange(len(x)).split(list(case[0]))):
            assert torch.allclose(r["eval"], _plain_bn(case).eval()(x[rows]).detach(), **tol), "eval output"


def test_the_running_variance_is_the_unbiased_global_variance():
    def job(rank, world_size):
        bn = SyncBatchNorm(1, momentum=1.0)  # running stats = the last batch's
        x = torch.tensor([[1.0], [2.0], [3.0], [10.0]]).tensor_split(world_size)[rank]
        bn(x)
        return bn.running_mean.item(), bn.running_var.item()

    everything = torch.tensor([1.0, 2.0, 3.0, 10.0])
    for mean, var in launch(job, 3, show=None):
        assert mean == pytest.approx(everything.mean().item())
        assert var == pytest.approx(everything.var(unbiased=True).item())


def test_one_all_reduce_in_forward_and_one_in_backward():
    def job(rank, world_size):
        sizes, real_all_reduce = [], dist.all_reduce

        def counting(tensor, *args, **kwargs):
            sizes.append(tensor.numel())
            return real_all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = counting  # in this rank's process only
        x = torch.randn(4, CHANNELS, 2, requires_grad=True)
        y = SyncBatchNorm(CHANNELS)(x)
        in_forward = list(sizes)
        y.sum().backward()
        return in_forward, sizes

    for in_forward, in_total in launch(job, 2, show=None):
        assert in_forward == [2 * CHANNELS + 1]  # [Σx, Σx², n]
        assert in_total == [2 * CHANNELS + 1, 2 * CHANNELS]  # then [Σg, Σg·x̂]


def test_statistics_stay_accurate_in_float32_when_the_mean_is_large():
    # Σx²/n - mean² in float32 would lose the whole variance here; the layer sums in float64.
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(12, 2, generator=g, dtype=torch.float64) + 10_000).float()

    def job(rank, world_size):
        bn = SyncBatchNorm(2, momentum=1.0)
        return bn(x.tensor_split(world_size)[rank]).detach(), bn.running_var

    reference = nn.BatchNorm1d(2, momentum=1.0).double()
    expected = reference(x.double())
    ranks = launch(job, 3, show=None)
    assert torch.allclose(torch.cat([y for y, _ in ranks]).double(), expected, atol=2e-3)
    for _, running_var in ranks:
        assert torch.allclose(running_var.double(), reference.running_var, rtol=1e-3)


def test_eval_mode_does_not_communicate():
    def job(rank, world_size):
        bn = SyncBatchNorm(CHANNELS)
        x = torch.randn(4, CHANNELS)

        def no_collectives(*args, **kwargs):
            raise AssertionError("eval mode must not communicate")

        dist.all_reduce = no_collectives  # in this rank's process only
        bn.eval()
        for _ in range(rank):  # different numbers of calls per rank: a collective would hang
            expected = nn.functional.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, False)
            assert torch.equal(bn(x), expected)
        bn.train()
        with pytest.raises(AssertionError, match="must not communicate"):
            bn(x)  # training does all-reduce: the patch is effective
        return True

    assert launch(job, 3, show=None, timeout=30) == [True] * 3


def test_too_few_values_in_the_global_batch_raises_on_every_rank():
    def job(rank, world_size):
        bn = SyncBatchNorm(CHANNELS)
        try:
            bn(torch.randn(1 - rank, CHANNELS))  # 1 sample on rank 0, none on rank 1
        except ValueError as e:
            return str(e)
        return "no error"

    messages = launch(job, 2, show=None, timeout=30)
    assert all("more than 1 value per channel" in m and "got 1" in m for m in messages), messages


def test_without_a_process_group_it_is_plain_batchnorm():
    torch.manual_seed(0)
    x = torch.randn(6, CHANNELS, 4) * 3 + 1
    plain, ours = nn.BatchNorm1d(CHANNELS), SyncBatchNorm(CHANNELS)
    assert torch.allclose(ours(x), plain(x), atol=1e-6)
    assert torch.allclose(ours.running_var, plain.running_var, atol=1e-6)


@pytest.mark.parametrize(
    "shape, message", [((4,), "(N, C, ...)"), ((4, CHANNELS + 1), f"expected {CHANNELS} channels")]
)
def test_bad_input_says_what_is_expected(shape, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SyncBatchNorm(CHANNELS)(torch.randn(shape))


# ------------------------------------------------------------------ convert


def test_convert_swaps_every_batchnorm_and_shares_its_state():
    inner = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, momentum=None))
    model = nn.Sequential(
        nn.Linear(3, 3), nn.BatchNorm1d(3, affine=False), inner, nn.SyncBatchNorm(4, track_running_stats=False)
    )
    model.eval()
    originals = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    converted = SyncBatchNorm.convert(model)
    assert converted is model  # containers are changed in place, like convert_sync_batchnorm
    layers = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(layers) == 3 and all(type(m) is SyncBatchNorm for m in layers)
    for new, old in zip(layers, originals):
        assert (new.num_features, new.eps, new.momentum, new.affine, new.track_running_stats) == (
            old.num_features, old.eps, old.momentum, old.affine, old.track_running_stats)
        assert new.weight is old.weight and new.bias is old.bias
        assert new.running_mean is old.running_mean and new.running_var is old.running_var
        assert new.training is False
    assert model[1].weight is None and model[3].running_mean is None
    single = SyncBatchNorm.convert(nn.BatchNorm1d(5))
    assert type(single) is SyncBatchNorm and single.num_features == 5


def test_convert_keeps_bias_false():
    bn = nn.BatchNorm1d(CHANNELS)
    bn.bias = None
    converted = SyncBatchNorm.convert(bn)
    assert converted.weight is bn.weight and converted.bias is None
    assert [name for name, _ in converted.named_parameters()] == ["weight"]


# ------------------------------------------------------------------ DDP training

WORLD, PER_RANK, TRAIN_STEPS = 4, 3, 5


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 4 * 4, 8), nn.BatchNorm1d(8, momentum=None), nn.ReLU(), nn.Linear(8, 2),
    ).double()


def _train_data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(TRAIN_STEPS, WORLD * PER_RANK, 3, 4, 4, generator=g, dtype=torch.float64) * 2 + 3
    y = torch.randn(TRAIN_STEPS, WORLD * PER_RANK, 2, generator=g, dtype=torch.float64)
    return x, y


def _train(model, rows=slice(None)):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in zip(*_train_data()):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()


def _ddp_job(rank, world_size, sync):
    model = _model()
    if sync:
        # What a GPU script does, then the course's layer swapped in for CPU.
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        assert sum(isinstance(m, nn.SyncBatchNorm) for m in model.modules()) == 2
        model = SyncBatchNorm.convert(model)
        assert not any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())
        assert sum(type(m) is SyncBatchNorm for m in model.modules()) == 2
    ddp_model = DDP(model)
    _train(ddp_model, slice(rank * PER_RANK, (rank + 1) * PER_RANK))
    return model.state_dict()


def _ddp_jobs(rank, world_size):
    """_ddp_job with the converted model, then with plain BatchNorm, in the same ranks."""
    return _ddp_job(rank, world_size, True), _ddp_job(rank, world_size, False)


def test_ddp_with_converted_model_matches_single_process_large_batch_training():
    reference = _model()
    _train(reference)
    expected = reference.state_dict()
    ranks = launch(_ddp_jobs, WORLD, show=None, timeout=60)
    for state, _ in ranks:
        assert state.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.allclose(state[key], value, rtol=1e-10, atol=1e-12), key

    # The same DDP run with plain BatchNorm does not match: the test can tell the difference.
    plain = ranks[0][1]
    assert not torch.allclose(plain["0.weight"], expected["0.weight"], rtol=1e-4, atol=1e-6)


def _notebook_and_package(rank, world_size, code, cases):
    from course.parallel import syncbn

    namespace = {"torch": torch, "dist": dist, "nn": nn}
    exec(code, namespace)  # notebook 06's solution of Exercise 1
    results = []
    for batches in cases:
        mine = batches[rank]
        mean, var = namespace["global_mean_var"](mine.clone())
        package_mean, package_var, _ = syncbn.global_mean_var(mine.clone())
        results.append((mean, var, package_mean, package_var))
    return results


def test_package_global_mean_var_is_the_notebooks():
    """Notebook 06's Exercise 1 derives global_mean_var; course.parallel.syncbn's is the same computation."""
    from course.classroom.exercises import solutions

    g = torch.Generator().manual_seed(0)
    cases = [[(torch.randn(n, CHANNELS, generator=g, dtype=torch.float64) + shift + r).to(dtype) for r, n in enumerate((5, 1, 10))]
             for dtype, shift in ((torch.float64, 0.0), (torch.float32, 10_000.0))]
    ranks = launch(_notebook_and_package, 3, solutions()["06"]["global_mean_var"], cases, show=None, timeout=60)
    for results in ranks:
        assert len(results) == 2
        for mean, var, package_mean, package_var in results:
            assert torch.allclose(mean.double(), package_mean, rtol=1e-12, atol=1e-9)
            assert torch.allclose(var.double(), package_var, rtol=1e-9, atol=1e-9)
