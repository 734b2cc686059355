"""Bytes per rank: what the tensors of a model and its optimizer really hold.

Notebook 11 derives these two functions (and a test checks that they are the same code):

    >>> bytes_per_rank(model, optimizer)
    {'parameters': 1048576, 'gradients': 1048576, 'optimizer': 2097168}

They count *storage*, the memory a tensor points into, not ``numel()``: a sharded
parameter (a ``DTensor``) is counted by its local shard (``to_local()``), padding
included, and tensors that are views of one buffer are counted once.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


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
