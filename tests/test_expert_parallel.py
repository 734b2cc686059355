"""course.parallel.expert_parallel: the expert-parallel MoE layer equals the single-process one (outputs,
input, router and expert gradients) on 2-4 ranks, with dropped tokens and with a rank that
receives no token; the capacity and the balancing loss do what their docstrings say; EP x DP
with sync_gradients trains like one process, and averaging expert gradients over the EP group
does not; notebook 16 derives the package's code."""

import copy
import functools
import inspect

import pytest
import torch
import torch.distributed as dist

from course.parallel import expert_parallel as ep
import course
from course import launch
from course.checks import nb16
from course.classroom.notebooks import SOLUTIONS, definitions
from course.classroom.doctor import PART_II_TORCH, torch_at_least

# course declares notebooks 11-18 for torch >= PART_II_TORCH (course/classroom/doctor.py, README).
pytestmark = pytest.mark.skipif(
    not torch_at_least(PART_II_TORCH), reason=f"notebooks 11-18 need torch >= {PART_II_TORCH}"
)

TIGHT = dict(rtol=1e-12, atol=1e-12)  # float64: the same sums, perhaps in another order
DIM, HIDDEN, TOKENS = 8, 16, 12


def _moe(n_experts, k, capacity_factor, skew=0.0):
    torch.manual_seed(0)
    moe = ep.MoE(DIM, HIDDEN, n_experts, k, capacity_factor).double()
    with torch.no_grad():
        moe.router.weight[0] += skew  # a skewed router sends most tokens to expert 0
    return moe


def _count(rank, tokens):
    return tokens[rank] if isinstance(tokens, tuple) else tokens  # a tuple: tokens per rank


def _tokens(rank, tokens=TOKENS, positive=False):
    x = torch.randn(_count(rank, tokens), DIM, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)
    return x.abs() if positive else x


def _upstream(rank, tokens=TOKENS):
    return torch.randn(_count(rank, tokens), DIM, generator=torch.Generator().manual_seed(200 + rank), dtype=torch.float64)


def _reference(world_size, moe, tokens, positive):
    """The single-process layer on each rank's tokens, one loss for all: gradients of everything."""
    moe = copy.deepcopy(moe)
    xs = [_tokens(r, tokens, positive).requires_grad_() for r in range(world_size)]
    outs = [moe(x) for x in xs]
    loss = sum((y * _upstream(r, tokens)).sum() + aux for r, (y, aux) in enumerate(outs))
    loss.backward()
    return moe, xs, outs


def _compare(rank, world_size, n_experts, k, capacity_factor, skew, tokens, positive):
    full = _moe(n_experts, k, capacity_factor, skew)
    moe, xs, outs = _reference(world_size, full, tokens, positive)
    layer = ep.ExpertParallelMoE(full)
    x = _tokens(rank, tokens, positive).requires_grad_()
    y, aux = layer(x)
    ((y * _upstream(rank, tokens)).sum() + aux).backward()
    torch.testing.assert_close(y, outs[rank][0], **TIGHT)
    torch.testing.assert_close(aux, outs[rank][1], **TIGHT)
    torch.testing.assert_close(x.grad, xs[rank].grad, **TIGHT)
    per_rank = n_experts // world_size
    for local, expert in enumerate(layer.experts):  # this rank's experts: every rank's tokens' contributions
        reference = moe.experts[rank * per_rank + local]
        for p, q in zip(expert.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad if q.grad is not None else torch.zeros_like(q), **TIGHT)
    # the router is replicated: this rank's gradient is its own tokens' term; the terms sum to the whole
    router_grad = layer.router.weight.grad.clone()
    dist.all_reduce(router_grad)
    torch.testing.assert_close(router_grad, moe.router.weight.grad, **TIGHT)
    r = ep.route(layer.router, x.detach(), k, capacity_factor)
    received = ep.exchange_counts(torch.bincount(r.experts[r.keep], minlength=n_experts))
    return {"dropped": int((~r.keep).sum()), "received": int(received.sum())}


CASES = {  # (world size, experts, k, capacity factor, skew, tokens per rank, positive tokens)
    "2 ranks, 4 experts, top-2": (2, 4, 2, None, 0.0, TOKENS, False),
    "3 ranks, 6 experts, top-2, capacity 1.0": (3, 6, 2, 1.0, 0.0, TOKENS, False),
    "4 ranks, 8 experts, top-1, capacity 1.25": (4, 8, 1, 1.25, 0.0, TOKENS, False),
    "4 ranks, 4 experts, top-2, skewed, capacity 1.0": (4, 4, 2, 1.0, 3.0, TOKENS, True),
    "3 ranks, 3 experts, 5/12/1 tokens, capacity 1.0": (3, 3, 2, 1.0, 0.0, (5, 12, 1), False),
    "3 ranks, 6 experts, 7/0/4 tokens: a rank with no tokens of its own": (3, 6, 2, None, 0.0, (7, 0, 4), False),
}


