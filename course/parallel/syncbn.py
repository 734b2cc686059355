"""Synchronised BatchNorm that also runs on CPU: normalise every rank with the global batch.

Under DDP each rank's BatchNorm normalises with the statistics of *its own* small batch.
This layer uses the statistics of the *global* batch (all ranks' batches together), so
N ranks compute exactly what one process would compute on the concatenated batch.
``nn.SyncBatchNorm`` does the same, but only for GPU tensors; this one is written to be
read, and works with gloo on CPU (notebook 06 builds it up and tests/test_syncbn.py proves it).

Forward, per channel (sums over the batch and any spatial positions), one all_reduce::

    all_reduce([Σx, Σx², n])                    # every rank now has the global sums
    mean = Σx / n,   var = Σx² / n - mean²      # biased variance: what BatchNorm divides by
    x̂ = (x - mean) / sqrt(var + eps),   y = weight * x̂ + bias
    running_var is updated with the unbiased var * n / (n - 1), like torch.

Backward, with g = ∂L/∂y and L the sum of every rank's loss, one more all_reduce::

    all_reduce([Σg, Σg·x̂])
    ∂L/∂x = weight / sqrt(var + eps) * (g - Σg / n - x̂ * Σg·x̂ / n)
    ∂L/∂weight = Σg·x̂ and ∂L/∂bias = Σg over this rank's samples only:
    they are ordinary parameter gradients, which DDP all-reduces like the others.

The backward needs global sums because every rank's output depends on every rank's
input through the shared mean and variance.

Every rank must call forward and backward the same number of times (they are
collectives). A rank with an empty batch (0 samples) still takes part: it adds zeros
and a count of 0 to the sums and gets an empty output. If the global batch has fewer
than 2 values per channel, every rank raises ValueError, like ``nn.BatchNorm``.
In eval mode the layer uses its running statistics and does not communicate (without
running statistics, ``track_running_stats=False``, each rank then normalises with its own
batch, as ``nn.SyncBatchNorm`` does). Outside a process group it is a plain BatchNorm.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def all_reduce_sum(tensor, group=None):
    """Sum ``tensor`` over the ranks, in place. Without a process group: a world of one."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, group=group)
    return tensor


def _reduce_dims_and_shape(x):
    """The dims to sum over (all but the channel dim 1), and a shape that broadcasts a
    per-channel vector over ``x``: (N, C) -> [0], (1, C); (N, C, H, W) -> [0, 2, 3], (1, C, 1, 1)."""
    dims = [0, *range(2, x.dim())]
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    return dims, shape


