"""Notebook 11's checks reject plausible wrong answers with a useful hint."""

import functools
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from course.checks import nb11
from course.classroom.doctor import PART_II_TORCH, torch_at_least
from course.parallel.fsdp import (
    free_parameter,
    fully_shard_by_hand,
    gather_parameter,
    reduce_scatter_gradients,
    scaled_step,
    shard_parameters,
)
from course.parallel.zero import flat_padded, zero1_step

# The judges' own reasons, with wrong answers built on the course's finished code: course.classroom.guard off
# (it would refuse them first; tests/test_guard.py tries it).
pytestmark = pytest.mark.usefixtures("judges_only")


def said(feedback):
    """The verdict's words on one line (the check's hints are cut into lines of at most 100 characters),
    after checking that such a hint prints no longer line (a failed rank's report is not the check's)."""
    assert not feedback.message.startswith("not yet. Hint:") or max(len(line) for line in repr(replace(feedback, details="")).splitlines()) <= 100, feedback
    return " ".join(feedback.message.split())

# ------------------------------------------------------------------ Exercise 1 (zero1_step)


def _trainable(model):  # the check's model has a frozen parameter: ZeRO-1 flattens only the trainable ones
    return [p for p in model.parameters() if p.requires_grad]


def _copy_back(model, flat):
    with torch.no_grad():
        offset = 0
        for p in _trainable(model):
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def _gather(model, shard, like):
    flat = torch.empty_like(like)
    dist.all_gather_into_tensor(flat, shard.detach())
    _copy_back(model, flat)


def _no_division(model, shard, optimizer):
    grads = flat_padded([p.grad for p in _trainable(model)], dist.get_world_size())
    shard.grad = torch.empty_like(shard)
    dist.reduce_scatter_tensor(shard.grad, grads)
    optimizer.step()
    _gather(model, shard, grads)


def _no_gather(model, shard, optimizer):
    world_size = dist.get_world_size()
    grads = flat_padded([p.grad for p in _trainable(model)], world_size)
    grad_shard = torch.empty_like(shard)
    dist.reduce_scatter_tensor(grad_shard, grads)
    shard.grad = grad_shard / world_size
    optimizer.step()
    old = flat_padded(_trainable(model), world_size)
    old.chunk(world_size)[dist.get_rank()].copy_(shard.detach())  # only my slice: the others stay stale
    _copy_back(model, old)


def _all_reduce(model, shard, optimizer):
    world_size = dist.get_world_size()
    grads = flat_padded([p.grad for p in _trainable(model)], world_size)
    dist.all_reduce(grads)
    shard.grad = grads.chunk(world_size)[dist.get_rank()] / world_size
    optimizer.step()
    _gather(model, shard, grads)


def _never_sets_grad(model, shard, optimizer):
    optimizer.step()


def _gathers_the_gradient(model, shard, optimizer):
    world_size = dist.get_world_size()
    grads = flat_padded([p.grad for p in _trainable(model)], world_size)
    grad_shard = torch.empty_like(shard)
    dist.reduce_scatter_tensor(grad_shard, grads)
    shard.grad = grad_shard / world_size
    optimizer.step()
    _gather(model, shard.grad, grads)


def _wrong_slice(model, shard, optimizer):
    world_size = dist.get_world_size()
    grads = flat_padded([p.grad for p in _trainable(model)], world_size)
    dist.all_reduce(grads)
    shard.grad = grads.chunk(world_size)[world_size - 1 - dist.get_rank()] / world_size
    optimizer.step()
    _gather(model, shard, grads)


def _never_steps(model, shard, optimizer):
    world_size = dist.get_world_size()
    grads = flat_padded([p.grad for p in _trainable(model)], world_size)
    shard.grad = torch.empty_like(shard)
    dist.reduce_scatter_tensor(shard.grad, grads)
    shard.grad /= world_size
    _gather(model, shard, grads)


def _sums_gathered_gradients(model, shard, optimizer):
    """Right numbers, wrong collective: every rank gathers every rank's whole gradient and sums."""
    world_size = dist.get_world_size()
    grads = flat_padded([p.grad for p in _trainable(model)], world_size)
    everyone = torch.empty(world_size * grads.numel())
    dist.all_gather_into_tensor(everyone, grads)
    total = everyone.view(world_size, -1).sum(0)
    shard.grad = total.chunk(world_size)[dist.get_rank()] / world_size
    optimizer.step()
    _gather(model, shard, grads)


