"""ZeRO stage 1 by hand: every rank keeps the optimizer state of one slice of the
parameters only. Notebook 11 derives these functions (a test checks they are the same code).

    shard, optimizer = zero1_setup(model, torch.optim.Adam, lr=1e-3)
    for x, y in batches:
        model.zero_grad()
        loss(model(x), y).backward()        # plain backward: no DDP, no hooks
        zero1_step(model, shard, optimizer)  # reduce-scatter, Adam on the shard, all-gather

Frozen parameters (``requires_grad=False``) stay out of the flat vector. :class:`ShardedOptimizer`
packs the same step as an optimizer built like ``ZeroRedundancyOptimizer``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def flat_padded(tensors, world_size: int) -> torch.Tensor:
    """The tensors as one flat vector, zero-padded to a multiple of ``world_size``."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    return nn.functional.pad(flat, (0, -flat.numel() % world_size))


def zero1_setup(model, optimizer_class, **options):
    """This rank's slice of the flat trainable parameters, and an optimizer that knows only it.
    Frozen parameters (requires_grad=False) stay out: no gradient, and no weight decay moves them."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    flat = flat_padded([p for p in model.parameters() if p.requires_grad], world_size)
    shard = nn.Parameter(flat.chunk(world_size)[rank].clone())
    return shard, optimizer_class([shard], **options)


def zero1_step(model, shard, optimizer):
    """After backward: average the gradients into this rank's slice (reduce-scatter),
    update the slice, and give every rank every updated slice (all-gather)."""
    world_size = dist.get_world_size()
    params = [p for p in model.parameters() if p.requires_grad]  # as zero1_setup flattened them
    grads = flat_padded([p.grad for p in params], world_size)
    grad_shard = torch.empty_like(shard)
    dist.reduce_scatter_tensor(grad_shard, grads)  # the sum over ranks, of my slice only
    shard.grad = grad_shard / world_size
    optimizer.step()
    flat = torch.empty_like(grads)
    dist.all_gather_into_tensor(flat, shard.detach())  # every rank's updated slice
    with torch.no_grad():
        offset = 0
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


class ShardedOptimizer:
    """ZeRO-1 as an optimizer, built like ``torch.distributed.optim.ZeroRedundancyOptimizer``:
    ``ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)``, or a list of param group
    dicts with options of their own. Unlike it, it runs on a plain model (no DDP): :meth:`step` is
    :func:`zero1_step` per param group (reduce-scatter, step on this rank's slice, all-gather), and
    it slices flat vectors, not whole tensors. Frozen parameters stay out; a parameter listed twice
    (tied weights) counts once. Every trainable parameter must have a gradient when it steps.
    ``state_dict()`` is this rank's slices' state: load it on as many ranks."""

    def __init__(self, params, optimizer_class, **defaults):
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        seen, self.parts = set(), []
        for group in groups:
            options = {**defaults, **{k: v for k, v in group.items() if k != "params"}}
            mine = nn.ParameterList([p for p in group["params"] if p.requires_grad and p not in seen])
            seen.update(mine)
            if len(mine):
                shard, optimizer = zero1_setup(mine, optimizer_class, **options)
                self.parts.append((mine, shard, optimizer))
        self.param_groups = [g for _, _, optimizer in self.parts for g in optimizer.param_groups]

    def zero_grad(self):
        for params, _, _ in self.parts:
            for p in params:
                p.grad = None

    def step(self):
        for params, shard, optimizer in self.parts:
            zero1_step(params, shard, optimizer)

    def state_dict(self):
        return {"groups": [optimizer.state_dict() for _, _, optimizer in self.parts]}

    def load_state_dict(self, state):
        if len(state["groups"]) != len(self.parts):
            raise ValueError(f"a state of {len(state['groups'])} param groups for an optimizer of {len(self.parts)}")
        for (_, _, optimizer), group_state in zip(self.parts, state["groups"]):
            optimizer.load_state_dict(group_state)
