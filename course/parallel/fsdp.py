"""ZeRO-2 and ZeRO-3 (FSDP) by hand, one small step after ZeRO-1 (``course/parallel/zero.py``).
Notebook 11 derives these functions (a test checks they are the same code).

Every trainable parameter is cut into N equal flat slices (the last one padded with zeros),
and rank r keeps slice r as a parameter of its own, its **shard**; the optimizer knows
only the shards::

    shards = shard_parameters(model)                     # {parameter: this rank's shard}
    optimizer = torch.optim.Adam(shards.values(), lr=1e-3)

* **ZeRO-2**: parameters stay whole. A hook reduce-scatters each gradient the moment
  backward has produced it and drops the whole gradient (:func:`reduce_scatter_gradients`);
  after ``optimizer.step()`` :func:`gather_parameter` makes every parameter whole again.
* **ZeRO-3 / FSDP**: parameters are freed too (:func:`free_parameter`), and each *unit* (a
  module: a layer, a block) gathers its parameters just before its forward, frees them
  after it, gathers them again before its backward, and frees each one as soon as its
  gradient is reduce-scattered (:func:`fully_shard_by_hand`).
* **Mixed precision** (:func:`compute_in`): the all-gather makes bfloat16 (or float16) copies
  to compute with; shards, optimizer state and gradient reduction stay float32. With float16,
  :func:`scaled_step` scales the loss and skips a step that overflowed, on every rank alike.
* :func:`gather_masters` gives every rank the whole float32 master weights, by name.

Frozen parameters (``requires_grad=False``) are not sharded: they stay whole on every
rank, as under DDP (FSDP2 shards them too). Like DDP, rank 0's parameters are broadcast
first, so ranks that initialised differently start equal; buffers are not (DDP broadcasts
them too, FSDP2 broadcasts nothing). A unit must return one tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def shard_parameters(model):
    """{parameter: this rank's slice of it}, for every trainable parameter of ``model``, after
    broadcasting rank 0's values (as DDP does). Shared (tied) parameters appear once."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shards = {}
    for p in model.parameters():
        dist.broadcast(p.data, 0)
        if p.requires_grad:
            flat = nn.functional.pad(p.detach().reshape(-1), (0, -p.numel() % world_size))
            shards[p] = nn.Parameter(flat.chunk(world_size)[rank].clone())
    return shards


def gather_parameter(p, shard):
    """Make ``p`` whole: all-gather every rank's slice into its memory (given back if freed),
    in ``p``'s dtype (the shard's, unless :func:`compute_in` changed it)."""
    full = torch.empty(shard.numel() * dist.get_world_size(), dtype=p.dtype)
    dist.all_gather_into_tensor(full, shard.detach().to(p.dtype))
    p.untyped_storage().resize_(p.numel() * p.element_size())
    p.data.copy_(full[: p.numel()].view_as(p))  # .data: autograd must not see a change of p


def free_parameter(p):
    """Give ``p``'s memory back; autograd and ``p`` keep pointing at it, empty, until it is refilled."""
    p.untyped_storage().resize_(0)


def reduce_scatter_gradients(shards, free=False):
    """ZeRO-2: as soon as backward has summed a parameter's gradient, reduce-scatter it into
    this rank's shard (the mean over ranks) and drop the whole gradient; with ``free``
    (ZeRO-3), free the parameter too: backward needs it no more."""
    world_size = dist.get_world_size()

    def hook(p):
        shard = shards[p]
        grad = nn.functional.pad(p.grad.to(shard.dtype).reshape(-1), (0, -p.numel() % world_size))
        mine = torch.empty_like(shard)
        dist.reduce_scatter_tensor(mine, grad)  # the sum over ranks, of my slice only
        shard.grad = mine / world_size if shard.grad is None else shard.grad + mine / world_size
        p.grad = None
        if free:
            free_parameter(p)

    for p in shards:
        p.register_post_accumulate_grad_hook(hook)


def fully_shard_by_hand(model, units):
    """ZeRO-3: parameters sharded at rest; each unit of ``units`` (and then ``model`` itself, for
    the parameters of no unit) gathers them for its forward and again for its backward."""
    shards = shard_parameters(model)
    for p in shards:
        free_parameter(p)
    reduce_scatter_gradients(shards, free=True)
    in_units = {p for unit in units for p in unit.parameters()}
    rest = [p for p in model.parameters() if p not in in_units]
    for unit, params in [(unit, list(unit.parameters())) for unit in units] + [(model, rest)]:
        own = [p for p in params if p in shards]

        def gather(*_, own=own):
            for p in own:
                if p.untyped_storage().nbytes() == 0:  # a tied parameter may be whole already
                    gather_parameter(p, shards[p])

        def after_forward(module, args, output, own=own, gather=gather):
            for p in own:
                free_parameter(p)
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(gather)  # runs before backward goes into the unit
            elif own and torch.is_grad_enabled() and not isinstance(output, torch.Tensor):
                raise TypeError(f"a unit must return one tensor (to hook its backward), not {type(output).__name__}")

        unit.register_forward_pre_hook(gather)
        unit.register_forward_hook(after_forward)
    return shards


def gather_masters(model, shards):
    """{name: the whole parameter}, gathered from every rank's shards (one all-gather each) in the
    shards' dtype: the float32 master weights even after :func:`compute_in`. Frozen parameters as
    they are. Every rank gets all of it: to save a checkpoint, or to compare with another run."""
    world_size, masters = dist.get_world_size(), {}
    for name, p in model.named_parameters():  # a tied parameter once, under its first name
        if p not in shards:
            masters[name] = p.detach().clone()
            continue
        full = torch.empty(shards[p].numel() * world_size, dtype=shards[p].dtype)
        dist.all_gather_into_tensor(full, shards[p].detach())
        masters[name] = full[: p.numel()].view(p.shape)
    return masters


def compute_in(model, shards, dtype):
    """Mixed precision, after :func:`fully_shard_by_hand`: forward and backward run on copies in
    ``dtype`` (bfloat16, float16), made by the all-gather; the shards, the optimizer's state and
    the reduce-scatter of the gradients stay in the shards' float32. Frozen parameters are cast."""
    for p in model.parameters():
        if p in shards:
            p.data = torch.empty_like(p, dtype=dtype)  # refilled by the next gather, in dtype
            free_parameter(p)
        else:
            p.data = p.data.to(dtype)


def scaled_step(shards, optimizer, loss, scale):
    """One step with loss scaling (float16): backward on ``loss * scale``; if any rank's gradient
    shards hold an inf or NaN, every rank skips the step and halves the scale (the verdict is
    all-reduced: each rank sees only its own shards); otherwise unscale and step.
    Returns the new scale and whether the step was taken."""
    (loss * scale).backward()
    found_inf = torch.tensor([float(not all(torch.isfinite(s.grad).all() for s in shards.values()))])
    dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)  # one verdict for all ranks
    if found_inf.item():
        optimizer.zero_grad()
        return scale / 2, False
    for s in shards.values():
        s.grad /= scale
    optimizer.step()
    return scale, True