def _two_rank_partner(model, shard, optimizer):
    """Right on 2 ranks only: swaps gradients with the one other rank, `1 - rank`."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    grads = flat_padded([p.grad for p in _trainable(model)], world_size)
    theirs = torch.empty_like(grads)
    request = dist.isend(grads, 1 - rank)
    dist.recv(theirs, 1 - rank)
    request.wait()
    shard.grad = (grads + theirs).chunk(world_size)[rank] / world_size
    optimizer.step()
    _gather(model, shard, grads)


def _all_reduces_on_a_subgroup(model, shard, optimizer):
    """The built-in all-reduce, hidden from the traced default group on a group of all ranks."""
    world_size = dist.get_world_size()
    grads = flat_padded([p.grad for p in _trainable(model)], world_size)
    dist.all_reduce(grads, group=dist.new_group(list(range(world_size))))
    shard.grad = grads.chunk(world_size)[dist.get_rank()] / world_size
    optimizer.step()
    _gather(model, shard, grads)


def _scatters_for_show_and_all_reduces_on_a_subgroup(model, shard, optimizer):
    """A reduce-scatter the traced group sees, and the all-reduce it does not see doing the work."""
    world_size = dist.get_world_size()
    grads = flat_padded([p.grad for p in _trainable(model)], world_size)
    dist.reduce_scatter_tensor(torch.empty_like(shard), grads)
    dist.all_reduce(grads, group=dist.new_group(list(range(world_size))))
    shard.grad = grads.chunk(world_size)[dist.get_rank()] / world_size
    optimizer.step()
    _gather(model, shard, grads)


def _broadcasts_the_gradient_too(model, shard, optimizer):
    """The right step, plus a broadcast of the whole flat gradient on the default group: only a few
    hundred bytes on the check's tiny model, hidden in gloo's overhead on the wire, but traced."""
    dist.broadcast(flat_padded([p.grad for p in _trainable(model)], dist.get_world_size()), 0)
    zero1_step(model, shard, optimizer)


def _flattens_every_parameter(model, shard, optimizer):
    """Ignores requires_grad: a frozen parameter has no gradient (taken as zeros here), and the
    flat vector no longer matches zero1_setup's shard."""
    world_size = dist.get_world_size()
    grads = flat_padded([torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()], world_size)
    grad_shard = torch.empty(grads.numel() // world_size)
    dist.reduce_scatter_tensor(grad_shard, grads)
    shard.grad = grad_shard[: shard.numel()] / world_size
    optimizer.step()
    flat = torch.empty_like(grads)
    dist.all_gather_into_tensor(flat, torch.cat([shard.detach(), grad_shard[shard.numel():]]))
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def _zero_grad_after_the_step(model, shard, optimizer):
    zero1_step(model, shard, optimizer)
    optimizer.zero_grad()  # shard.grad = None: harmless once the step is done


def _crashes(model, shard, optimizer):
    raise KeyError("oops")


def _list_collectives(model, shard, optimizer, scatter_a_list=False):
    """Right, with dist.all_gather on a list: the same bytes as all_gather_into_tensor on gloo. With
    ``scatter_a_list``, dist.reduce_scatter on a list too: right values, but more bytes on gloo."""
    world_size = dist.get_world_size()
    grads = flat_padded([p.grad for p in _trainable(model)], world_size)
    mine = torch.empty_like(shard)
    if scatter_a_list:
        dist.reduce_scatter(mine, list(grads.chunk(world_size)))
    else:
        dist.reduce_scatter_tensor(mine, grads)
    shard.grad = mine / world_size
    optimizer.step()
    slices = [torch.empty_like(shard) for _ in range(world_size)]
    dist.all_gather(slices, shard.detach())
    _copy_back(model, torch.cat(slices))


_whole_adams = {}  # in the rank's process: one Adam over the whole model, kept from step to step


def _keeps_a_whole_adam(model, shard, optimizer):
    """ZeRO-1's collectives and bytes, DDP's memory: the gathered slices are the averaged *gradient*, and
    an Adam over the whole model (its state for every value, on every rank) steps; the real optimizer
    steps only for show."""
    world_size, params = dist.get_world_size(), _trainable(model)
    whole = _whole_adams.setdefault(id(model), torch.optim.Adam(params, lr=0.1))
    grads = flat_padded([p.grad for p in params], world_size)
    mine = torch.empty_like(shard)
    dist.reduce_scatter_tensor(mine, grads)
    mine /= world_size
    shard.grad = mine.clone()
    optimizer.step()
    flat = torch.empty_like(grads)
    dist.all_gather_into_tensor(flat, mine)
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    whole.step()


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_no_division, "divide by the world size"),
        (_no_gather, "all_gather the updated shards"),
        (_all_reduce, "you used all_reduce"),
        (_never_sets_grad, "shard.grad was None"),
        (_never_steps, "never called optimizer.step()"),
        (_gathers_the_gradient, "the weights differ from DDP + Adam"),
        (_wrong_slice, "not this rank's slice"),
        (_crashes, "KeyError"),
        (_sums_gathered_gradients, "all-gathered more than one slice per rank"),
        (_two_rank_partner, "never reduce-scattered the whole gradient"),  # right sums on 2 ranks, fails on 3
        (_all_reduces_on_a_subgroup, "never reduce-scattered the whole gradient on the default process group"),
        (_scatters_for_show_and_all_reduces_on_a_subgroup, "more on the wire than a reduce-scatter and an all-gather"),
        (_broadcasts_the_gradient_too, "also called broadcast"),
        (_flattens_every_parameter, "shard.grad is not this rank's slice"),
        (functools.partial(_list_collectives, scatter_a_list=True), "gloo sends more bytes for it"),
        (_keeps_a_whole_adam, "keeps 436 bytes of tensors alive from one step to the next"),  # 8 x 53 + 4 x 3
    ],
)
def test_zero1_step_rejects_wrong_answers(answer, hint):
    feedback = nb11.zero1_step(answer)
    assert feedback.status == "wrong" and hint in said(feedback), feedback


