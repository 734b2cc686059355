"""Context parallelism by hand: ring attention (notebook 15).

The sequence is split over the ranks: rank r holds the queries, keys and values of its own
tokens, whose global positions are ``layout[r]`` (a 1-D LongTensor; the same ``layout`` list
on every rank). Attention needs every query against every key, so the keys and values travel:
at step s rank r holds the K/V chunk of rank ``(r - s) % N``, computes its queries' attention
over that chunk alone (:func:`attend`: an output and a log-sum-exp per query) and folds it into
its running result (:func:`merge`, the online softmax). Meanwhile the next chunk is already on
its way (:func:`start_pass`, gloo ``isend``/``irecv`` in the background). After N steps every
query has seen every key, and no rank ever held more than two K/V chunks.

Backward (:class:`RingAttention`) sends the K/V chunks around once more, now with two
accumulators, dK and dV, that collect each rank's share of the gradient and arrive back at
their owner after N passes. Nothing of size sequence × sequence is ever stored.

Shapes: q, k, v are (..., tokens, dim) (leading dims such as batch and heads are carried
along). Layouts: :func:`contiguous_layout` (rank r: the r-th slice; with a causal mask the
last rank does most of the work) and :func:`zigzag_layout` (two slices per rank, an early and
a late one, which balances it). Notebook 15 derives this code; a test asserts that its cells and
this file hold the same code.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def contiguous_layout(seq_len, world_size):
    """Rank r holds the r-th of N consecutive slices (sizes differ by at most one token)."""
    return list(torch.arange(seq_len).tensor_split(world_size))


def zigzag_layout(seq_len, world_size):
    """Two of 2N equal slices per rank, an early one and a late one, paired so that under a
    causal mask every rank has as many (query, key) pairs to compute."""
    slices = torch.arange(seq_len).tensor_split(2 * world_size)
    return [torch.cat([slices[r], slices[2 * world_size - 1 - r]]) for r in range(world_size)]


def visible(q_pos, k_pos, causal):
    """The query rows that see at least one of these keys, and the key columns that at least
    one of these queries sees (all of them without a causal mask)."""
    if not causal:
        return torch.ones_like(q_pos, dtype=torch.bool), torch.ones_like(k_pos, dtype=torch.bool)
    return q_pos >= k_pos.min(), k_pos <= q_pos.max()


def attend(q, k, v, q_pos, k_pos, causal=False):
    """Attention of the queries over one K/V chunk alone: each query's output over the chunk
    and the log-sum-exp of its scores (out 0 and lse -inf for a query that sees no key of
    the chunk). With ``causal``, the query at position i sees the keys at positions <= i, and
    only the rows and columns that see something are computed."""
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    lse = q.new_full(q.shape[:-1], float("-inf"))
    rows, cols = visible(q_pos, k_pos, causal)
    if not rows.any():
        return out, lse
    scores = q[..., rows, :] @ k[..., cols, :].transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(k_pos[cols] > q_pos[rows, None], float("-inf"))
    lse[..., rows] = scores.logsumexp(-1)
    out[..., rows, :] = scores.softmax(-1) @ v[..., cols, :]
    return out, lse


def merge(out1, lse1, out2, lse2):
    """The online softmax: two partial results (over two disjoint sets of keys) -> the result
    over both. Each output is weighted by its share of the total exp-sum, exp(lse_i - lse),
    computed after subtracting the larger lse so that no exp can overflow. A query that saw
    no key in either partial (both lse -inf) keeps out 0 and lse -inf."""
    m = torch.maximum(lse1, lse2)
    m = m.masked_fill(m == float("-inf"), 0)  # both -inf: -inf - (-inf) would be nan; any finite m will do
    w1, w2 = (lse1 - m).exp(), (lse2 - m).exp()  # <= 1; the larger one is exactly 1, or both are 0
    lse = m + (w1 + w2).log()  # -inf if both are 0
    total = (w1 + w2).clamp(min=1)  # between 1 and 2 unchanged; 0 (nothing seen) -> 1, so out stays 0
    out = (w1.unsqueeze(-1) * out1 + w2.unsqueeze(-1) * out2) / total.unsqueeze(-1)
    return out, lse


def start_pass(tensor, incoming_shape, tag=0):
    """Send ``tensor`` to the next rank and receive a tensor of ``incoming_shape`` from the
    previous one, both in the background. Returns the receive buffer and the requests."""
    rank, n = dist.get_rank(), dist.get_world_size()
    if n == 1:  # the next rank is this one: keep it
        return tensor, []
    incoming = tensor.new_empty(incoming_shape)
    requests = [dist.isend(tensor, (rank + 1) % n, tag=tag), dist.irecv(incoming, (rank - 1) % n, tag=tag)]
    return incoming, requests


def ring_forward(q, k, v, layout, causal=False):
    """This rank's attention output and log-sum-exp over the whole sequence: K/V chunks go
    around the ring, the next one in flight while the current one is computed."""
    rank, n = dist.get_rank(), dist.get_world_size()
    kv = torch.stack([k, v])
    out = lse = None
    for step in range(n):
        src = (rank - step) % n  # whose K/V chunk this rank holds now
        if step < n - 1:
            shape = (2, *k.shape[:-2], len(layout[(src - 1) % n]), k.shape[-1])
            incoming, requests = start_pass(kv, shape)
        o, l = attend(q, kv[0], kv[1], layout[rank], layout[src], causal)
        out, lse = (o, l) if out is None else merge(out, lse, o, l)
        if step < n - 1:
            for request in requests:
                request.wait()
            kv = incoming
    return out, lse


def attend_backward(q, k, v, q_pos, k_pos, causal, out, lse, grad_out):
    """The gradients of the whole attention with respect to q, and to this chunk's k and v,
    from the chunk alone: ``out`` and ``lse`` are the final ones (over the whole sequence),
    so exp(scores - lse) is this chunk's part of the full softmax."""
    grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    rows, cols = visible(q_pos, k_pos, causal)
    if not rows.any():
        return grad_q, grad_k, grad_v
    scale = q.shape[-1] ** -0.5
    qr, kc, vc, go = q[..., rows, :], k[..., cols, :], v[..., cols, :], grad_out[..., rows, :]
    scores = qr @ kc.transpose(-2, -1) * scale
    if causal:
        scores = scores.masked_fill(k_pos[cols] > q_pos[rows, None], float("-inf"))
    p = (scores - lse[..., rows, None]).exp()  # probabilities of the full softmax
    grad_v[..., cols, :] = p.transpose(-2, -1) @ go
    grad_p = go @ vc.transpose(-2, -1)
    delta = (go * out[..., rows, :]).sum(-1, keepdim=True)  # sum_j p_ij dp_ij, the softmax's own term
    grad_scores = p * (grad_p - delta) * scale
    grad_q[..., rows, :] = grad_scores @ kc
    grad_k[..., cols, :] = grad_scores.transpose(-2, -1) @ qr
    return grad_q, grad_k, grad_v


