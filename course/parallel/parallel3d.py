"""3-D parallelism (notebook 18): data × pipeline × tensor parallelism on one mesh of ranks.

The ``world_size = dp · pp · tp`` ranks form a 3-D grid; rank ``r`` sits at

    r = (d · pp + p) · tp + t          (d, p, t) = its data, pipeline and tensor coordinates

so the tensor dimension varies fastest: on a real cluster the ``tp`` ranks of one group are
neighbours, on one node, where the links are fastest (TP talks in every layer). This is the
order ``init_device_mesh(device, (dp, pp, tp))`` uses too.

* **TP** (notebook 13): inside a stage, each block's attention heads and MLP are split over
  the ``tp`` ranks with Megatron's column/row-parallel layers (``course.parallel.tensor_parallel``).
* **PP** (notebook 14): the blocks are cut into ``pp`` stages; the first stage also holds the
  embedding, the last the output layer and the loss. Micro-batches flow GPipe's way:
  activations forward with ``isend``, gradients back.
* **DP** (notebook 10): the ``dp`` pipelines each take a slice of the batch; after backward
  every rank averages its gradients with the ranks that hold the *same* slice of the model.

:func:`train` runs it and returns what each rank holds; :func:`shard_like` cuts a
one-process model the same way, so each rank can compare its weights with one process's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course.parallel.tensor_parallel import MLP, ParallelMLP, ParallelSelfAttention, SelfAttention

VOCAB, DIM, HEADS, SEQ, LAYERS, BATCH = 32, 16, 4, 8, 2, 8  # the notebook's language model and batch


class Block(nn.Module):
    """A transformer block without normalisation: x + attention(x), then + MLP(x)."""

    def __init__(self, attn, mlp):
        super().__init__()
        self.attn, self.mlp = attn, mlp

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class TinyLM(nn.Sequential):
    """Embedding, ``layers`` blocks, output layer: a causal language model."""

    def __init__(self, vocab=VOCAB, dim=DIM, heads=HEADS, layers=LAYERS, seed=0):
        torch.manual_seed(seed)
        blocks = [Block(SelfAttention(dim, heads), MLP(dim, 4 * dim)) for _ in range(layers)]
        super().__init__(nn.Embedding(vocab, dim), *blocks, nn.Linear(dim, vocab))


def make_batch(batch=BATCH, seq=SEQ, vocab=VOCAB, seed=1):
    """Token sequences and their next tokens (the same on every rank)."""
    tokens = torch.randint(vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def coordinates(rank, dp, pp, tp):
    """(d, p, t) of ``rank`` in the grid."""
    return rank // (pp * tp), rank // tp % pp, rank % tp


def mesh_groups(dp, pp, tp):
    rank = lambda d, p, t: (d * pp + p) * tp + t  # noqa: E731
    return {  # a dimension's group: the ranks whose other two coordinates are equal
        "dp": [[rank(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[rank(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
        "tp": [[rank(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)],
    }


grid_groups = mesh_groups  # the name the code below calls it by, so a notebook's own mesh_groups stays its own


def shard_like(model: TinyLM, p, pp, tp_group) -> nn.Sequential:
    """Stage ``p`` of ``pp`` of ``model``, its blocks split over ``tp_group``: this rank's part."""
    blocks = list(model)[1:-1]
    if len(blocks) % pp:
        raise ValueError(f"{len(blocks)} blocks do not split into {pp} equal stages")
    per = len(blocks) // pp
    parts = [Block(ParallelSelfAttention(b.attn, tp_group), ParallelMLP(b.mlp, tp_group)) for b in blocks[p * per : (p + 1) * per]]
    first = [model[0]] if p == 0 else []
    last = [model[-1]] if p == pp - 1 else []
    return nn.Sequential(*first, *parts, *last)