def test_zero1_step_accepts_a_step_that_zeroes_the_gradient_afterwards():
    assert nb11.zero1_step(_zero_grad_after_the_step).status == "correct"


def test_zero1_step_accepts_the_list_form_of_the_all_gather():
    """dist.all_gather on a list does the same step with the same bytes: not 'bytes a ZeRO-1 step does not need'."""
    feedback = nb11.zero1_step(_list_collectives, world_sizes=(3,))  # padding, no single partner
    assert feedback.status == "correct", feedback


def test_zero1_step_without_wire_judges_by_process_groups_and_says_so(monkeypatch):
    """Where course.observe.wire cannot measure (macOS, Windows; simulated), the all-reduce hidden on a
    subgroup is still rejected (a process group of the answer's own), and a right answer's verdict says
    the bytes were not measured."""
    monkeypatch.setattr(nb11.wire, "available", lambda: False)
    feedback = nb11.zero1_step(_scatters_for_show_and_all_reduces_on_a_subgroup)
    assert feedback.status == "wrong" and "process group of its own" in said(feedback), feedback
    feedback = nb11.zero1_step(_zero_grad_after_the_step, world_sizes=(2,))  # one launch is enough for the verdict
    assert feedback.status == "correct" and "bytes on the wire not measured" in said(feedback), feedback


# ------------------------------------------------------------------ Exercise 2 (fully_shard_by_hand)


def _never_frees(model, units):  # ZeRO-2: parameters whole all the time
    shards = shard_parameters(model)
    reduce_scatter_gradients(shards)
    return shards


def _reduce_by(collective, free):
    """reduce_scatter_gradients(shards, free) with another way of reducing: collective(whole gradient,
    world size) returns the summed padded gradient, of which each rank keeps its slice."""

    def attach(shards):
        world_size = dist.get_world_size()

        def hook(p):
            grad = torch.nn.functional.pad(p.grad.reshape(-1), (0, -p.numel() % world_size))
            shards[p].grad = collective(grad, world_size).chunk(world_size)[dist.get_rank()] / world_size
            p.grad = None
            if free:
                free_parameter(p)

        for p in shards:
            p.register_post_accumulate_grad_hook(hook)

    return attach


