"""Notebook 15's checks accept the course's answers and reject plausible wrong ones with a specific hint."""

import pytest
import torch
import torch.distributed as dist

from course.parallel import context_parallel as cp
from course.checks import nb15
from course.classroom.notebooks import solution_paths
from course.parallel.context_parallel import attend, merge, start_pass

SOLUTION, = solution_paths(["15_context_parallel"])

# The judges' own reasons, with wrong answers built on the course's finished code: course.classroom.guard off
# (it would refuse them first; tests/test_guard.py tries it).
pytestmark = pytest.mark.usefixtures("judges_only")

# ------------------------------------------------------------------ Exercise 1: merge


def _average(out1, lse1, out2, lse2):
    return (out1 + out2) / 2, torch.logaddexp(lse1, lse2)


def _exp_without_the_max(out1, lse1, out2, lse2):  # right in exact arithmetic, overflows in float32
    w1, w2 = lse1.exp(), lse2.exp()
    return (w1[..., None] * out1 + w2[..., None] * out2) / (w1 + w2)[..., None], (w1 + w2).log()


def _lse_is_the_max(out1, lse1, out2, lse2):
    out, _ = merge(out1, lse1, out2, lse2)
    return out, torch.maximum(lse1, lse2)


def _not_normalised(out1, lse1, out2, lse2):  # rescaled by the max, but not divided by the total weight
    m = torch.maximum(lse1, lse2)
    w1, w2 = (lse1 - m).exp(), (lse2 - m).exp()
    return w1[..., None] * out1 + w2[..., None] * out2, m + (w1 + w2).log()


def _out_only(out1, lse1, out2, lse2):
    return merge(out1, lse1, out2, lse2)[0]


def _logaddexp(out1, lse1, out2, lse2):  # right unless both lse are -inf: -inf - (-inf) is nan
    lse = torch.logaddexp(lse1, lse2)
    return (lse1 - lse).exp()[..., None] * out1 + (lse2 - lse).exp()[..., None] * out2, lse


def _softplus(out1, lse1, out2, lse2):  # right for finite lse, nan when one lse is -inf (d = -inf - -inf)
    d = lse2 - lse1
    w2 = torch.sigmoid(d)[..., None]
    return out1 * (1 - w2) + out2 * w2, lse1 + torch.nn.functional.softplus(d)


def _three_d_only(out1, lse1, out2, lse2):  # right on (heads, tokens, dim), raises on 4-D tensors
    lse = torch.logaddexp(lse1, lse2)
    w1, w2 = (lse1 - lse).exp(), (lse2 - lse).exp()
    return w1[:, :, None] * out1 + w2[:, :, None] * out2, lse


def _logaddexp_guarded(out1, lse1, out2, lse2):  # another correct answer
    lse = torch.logaddexp(lse1, lse2)
    safe = lse.masked_fill(lse == float("-inf"), 0)
    return (lse1 - safe).exp()[..., None] * out1 + (lse2 - safe).exp()[..., None] * out2, lse


def _first_as_ref(out1, lse1, out2, lse2):  # rescales by lse1, not the max: e^(lse2 - lse1) overflows
    m = torch.where(lse1 == -torch.inf, lse2, lse1)
    m = m.masked_fill(m == -torch.inf, 0)
    w1, w2 = (lse1 - m).exp(), (lse2 - m).exp()
    t = w1 + w2
    return (w1[..., None] * out1 + w2[..., None] * out2) / t.clamp(min=1e-30)[..., None], m + t.log()


def _clamped(out1, lse1, out2, lse2):  # right, but an empty merge gets lse -1e30 instead of -inf
    out, lse = merge(out1, lse1, out2, lse2)
    return out, lse.clamp(min=-1e30)


def test_merge_accepts_correct_answers():
    assert nb15.merge(merge).status == "correct"
    assert nb15.merge(_logaddexp_guarded).status == "correct"


