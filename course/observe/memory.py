"""Bytes per rank: what the tensors of a model and its optimizer really hold.

Notebook 11 derives these functions (and a test checks that they are the same code):

    >>> bytes_per_rank(model, optimizer)
    {'parameters': 1048576, 'gradients': 1048576, 'optimizer': 2097168}

and ``saved_activation_bytes``, the activations autograd keeps for backward (notebooks 11, 12 and 15).
They count *storage*, the memory a tensor points into, not ``numel()``: a sharded
parameter (a ``DTensor``) is counted by its local shard (``to_local()``), padding
included, and tensors that are views of one buffer are counted once.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode


def storage_bytes(tensors) -> int:
    """Bytes of memory behind ``tensors`` on this rank: each distinct storage once.
    A DTensor counts as its local shard; a view counts as the whole buffer it views."""
    storages = {}
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def bytes_per_rank(model, optimizer) -> dict:
    """This rank's bytes of parameters, gradients and optimizer state."""
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "parameters": storage_bytes(params),
        "gradients": storage_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": storage_bytes(state),
    }


def saved_activation_bytes(forward, model, x):
    """Bytes of the tensors autograd saves for backward while running forward(x), weights excluded."""
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()  # _cdata: which storage it is (a fake tensor's data_ptr() is always 0)
        if storage._cdata not in weights:
            saved[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward(x)
    return sum(saved.values()), out


class LiveBytes(TorchDispatchMode):
    """While active, follows every tensor an operation creates, and after each operation adds up
    the bytes of the storages still alive (each once, at its size then: a storage resized to 0
    counts 0); ``peak`` is the most seen at once. ``tensors`` made before (parameters, optimizer
    state) are followed from the start. Backward runs its operations here too."""

    def __init__(self, tensors=()):
        super().__init__()
        self.alive = {}  # id -> weak reference to a tensor
        for t in tensors:
            self.follow(t)
        self.peak = self.now()

    def follow(self, t):
        if isinstance(t, DTensor):
            t = t.to_local()
        self.alive[id(t)] = weakref.ref(t)

    def now(self) -> int:
        storages = {}
        for key, ref in list(self.alive.items()):
            t = ref()
            if t is None:
                del self.alive[key]  # dead: forget it
                continue
            storage = t.untyped_storage()
            storages[storage._cdata] = storage.nbytes()
        return sum(storages.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.follow(t)
        self.peak = max(self.peak, self.now())
        return out