def _all_reduce_on(group):
    def collective(grad, world_size):
        dist.all_reduce(grad, group=group() if group else None)
        return grad

    return collective


def _scatter_for_show_then_all_reduce_on(group):
    """A reduce-scatter the traced default group sees, and an all-reduce on a group it does not see."""

    def collective(grad, world_size):
        dist.reduce_scatter_tensor(torch.empty(grad.numel() // world_size), grad.clone())
        dist.all_reduce(grad, group=group())
        return grad

    return collective


def _gather_and_sum(grad, world_size):
    everyone = torch.empty(world_size * grad.numel())
    dist.all_gather_into_tensor(everyone, grad)
    return everyone.view(world_size, -1).sum(0)


def _hooks(model, units, before_backward=True, free_after_gradient=True, gather_all_for_backward=False, reduce=None,
           only_if_freed=True, root=True, keep_root=False, keep_tied=False):
    shards = shard_parameters(model)
    for p in shards:
        free_parameter(p)
    if reduce is None:
        reduce_scatter_gradients(shards, free=free_after_gradient)
    else:
        reduce(shards)
    in_units = {p for unit in units for p in unit.parameters()}
    root_part = [(model, [p for p in model.parameters() if p not in in_units])] if root else []
    # keep_tied: a parameter that a later unit uses too stays whole from this unit's forward to that one's
    later = {id(u): [p for p in u.parameters() if any(p is q for v in units[i + 1:] for q in v.parameters())]
             for i, u in enumerate(units)}
    for unit, params in [(u, list(u.parameters())) for u in units] + root_part:
        own = [p for p in params if p in shards]

        def gather(*_, own=own):
            for p in own:
                if not only_if_freed or p.untyped_storage().nbytes() == 0:
                    gather_parameter(p, shards[p])

        def after_forward(module, args, output, own=own, gather=gather):
            if keep_root and module is model:  # FSDP2's root: whole from its forward to its backward
                return
            for p in own:
                if not (keep_tied and any(p is q for q in later.get(id(module), ()))):
                    free_parameter(p)
            if before_backward:
                output.register_hook(gather)

        unit.register_forward_pre_hook(gather)
        unit.register_forward_hook(after_forward)
    if gather_all_for_backward:  # the root's output hook runs first in backward: every unit whole at once

        def gather_all(grad):
            for p, shard in shards.items():
                if p.untyped_storage().nbytes() == 0:
                    gather_parameter(p, shard)

        model.register_forward_hook(lambda m, a, output: output.register_hook(gather_all) and None)
    return shards


def _forgets_the_root(model, units):
    """No hooks on the model itself: the parameters of no unit stay freed when its forward uses them."""
    return _hooks(model, units, root=False)


def _gathers_the_tied_weight_twice(model, units):
    """Gathers a unit's parameters even when they are whole: the tied weight, whole already when
    backward reaches its second unit, is all-gathered again (right weights, more bytes)."""
    return _hooks(model, units, only_if_freed=False)


def _gathers_every_unit_for_backward(model, units):
    return _hooks(model, units, gather_all_for_backward=True)


def _all_reduces_on_a_subgroup_unit(model, units):
    groups = {}
    group = lambda: groups.setdefault("all", dist.new_group(list(range(dist.get_world_size()))))  # noqa: E731
    group()  # created by every rank, in the same order
    return _hooks(model, units, reduce=_reduce_by(_all_reduce_on(group), free=True))


def _scatters_for_show_unit(model, units):
    groups = {}
    group = lambda: groups.setdefault("all", dist.new_group(list(range(dist.get_world_size()))))  # noqa: E731
    group()
    return _hooks(model, units, reduce=_reduce_by(_scatter_for_show_then_all_reduce_on(group), free=True))


def _sums_gathered_gradients_unit(model, units):
    return _hooks(model, units, reduce=_reduce_by(_gather_and_sum, free=True))


def _calls_the_course_version(model, units):
    return fully_shard_by_hand(model, units)


def _fsdp2(model, units):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return {p: p for p in model.parameters() if p.requires_grad}


def _no_gather_before_backward(model, units):
    return _hooks(model, units, before_backward=False)


def _keeps_parameters_after_backward(model, units):
    return _hooks(model, units, free_after_gradient=False)


def _gathers_everything_at_the_root(model, units):
    return _hooks(model, [])  # the model is the only unit: every parameter whole for the whole forward


def _returns_nothing(model, units):
    _hooks(model, units)


def _all_reduces(model, units):
    """Each gradient all-reduced whole (on the default group), then sliced: DDP's collective."""
    return _hooks(model, units, reduce=_reduce_by(_all_reduce_on(None), free=True))


def _reduce_after_backward(stash):
    """ZeRO-3's parameter freeing, but every gradient reduce-scattered only when backward ends (a callback
    queued on autograd's engine): whole gradients all through backward. With ``stash`` the whole gradients
    are moved out of p.grad into a list of the answer's own until then."""

    def attach(shards):
        world_size, queued, stashed = dist.get_world_size(), [], {}

        def reduce_all():
            queued.clear()
            for p, shard in shards.items():
                whole = stashed.pop(p, None) if stash else p.grad
                if whole is None:
                    continue
                grad = torch.nn.functional.pad(whole.reshape(-1), (0, -p.numel() % world_size))
                mine = torch.empty_like(shard)
                dist.reduce_scatter_tensor(mine, grad)
                shard.grad = mine / world_size if shard.grad is None else shard.grad + mine / world_size
                p.grad = None

        def hook(p):
            if stash:
                stashed[p], p.grad = p.grad, None
            free_parameter(p)
            if not queued:
                queued.append(True)
                torch.autograd.Variable._execution_engine.queue_callback(reduce_all)

        for p in shards:
            p.register_post_accumulate_grad_hook(hook)

    return attach


def _keeps_whole_gradients_until_backward_ends(model, units):
    return _hooks(model, units, reduce=_reduce_after_backward(stash=False))


def _stashes_whole_gradients_until_backward_ends(model, units):
    return _hooks(model, units, reduce=_reduce_after_backward(stash=True))


def _keeps_a_copy_for_backward(model, units):
    """Gathers each unit for its forward and frees it after, but keeps a whole copy aside and refills the
    parameters from it for backward: no all-gather in backward, and the memory ZeRO-3 frees still held."""
    shards = shard_parameters(model)
    for p in shards:
        free_parameter(p)
    reduce_scatter_gradients(shards, free=True)
    in_units = {p for unit in units for p in unit.parameters()}
    copies = {}
    for unit, params in [(u, list(u.parameters())) for u in units] + [(model, [p for p in model.parameters()
                                                                               if p not in in_units])]:
        own = [p for p in params if p in shards]

        def gather(*_, own=own):
            for p in own:
                if p.untyped_storage().nbytes() == 0:
                    gather_parameter(p, shards[p])

        def refill(grad, own=own):
            for p in own:
                if p.untyped_storage().nbytes() == 0:
                    p.untyped_storage().resize_(p.numel() * p.element_size())
                    p.data.copy_(copies[p])

        def after_forward(module, args, output, own=own, refill=refill):
            for p in own:
                copies[p] = p.detach().clone()  # whole, from forward to backward
                free_parameter(p)
            output.register_hook(refill)

        unit.register_forward_pre_hook(gather)
        unit.register_forward_hook(after_forward)
    return shards


def test_fully_shard_by_hand_accepts_an_answer_built_from_the_parts():
    """On 3 ranks (uneven shards), with the root's parameters kept whole from its forward to its backward,
    as FSDP2 does, and a tied weight kept whole from its first unit's forward to its second's (fewer bytes
    gathered in forward than the course's version: allowed; it was rejected as a hidden backward copy once).
    2 ranks, plain: the test below."""
    feedback = nb11.fully_shard_by_hand(functools.partial(_hooks, keep_root=True, keep_tied=True), world_sizes=(3,))
    assert feedback.status == "correct", feedback


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_never_frees, "between forward and backward a unit's parameters were still whole"),
        (_no_gather_before_backward, "gather each unit's parameters again before its backward"),
        (_keeps_parameters_after_backward, "after the step some parameters were still whole"),
        (_gathers_everything_at_the_root, "parameters of other units were whole too"),
        (_returns_nothing, "return the {parameter: shard} dict"),
        (_all_reduces, "you used all_reduce"),
        (_gathers_every_unit_for_backward, "when backward reached a unit, parameters of other units were whole too"),
        (_all_reduces_on_a_subgroup_unit, "saw no reduce-scatter of every trainable gradient"),
        (_sums_gathered_gradients_unit, "saw no reduce-scatter of every trainable gradient"),
        (_scatters_for_show_unit, "more on the wire in 2 steps than the course's"),
        (_keeps_whole_gradients_until_backward_ends, "whole gradients of units it had passed were still held"),
        (_stashes_whole_gradients_until_backward_ends, "not reduce-scattered into their shards yet"),
        (_gathers_the_tied_weight_twice, "the model with a tied weight: your ranks all-gathered"),
        (_keeps_a_copy_for_backward, "that is fully_shard's reshard_after_forward=False"),
        (_forgets_the_root, "parameters of no unit still freed: gather them in a forward pre-hook on the model"),
        (fully_shard_by_hand, "the course's own course.parallel.fsdp.fully_shard_by_hand"),
        (_calls_the_course_version, "the course's own course.parallel.fsdp.fully_shard_by_hand"),
        pytest.param(_fsdp2, "that is PyTorch's FSDP2", marks=pytest.mark.skipif(
            not torch_at_least(PART_II_TORCH), reason="torch 2.8's fully_shard fails here before the check sees it")),
    ],
)
def test_fully_shard_by_hand_rejects_wrong_answers(answer, hint):
    feedback = nb11.fully_shard_by_hand(answer)
    assert feedback.status == "wrong" and hint in said(feedback), feedback