def test_merge_keeps_two_empty_partials_empty():
    out, lse = merge(torch.zeros(3, 4), torch.full((3,), float("-inf")), torch.zeros(3, 4), torch.full((3,), float("-inf")))
    assert torch.equal(out, torch.zeros(3, 4)) and torch.equal(lse, torch.full((3,), float("-inf")))


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_average, "plain average"),
        (_exp_without_the_max, "an exp overflowed"),
        (_lse_is_the_max, "not the larger of the two"),
        (_not_normalised, "merged output differs"),
        (_out_only, "return a pair"),
        (_softplus, "see none of one chunk (lse -inf)"),
        (_logaddexp, "both saw no key (lse -inf)"),
        (_three_d_only, "4-D (batch, heads, tokens, dim) tensors"),
        (lambda out1, lse1, out2, lse2: (torch.zeros(2, 5, 8), torch.zeros(2, 5)), "merged lse differs"),
    ],
)
def test_merge_rejects_wrong_answers(answer, hint):
    feedback = nb15.merge(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


@pytest.mark.parametrize("answer, hint", [(_first_as_ref, "an exp overflowed"), (_clamped, "exactly -inf")])
def test_merge_rejects_near_misses_every_time(answer, hint):  # the check's inputs are random: try several
    for _ in range(8):
        feedback = nb15.merge(answer)
        assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_an_untouched_stub_is_not_attempted():
    def merge(out1, lse1, out2, lse2):
        """The docstring the student sees."""
        ...

    def ring_forward(q, k, v, layout, causal=False):
        ...

    def zigzag_layout(seq_len, world_size):
        ...

    assert nb15.merge(merge).status == "todo"
    assert nb15.ring_forward(ring_forward).status == "todo"
    assert nb15.zigzag_layout(zigzag_layout).status == "todo"


# ------------------------------------------------------------------ Exercise 2: ring_forward


def _merge_without_the_max(out1, lse1, out2, lse2):  # right in exact arithmetic; inf/nan for large scores
    w1, w2 = lse1.exp(), lse2.exp()
    return (w1[..., None] * out1 + w2[..., None] * out2) / (w1 + w2).clamp(min=1e-30)[..., None], (w1 + w2).log()


def _ring(pass_fn=start_pass, peer_of=None, attend_causal=None, key_positions=None, overlap=True, result="pair",
          merge_fn=merge, keep_clones=False, busy_wait=False, shape_of=None):
    """A ring forward with one thing changed, to build the wrong answers below."""

    def ring_forward(q, k, v, layout, causal=False):
        rank, n = dist.get_rank(), dist.get_world_size()
        kv = torch.stack([k, v])
        out = lse = None
        kept = []
        for step in range(n):
            src = (rank - step) % n
            shape = (2, *k.shape[:-2], len(layout[(src - 1) % n]), k.shape[-1])
            if shape_of is not None:
                shape = shape_of(k, layout, src, n)
            if keep_clones:
                kept.append(kv.clone())
            if step < n - 1 and overlap:
                incoming, requests = pass_fn(kv, shape)
            mask = causal if attend_causal is None else attend_causal
            k_pos = layout[src] if key_positions is None else layout[rank]
            if busy_wait and step < n - 1:  # blocking: a dummy product between post and wait, then attend
                if busy_wait == "k row":  # on a one-row view of K: K's storage, but not attention's work
                    kv[0][..., :1, :] @ kv[0][..., :1, :].mT
                else:
                    torch.ones(2, 2) @ torch.ones(2, 2)
                for request in requests:
                    request.wait()
                requests = []
            o, l = attend(q, kv[0], kv[1], layout[rank], k_pos, mask)
            out, lse = (o, l) if out is None else merge_fn(out, lse, o, l)
            if step < n - 1:
                if not overlap:
                    incoming, requests = pass_fn(kv, shape)
                for request in requests:
                    request.wait()
                kv = incoming
        return (out, lse) if result == "pair" else out

    return ring_forward


def _waits_twice(q, k, v, layout, causal=False):  # right, but a second wait() hangs on gloo
    rank, n = dist.get_rank(), dist.get_world_size()
    kv, out, lse, requests = torch.stack([k, v]), None, None, []
    for step in range(n):
        src = (rank - step) % n
        if step < n - 1:
            incoming, requests = start_pass(kv, (2, *k.shape[:-2], len(layout[(src - 1) % n]), k.shape[-1]))
        o, l = attend(q, kv[0], kv[1], layout[rank], layout[src], causal)
        out, lse = (o, l) if out is None else merge(out, lse, o, l)
        if step < n - 1:
            for request in requests + requests:
                request.wait()
            kv = incoming
    return out, lse


def _two_rank_pass(tensor, shape, tag=0):  # the peer is "the other rank": right on 2 ranks only
    incoming = tensor.new_empty(shape)
    other = 1 - dist.get_rank()
    return incoming, [dist.isend(tensor, other), dist.irecv(incoming, other)]


def _blocking_pass(tensor, shape, tag=0):
    rank, n = dist.get_rank(), dist.get_world_size()
    incoming = tensor.new_empty(shape)
    if rank % 2:
        dist.recv(incoming, (rank - 1) % n)
        dist.send(tensor, (rank + 1) % n)
    else:
        dist.send(tensor, (rank + 1) % n)
        dist.recv(incoming, (rank - 1) % n)
    return incoming, []


def _all_gather(q, k, v, layout, causal=False):
    n = dist.get_world_size()
    keys = [k.new_empty(*k.shape[:-2], len(p), k.shape[-1]) for p in layout]
    values = [v.new_empty(*v.shape[:-2], len(p), v.shape[-1]) for p in layout]
    dist.all_gather(keys, k.contiguous())
    dist.all_gather(values, v.contiguous())
    out = lse = None
    for src in range(n):
        o, l = attend(q, keys[src], values[src], layout[dist.get_rank()], layout[src], causal)
        out, lse = (o, l) if out is None else merge(out, lse, o, l)
    return out, lse


def _all_gather_functional(q, k, v, layout, causal=False):  # no dist.all_gather by name: caught by its size
    import torch.distributed._functional_collectives as funcol

    rank, n = dist.get_rank(), dist.get_world_size()
    width = max(len(p) for p in layout)  # padded to equal sizes
    pad = lambda t: torch.cat([t, t.new_zeros(*t.shape[:-2], width - t.shape[-2], t.shape[-1])], -2)  # noqa: E731
    keys = funcol.all_gather_tensor(pad(k).contiguous(), -2, list(range(n)))
    values = funcol.all_gather_tensor(pad(v).contiguous(), -2, list(range(n)))
    take = torch.cat([torch.arange(len(p)) + width * r for r, p in enumerate(layout)])
    return attend(q, keys[..., take, :], values[..., take, :], layout[rank], torch.cat(layout), causal)


def _everyone(q, k, v, layout, causal=False):  # every rank sends its K/V to every other rank directly
    rank, n = dist.get_rank(), dist.get_world_size()
    kv = torch.stack([k, v])
    buffers = {src: kv.new_empty(2, *k.shape[:-2], len(layout[src]), k.shape[-1]) for src in range(n) if src != rank}
    requests = [dist.isend(kv, dst) for dst in range(n) if dst != rank]
    requests += [dist.irecv(buffer, src) for src, buffer in buffers.items()]
    out, lse = attend(q, k, v, layout[rank], layout[rank], causal)
    for request in requests:
        request.wait()
    for src, buffer in buffers.items():
        out, lse = merge(out, lse, *attend(q, buffer[0], buffer[1], layout[rank], layout[src], causal))
    return out, lse


def _keep_all(overlap):
    """Every chunk passed around the ring and kept; attention on each one either while the next one
    travels (overlap) or on all of them after the loop."""

    def ring_forward(q, k, v, layout, causal=False):
        rank, n = dist.get_rank(), dist.get_world_size()
        held = [torch.stack([k, v])]
        out = lse = None
        for step in range(n):
            src = (rank - step) % n
            if step < n - 1:
                incoming, requests = start_pass(held[-1], (2, *k.shape[:-2], len(layout[(src - 1) % n]), k.shape[-1]))
            if overlap:
                o, l = attend(q, held[-1][0], held[-1][1], layout[rank], layout[src], causal)
                out, lse = (o, l) if out is None else merge(out, lse, o, l)
            if step < n - 1:
                for request in requests:
                    request.wait()
                held.append(incoming)
        if not overlap:
            for step, kv in enumerate(held):
                o, l = attend(q, kv[0], kv[1], layout[rank], layout[(rank - step) % n], causal)
                out, lse = (o, l) if out is None else merge(out, lse, o, l)
        return out, lse

    return ring_forward


def _batched_pass(tensor, shape, tag=0):  # a right answer: the pass with batch_isend_irecv (picotron's way)
    rank, n = dist.get_rank(), dist.get_world_size()
    incoming = tensor.new_empty(shape)
    ops = [dist.P2POp(dist.isend, tensor, (rank + 1) % n), dist.P2POp(dist.irecv, incoming, (rank - 1) % n)]
    return incoming, dist.batch_isend_irecv(ops)


def _c10d_all_gather(q, k, v, layout, causal=False):  # the collective under distributed_c10d's name
    from torch.distributed import distributed_c10d

    rank, n = dist.get_rank(), dist.get_world_size()
    out = lse = None
    for src in range(n):
        keys = [k.new_empty(*k.shape[:-2], len(p), k.shape[-1]) for p in layout]
        values = [v.new_empty(*v.shape[:-2], len(p), v.shape[-1]) for p in layout]
        distributed_c10d.all_gather(keys, k.contiguous())
        distributed_c10d.all_gather(values, v.contiguous())
        o, l = attend(q, keys[src], values[src], layout[rank], layout[src], causal)
        out, lse = (o, l) if out is None else merge(out, lse, o, l)
    return out, lse


def _own_chunk_only(q, k, v, layout, causal=False):
    rank = dist.get_rank()
    return attend(q, k, v, layout[rank], layout[rank], causal)


# The notebook's Exercise 2 answer is this very code (tests/test_context_parallel.py: the notebook derives it), and
# its check cell's stored verdict is compared by nbval.
@pytest.mark.repeats_solution_notebook
@pytest.mark.parametrize("path", [SOLUTION], ids=lambda p: p.stem)
def test_ring_forward_accepts_the_course_ring(path):
    assert nb15.ring_forward(cp.ring_forward).status == "correct"


def test_ring_forward_accepts_batch_isend_irecv():
    feedback = nb15.ring_forward(_ring(pass_fn=_batched_pass))
    assert feedback.status == "correct", feedback


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_all_gather, "called dist.all_gather"),
        (_all_gather_functional, "built a tensor of"),
        (_everyone, "chunks' K and V at once"),  # on 3 ranks both peers are neighbours; 4 buffers alive
        (_ring(pass_fn=_two_rank_pass), "compute the neighbours"),
        (_ring(pass_fn=_blocking_pass), "called dist.send"),
        (_ring(overlap=False), "between posting each irecv and waiting for it the check saw no matrix product on a chunk"),
        (_ring(attend_causal=False), "*without* the causal mask"),
        (_ring(key_positions="mine"), "failed: IndexError"),  # positions of another chunk: the wrong length
        (_ring(result="out"), "return a pair"),
        (_waits_twice, "waited twice for the same request"),
        (_keep_all(overlap=False), "between posting each irecv and waiting for it the check saw no matrix product on a chunk"),
        (_keep_all(overlap=True), "chunks' K and V at once"),
        (_c10d_all_gather, "called dist.all_gather"),
        (_own_chunk_only, "no isend/irecv seen"),
        (_ring(merge_fn=_merge_without_the_max), "has inf or nan"),
        (_ring(keep_clones=True), "(receive buffers, stacks, clones: any copy)"),
        (_ring(busy_wait=True), "no matrix product on a chunk's keys or values"),
        (_ring(busy_wait="k row"), "a product on a few rows of K is not attention"),
        (_ring(shape_of=lambda k, layout, src, n: (2, *k.shape[:-2], len(layout[src]), k.shape[-1])),
         "receive buffer number"),  # the shape of the chunk held, not of the one arriving: uneven chunks differ
    ],
)
def test_ring_forward_rejects_wrong_answers(answer, hint, monkeypatch):
    monkeypatch.setattr(nb15, "TIMEOUT", 10)  # a ring that hangs is reported after this
    feedback = nb15.ring_forward(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


# ------------------------------------------------------------------ Exercise 3: zigzag_layout


def _slices(seq_len, world_size):
    return torch.arange(seq_len).tensor_split(2 * world_size)


def _view(seq_len, world_size):  # raises when 2N does not divide the length
    return torch.arange(seq_len).view(2 * world_size, -1)


def _cut(seq_len, world_size):  # slices of seq_len // 2N tokens: drops the rest when 2N does not divide
    size = seq_len // (2 * world_size)
    return [torch.arange(i * size, (i + 1) * size) for i in range(2 * world_size)]


# the course's layouts for the lengths the check used to try, written out
_HARD_CODED = {(s, n): [p.tolist() for p in cp.zigzag_layout(s, n)] for s, n in ((24, 2), (24, 3), (32, 4))}


@pytest.mark.parametrize(
    "answer, hint",
    [
        (cp.contiguous_layout, "not balanced"),
        (lambda s, n: [torch.cat([_slices(s, n)[r], _slices(s, n)[r + n]]) for r in range(n)], "not balanced"),
        (lambda s, n: [torch.cat([_slices(s, n)[r], _slices(s, n)[2 * n - r]]) for r in range(n)], "raised IndexError"),
        (lambda s, n: [torch.arange(r, s, n) for r in range(n)], "more than two slices"),
        (lambda s, n: [torch.arange(s)], "one per rank"),
        (lambda s, n: _HARD_CODED[s, n], "raised KeyError"),
        (lambda s, n: [torch.cat([_view(s, n)[r], _view(s, n)[2 * n - 1 - r]]) for r in range(n)], "2N does not divide"),
        (lambda s, n: [torch.cat([_cut(s, n)[r], _cut(s, n)[2 * n - 1 - r]]) for r in range(n)], "none is dropped"),
        (lambda s, n: [torch.cat([_slices(s, n)[r], _slices(s, n)[2 * n - 1 - r]]) for r in range(n - 1)] + [torch.arange(0)],
         "every token exactly once"),
        (lambda s, n: 42, "one 1-D tensor of token positions per rank"),
    ],
)
def test_zigzag_layout_rejects_wrong_answers(answer, hint):
    feedback = nb15.zigzag_layout(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


# The notebook's Exercise 3 answer is this very code (tests/test_context_parallel.py), its verdict compared by nbval.
@pytest.mark.repeats_solution_notebook
@pytest.mark.parametrize("path", [SOLUTION], ids=lambda p: p.stem)
def test_zigzag_layout_accepts_the_course_layout(path):
    assert nb15.zigzag_layout(cp.zigzag_layout).status == "correct"


def test_zigzag_layout_accepts_lists():
    as_lists = lambda s, n: [p.tolist() for p in cp.zigzag_layout(s, n)]  # noqa: E731
    assert nb15.zigzag_layout(as_lists).status == "correct"
