"""Tensor parallelism by hand: Megatron-LM's column- and row-parallel linear layers.

Megatron-LM (Shoeybi et al., 2019) writes a linear layer as ``Y = X A + b`` with ``A`` of
shape (in, out); ``nn.Linear`` stores ``W = Aᵀ``, of shape (out, in). Split over N ranks:

* **column-parallel**: rank i holds the columns ``A_i`` (= rows of ``W``): some *output*
  features. It computes ``Y_i = X A_i + b_i`` from the whole input ``X``; nothing to send
  in forward. In backward, ``∂L/∂X = Σ_i ∂L/∂Y_i A_iᵀ`` is a sum over ranks: one all-reduce.
* **row-parallel**: rank i holds the rows ``A_i`` (= columns of ``W``): some *input*
  features, and gets only its slice ``X_i`` of the input. ``Y = Σ_i X_i A_i + b`` is a sum
  over ranks: one all-reduce in forward (the bias is added once, after it). In backward each
  rank already has the whole ``∂L/∂Y``: nothing to send.

The two communication patterns are two autograd functions, Megatron's *f* and *g*:

    CopyToParallel      (f)  forward: identity     backward: all-reduce
    ReduceFromParallel  (g)  forward: all-reduce   backward: identity

A Megatron MLP is column-parallel, then an element-wise activation on each rank's own
features, then row-parallel: one f at its entrance, one g at its exit, so one all-reduce in
forward and one in backward, and the big hidden activation is never communicated.

Every layer here is built from a full layer (``ColumnParallelLinear(nn.Linear(...))``) and
keeps this rank's slice of it, so tests can compare with the unsplit layer directly.
``group`` is the tensor-parallel process group (default: all ranks). Notebook 13 derives
this code; tests/test_tensor_parallel.py proves it equals the unsplit layers.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class CopyToParallel(torch.autograd.Function):
    """Megatron's f: forward passes the input through; backward sums the gradient over
    the ranks, because every rank used the same input for its own part of the output."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromParallel(torch.autograd.Function):
    """Megatron's g: forward sums the ranks' partial outputs; backward passes the gradient
    through, because every rank's partial output contributed to the sum with weight 1."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromParallel(torch.autograd.Function):
    """Concatenate the ranks' slices of the last dimension (all-gather); backward keeps
    this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        n, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(n, dim=-1)[rank].contiguous(), None


def shard(tensor, dim, group=None):
    """This rank's equal slice of ``tensor`` along ``dim``, as a new trainable parameter."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if tensor.shape[dim] % n:
        raise ValueError(f"size {tensor.shape[dim]} of dim {dim} does not split evenly over {n} ranks")
    return nn.Parameter(tensor.detach().chunk(n, dim=dim)[rank].clone())


class ColumnParallelLinear(nn.Module):
    """This rank's output features of ``full``. Input: the whole ``x`` (the same on every
    rank). Output: this rank's features, or all of them with ``gather_output=True``."""

    def __init__(self, full: nn.Linear, group=None, gather_output=False):
        super().__init__()
        self.group, self.gather_output = group, gather_output
        self.weight = shard(full.weight, 0, group)  # W is (out, in): rows = output features
        self.bias = shard(full.bias, 0, group)

    def forward(self, x):
        x = CopyToParallel.apply(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return GatherFromParallel.apply(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """This rank's input features of ``full``. Input: this rank's slice of ``x``'s last
    dimension. Output: the whole result, the same on every rank."""

    def __init__(self, full: nn.Linear, group=None):
        super().__init__()
        self.group = group
        self.weight = shard(full.weight, 1, group)  # columns of W = input features
        self.bias = nn.Parameter(full.bias.detach().clone())  # whole, added once after the sum

    def forward(self, x_local):
        partial = F.linear(x_local, self.weight)
        return ReduceFromParallel.apply(partial, self.group) + self.bias


class MLP(nn.Module):
    """The unsplit block: dim -> hidden -> dim with a GELU between."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class ParallelMLP(nn.Module):
    """Megatron's MLP: column-parallel up, GELU on this rank's hidden features, row-parallel
    down. One all-reduce in forward (g), one in backward (f)."""

    def __init__(self, full: MLP, group=None):
        super().__init__()
        self.up = ColumnParallelLinear(full.up, group)
        self.down = RowParallelLinear(full.down, group)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class SelfAttention(nn.Module):
    """The unsplit block: causal multi-head self-attention on (batch, seq, dim)."""

    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape

        def heads(t):  # (b, s, n_heads * head_dim) -> (b, n_heads, s, head_dim)
            return t.view(b, s, self.n_heads, -1).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class ParallelSelfAttention(SelfAttention):
    """Heads split across ranks: q, k, v keep this rank's output features (whole heads),
    out is row-parallel. Heads never mix, so attention itself needs no communication: one f
    at the entrance (x feeds q, k and v: one all-reduce of its gradient) and one g at the exit."""

    def __init__(self, full: SelfAttention, group=None):
        nn.Module.__init__(self)
        n = dist.get_world_size(group)
        if full.n_heads % n:
            raise ValueError(f"{full.n_heads} heads do not split evenly over {n} ranks")
        self.group, self.n_heads = group, full.n_heads // n  # heads on this rank
        self.q, self.k, self.v = (column_slice(layer, group) for layer in (full.q, full.k, full.v))
        self.out = RowParallelLinear(full.out, group)

    def forward(self, x):
        return super().forward(CopyToParallel.apply(x, self.group))


def column_slice(full: nn.Linear, group=None) -> nn.Linear:
    """A plain ``nn.Linear`` with this rank's output features of ``full`` (no communication)."""
    rows = full.out_features // dist.get_world_size(group)
    part = nn.Linear(full.in_features, rows, device="meta")
    part.weight, part.bias = shard(full.weight, 0, group), shard(full.bias, 0, group)
    return part