def test_fully_shard_by_hand_without_wire_judges_by_process_groups_and_says_so(monkeypatch):
    """Where course.observe.wire cannot measure (simulated): the all-reduce on a subgroup behind a
    reduce-scatter for show is rejected by another measure, and a right answer is told what was not checked."""
    monkeypatch.setattr(nb11.wire, "available", lambda: False)
    feedback = nb11.fully_shard_by_hand(_scatters_for_show_unit)
    assert feedback.status == "wrong" and "process group of its own" in said(feedback), feedback
    feedback = nb11.fully_shard_by_hand(_hooks, world_sizes=(2,))  # 3 ranks: the test above
    assert feedback.status == "correct" and "bytes on the wire not measured" in said(feedback), feedback


# ------------------------------------------------------------------ Exercise 3 (scaled_step)


def _scaler(agree="max", unscale=True, zero_on_skip=True, halve=True, test=torch.isfinite, first_only=False):
    def step(shards, optimizer, loss, scale):
        (loss * scale).backward()
        if first_only:  # looks at the first shard only
            found = torch.tensor([float(not torch.isfinite(next(iter(shards.values())).grad).all())])
        elif test is torch.isinf:  # misses a NaN
            found = torch.tensor([float(any(torch.isinf(s.grad).any() for s in shards.values()))])
        else:
            found = torch.tensor([float(not all(torch.isfinite(s.grad).all() for s in shards.values()))])
        if agree == "max":
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        elif agree == "sum":
            dist.all_reduce(found)  # any nonzero count means an overflow somewhere: also right
        elif agree == "rank 0":
            dist.broadcast(found, 0)
        elif agree == "where found" and found.item():  # one-sided: only a rank that found an overflow all-reduces
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        elif agree == "copies":  # right verdicts, but whole shards on the wire instead of one number
            copies = [s.grad.clone() for s in shards.values()]
            for grad_copy in copies:
                dist.all_reduce(grad_copy)
            found = torch.tensor([float(not all(torch.isfinite(c).all() for c in copies))])
        if found.item():
            if zero_on_skip:
                optimizer.zero_grad()
            return (scale / 2 if halve else scale), False
        if unscale:
            for s in shards.values():
                s.grad /= scale
        optimizer.step()
        return scale, True

    return step


