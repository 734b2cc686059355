"""Notebook 15's checks accept the course's answers and reject plausible wrong ones with a specific hint."""

import pytest
import torch
import torch.distributed as dist

from course.parallel import expert_parallel as ep
from course.checks import nb15
from course.classroom.doctor import PART_II_TORCH, torch_at_least

# course declares notebooks 11-17 for torch >= PART_II_TORCH (course/classroom/doctor.py, README).
# The judges' own reasons, with wrong answers built on the course's finished code: course.classroom.guard off
# (it would refuse them first; tests/test_guard.py tries it).
pytestmark = [
    pytest.mark.skipif(not torch_at_least(PART_II_TORCH), reason=f"notebooks 11-17 need torch >= {PART_II_TORCH}"),
    pytest.mark.usefixtures("judges_only"),
]

# ------------------------------------------------------------------ Exercise 1: dispatch and combine


def _gather_dispatch(x_sorted, counts, group=None):  # every token to every rank, then keep this rank's
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    all_counts = [torch.empty_like(counts) for _ in range(n)]
    dist.all_gather(all_counts, counts, group=group)
    sizes = [int(c.sum()) for c in all_counts]
    parts = [x_sorted.new_empty(s, x_sorted.shape[1]) for s in sizes]
    padded = max(sizes)
    buffers = [x_sorted.new_zeros(padded, x_sorted.shape[1]) for _ in range(n)]
    mine = x_sorted.new_zeros(padded, x_sorted.shape[1])
    mine[: len(x_sorted)] = x_sorted
    dist.all_gather(buffers, mine, group=group)
    per_rank = len(counts) // n
    received, counts_received = [], []
    for source, (c, buf) in enumerate(zip(all_counts, buffers)):
        parts[source] = buf[: sizes[source]]
        start = int(c[: rank * per_rank].sum())
        stop = start + int(c[rank * per_rank:(rank + 1) * per_rank].sum())
        received.append(parts[source][start:stop])
        counts_received.append(c[rank * per_rank:(rank + 1) * per_rank])
    return torch.cat(received), torch.stack(counts_received)


def _even_dispatch(x_sorted, counts, group=None):  # all_to_all_single without split sizes
    counts_received = ep.exchange_counts(counts, group)
    out = torch.empty_like(x_sorted)
    dist.all_to_all_single(out, x_sorted, group=group)
    return out, counts_received


def _symmetric_dispatch(x_sorted, counts, group=None):  # no counts exchange: "I receive what I send"
    n = dist.get_world_size(group)
    counts_received = counts.view(n, -1)
    send = counts_received.sum(1).tolist()
    return ep.AllToAll.apply(x_sorted, send, send, group), counts_received


def _two_rank_dispatch(x_sorted, counts, group=None):  # hard-coded for 2 ranks
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    counts_received = received.view(2, -1)
    send = counts.view(2, -1).sum(1).tolist()
    return ep.AllToAll.apply(x_sorted, counts_received.sum(1).tolist(), send, group), counts_received


def _no_autograd_dispatch(x_sorted, counts, group=None):  # plain all_to_all_single: no gradient goes back
    counts_received = ep.exchange_counts(counts, group)
    n = dist.get_world_size(group)
    send, receive = counts.view(n, -1).sum(1).tolist(), counts_received.sum(1).tolist()
    out = x_sorted.new_empty(sum(receive), x_sorted.shape[1])
    dist.all_to_all_single(out, x_sorted.detach(), receive, send, group=group)
    return out, counts_received


def _counts_by_expert_dispatch(x_sorted, counts, group=None):  # (E/N, N): experts as rows, sources as columns
    n = dist.get_world_size(group)
    counts_received = ep.exchange_counts(counts, group)
    send, receive = counts.view(n, -1).sum(1).tolist(), counts_received.sum(1).tolist()
    x_received = ep.AllToAll.apply(x_sorted, receive, send, group)
    return x_received, counts_received.T.contiguous().view(counts_received.shape)


_COURSE_DISPATCH, _COURSE_COMBINE = ep.dispatch, ep.combine  # the check puts the answer's in their place


def _default_group_dispatch(x_sorted, counts, group=None):  # ignores group: all ranks
    return _COURSE_DISPATCH(x_sorted, counts)


def _default_group_combine(y_received, counts, counts_received, group=None):
    return _COURSE_COMBINE(y_received, counts, counts_received)


def _unswapped_combine(y_received, counts, counts_received, group=None):  # the dispatch's splits again
    n = dist.get_world_size(group)
    send = counts.view(n, -1).sum(1).tolist()
    return ep.AllToAll.apply(y_received, counts_received.sum(1).tolist(), send, group)


def _no_exchange_combine(y_received, counts, counts_received, group=None):  # results never sent back
    return y_received


