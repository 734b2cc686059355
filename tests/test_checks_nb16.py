"""Notebook 16's checks accept the course's answers and reject plausible wrong ones with a specific hint."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course.parallel import expert_parallel as ep
from course.checks import nb16
from course.classroom.doctor import PART_II_TORCH, torch_at_least

# course declares notebooks 11-18 for torch >= PART_II_TORCH (course/classroom/doctor.py, README).
# The judges' own reasons, with wrong answers built on the course's finished code: course.classroom.guard off
# (it would refuse them first; tests/test_guard.py tries it).
pytestmark = [
    pytest.mark.skipif(not torch_at_least(PART_II_TORCH), reason=f"notebooks 11-18 need torch >= {PART_II_TORCH}"),
    pytest.mark.usefixtures("judges_only"),
]

# ------------------------------------------------------------------ Exercise 1: routing and the capacity


def _ignores_capacity(experts, n_experts, capacity):
    return torch.ones_like(experts, dtype=torch.bool)


def _token_order(experts, n_experts, capacity):  # token 0's choices, then token 1's, ...: not first choices first
    queue = F.one_hot(experts.reshape(-1), n_experts)
    place = (queue.cumsum(0) * queue).sum(-1) - 1
    return (place < capacity).view(experts.shape)


def _one_too_many(experts, n_experts, capacity):  # place <= capacity: capacity + 1 kept
    tokens, k = experts.shape
    queue = F.one_hot(experts.T.reshape(-1), n_experts)
    place = (queue.cumsum(0) * queue).sum(-1) - 1
    return (place <= capacity).view(k, tokens).T


def _route_with(top=None, weights="top-k softmax", capacity="right"):
    def route(router, x, k, capacity_factor=None):
        logits = router(x)
        scores, experts = logits.topk(top or k, dim=-1)
        w = logits.softmax(-1).gather(-1, experts) if weights == "all experts" else scores.softmax(-1)
        keep = torch.ones_like(experts, dtype=torch.bool)
        if capacity_factor is not None and capacity != "ignored":
            per = x.shape[0] * (k if capacity == "right" else 1)
            keep = ep.within_capacity(experts, logits.shape[-1], math.ceil(capacity_factor * per / logits.shape[-1]))
        if weights == "kept only":  # renormalised over the kept assignments
            w = w * keep
            w = w / w.sum(-1, keepdim=True).clamp(min=1e-12)
        return ep.Routing(experts, w, keep, logits)

    return route


def test_routing_accepts_the_course_functions():
    assert nb16.routing(ep.route, ep.within_capacity).status == "correct"


@pytest.mark.parametrize(
    "route, within_capacity, hint",
    [
        (ep.route, _ignores_capacity, "an expert keeps at most its capacity"),
        (ep.route, _one_too_many, "an expert keeps at most its capacity"),
        (ep.route, _token_order, "first choices of"),
        (_route_with(top=1), ep.within_capacity, "top-1 for top-2"),
        (_route_with(weights="all experts"), ep.within_capacity, "not the softmax over all experts"),
        (_route_with(weights="kept only"), ep.within_capacity, "renormalised over the kept assignments"),
        (_route_with(capacity="ignored"), ep.within_capacity, "every assignment was kept"),
        (_route_with(capacity="without k"), ep.within_capacity, "ceil(capacity_factor x tokens x k / experts)"),
    ],
)
def test_routing_rejects_wrong_answers(route, within_capacity, hint):
    feedback = nb16.routing(route, within_capacity)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


# ------------------------------------------------------------------ Exercise 2: the load-balancing loss


def _aux(divide_by="assignments", times_e=True, p_from="logits", straight_through=False, guard_empty=True,
         count="all"):
    def load_balancing_loss(routing):
        n_experts = routing.logits.shape[-1]
        if guard_empty == "constant" and routing.experts.numel() == 0:
            return torch.tensor(0.0, dtype=routing.logits.dtype)  # right value, no graph
        if guard_empty and routing.experts.numel() == 0:
            return routing.logits.sum() * 0
        experts = routing.experts[routing.keep][:, None] if count == "kept" else routing.experts
        counts = F.one_hot(experts, n_experts).sum((0, 1)).to(routing.logits.dtype)
        f = counts / (experts.numel() if divide_by == "assignments" else experts.shape[0])
        if p_from == "logits":
            p = routing.logits.softmax(-1).mean(0)
        else:  # the k weights, scattered to their experts
            p = torch.zeros_like(routing.logits).scatter(-1, routing.experts, routing.weights).mean(0)
        if straight_through:  # f's value, but a gradient through the probabilities
            soft = routing.logits.softmax(-1).mean(0)
            f = f + soft - soft.detach()
        return (n_experts if times_e else 1) * (f * p).sum()

    return load_balancing_loss


def test_balancing_loss_accepts_the_course_function():
    assert nb16.balancing_loss(ep.load_balancing_loss).status == "correct"


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_aux(divide_by="tokens"), "k = 2 times the course's"),
        (_aux(count="kept"), "counts only the kept assignments"),
        (_aux(guard_empty="constant"), "a constant 0 with no graph"),
        (_aux(times_e=False), "times too small: multiply by E"),
        (_aux(p_from="weights"), ("not the k weights", "P_e, from the logits, carries it")),  # value right by chance: 1 seed in 60
        (_aux(straight_through=True), "the value is right but the gradient is not"),
        (_aux(guard_empty=False), "0, not 0/0"),
    ],
)
def test_balancing_loss_rejects_wrong_answers(answer, hint):
    feedback = nb16.balancing_loss(answer)
    hints = hint if isinstance(hint, tuple) else (hint,)
    assert feedback.status == "wrong" and any(h in feedback.message for h in hints), feedback


# ------------------------------------------------------------------ Exercise 3: dispatch and combine


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


def _everything_dispatch(x_sorted, counts, group=None):  # every token to every rank, all_to_all_single only
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    counts_received = ep.exchange_counts(counts, group)
    all_counts = torch.empty(n * len(counts), dtype=counts.dtype)
    dist.all_to_all_single(all_counts, counts.repeat(n), group=group)  # every rank's counts, to every rank
    all_counts = all_counts.view(n, -1)
    sizes = all_counts.sum(1).tolist()
    everything = ep.AllToAll.apply(x_sorted.repeat(n, 1), sizes, [len(x_sorted)] * n, group)
    per_rank, parts, start = len(counts) // n, [], 0
    for source in range(n):
        before = int(all_counts[source, : rank * per_rank].sum())
        parts.append(everything[start + before: start + before + int(counts_received[source].sum())])
        start += sizes[source]
    return torch.cat(parts), counts_received


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
        (_everything_dispatch, ep.combine, "an all-gather in disguise"),
    ],
)
def test_dispatch_combine_rejects_wrong_answers(dispatch, combine, hint):
    feedback = nb16.dispatch_combine(dispatch, combine)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_dispatch_combine_accepts_the_course_functions_and_cases_cover_what_it_claims():
    assert nb16.dispatch_combine(ep.dispatch, ep.combine).status == "correct"
    assert sorted(case[0] for case in nb16.LAYER_CASES) == [2, 3, 4, 4]
    assert any(case[-1] > 1 for case in nb16.LAYER_CASES)  # a layer on a subgroup
    assert any(case[3] is not None for case in nb16.LAYER_CASES)  # a capacity that drops
    assert any(len(set(case[5])) > 1 for case in nb16.LAYER_CASES)  # uneven tokens per rank


def test_the_stub_is_not_attempted():
    def dispatch(x_sorted, counts, group=None):
        ...

    assert nb16.dispatch_combine(dispatch, ep.combine).status == "todo"

    def within_capacity(experts, n_experts, capacity):
        ...

    def load_balancing_loss(routing):
        """The docstring the student sees."""
        ...

    assert nb16.routing(ep.route, within_capacity).status == "todo"
    assert nb16.balancing_loss(load_balancing_loss).status == "todo"


# ------------------------------------------------------------------ Exercise 4: bytes


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
        (lambda c, r, d: _right(c, r, d) + d * 4, "you predicted"),  # one token too many
        (lambda c, r, d: _right(c, r, d) - d * 4, "you predicted"),  # one token too few
        (lambda c, r, d: _right(nb16.random_send_counts(len(c), len(c) - 2), r, d), "you predicted"),  # a table
    ],
)
def test_bytes_sent_rejects_wrong_answers(predict, hint):
    feedback = nb16.bytes_sent(predict)
    # the counts are drawn at random: a wrong guess may, by chance, equal what a rank receives (its column),
    # its row with its own chunk or its payload in values, and is then named as that mistake (too)
    by_chance = ("what the rank receives", "own chunk is copied", "a float32 value is 4 bytes") if hint == "you predicted" else ()
    assert feedback.status == "wrong" and any(h in feedback.message for h in (hint, *by_chance)), feedback


def test_bytes_sent_names_both_mistakes_when_the_counts_make_them_equal(monkeypatch):
    """SEED 0 draws [[2, 6], [8, 2]] on 2 ranks: rank 0 receives 8 tokens, as many as its whole row. The
    column (what it receives) was named as the row with its own chunk, 1 draw in ~25 (the flaky test above)."""
    monkeypatch.setattr(nb16, "SEED", 0)
    feedback = nb16.bytes_sent(lambda c, r, d: int(c[:, r].sum() - c[r, r]) * d * 4)
    assert feedback.status == "wrong" and "what the rank receives" in feedback.message, feedback
    assert "own chunk is copied in memory" in feedback.message, feedback


def test_bytes_sent_names_values_for_bytes_when_it_equals_what_the_rank_receives(monkeypatch):
    """SEED 10 draws [[8, 4], [1, 5]] on 2 ranks: rank 0's 4 tokens in values (4 x 96) equal the 1 token it
    receives in bytes (96 x 4). That answer was named only 'what the rank receives', ~1 draw in 45."""
    monkeypatch.setattr(nb16, "SEED", 10)
    feedback = nb16.bytes_sent(lambda c, r, d: int(c[r].sum() - c[r, r]) * d)
    assert feedback.status == "wrong" and "a float32 value is 4 bytes" in feedback.message, feedback
    assert "what the rank receives" in feedback.message, feedback


def test_bytes_sent_accepts_the_payload_and_the_payload_plus_headers():
    assert nb16.bytes_sent(_right).status == "correct"
    assert nb16.bytes_sent(lambda c, r, d: (c[r].sum() - c[r, r]) * d * 4).status == "correct"  # a 0-d tensor
    assert len(set(nb16.BYTES_DIMS.values())) == len(nb16.BYTES_DIMS)  # dim varies with the world size
    assert nb16.bytes_sent(lambda c, r, d: _right(c, r, d) + 144 * (len(c) - 1)).status == "correct"


def test_random_send_counts_keep_a_chunk_at_home():
    for n, seed in ((2, 0), (3, 1), (4, 2)):
        counts = nb16.random_send_counts(n, seed)
        assert (counts.diagonal() >= 2).all() and len(set(counts.flatten().tolist())) > 2


# ------------------------------------------------------------------ Exercise 5: EP x DP gradient sync


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
    feedback = nb16.ep_dp_sync(sync)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_ep_dp_sync_accepts_the_course_function():
    assert nb16.ep_dp_sync(ep.sync_gradients).status == "correct"