def _sharded_grad_scaler(shards, optimizer, loss, scale):
    """PyTorch's own scaler for sharded gradients, which all-reduces its found-inf flag itself."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    scaler = ShardedGradScaler(device="cpu", init_scale=scale)
    scaler.scale(loss).backward()
    stepped = scaler.step(optimizer) is not None or not any(
        v.item() for v in scaler._found_inf_per_device(optimizer).values())
    scaler.update()
    if not stepped:
        optimizer.zero_grad()
    return scaler.get_scale(), stepped


def test_scaled_step_accepts_the_solution_and_a_summed_verdict():
    assert nb11.scaled_step(scaled_step).status == "correct"
    assert nb11.scaled_step(_scaler(agree="sum"), world_sizes=(3,)).status == "correct"  # 2 and 3: the line above


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_scaler(agree=None), "the ranks disagreed"),
        (_scaler(agree="rank 0"), "was taken though a gradient held an inf or a NaN"),
        (_scaler(agree="copies"), "copies of the gradient shards"),
        (_scaler(unscale=False), "still scaled"),
        (_scaler(zero_on_skip=False), "zero the gradients"),
        (_scaler(halve=False), "halve it when the step is skipped"),
        (_scaler(test=torch.isinf), "test with torch.isfinite"),
        (_scaler(first_only=True), "step 1 was taken though a gradient held an inf or a NaN"),
        (_sharded_grad_scaler, "that is PyTorch's GradScaler"),
        (lambda shards, optimizer, loss, scale: scale, "return (the new scale, whether the step was taken)"),
    ],
)
def test_scaled_step_rejects_wrong_answers(answer, hint):
    feedback = nb11.scaled_step(answer)
    assert feedback.status == "wrong" and hint in said(feedback), feedback


def test_scaled_step_names_the_ranks_that_never_joined_a_one_sided_collective():
    # At step 0 the overflow lands in the last rank's slice: it all-reduces, rank 0 goes on to its next step.
    # It hangs forever: the check stops it after hang_s (10 s by default; 3 here, on 2 ranks, to keep the test short).
    feedback = nb11.scaled_step(_scaler(agree="where found"), world_sizes=(2,), hang_s=3)
    assert feedback.status == "wrong", feedback
    assert "rank 1 waited in a collective of your step that rank 0 never joined" in said(feedback), feedback
    assert "stopped them after 3 s" in said(feedback) and "rank 1:" in feedback.details, feedback


def _slow(shards, optimizer, loss, scale):
    """Right, but slow (a stand-in for a per-element Python loop): 7 steps take 7 s."""
    time.sleep(1.0)
    return scaled_step(shards, optimizer, loss, scale)


def test_scaled_step_calls_a_slow_answer_slow_not_mismatched():
    """Ranks still running the answer outside a collective at the timeout were slow, not waiting for
    each other: the verdict says so, and where they were."""
    feedback = nb11.scaled_step(_slow, world_sizes=(2,), hang_s=3)
    assert feedback.status == "wrong", feedback
    assert "still running your step (test_checks_nb11.py:" in said(feedback) and "too slow?" in said(feedback), feedback
    assert "never joined" not in said(feedback) and "did not match" not in said(feedback), feedback


def _async_one_sided(shards, optimizer, loss, scale):
    """Only ranks that found an overflow all-reduce, with async_op=True: they wait in Work.wait(), C++."""
    found = torch.tensor(1.0)
    dist.all_reduce(found, op=dist.ReduceOp.MAX, async_op=True).wait()
    return scale, True


def test_scaled_step_counts_a_rank_blocked_in_work_wait_as_waiting_in_a_collective():
    """The verdict on stacks as the launcher dumps them at a timeout (no launch): rank 1 is blocked in
    Work.wait(), whose innermost Python frame is the answer's own line, rank 0 went on."""
    import inspect
    from types import SimpleNamespace

    lines, first = inspect.getsourcelines(_async_one_sided)
    at = first + next(i for i, line in enumerate(lines) if ".wait(" in line)
    here = _async_one_sided.__code__.co_filename
    stack = (f'Thread 0x1 (most recent call first):\n  File "{here}", line {at} in _async_one_sided\n'
             f'  File "/course/checks/nb11.py", line 1 in _scaler_pair\n')
    stacks = {0: 'Thread 0x1 (most recent call first):\n  File "/x/y.py", line 3 in forward\n', 1: stack}
    # faulthandler prints the most recent call first; the launcher's stacks read the other way round
    stacks = {r: "\n".join(reversed(s.splitlines())) for r, s in stacks.items()}
    feedback = nb11._scaler_hung(_async_one_sided, SimpleNamespace(stacks=stacks, ranks=[0, 1]), 2, 10)
    assert "rank 1 waited in a collective of your step that rank 0 never joined" in said(feedback), feedback
    assert "too slow" not in said(feedback), feedback
