"""Collectives built from point-to-point messages: a naive all-reduce and the ring.

Notebook 10 derives them; notebooks 11-14 reuse the ring's two halves:

* :func:`ring_reduce_scatter` leaves rank ``r`` with the sum over all ranks of chunk ``r``
  (what ``dist.reduce_scatter_tensor`` does, for any length);
* :func:`ring_all_gather` copies every rank's chunk ``r`` to all ranks
  (what ``dist.all_gather_into_tensor`` does);
* :func:`ring_all_reduce` is the two in a row: each rank sends 2(N-1)/N times the
  tensor's bytes, whatever N is, instead of rank 0 sending (N-1) times them.

A tensor is cut into ``world_size`` chunks with :func:`chunks` (``torch.tensor_split``:
when the length does not divide, the first chunks are one element longer). The
functions work in place on the tensor's memory, so it must be contiguous.

Every message goes through :func:`send` / :func:`isend`, which add up the bytes this
rank sends (:func:`bytes_sent`, :func:`reset_counts`): the bytes, not the seconds,
are what a ring saves, and counting them is deterministic.
"""

import torch
import torch.distributed as dist

_sent = {"bytes": 0, "messages": 0}  # this process's counters (each rank is its own process)


def send(tensor, dst):
    """``dist.send``, counting the bytes."""
    _count(tensor)
    dist.send(tensor, dst)


def isend(tensor, dst):
    """``dist.isend`` (returns the request to ``wait()`` on), counting the bytes."""
    _count(tensor)
    return dist.isend(tensor, dst)


def _count(tensor):
    _sent["bytes"] += tensor.numel() * tensor.element_size()
    _sent["messages"] += 1


def bytes_sent():
    """Bytes this rank has sent through :func:`send` / :func:`isend` since :func:`reset_counts`."""
    return _sent["bytes"]


def messages_sent():
    """Messages this rank has sent through :func:`send` / :func:`isend` since :func:`reset_counts`."""
    return _sent["messages"]


def reset_counts():
    _sent.update(bytes=0, messages=0)


def chunks(tensor, n):
    """``n`` views that cover ``tensor``'s elements in order; lengths differ by at most one."""
    if not tensor.is_contiguous():
        raise ValueError("the ring works in place on the tensor's memory: pass a contiguous tensor")
    return torch.tensor_split(tensor.view(-1), n)


def naive_all_reduce(tensor):
    """Sum ``tensor`` over all ranks, in place: everyone sends to rank 0, which adds up and sends back."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        incoming = torch.empty_like(tensor)
        for src in range(1, world_size):
            dist.recv(incoming, src)
            tensor += incoming
        for dst in range(1, world_size):
            send(tensor, dst)
    else:
        send(tensor, 0)
        dist.recv(tensor, 0)
    return tensor


def ring_reduce_scatter(tensor):
    """Phase 1 of the ring: afterwards chunk ``rank`` of ``tensor`` holds the sum over all
    ranks of that chunk; the other chunks hold partial sums. Returns chunk ``rank`` (a view)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    parts = chunks(tensor, world_size)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for step in range(world_size - 1):
        outgoing = parts[(rank - 1 - step) % world_size]  # the partial sum I pass on
        incoming = parts[(rank - 2 - step) % world_size]  # the chunk I add my left neighbour's to
        received = torch.empty_like(incoming)
        request = isend(outgoing, right)
        dist.recv(received, left)
        request.wait()
        incoming += received
    return parts[rank]


def ring_all_gather(tensor):
    """Phase 2 of the ring: rank ``r`` owns chunk ``r`` of ``tensor``; afterwards every rank
    holds every chunk. In place; returns ``tensor``."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    parts = chunks(tensor, world_size)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for step in range(world_size - 1):
        request = isend(parts[(rank - step) % world_size], right)  # a finished chunk, passed on
        dist.recv(parts[(rank - 1 - step) % world_size], left)
        request.wait()
    return tensor


def ring_all_reduce(tensor):
    """Sum ``tensor`` over all ranks, in place, like ``dist.all_reduce``:
    reduce-scatter, then all-gather."""
    ring_reduce_scatter(tensor)
    return ring_all_gather(tensor)
