"""Expert parallelism by hand: a Mixture-of-Experts layer whose experts live on different ranks.

A Mixture-of-Experts (MoE) layer replaces one MLP by ``E`` of them (the *experts*) and a
*router*, a linear layer that scores every expert for every token. Each token goes to the
``k`` experts with the highest scores, and the layer's output for the token is their outputs
weighted by the softmax of those ``k`` scores. So each token costs ``k`` expert MLPs, whatever ``E``.

GShard and the Switch Transformer add two pieces (*dropless* MoEs, e.g. MegaBlocks, have no
capacity and drop nothing):

* a **capacity**: each expert takes at most ``ceil(capacity_factor * tokens * k / E)`` of a
  batch's (token, choice) assignments, first choices of every token first; the assignments
  past it are **dropped** (they add nothing to the token's output);
* the **auxiliary load-balancing loss** of the Switch Transformer (Fedus et al., 2021),
  ``E * Σ_e f_e P_e`` (``f_e``: the fraction of assignments routed to expert ``e``, ``P_e``: its
  mean router probability), which is 1 when the load is even and grows as it concentrates.

**Expert parallelism** puts ``E / N`` experts on each of ``N`` ranks; the router is replicated.
Each rank routes its own tokens, then:

1. sorts its kept assignments by expert and **exchanges the counts** (an all-to-all of ``E``
   integers): every rank learns how many tokens it will receive from each rank;
2. sends the tokens to the ranks of their experts: ``all_to_all_single`` with **uneven** split
   sizes (:func:`dispatch`);
3. runs its experts on what it received (:func:`run_experts`);
4. sends the results back with the reverse all-to-all (:func:`combine`), and adds them up,
   weighted, at their tokens' places.

Gradients flow back the same way: the backward of an all-to-all is the all-to-all with the
split sizes swapped (:class:`AllToAll`). An expert's gradient then holds the contributions of
every rank's tokens; the router's holds only this rank's, so with data parallelism on top the
two kinds of gradients are summed over different process groups (:func:`sync_gradients`).

Notebook 16 derives this code; tests/test_expert_parallel.py proves the expert-parallel layer
equals :class:`MoE` (outputs and gradients, dropped tokens, a rank that receives no token).
"""

import copy
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Expert(nn.Module):
    """One expert: a small MLP, dim -> hidden -> dim with a GELU between."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


@dataclass
class Routing:
    """Where a batch of T tokens goes: for each token its k experts (T, k), their weights (T, k),
    whether each assignment fits its expert's capacity (T, k), and the router's logits (T, E)."""

    experts: torch.Tensor
    weights: torch.Tensor
    keep: torch.Tensor
    logits: torch.Tensor


def within_capacity(experts, n_experts, capacity):
    """Which assignments (T, k) their expert keeps: it takes the first choices of all tokens (in
    token order), then the second choices, ..., until it holds ``capacity`` of them."""
    tokens, k = experts.shape
    queue = F.one_hot(experts.T.reshape(-1), n_experts)  # first choices first
    place = (queue.cumsum(0) * queue).sum(-1) - 1  # each assignment's place in its expert's queue
    return (place < capacity).view(k, tokens).T


def route(router, x, k, capacity_factor=None):
    """Score the experts for each token of ``x`` (T, dim), keep the top k, weigh them by the
    softmax of their scores, and mark which assignments fit their expert's capacity (all of
    them with ``capacity_factor=None``)."""
    logits = router(x)
    top, experts = logits.topk(k, dim=-1)
    keep = torch.ones_like(experts, dtype=torch.bool)
    if capacity_factor is not None:
        n_experts = logits.shape[-1]
        keep = within_capacity(experts, n_experts, math.ceil(capacity_factor * x.shape[0] * k / n_experts))
    return Routing(experts, top.softmax(dim=-1), keep, logits)


def load_balancing_loss(routing):
    """Switch Transformer's auxiliary loss, E · Σ_e f_e P_e: f_e, the fraction of assignments
    routed to expert e (a count: no gradient), P_e, its mean router probability (differentiable).
    It is 1 for an even load; with top-1 and every token on expert 0 it is E · P_0, which approaches
    E as the router puts all its probability on expert 0; 0 for no tokens."""
    n_experts = routing.logits.shape[-1]
    if routing.experts.numel() == 0:  # a rank with no tokens of its own: no load, no loss (not 0/0)
        return routing.logits.sum() * 0
    f = F.one_hot(routing.experts, n_experts).sum((0, 1)) / routing.experts.numel()
    p = routing.logits.softmax(dim=-1).mean(0)
    return n_experts * (f * p).sum()


class MoE(nn.Module):
    """The single-process layer: a router and ``n_experts`` experts. ``forward(x)`` takes
    tokens (T, dim) and returns (output (T, dim), auxiliary load-balancing loss)."""

    def __init__(self, dim, hidden, n_experts, k=2, capacity_factor=None):
        super().__init__()
        self.k, self.capacity_factor = k, capacity_factor
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(n_experts))

    def forward(self, x):
        r = route(self.router, x, self.k, self.capacity_factor)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, choice = torch.where((r.experts == e) & r.keep)
            y = y.index_add(0, token, r.weights[token, choice, None] * expert(x[token]))
        return y, load_balancing_loss(r)


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits, differentiable: rank i sends the rows
    ``x[sum(input_splits[:j]) : ...][:input_splits[j]]`` to rank j and receives
    ``output_splits[j]`` rows from rank j. The backward sends each gradient row back to
    where its row came from: the same exchange with the split sizes swapped."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        grad_x = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_x, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return grad_x, None, None, None


def exchange_counts(counts, group=None):
    """``counts`` (E,): how many tokens this rank sends to each expert. Returns (N, E/N): row i
    holds how many tokens rank i sends to each of this rank's experts (one all-to-all of E
    integers: every rank sends each rank the counts of that rank's experts)."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    return received.view(dist.get_world_size(group), -1)


