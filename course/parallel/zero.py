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

import copy

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


def _each_once(params):
    """Param groups (dicts) from ``params``, with a parameter listed again (a tied weight) left out."""
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    seen, once = set(), []
    for group in groups:
        listed = group["params"]
        mine = []
        for p in [listed] if isinstance(listed, torch.Tensor) else listed:
            if p not in seen:
                seen.add(p)
                mine.append(p)
        once.append({**group, "params": mine})
    return once


def _options(group) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def _per_element(name, value, shape) -> bool:
    """Is this optimizer state one value per element of a tensor of ``shape`` (Adam's moments), or
    one for the whole tensor (Adam's ``step``)?"""
    return isinstance(value, torch.Tensor) and value.shape == shape and (value.dim() > 0 or name != "step")


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1 as a ``torch.optim.Optimizer``, built like ``torch.distributed.optim.ZeroRedundancyOptimizer``:
    ``ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)``, or a list of param group dicts
    with options of their own. Unlike it, it runs on a plain model (no DDP) and slices flat vectors, not
    whole tensors: :meth:`step` is :func:`zero1_step` for each param group (reduce-scatter, the inner
    optimizer's step on this rank's slice, all-gather). Frozen parameters stay out of the slices; a
    parameter listed twice (tied weights) counts once. Every trainable parameter needs a gradient.
    Like it, it broadcasts nothing when built: start every rank from the same weights (under
    ``ZeroRedundancyOptimizer`` DDP's constructor broadcasts rank 0's; here, seed alike or broadcast them).

    ``param_groups`` are the whole groups, as in any optimizer: an LR scheduler changes their options, and
    each step hands them to the inner optimizers. :meth:`consolidate_state_dict` (on every rank) gathers the
    slices' state on one rank, where :meth:`state_dict` is then an unsharded optimizer's (one entry per
    parameter); :meth:`load_state_dict` takes such a state on any number of ranks, each keeping its slice."""

    def __init__(self, params, optimizer_class, **defaults):
        self.optimizer_class = optimizer_class
        self.parts = []  # per param group: (trainable parameters, this rank's slice, its optimizer) or None
        self._consolidated = None
        super().__init__(_each_once(params), defaults)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)  # torch's checks, and the defaults filled in
        group = self.param_groups[-1]
        trainable = nn.ParameterList([p for p in group["params"] if p.requires_grad])
        if not len(trainable):
            self.parts.append(None)
            return
        shard, optimizer = zero1_setup(trainable, self.optimizer_class, **_options(group))
        group.update(_options(optimizer.param_groups[0]))  # the inner optimizer's own defaults shown too
        self.parts.append((trainable, shard, optimizer))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, part in zip(self.param_groups, self.parts):
            if part is None:
                continue
            trainable, shard, optimizer = part
            missing = [tuple(p.shape) for p in trainable if p.grad is None]
            if missing:
                raise RuntimeError(f"ShardedOptimizer: no gradient for trainable parameters of shapes {missing}; "
                                   "every rank must reduce every gradient (freeze them: requires_grad_(False))")
            optimizer.param_groups[0].update(_options(group))  # e.g. the lr an LR scheduler set
            zero1_step(trainable, shard, optimizer)
        return loss

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's slices of the optimizer state on rank ``to``; call it on every rank."""
        mine = [part[2].state_dict()["state"].get(0) if part else None for part in self.parts]
        everyone = [None] * dist.get_world_size() if dist.get_rank() == to else None
        dist.gather_object(mine, everyone, dst=to)
        self._consolidated = None if everyone is None else self._whole_state(everyone)

    def _whole_state(self, everyone):
        """One state per parameter, indexed as ``torch.optim.Optimizer.state_dict`` indexes them."""
        state, index = {}, 0
        for g, (group, part) in enumerate(zip(self.param_groups, self.parts)):
            slices = [rank_state[g] for rank_state in everyone]  # None before the first step
            offset = 0
            for p in group["params"]:
                if p.requires_grad and slices[0] is not None:
                    shard_shape = part[1].shape
                    state[index] = {
                        name: torch.cat([s[name] for s in slices])[offset : offset + p.numel()].view_as(p).clone()
                        if _per_element(name, value, shard_shape) else copy.deepcopy(value)
                        for name, value in slices[0].items()
                    }
                    offset += p.numel()
                index += 1
        return state

    def state_dict(self):
        """The whole optimizer's state, as an unsharded optimizer's; only on the rank that
        :meth:`consolidate_state_dict` gathered it on, as of then."""
        if self._consolidated is None:
            raise RuntimeError(f"ShardedOptimizer: call consolidate_state_dict(to={dist.get_rank()}) on every rank "
                               "first; the state is gathered on that rank only")
        return {"state": self._consolidated, "param_groups": super().state_dict()["param_groups"]}

    def load_state_dict(self, state_dict):
        """Load a whole state (from :meth:`state_dict`, saved on any number of ranks): each rank keeps
        its slices. Call it on every rank with the same state."""
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"a state of param groups of {[len(g['params']) for g in saved]} parameters "
                             f"for an optimizer of {[len(g['params']) for g in self.param_groups]}")
        rank, world_size = dist.get_rank(), dist.get_world_size()
        for group, part, saved_group in zip(self.param_groups, self.parts, saved):
            group.update(_options(saved_group))
            if part is None:
                continue
            trainable, shard, optimizer = part
            states = [state_dict["state"].get(i) for i, p in zip(saved_group["params"], group["params"])
                      if p.requires_grad]
            inner = {}
            if any(s is not None for s in states):
                if any(s is None for s in states):
                    raise ValueError("a param group in which only some trainable parameters have a state")
                inner = {0: {name: flat_padded([s[name] for s in states], world_size).chunk(world_size)[rank].clone()
                             if _per_element(name, value, trainable[0].shape) else copy.deepcopy(value)
                             for name, value in states[0].items()}}
            optimizer.load_state_dict({"state": inner, "param_groups": [{**_options(group), "params": [0]}]})