class RingAttention(torch.autograd.Function):
    """Ring attention with its own backward. ``RingAttention.apply(q, k, v, layout, causal)``
    on every rank returns this rank's rows of softmax(q kᵀ / sqrt(dim)) v over the whole
    sequence; backward gives each rank the gradients of its own q, k and v."""

    @staticmethod
    def forward(ctx, q, k, v, layout, causal=False):
        if len(layout) != dist.get_world_size() or len(layout[dist.get_rank()]) != q.shape[-2]:
            raise ValueError("layout must list every rank's token positions, and this rank's must match q's tokens")
        out, lse = ring_forward(q, k, v, layout, causal)
        ctx.save_for_backward(q, k, v, out, lse)  # O(tokens on this rank): no score matrix
        ctx.layout, ctx.causal = layout, causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        layout, causal = ctx.layout, ctx.causal
        rank, n = dist.get_rank(), dist.get_world_size()
        grad_q = torch.zeros_like(q)
        kv, grads, grad_requests = torch.stack([k, v]), None, []
        for step in range(n):
            src = (rank - step) % n
            if step < n - 1:  # the next K/V chunk travels while this one is computed
                shape = (2, *k.shape[:-2], len(layout[(src - 1) % n]), k.shape[-1])
                incoming, kv_requests = start_pass(kv, shape)
            dq, dk, dv = attend_backward(q, kv[0], kv[1], layout[rank], layout[src], causal, out, lse, grad_out)
            grad_q += dq
            mine = torch.stack([dk, dv])
            for request in grad_requests:  # the accumulator of chunk src has arrived (and ours has left)
                request.wait()
            if grads is not None:  # what the ranks chunk src visited before added
                mine += grads
            # pass the accumulator on; after the n-th pass it is back at its owner
            shape = (2, *k.shape[:-2], len(layout[(src - 1) % n]), k.shape[-1])
            grads, grad_requests = start_pass(mine, shape, tag=1)
            if step < n - 1:
                for request in kv_requests:
                    request.wait()
                kv = incoming
        for request in grad_requests:
            request.wait()
        return grad_q, grads[0], grads[1], None, None


def ring_attention(q, k, v, layout, causal=False):
    """:class:`RingAttention` as a function."""
    return RingAttention.apply(q, k, v, layout, causal)