@torch.no_grad()
def global_mean_var(x, group=None):
    """Per-channel mean and biased variance of the batch made of every rank's ``x``, and
    its number of values per channel ``n``. One all_reduce of [Σx, Σx², n].

    The sums are taken in float64 so that Σx²/n - mean² does not lose the digits that
    float32 would (the two terms are close when the mean is large compared with the spread)."""
    dims, _ = _reduce_dims_and_shape(x)
    channels = x.shape[1]
    x64 = x.double()  # square in float64 too: near 1e8, float32 numbers are 8 apart
    stats = torch.cat([
        x64.sum(dims),
        (x64 * x64).sum(dims),
        torch.tensor([x.numel() // channels], dtype=torch.float64, device=x.device),
    ])
    all_reduce_sum(stats, group)
    total, total_sq, n = stats[:channels], stats[channels : 2 * channels], int(stats[-1].item())
    if n < 2:
        raise ValueError(
            f"Expected more than 1 value per channel in the global batch when training, got {n}: "
            "use a larger batch (or call model.eval())."
        )
    mean = total / n
    var = (total_sq / n - mean * mean).clamp_(min=0)
    return mean, var, n


class SyncBatchNormFunction(torch.autograd.Function):
    """Normalise ``x`` with the global ``mean`` and ``var``;
    the backward all-reduces Σg and Σg·x̂."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, var, n, eps, group):
        _, shape = _reduce_dims_and_shape(x)
        invstd = torch.rsqrt(var + eps).to(x.dtype).view(shape)
        x_hat = (x - mean.to(x.dtype).view(shape)) * invstd
        y = x_hat
        if weight is not None:
            y = y * weight.view(shape)
        if bias is not None:
            y = y + bias.view(shape)
        ctx.save_for_backward(x_hat, invstd, weight)
        ctx.n, ctx.group = n, group
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x_hat, invstd, weight = ctx.saved_tensors
        dims, shape = _reduce_dims_and_shape(grad_out)
        local_sum_g = grad_out.sum(dims)  # this rank's Σg and Σg·x̂
        local_sum_g_xhat = (grad_out * x_hat).sum(dims)

        grad_x = None
        if ctx.needs_input_grad[0]:
            sums = all_reduce_sum(torch.cat([local_sum_g, local_sum_g_xhat]), ctx.group)
            sum_g, sum_g_xhat = (s.view(shape) for s in sums.chunk(2))
            scale = invstd if weight is None else invstd * weight.view(shape)
            grad_x = scale * (grad_out - sum_g / ctx.n - x_hat * sum_g_xhat / ctx.n)

        grad_weight = local_sum_g_xhat if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = local_sum_g if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Drop-in for ``nn.SyncBatchNorm`` that also works with gloo on CPU.

    Same arguments as ``nn.SyncBatchNorm``; accepts (N, C) and (N, C, L) like BatchNorm1d,
    (N, C, H, W) like BatchNorm2d, and so on. ``SyncBatchNorm.convert(model)`` swaps it in
    for every BatchNorm layer, like ``nn.SyncBatchNorm.convert_sync_batchnorm``.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_group=None, device=None, dtype=None, *, bias=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        if affine and not bias:
            self.bias = None  # what nn.BatchNorm(bias=False) does, on any torch version
        self.process_group = process_group

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"expected input of shape (N, C, ...), got a {x.dim()}D input")
        if x.shape[1] != self.num_features:
            raise ValueError(f"expected {self.num_features} channels in dim 1, got input of shape {tuple(x.shape)}")

    def forward(self, x):
        self._check_input_dim(x)
        if not self.training:  # eval: no communication, exactly like nn.SyncBatchNorm
            use_batch_stats = self.running_mean is None
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                use_batch_stats, 0.0, self.eps)

        mean, var, n = global_mean_var(x, self.process_group)
        if self.track_running_stats:
            self._update_running_stats(mean, var, n)
        return SyncBatchNormFunction.apply(x, self.weight, self.bias, mean, var, n, self.eps, self.process_group)

    @torch.no_grad()
    def _update_running_stats(self, mean, var, n):
        self.num_batches_tracked.add_(1)
        if self.momentum is None:  # cumulative average of every batch so far
            momentum = 1.0 / self.num_batches_tracked.item()
        else:
            momentum = self.momentum
        unbiased_var = var * n / (n - 1)
        self.running_mean.mul_(1 - momentum).add_(momentum * mean.to(self.running_mean.dtype))
        self.running_var.mul_(1 - momentum).add_(momentum * unbiased_var.to(self.running_var.dtype))

    @classmethod
    def convert(cls, module, process_group=None):
        """Return ``module`` with every BatchNorm layer (BatchNorm1d/2d/3d, nn.SyncBatchNorm)
        replaced by this class, sharing its parameters and running statistics.
        Mirrors ``nn.SyncBatchNorm.convert_sync_batchnorm``; a BatchNorm passed directly
        is returned as a new layer."""
        converted = module
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group, bias=module.bias is not None)
            if module.affine:
                converted.weight, converted.bias = module.weight, module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.training = module.training
            if hasattr(module, "qconfig"):
                converted.qconfig = module.qconfig
        for name, child in module.named_children():
            converted.add_module(name, cls.convert(child, process_group))
        return converted