def _every_case_of_this_size(rank, world_size):
    """_compare for each case of CASES on world_size ranks, one after the other in the same ranks."""
    results = {}
    for case, (size, *args) in CASES.items():
        if size == world_size:
            try:
                results[case] = _compare(rank, world_size, *args)
            except AssertionError as e:  # the whole launch fails: say which case did
                raise AssertionError(f"{case}: {e}") from e
    return results


@functools.cache
def _cases_on(world_size):
    """Every case of CASES on world_size ranks: one launch for all of them."""
    per_rank = launch(_every_case_of_this_size, world_size, show=None, timeout=120)
    return {case: [results[case] for results in per_rank] for case in per_rank[0]}


@pytest.mark.parametrize("case", CASES)
def test_expert_parallel_equals_the_single_process_layer(case):
    world_size = CASES[case][0]
    results = _cases_on(world_size)[case]
    if CASES[case][3] is not None:
        assert sum(r["dropped"] for r in results) > 0, "the case is meant to drop tokens"


def test_a_rank_that_receives_no_token():
    # all tokens positive, router row 0 boosted: every top-1 choice is expert 0, on rank 0;
    # ranks 1-3 receive nothing, run their experts on no rows, and get zero gradients
    results = launch(_compare, 4, 4, 1, None, 5.0, TOKENS, True, show=None, timeout=120)
    assert [r["received"] for r in results] == [4 * TOKENS, 0, 0, 0]


def test_capacity_keeps_first_choices_first():
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])  # (token, choice)
    keep = ep.within_capacity(experts, 3, capacity=2)
    # expert 0 keeps tokens 0 and 1's first choices; token 2's first choice and token 3's second are dropped;
    # expert 1 keeps token 3's first choice (first choices go first), then token 0's second choice
    assert keep.tolist() == [[True, True], [True, True], [False, False], [True, False]]


def test_route_and_the_capacity_factor():
    moe = _moe(4, 2, 1.0)
    r = ep.route(moe.router, _tokens(0), 2, capacity_factor=1.0)
    capacity = 6  # ceil(1.0 * 12 tokens * 2 / 4 experts)
    kept = torch.bincount(r.experts[r.keep], minlength=4)
    assert kept.max() <= capacity and (~r.keep).any()
    torch.testing.assert_close(r.weights.sum(-1), torch.ones(TOKENS, dtype=torch.float64))
    assert ep.route(moe.router, _tokens(0), 2).keep.all()  # no capacity factor: nothing dropped


def test_an_empty_batch_gives_no_output_and_a_zero_balancing_loss():
    moe = _moe(4, 2, 1.0)
    y, aux = moe(torch.zeros(0, DIM, dtype=torch.float64))
    assert y.shape == (0, DIM) and aux.item() == 0.0


def test_load_balancing_loss_is_one_when_even_and_e_when_concentrated():
    n = 4
    even = ep.Routing(torch.arange(8).remainder(n).view(8, 1), None, None, torch.zeros(8, n))
    assert ep.load_balancing_loss(even).item() == pytest.approx(1.0)
    logits = torch.zeros(8, n)
    logits[:, 0] = 100.0
    one = ep.Routing(torch.zeros(8, 1, dtype=torch.long), None, None, logits)
    assert ep.load_balancing_loss(one).item() == pytest.approx(n)


def _uneven(rank, world_size):
    with pytest.raises(ValueError, match="do not split evenly over 3 ranks"):
        ep.ExpertParallelMoE(ep.MoE(DIM, HIDDEN, 4))
    return True


def _rows_to_self_differ(rank, world_size):  # rank 0 sends itself 2 rows but expects 1 from itself
    sends, expects = ([2, 0], [1, 0]) if rank == 0 else ([0, 0], [0, 0])
    dist.all_to_all_single(torch.empty(sum(expects), 4), torch.ones(sum(sends), 4), expects, sends)


def test_rows_to_and_from_itself_that_differ_raise_gloos_runtime_error():
    # notebook 16, section 2: the one disagreement of split sizes that is a Python exception (torch 2.15, gloo)
    with pytest.raises(course.WorkerError, match=r"RuntimeError.*alltoallv\.cc.*inLengthPerRank\[myRank\] == "
                       r"outLengthPerRank\[myRank\]"):
        launch(_rows_to_self_differ, 2, show=None, timeout=30)


def test_experts_that_do_not_split_evenly_are_refused_with_a_clear_error():
    assert launch(_uneven, 3, show=None) == [True] * 3


# ------------------------------------------------------------------ EP x DP: which group sums which gradient