def dispatch(x_sorted, counts, group=None):
    """Send each token to the rank of its expert. ``x_sorted`` (n, dim): this rank's kept
    assignments, sorted by expert; ``counts`` (E,): how many go to each expert. Returns the
    tokens this rank's experts must process, grouped by source rank, then by expert, and
    their counts (N, E/N) from :func:`exchange_counts`."""
    counts_received = exchange_counts(counts, group)
    send = counts.view(dist.get_world_size(group), -1).sum(1).tolist()  # rows to each rank
    receive = counts_received.sum(1).tolist()  # rows from each rank
    return AllToAll.apply(x_sorted, receive, send, group), counts_received


def combine(y_received, counts, counts_received, group=None):
    """The reverse of :func:`dispatch`: send each expert output back to the rank of its token.
    Returns them in the order of ``x_sorted``."""
    send = counts.view(dist.get_world_size(group), -1).sum(1).tolist()
    receive = counts_received.sum(1).tolist()
    return AllToAll.apply(y_received, send, receive, group)  # splits swapped


def run_experts(experts, x_received, counts_received):
    """Run each of this rank's experts on its rows of ``x_received`` (grouped by source rank,
    then by expert, as :func:`dispatch` returns them); an expert with no rows runs on none."""
    n_sources, n_local = counts_received.shape
    expert_of_row = torch.arange(n_local).repeat(n_sources).repeat_interleave(counts_received.flatten())
    y = torch.zeros_like(x_received)
    for e, expert in enumerate(experts):
        rows = torch.where(expert_of_row == e)[0]
        y = y.index_copy(0, rows, expert(x_received[rows]))
    return y


class ExpertParallelMoE(nn.Module):
    """:class:`MoE` with its experts spread over the ranks of ``group``: this rank keeps experts
    ``rank * E/N`` to ``(rank + 1) * E/N - 1`` of ``full`` and a copy of its router. Each rank
    routes its own tokens; ``forward`` returns what ``full`` returns for them.

    Like DDP, it makes the copies equal at construction, whatever each rank's ``full`` holds: the
    router, replicated on every rank, is broadcast from rank 0 over all ranks (so every rank must
    construct the layer); with data parallelism on top, the experts are broadcast over
    ``expert_data_group`` (the ranks that hold the same experts) from its first rank."""

    def __init__(self, full: MoE, group=None, expert_data_group=None):
        super().__init__()
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        n_experts = len(full.experts)
        if n_experts % n:
            raise ValueError(f"{n_experts} experts do not split evenly over {n} ranks: use a number of ranks that divides it")
        per_rank = n_experts // n
        self.group, self.k, self.capacity_factor, self.n_experts = group, full.k, full.capacity_factor, n_experts
        self.router = copy.deepcopy(full.router)
        self.experts = nn.ModuleList(copy.deepcopy(full.experts[e]) for e in range(rank * per_rank, (rank + 1) * per_rank))
        with torch.no_grad():
            for p in self.router.parameters():
                dist.broadcast(p, src=0)
            if expert_data_group is not None:
                for p in self.experts.parameters():
                    dist.broadcast(p, src=dist.get_global_rank(expert_data_group, 0), group=expert_data_group)

    def forward(self, x):
        r = route(self.router, x, self.k, self.capacity_factor)
        token, choice = torch.where(r.keep)  # the kept assignments, sorted by expert below
        order = r.experts[token, choice].argsort(stable=True)
        token, choice = token[order], choice[order]
        counts = torch.bincount(r.experts[token, choice], minlength=self.n_experts)
        x_received, counts_received = dispatch(x[token], counts, self.group)
        y_received = run_experts(self.experts, x_received, counts_received)
        y_sorted = combine(y_received, counts, counts_received, self.group)
        y = torch.zeros_like(x).index_add(0, token, r.weights[token, choice, None] * y_sorted)
        return y, load_balancing_loss(r)


def expert_parameters(model):
    """The ``id``s of the parameters in the ``experts`` of every expert-parallel layer of ``model`` (a
    module with ``experts`` and the process ``group`` they are spread over, like :class:`ExpertParallelMoE`):
    chosen by module, not by name (a replicated layer named ``shared_experts`` is no expert)."""
    layers = [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "group")]
    return {id(p) for m in layers for p in m.experts.parameters()}


def sync_gradients(model, expert_data_group, group=None):
    """Make every gradient the gradient of the mean of all ranks' losses (data parallelism over
    ``group``, default: all ranks; each rank computes the mean loss of its own tokens).

    * Replicated parameters (the router, any dense layer): sum over all ranks, divide by their
      number, as DDP does.
    * Expert parameters: the all-to-all's backward has already summed into them the
      contributions of the tokens of every rank of the expert-parallel group. What is missing
      are the other copies of the same experts: sum over ``expert_data_group`` (the ranks that hold
      the same experts), then divide by the number of *all* ranks, whose losses are averaged.
    """
    world, experts = dist.get_world_size(group), expert_parameters(model)
    for p in model.parameters():
        if not p.requires_grad:  # frozen: no gradient to sync (every rank skips it alike)
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # a parameter this rank did not use: every rank must join
        dist.all_reduce(p.grad, group=expert_data_group if id(p) in experts else group)
        p.grad /= world
