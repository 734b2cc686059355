"""Data parallelism from scratch, in three steps, each a small change of the last (notebook 10).

All three have the same use, and all three give DDP's weights::

    dp = BucketedDataParallel(model)          # or AllReduceAfterBackward, OverlapPerParameter
    loss_fn(model(x), y).backward()
    dp.finish()                               # every rank now has the averaged gradients
    optimizer.step()

1. :class:`AllReduceAfterBackward`: after backward, all-reduce every gradient, one after
   the other. Communication starts only when all computation is over.
2. :class:`OverlapPerParameter`: a hook on each parameter starts an *asynchronous*
   all-reduce as soon as autograd has accumulated its gradient, so the messages travel
   while backward computes the earlier layers; ``finish`` waits for them.
3. :class:`BucketedDataParallel`: what DDP does. Gradients are copied into a few flat
   buckets as they arrive; each full bucket is all-reduced asynchronously (fewer, larger
   messages), in the same order on every rank.

Like DDP's default all-reduce, each gradient is divided by the world size and then summed.
Each class expects one ``backward()`` per ``finish()``.

All three start with :func:`replicate`, what DDP does besides averaging gradients: rank 0's
parameters and buffers are broadcast at construction (ranks that initialised differently
agree from the start), and its buffers again before each forward. Frozen parameters
(``requires_grad=False``) get no gradient and are not all-reduced; a parameter shared by
two layers (tied weights) is one tensor, all-reduced once.
"""

import torch
import torch.distributed as dist


def replicate(model):
    """Make every rank hold rank 0's model, as DDP does: its parameters (frozen ones too) and
    buffers now, and its buffers (BatchNorm's running statistics) again before each forward,
    except after a forward run without gradients (``torch.no_grad()``). DDP also skips it after a
    forward inside its ``no_sync()``, which these classes do not have; ``model.eval()`` plays no part."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:  # a tied parameter is listed once
            dist.broadcast(tensor, src=0)
    sync = {"next forward": True}

    def before_forward(module, args):
        if sync["next forward"]:
            with torch.no_grad():
                for buffer in module.buffers():
                    dist.broadcast(buffer, src=0)

    def after_forward(module, args, output):
        sync["next forward"] = torch.is_grad_enabled()

    model.register_forward_pre_hook(before_forward)
    model.register_forward_hook(after_forward)


def trainable(model):
    """The parameters that get gradients: frozen ones (``requires_grad=False``) have none."""
    return [p for p in model.parameters() if p.requires_grad]


class AllReduceAfterBackward:
    """Step 1: after backward, all-reduce each gradient and divide by the world size."""

    def __init__(self, model):
        replicate(model)
        self.model = model

    def finish(self):
        world_size = dist.get_world_size()
        for p in trainable(self.model):
            p.grad /= world_size
            dist.all_reduce(p.grad)


class OverlapPerParameter:
    """Step 2: start each gradient's all-reduce from a hook, during backward; wait in finish()."""

    def __init__(self, model):
        replicate(model)
        self.pending = []  # the async all-reduces started during this backward
        for p in trainable(model):
            p.register_post_accumulate_grad_hook(self.grad_ready)

    def grad_ready(self, p):
        p.grad /= dist.get_world_size()
        self.pending.append(dist.all_reduce(p.grad, async_op=True))

    def finish(self):
        for work in self.pending:
            work.wait()
        self.pending.clear()


class Bucket:
    """Some parameters' gradients, side by side in one flat buffer: one all-reduce for all."""

    def __init__(self, params):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
        pieces = self.buffer.split([p.numel() for p in params])
        self.views = {p: piece.view_as(p) for p, piece in zip(params, pieces)}
        self.ready = set()  # parameters whose gradient is in the buffer
        self.work = None  # the running all-reduce

    def is_full(self):
        return len(self.ready) == len(self.params)


class BucketedDataParallel:
    """Step 3: DDP's buckets. Gradients are copied into flat buckets of about ``bucket_cap_mb``
    as they arrive; each full bucket is all-reduced asynchronously, in bucket order.

    A parameter that gets no gradient leaves its bucket incomplete: ``finish()`` raises,
    naming it, unless ``find_unused_parameters=True``, which counts its gradient as zero.
    """

    def __init__(self, model, bucket_cap_mb=1.0, find_unused_parameters=False):
        replicate(model)
        self.find_unused_parameters = find_unused_parameters
        self.names = {p: name for name, p in model.named_parameters()}
        # The last layer's gradients are computed first, so its parameters go in bucket 0.
        self.buckets, params, size = [], [], 0
        for p in reversed(trainable(model)):
            params.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_cap_mb * 2**20:
                self.buckets.append(Bucket(params))
                params, size = [], 0
        if params:
            self.buckets.append(Bucket(params))
        self.bucket_of = {p: bucket for bucket in self.buckets for p in bucket.params}
        self.next_bucket = 0  # buckets are all-reduced in order, so every rank issues the same sequence
        for p in trainable(model):
            p.register_post_accumulate_grad_hook(self.grad_ready)

    def grad_ready(self, p):
        bucket = self.bucket_of[p]
        bucket.views[p].copy_(p.grad).div_(dist.get_world_size())
        bucket.ready.add(p)
        self.launch_full_buckets()

    def launch_full_buckets(self):
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].is_full():
            bucket = self.buckets[self.next_bucket]
            bucket.work = dist.all_reduce(bucket.buffer, async_op=True)
            self.next_bucket += 1

    def finish(self):
        unused = [p for bucket in self.buckets for p in bucket.params if p not in bucket.ready]
        if unused and not self.find_unused_parameters:
            names = ", ".join(self.names[p] for p in unused)
            raise RuntimeError(
                f"these parameters got no gradient in this backward, so their buckets were never "
                f"all-reduced: {names}. Make the loss depend on them, or pass find_unused_parameters=True "
                f"(their gradient then counts as zero on this rank)."
            )
        for p in unused:
            self.bucket_of[p].views[p].zero_()
            self.bucket_of[p].ready.add(p)
        self.launch_full_buckets()
        for bucket in self.buckets:
            bucket.work.wait()
            for p in bucket.params:
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.copy_(bucket.views[p])
            bucket.ready.clear()
        self.next_bucket = 0