@pytest.mark.parametrize(
    "dispatch, combine, hint",
    [
        (_gather_dispatch, ep.combine, "all_gather of the tokens over all ranks"),
        (_default_group_dispatch, _default_group_combine, "the ep group of a 2 x 2 mesh"),
        (_even_dispatch, ep.combine, "differs from the single-process layer's"),
        (_symmetric_dispatch, ep.combine, "differs from the single-process layer's"),
        (_two_rank_dispatch, ep.combine, "with 3 ranks"),
        (_no_autograd_dispatch, ep.combine, "use the differentiable AllToAll"),
        (_counts_by_expert_dispatch, ep.combine, "a rank failed"),  # sizes that disagree: gloo refuses
        (ep.dispatch, _unswapped_combine, "a rank failed"),
        (ep.dispatch, _no_exchange_combine, "differs from the single-process"),
    ],
)
def test_dispatch_combine_rejects_wrong_answers(dispatch, combine, hint):
    feedback = nb15.dispatch_combine(dispatch, combine)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_dispatch_combine_accepts_the_course_functions_and_cases_cover_what_it_claims():
    assert nb15.dispatch_combine(ep.dispatch, ep.combine).status == "correct"
    assert sorted(case[0] for case in nb15.LAYER_CASES) == [2, 3, 4, 4]
    assert any(case[-1] > 1 for case in nb15.LAYER_CASES)  # a layer on a subgroup
    assert any(case[3] is not None for case in nb15.LAYER_CASES)  # a capacity that drops
    assert any(len(set(case[5])) > 1 for case in nb15.LAYER_CASES)  # uneven tokens per rank


def test_the_stub_is_not_attempted():
    def dispatch(x_sorted, counts, group=None):
        ...

    assert nb15.dispatch_combine(dispatch, ep.combine).status == "todo"


# ------------------------------------------------------------------ Exercise 2: bytes


def _right(counts, rank, dim):
    return int(counts[rank].sum() - counts[rank, rank]) * dim * 4


@pytest.mark.parametrize(
    "predict, hint",
    [
        (lambda c, r, d: int(c[r].sum()) * d * 4, "own chunk is copied in memory"),
        (lambda c, r, d: int(c[:, r].sum() - c[r, r]) * d * 4, "what the rank receives"),
        (lambda c, r, d: int(c[r].sum() - c[r, r]) * d, "a float32 value is 4 bytes"),
        (lambda c, r, d: 16 * d * 4 * (len(c) - 1) // len(c), "you predicted"),  # a balanced-load law
        (lambda c, r, d: 4352, "you predicted"),  # one right answer, hard-coded
        (lambda c, r, d: int(c[r].sum() - c[r, r]) * 128 * 4, "you predicted"),  # dim hard-coded
        (lambda c, r, d: "many", "return a number of bytes"),
    ],
)
def test_bytes_sent_rejects_wrong_answers(predict, hint):
    feedback = nb15.bytes_sent(predict)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_bytes_sent_accepts_the_payload_and_the_payload_plus_headers():
    assert nb15.bytes_sent(_right).status == "correct"
    assert nb15.bytes_sent(lambda c, r, d: (c[r].sum() - c[r, r]) * d * 4).status == "correct"  # a 0-d tensor
    assert len(set(nb15.BYTES_DIMS.values())) == len(nb15.BYTES_DIMS)  # dim varies with the world size
    assert nb15.bytes_sent(lambda c, r, d: _right(c, r, d) + 144 * (len(c) - 1)).status == "correct"


def test_random_send_counts_keep_a_chunk_at_home():
    for n, seed in ((2, 0), (3, 1), (4, 2)):
        counts = nb15.random_send_counts(n, seed)
        assert (counts.diagonal() >= 2).all() and len(set(counts.flatten().tolist())) > 2


# ------------------------------------------------------------------ Exercise 3: EP x DP gradient sync


def _trained(model):  # the parameters with a gradient (the check's experts have frozen biases)
    return [p for p in model.parameters() if p.requires_grad]


def _ddp_average(model, expert_data_group):  # the colleague's bug: experts divided by the dp group's size
    experts = ep.expert_parameters(model)
    for p in _trained(model):
        group = expert_data_group if id(p) in experts else None
        dist.all_reduce(p.grad, group=group)
        p.grad /= dist.get_world_size(group)


def _everything_over_all_ranks(model, expert_data_group):
    for p in _trained(model):
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def _router_over_dp_group(model, expert_data_group):
    for p in _trained(model):
        dist.all_reduce(p.grad, group=expert_data_group)
        p.grad /= dist.get_world_size()


def _hard_coded_four(model, expert_data_group):
    experts = ep.expert_parameters(model)
    for p in _trained(model):
        dist.all_reduce(p.grad, group=expert_data_group if id(p) in experts else None)
        p.grad /= 4


def _frozen_not_skipped(model, expert_data_group):  # right, but all_reduce(None) for a frozen parameter
    experts = ep.expert_parameters(model)
    for p in model.parameters():
        dist.all_reduce(p.grad, group=expert_data_group if id(p) in experts else None)
        p.grad /= dist.get_world_size()


def _experts_not_synced(model, expert_data_group):
    experts = ep.expert_parameters(model)
    for p in _trained(model):
        if id(p) not in experts:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


@pytest.mark.parametrize(
    "sync, hint",
    [
        (_ddp_average, "the router is right but the experts are not"),
        (_everything_over_all_ranks, "the router is right but the experts are not"),
        (_router_over_dp_group, "the experts are right but the router is not"),
        (_hard_coded_four, "on a 2 x 1 mesh"),
        (_experts_not_synced, "the experts are not"),
        (_frozen_not_skipped, "frozen biases"),
    ],
)
def test_ep_dp_sync_rejects_wrong_answers(sync, hint):
    feedback = nb15.ep_dp_sync(sync)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_ep_dp_sync_accepts_the_course_function():
    assert nb15.ep_dp_sync(ep.sync_gradients).status == "correct"