@pytest.mark.parametrize("world_size, dp", [(2, 1), (4, 2), (4, 1), (2, 2)])
def test_ep_times_dp_with_sync_gradients_trains_like_one_process(world_size, dp):
    results = launch(nb16.train_ep_dp, world_size, dp, ep.sync_gradients, show=None, timeout=120)
    moe = nb16.train_one_process(world_size)
    assert nb16.compare_training(results, moe) == (True, True)
    assert not torch.allclose(moe.router.weight, nb16.make_moe(4, 2, 1.0).router.weight)  # it did train
    # (wrong syncs, e.g. experts averaged over the wrong group: tests/test_checks_nb16.py and notebook 16)


def _sync_with_frozen_unused_and_shared(rank, world_size):
    # on 2 ranks, a 2 x 1 mesh (dp x ep): both ranks hold the same 2 experts (expert_data_group = all)
    # and a replicated dense layer named like experts, "shared_experts", that must be synced as replicated
    ep_groups = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group, in order
    model = torch.nn.ModuleDict({"moe": ep.ExpertParallelMoE(ep.MoE(2, 4, 2), ep_groups[rank]),
                                 "shared_experts": torch.nn.Linear(2, 2)})
    router, expert, shared = model["moe"].router, model["moe"].experts[0], model["shared_experts"]
    shared.bias.requires_grad_(False)  # frozen
    router.weight.grad = torch.full((2, 2), float(rank + 1))
    shared.weight.grad = torch.full((2, 2), float(rank + 1))
    # the expert got no gradient on rank 0 (unused there), 3.0 on rank 1
    expert.up.weight.grad = None if rank == 0 else torch.full((4, 2), 3.0)
    ep.sync_gradients(model, expert_data_group=None)
    return (shared.bias.grad, router.weight.grad[0, 0].item(), shared.weight.grad[0, 0].item(),
            expert.up.weight.grad[0, 0].item(), expert.up.bias.grad.abs().sum().item())


def test_sync_gradients_selects_experts_by_module_skips_frozen_and_joins_with_zeros_for_unused():
    results = launch(_sync_with_frozen_unused_and_shared, 2, show=None, timeout=60)
    # router and shared_experts (replicated): (1 + 2) / 2; expert: (0 + 3) / 2 (summed over its group,
    # divided by all ranks); unused bias: 0; frozen bias: no gradient
    assert results == [(None, 1.5, 1.5, 1.5, 0.0)] * 2


def test_expert_parameters_are_chosen_by_module_not_by_name():
    model = torch.nn.ModuleDict({"shared_experts": torch.nn.Linear(2, 2)})
    assert ep.expert_parameters(model) == set()  # "experts." is in its parameters' names, yet it is no expert
    model = torch.nn.ModuleDict({"moe": ep.MoE(2, 4, 2)})
    assert ep.expert_parameters(model) == set()  # a single-process MoE is replicated: no expert-parallel layer


def _differently_initialised(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    torch.manual_seed(rank)  # every rank its own initial weights, as if a seed were forgotten
    layer = ep.ExpertParallelMoE(ep.MoE(DIM, HIDDEN, 4), mesh.get_group("ep"), mesh.get_group("dp"))
    routers = [torch.empty_like(layer.router.weight) for _ in range(world_size)]
    dist.all_gather(routers, layer.router.weight.detach())
    experts = torch.cat([p.detach().flatten() for p in layer.experts.parameters()])
    same_experts = [torch.empty_like(experts) for _ in range(world_size)]
    dist.all_gather(same_experts, experts)
    torch.manual_seed(0)
    rank0 = ep.MoE(DIM, HIDDEN, 4)  # rank 0's full layer: its router is everyone's
    torch.manual_seed(rank % 2)  # the first rank of my dp group ({0, 2} or {1, 3}): its experts are mine
    source = ep.MoE(DIM, HIDDEN, 4)
    first = mesh.get_local_rank("ep") * 2
    source_experts = torch.cat([p.detach().flatten() for e in source.experts[first:first + 2] for p in e.parameters()])
    return (all(torch.equal(w, rank0.router.weight) for w in routers),
            torch.equal(same_experts[rank], same_experts[rank ^ 2]),  # the other rank of my dp group
            torch.equal(experts, source_experts))


def test_ranks_initialised_differently_start_from_rank_0s_router_and_their_dp_groups_experts():
    results = launch(_differently_initialised, 4, show=None, timeout=60)
    assert results == [(True, True, True)] * 4


# ------------------------------------------------------------------ notebook 16 derives this code


DERIVED = ["Expert", "Routing", "within_capacity", "route", "load_balancing_loss", "MoE", "AllToAll",
           "run_experts", "ExpertParallelMoE", "expert_parameters"]  # dispatch and combine: Exercise 3, the package's printed


@pytest.mark.parametrize("name", DERIVED)
def test_the_notebook_derives_the_package_code(name):
    derived = definitions(SOLUTIONS / "16_expert_parallel.ipynb")
    assert name in derived, f"notebook 16 no longer defines {name}"
    assert derived[name] == inspect.getsource(getattr(ep, name)).rstrip(), (
        f"notebook 16's {name} differs from course/parallel/expert_parallel.py: keep them identical"
    )