def prefetch_forward(units, shards):
    """Forward prefetching, after :func:`fully_shard_by_hand`: when a unit starts its forward, start
    the all-gathers of the next unit's parameters without waiting (``async_op=True``), so that they
    travel while this unit computes; the next unit then waits for them instead of gathering.
    ``units`` in the order forward runs them. (FSDP2 prefetches in backward too.)"""
    world_size, pending = dist.get_world_size(), {}

    def start(module, args, upcoming):
        for p in upcoming:
            if p.untyped_storage().nbytes() == 0 and p not in pending:
                full = torch.empty(shards[p].numel() * world_size, dtype=p.dtype)
                work = dist.all_gather_into_tensor(full, shards[p].detach().to(p.dtype), async_op=True)
                pending[p] = work, full

    def wait(module, args, own):
        for p in own:
            if p in pending:
                work, full = pending.pop(p)
                work.wait()
                p.untyped_storage().resize_(p.numel() * p.element_size())
                p.data.copy_(full[: p.numel()].view_as(p))

    for unit, upcoming in zip(units, units[1:]):
        unit.register_forward_pre_hook(lambda m, a, up=[p for p in upcoming.parameters() if p in shards]: start(m, a, up))
    for unit in units[1:]:
        own = [p for p in unit.parameters() if p in shards]
        unit.register_forward_pre_hook(lambda m, a, own=own: wait(m, a, own), prepend=True)  # before its gather