def pipeline_step(stage, inputs, targets, m, prev, next, scale):
    """GPipe on this rank's stage: ``m`` forwards, then ``m`` backwards. ``prev``/``next`` are
    the global ranks of the neighbouring stages (None at the ends); the last stage's loss is
    multiplied by ``scale`` so that the micro-batches' losses add up to the batch mean.
    Returns the sum of the micro-batches' scaled losses (last stage) or None."""
    micro_in, micro_out = inputs.chunk(m), targets.chunk(m)
    saved, sends, total = [], [], None
    for i in range(m):
        if prev is None:
            x = micro_in[i]
        else:
            x = torch.empty(*micro_in[i].shape, DIM)
            dist.recv(x, prev)
            x.requires_grad_()
        y = stage(x)
        if next is None:
            y = F.cross_entropy(y.reshape(-1, VOCAB), micro_out[i].reshape(-1)) * scale
            total = y.detach() if total is None else total + y.detach()
        else:
            sends.append(dist.isend(y.detach(), next))
        saved.append((x, y))
    for i in reversed(range(m)):
        x, y = saved[i]
        grad = None
        if next is not None:
            grad = torch.empty_like(y)
            dist.recv(grad, next)
        y.backward(grad)
        if prev is not None:
            sends.append(dist.isend(x.grad, prev))
    for work in sends:
        work.wait()
    return total


def average_gradients(stage, dp_group):
    """Data parallelism: average this rank's gradients with the ranks that hold the same slice
    of the model, in one all-reduce of all of them laid end to end (one bucket)."""
    grads = [q.grad for q in stage.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=dp_group)
    flat /= dist.get_world_size(dp_group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def make_groups(dp, pp, tp):
    """Create every group of every dimension (each rank must create all of them, in the same
    order) and return this rank's group in each: {"dp": ..., "pp": ..., "tp": ...}."""
    rank, mine = dist.get_rank(), {}
    for dim, lists in grid_groups(dp, pp, tp).items():
        for ranks in lists:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[dim] = group
    return mine


def train(rank, world_size, dp, pp, tp, steps=2, m=2, lr=0.2):
    """Train :class:`TinyLM` on the dp × pp × tp grid for ``steps`` SGD steps; return this rank's
    largest difference from one process's weights, the bytes it sent per dimension and its
    parameters' bytes."""
    from course.observe import wire

    if dp * pp * tp != world_size:
        raise ValueError(f"dp * pp * tp = {dp * pp * tp}, but there are {world_size} ranks")
    d, p, t = coordinates(rank, dp, pp, tp)
    my = make_groups(dp, pp, tp)
    stage = shard_like(TinyLM(), p, pp, my["tp"])
    optimizer = torch.optim.SGD(stage.parameters(), lr=lr)
    inputs, targets = (x.chunk(dp)[d] for x in make_batch())  # this pipeline's slice of the batch
    prev = rank - tp if p > 0 else None
    next = rank + tp if p < pp - 1 else None
    with wire.measure() as sent:
        for _ in range(steps):
            optimizer.zero_grad()
            pipeline_step(stage, inputs, targets, m, prev, next, scale=1 / m)
            average_gradients(stage, my["dp"])
            optimizer.step()
    per_dim = {"dp": 0, "pp": 0, "tp": 0}
    for peer, n in wire.sent_per_peer(sent).items():
        differ = [dim for dim, a, b in zip("dp pp tp".split(), coordinates(peer, dp, pp, tp), (d, p, t)) if a != b]
        dim = differ[0] if len(differ) == 1 else "other"
        per_dim[dim] = per_dim.get(dim, 0) + n
    one = TinyLM()  # one process, the whole batch, the same steps
    one_optimizer = torch.optim.SGD(one.parameters(), lr=lr)
    x, y = make_batch()
    for _ in range(steps):
        one_optimizer.zero_grad()
        F.cross_entropy(one(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        one_optimizer.step()
    expected = shard_like(one, p, pp, my["tp"])
    diff = max((a - b).abs().max().item() for a, b in zip(stage.parameters(), expected.parameters()))
    return {"diff": diff, "sent": per_dim, "param_bytes": sum(q.numel() * q.element_size() for q in stage.parameters())}
