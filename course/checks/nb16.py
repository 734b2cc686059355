"""Checks for notebook 16 (expert parallelism)."""

import copy
import functools
import numbers
import random

import torch
import torch.distributed as dist

from course.parallel import expert_parallel as ep
from course.classroom import guard
from course.observe import tracing, wire
from course.classroom.exercises import correct, exercise, wrong
from course.runtime.launcher import WorkerError, launch

DIM, HIDDEN = 8, 16
ALL_TO_ALL = {"all_to_all", "all_to_all_single"}


# ------------------------------------------------------------------ Exercise 1: top-k routing and the capacity

# (tokens, k, experts, capacity): top-1 to top-3, capacities that drop many, a few, or no assignments
CAPACITY_CASES = [(16, 2, 4, 8), (16, 2, 4, 5), (12, 1, 4, 2), (10, 3, 6, 4), (9, 2, 8, 1), (6, 2, 4, 12)]


def _choices(seed, tokens, k, n_experts, skew=0.0):
    """Each token's k distinct experts, best first, from random scores (expert 0 raised by ``skew``)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, n_experts, generator=g)
    logits[:, 0] += skew
    return logits.topk(k, dim=-1).indices


def _judge_capacity(fn, seed):
    for i, (tokens, k, n_experts, capacity) in enumerate(CAPACITY_CASES):
        experts = _choices(seed + i, tokens, k, n_experts, skew=1.5)
        case = f"{tokens} tokens, top-{k} of {n_experts} experts, capacity {capacity}"
        try:
            keep = fn(experts.clone(), n_experts, capacity)
        except Exception as e:  # noqa: BLE001 - reported as the feedback
            return wrong(f"with {case}, within_capacity raised {type(e).__name__}: {e}")
        if not isinstance(keep, torch.Tensor) or keep.shape != experts.shape:
            return wrong(f"within_capacity returns a boolean tensor shaped like experts, (tokens, k) = "
                         f"{tuple(experts.shape)}: True for each assignment its expert keeps.")
        keep = keep.bool()
        expected = guard.original(ep.within_capacity)(experts, n_experts, capacity)  # the course's, unguarded
        if torch.equal(keep, expected):
            continue
        for e in range(n_experts):
            held = int(keep[experts == e].sum())
            if held > capacity:
                return wrong(f"with {case}, expert {e} kept {held} assignments: an expert keeps at most its "
                             "capacity and drops the rest.")
        for e in range(n_experts):
            dropped_first = ((experts[:, 0] == e) & ~keep[:, 0]).any()
            kept_later = ((experts[:, 1:] == e) & keep[:, 1:]).any()
            if dropped_first and kept_later:
                return wrong(f"with {case}, expert {e} kept a second (or later) choice and dropped a first choice: "
                             "an expert takes the first choices of all tokens first (in token order), then the "
                             "second choices, and so on.")
        t, j = torch.nonzero(keep != expected)[0].tolist()
        return wrong(f"with {case}, token {t}'s choice {j} (expert {int(experts[t, j])}) should be "
                     f"{'kept' if expected[t, j] else 'dropped'}: fill each expert in the order first choices of "
                     "tokens 0, 1, ..., then second choices, until it holds its capacity.")
    return None


def _judge_route(route, seed):
    for i, (tokens, k, n_experts, capacity_factor) in enumerate(
            [(12, 2, 4, None), (12, 1, 4, 1.0), (16, 2, 4, 1.0), (10, 3, 6, 1.25), (9, 2, 8, None)]):
        torch.manual_seed(seed + i)
        router = torch.nn.Linear(DIM, n_experts, bias=False)
        with torch.no_grad():
            router.weight[0] += 0.5  # a skewed router: capacities drop
        x = torch.randn(tokens, DIM, generator=torch.Generator().manual_seed(seed + i)).abs()
        case = f"{tokens} tokens, top-{k} of {n_experts} experts, capacity factor {capacity_factor}"
        try:
            got = route(router, x, k, capacity_factor)
        except Exception as e:  # noqa: BLE001 - reported as the feedback
            return wrong(f"with {case}, route raised {type(e).__name__}: {e}")
        want = guard.original(ep.route)(router, x, k, capacity_factor)
        if not all(isinstance(getattr(got, a, None), torch.Tensor) for a in ("experts", "weights", "keep", "logits")):
            return wrong("route returns a Routing(experts, weights, keep, logits).")
        if got.experts.shape != want.experts.shape:
            return wrong(f"with {case}, route returned experts of shape {tuple(got.experts.shape)}, not (tokens, k) = "
                         f"{tuple(want.experts.shape)}: each token goes to its top {k} experts (top-{got.experts.shape[-1]} "
                         f"for top-{k}?).")
        if not torch.equal(got.experts.sort(-1).values, want.experts.sort(-1).values):
            return wrong(f"with {case}, a token went to other experts than its {k} highest-scoring ones.")
        order = got.experts.argsort(-1)  # compare weights and keep expert by expert, whatever the order
        weights = got.weights.gather(-1, order) if got.weights.shape == got.experts.shape else got.weights
        keep = got.keep.bool().gather(-1, order) if got.keep.shape == got.experts.shape else got.keep
        want_order = want.experts.argsort(-1)
        if weights.shape != want.weights.shape or not torch.allclose(weights, want.weights.gather(-1, want_order), atol=1e-6):
            kept = want.weights * want.keep
            kept = (kept / kept.sum(-1, keepdim=True).clamp(min=1e-12)).gather(-1, want_order)
            if not want.keep.all() and weights.shape == kept.shape and torch.allclose(weights, kept, atol=1e-6):
                return wrong(f"with {case}, the weights were renormalised over the kept assignments: a token's k "
                             "weights are the softmax of its k scores, whether or not the capacity drops one "
                             "(a dropped assignment's share is lost, its output 0).")
            return wrong(f"with {case}, the weights differ: a token's k weights are the softmax of its k scores "
                         "(they sum to 1), not the softmax over all experts.")
        if keep.shape != want.keep.shape or not torch.equal(keep, want.keep.gather(-1, want_order)):
            if capacity_factor is not None and keep.all():
                return wrong(f"with {case}, every assignment was kept: with a capacity factor each expert keeps "
                             "ceil(capacity_factor x tokens x k / experts) of them (within_capacity).")
            return wrong(f"with {case}, the kept assignments differ: the capacity is "
                         "ceil(capacity_factor x tokens x k / experts), and within_capacity decides which fit.")
    return None


@exercise(
    "Exercise 1 (routing and the capacity)",
    hint="within_capacity: lay the assignments out first choices first (experts.T flattened: choice 0 of every "
    "token, then choice 1, ...); an assignment's place in its expert's queue is how many assignments to that "
    "expert came before it (a cumulative count); keep it if its place < capacity. route: logits.topk(k), the "
    "softmax of the k scores, and within_capacity with ceil(capacity_factor * tokens * k / experts).",
    finished=("course.parallel.expert_parallel.within_capacity", "course.parallel.expert_parallel.route"),
)
def routing(route, within_capacity):
    """Exercise 1: top-k routing with a capacity that takes first choices first."""
    seed = random.randrange(1 << 30)  # fresh scores each time: nothing can be hard-coded
    feedback = _judge_capacity(within_capacity, seed)
    if feedback is None:
        feedback = _judge_route(route, seed)
    if feedback is not None:
        return feedback
    return correct("top-1 to top-3, with capacities: first choices first.")


# ------------------------------------------------------------------ Exercise 2: the load-balancing loss


def _routings(seed):
    """(name, Routing with leaf logits): top-1 and top-2, 4 and 8 experts, a skewed router, an exactly even
    load (f_e = P_e = 1/E: the loss is 1), assignments dropped by the capacity, and a rank with no tokens."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for name, tokens, k, n_experts, skew in (("top-2 of 4 experts", 12, 2, 4, 0.0), ("top-1 of 8 experts", 16, 1, 8, 0.0),
                                              ("top-2 of 8, skewed", 20, 2, 8, 2.0)):
        logits = torch.randn(tokens, n_experts, generator=g, dtype=torch.float64)
        logits[:, 0] += skew
        cases.append((name, logits.requires_grad_(), k))
    even = torch.zeros(8, 4, dtype=torch.float64)  # equal scores: P_e = 1/4; top-1 by hand below: f_e = 1/4
    cases.append(("an even load", even.requires_grad_(), 1))
    skewed = torch.randn(12, 4, generator=g, dtype=torch.float64)
    skewed[:, 0] += 2.0  # most first choices on expert 0, beyond its capacity: assignments dropped
    cases.append(("top-2 of 4, capacity 4 (assignments dropped)", skewed.requires_grad_(), 2))
    cases.append(("a rank with no tokens", torch.zeros(0, 4, dtype=torch.float64, requires_grad=True), 2))
    routings = []
    for name, logits, k in cases:
        if name == "an even load":
            experts = torch.arange(8).remainder(4)[:, None]
        else:
            experts = logits.detach().topk(k, dim=-1).indices
        weights = logits.detach().gather(-1, experts).softmax(-1)
        keep = torch.ones_like(experts, dtype=torch.bool)
        if "dropped" in name:  # f counts every assignment, kept or dropped: the router's choices
            keep = ep.within_capacity(experts, logits.shape[-1], 4)  # 16 places for 24
            assert not keep.all()
        routings.append((name, ep.Routing(experts, weights, keep, logits)))
    return routings


@exercise(
    "Exercise 2 (the load-balancing loss)",
    hint="f: one_hot(routing.experts, E) summed over tokens and choices, divided by the number of assignments "
    "(tokens x k), so that it sums to 1; P: the softmax of routing.logits over the experts, averaged over the "
    "tokens; the loss is E * (f * P).sum(). A batch with no tokens: return 0 that keeps the graph "
    "(logits.sum() * 0), not 0/0.",
    finished=("course.parallel.expert_parallel.load_balancing_loss",),
)
def balancing_loss(fn):
    """Exercise 2: the Switch Transformer's auxiliary loss, its value and its gradient."""
    seed = random.randrange(1 << 30)
    for name, routing in _routings(seed):
        mine = ep.Routing(routing.experts, routing.weights, routing.keep, routing.logits.detach().requires_grad_())
        try:
            loss = fn(mine)
        except Exception as e:  # noqa: BLE001 - reported as the feedback
            return wrong(f"with {name}, your loss raised {type(e).__name__}: {e}")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return wrong("return the loss as a one-element tensor.")
        want = guard.original(ep.load_balancing_loss)(routing)
        if not torch.isfinite(loss).all():
            return wrong(f"with {name}, the loss is {loss.item()}: a rank with no tokens has no load and no loss "
                         "(0, not 0/0).")
        if not torch.allclose(loss.double(), want, atol=1e-9):
            n_experts, k = routing.logits.shape[-1], routing.experts.shape[-1]
            if k > 1 and torch.allclose(loss.double(), k * want, atol=1e-9):
                return wrong(f"with {name}, the loss is k = {k} times the course's: here f_e is the fraction of "
                             "all tokens x k assignments, so that the f_e sum to 1 and an even load gives 1. Some "
                             "implementations divide by the tokens only (Hugging Face's Mixtral load-balancing "
                             "loss: an even load gives k there); this exercise asks for the course's.")
            if not routing.keep.all():
                kept = ep.Routing(routing.experts[routing.keep][:, None], routing.weights, routing.keep,
                                  routing.logits)
                if torch.allclose(loss.double(), guard.original(ep.load_balancing_loss)(kept), atol=1e-9):
                    return wrong(f"with {name}, your f_e counts only the kept assignments: f_e is where the "
                                 "router sends them, all tokens x k, dropped or not (the loss is there to "
                                 "teach the router to spread the load, so that fewer are dropped).")
            if torch.allclose(loss.double() * n_experts, want, atol=1e-9):
                return wrong(f"with {name}, the loss is E = {n_experts} times too small: multiply by E, so that an "
                             "even load gives 1.")
            return wrong(f"with {name}, the loss is {loss.item():.4f}, not {want.item():.4f}: E * sum_e f_e P_e, "
                         "f_e the fraction of assignments to expert e, P_e the mean of the router's softmax over "
                         "all E experts (from the logits, not the k weights).")
        if not loss.requires_grad:
            if not routing.logits.numel():
                return wrong(f"with {name}, the loss is a constant 0 with no graph: backward() of it "
                             "raises (it does not require grad), yet every rank must run backward, for the "
                             "all-to-all's backward needs them all. Return 0 that keeps the graph "
                             "(logits.sum() * 0).")
            return wrong(f"with {name}, the loss has no gradient: P_e, from the logits, carries it.")
        if routing.logits.numel():
            want.backward()
            loss.backward()
            if mine.logits.grad is None or not torch.allclose(mine.logits.grad, routing.logits.grad, atol=1e-9):
                return wrong(f"with {name}, the value is right but the gradient is not: f_e is a count (no "
                             "gradient); only P_e, the mean softmax of the logits, is differentiable.")
    return correct("value and gradient right; even load 1, no tokens 0.")


# ------------------------------------------------------------------ Exercise 3: dispatch and combine

# (ranks, experts, k, capacity factor, router skew, tokens per rank, dp): several world sizes, so that a
# solution written for 2 ranks fails; uneven counts everywhere; dropped tokens; ranks that receive no
# token at all (the skewed router sends every token to expert 0); and a layer on a subgroup (the ep
# group of a dp x ep mesh), so that an answer that ignores ``group`` fails.
LAYER_CASES = [
    (2, 4, 2, None, 0.0, (12, 12), 1),
    (3, 6, 2, 1.0, 0.0, (5, 12, 0), 1),  # rank 2 has no tokens of its own
    (4, 4, 1, None, 6.0, (6, 6, 6, 6), 1),
    (4, 4, 2, 1.0, 0.0, (6, 9, 4, 7), 2),  # ep groups {0, 1} and {2, 3}
]


def _case_name(world_size, n_experts, k, capacity_factor, skew, tokens, dp):
    name = f"{world_size} ranks, {n_experts} experts, top-{k}, tokens per rank {list(tokens)}"
    if capacity_factor is not None:
        name += f", capacity factor {capacity_factor}"
    if dp > 1:
        name += f", the layer on the ep group of a {dp} x {world_size // dp} mesh (dp x ep)"
    return name + (", every token routed to expert 0" if skew else "")


def make_moe(n_experts, k, capacity_factor, skew=0.0):
    """The float64 MoE the checks compare with; ``skew`` raises expert 0's router row."""
    torch.manual_seed(0)
    moe = ep.MoE(DIM, HIDDEN, n_experts, k, capacity_factor).double()
    with torch.no_grad():
        moe.router.weight[0] += skew
    return moe


def make_tokens(rank, count, positive=False):
    """Rank ``rank``'s tokens and the upstream gradient of its output (positive tokens with a skewed
    router all choose expert 0 first)."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(count, DIM, generator=g, dtype=torch.float64)
    return (x.abs() if positive else x), torch.randn(count, DIM, generator=g, dtype=torch.float64)


def _not_reentrant(answer, dotted):
    """``answer``, refusing to be called again while it runs: it called ``dotted``, the name the
    check bound it to."""
    running = []

    def call(*args, **kwargs):
        if running:
            raise guard.FinishedVersionUsed(guard.message(dotted))
        running.append(True)
        try:
            return answer(*args, **kwargs)
        finally:
            running.pop()

    return call


def _layer_run(rank, world_size, dispatch, combine, n_experts, k, capacity_factor, skew, tokens, dp):
    group, members = None, list(range(world_size))
    if dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        group = init_device_mesh("cpu", (dp, world_size // dp), mesh_dim_names=("dp", "ep")).get_group("ep")
        members = dist.get_process_group_ranks(group)
    full = make_moe(n_experts, k, capacity_factor, skew)
    reference = copy.deepcopy(full)
    loss = 0
    inputs = {}
    for r in members:  # the single-process layer on the tokens of every rank of the layer's group
        x, upstream = make_tokens(r, tokens[r], positive=skew > 0)
        x.requires_grad_()
        y, aux = reference(x)
        loss = loss + (y * upstream).sum() + aux
        inputs[r] = (x, y.detach())
    loss.backward()
    # the rows this rank must send in the dispatch (its kept assignments) and receive (the kept assignments of
    # every member for this rank's experts): the combine sends back what was received, backward reverses both
    per_rank = n_experts // len(members)
    first = members.index(rank) * per_rank
    kept, received = 0, 0
    for r in members:
        routing = ep.route(reference.router, make_tokens(r, tokens[r], positive=skew > 0)[0], k, capacity_factor)
        chosen = routing.experts[routing.keep]
        kept += len(chosen) if r == rank else 0
        received += int(((chosen >= first) & (chosen < first + per_rank)).sum())
    needed = 2 * (kept + received) * DIM * 8  # float64 rows, forward and backward

    # The layer calls the answer's functions (in this rank only). An answer that calls
    # ep.dispatch (the course's own) would now call itself: say so rather than recurse.
    ep.dispatch = _not_reentrant(dispatch, "course.parallel.expert_parallel.dispatch")
    ep.combine = _not_reentrant(combine, "course.parallel.expert_parallel.combine")
    layer = ep.ExpertParallelMoE(full, group)
    x, upstream = make_tokens(rank, tokens[rank], positive=skew > 0)
    x.requires_grad_()
    groups = [None] if group is None else [None, group]
    for g in groups:
        tracing.clear(g)
    y, aux = layer(x)
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return {"bad_shape": True}
    ((y * upstream).sum() + aux).backward()
    for g in groups:
        tracing.wait_all(g)
    expert_grads_ok = all(
        torch.allclose(p.grad if p.grad is not None else torch.zeros_like(p),
                       q.grad if q.grad is not None else torch.zeros_like(q), rtol=1e-9, atol=1e-9)
        for local, expert in enumerate(layer.experts)
        for p, q in zip(expert.parameters(), reference.experts[first + local].parameters())
    )
    return {
        "ops": sorted({(c.op, "all ranks" if g is None else "the ep group", _what(c, x)) for g in groups
                       for c in tracing.collectives(g)}),
        "token_bytes": sum(c.bytes for g in groups for c in tracing.collectives(g) if _what(c, x) == "tokens"),
        "needed_bytes": needed,
        "output_ok": torch.allclose(y, inputs[rank][1], rtol=1e-9, atol=1e-9),
        "input_grad_ok": x.grad is not None and torch.allclose(x.grad, inputs[rank][0].grad, rtol=1e-9, atol=1e-9),
        "expert_grads_ok": expert_grads_ok,
    }


def _what(collective, x):
    """What a collective carried: tokens (rows of dim values) or counts (integers)."""
    return "counts" if all(d.startswith("int") for d in collective.dtypes) else "tokens"


def _judge_layer(results, case, subgroup):
    if any("bad_shape" in r for r in results):
        return wrong(f"with {case}, the layer's output does not have its input's shape: combine must return one row "
                     "per row of x_sorted, in x_sorted's order.")
    ops = sorted({op for r in results for op in r["ops"]})
    others = [f"{op} of the {what} over {where}" for op, where, what in ops if op not in ALL_TO_ALL]
    if others:
        return wrong(f"with {case}, the answer ran {'; '.join(others)}: an all-gather gives every rank everything, "
                     "a broadcast or all-reduce is not an exchange. Send each rank only what is for it, with "
                     "all_to_all_single and the split sizes.")
    if subgroup and any(where == "all ranks" for _, where, _ in ops):
        return wrong(f"with {case}, the answer ran its all-to-alls over all ranks, not over the layer's group: "
                     "pass group= to every collective (and take N from dist.get_world_size(group)).")
    if not ops:
        return wrong("the answer ran no collective: the tokens must travel to the ranks of their experts.")
    if not all(r["output_ok"] for r in results):
        bad = [rank for rank, r in enumerate(results) if not r["output_ok"]]
        return wrong(f"with {case}, the output on rank(s) {bad} differs from the single-process layer's: are the tokens "
                     "received grouped by source rank, then by expert, and do the results come back in x_sorted's order?")
    if not all(r["input_grad_ok"] for r in results):
        return wrong(f"with {case}, the output is right but the input gradient is not: the gradient must travel back "
                     "through both exchanges — use the differentiable AllToAll, not dist.all_to_all_single directly.")
    if not all(r["expert_grads_ok"] for r in results):
        return wrong(f"with {case}, the output is right but the experts' gradients are not.")
    for rank, r in enumerate(results):
        if r["token_bytes"] > r["needed_bytes"]:
            return wrong(f"with {case}, rank {rank} handed {r['token_bytes']:,} B of tokens to its all-to-alls "
                         f"(forward and backward), {r['token_bytes'] / r['needed_bytes']:.1f} x the "
                         f"{r['needed_bytes']:,} B the exchange needs: each row goes only to the rank of its "
                         "expert (and back), with uneven split sizes. Sending every token to every rank is an "
                         "all-gather in disguise, N times the bytes.")
    return None


@exercise(
    "Exercise 3 (dispatch and combine)",
    hint="dispatch: first an all-to-all of the counts (each rank sends each rank the counts of that rank's experts), "
    "then rows per rank = counts summed per rank, and AllToAll.apply(x_sorted, rows to receive, rows to send, group); "
    "combine: the same exchange backwards, split sizes swapped.",
    finished=("course.parallel.expert_parallel.dispatch", "course.parallel.expert_parallel.combine"),
)
def dispatch_combine(dispatch, combine):
    """Exercise 3: the expert-parallel layer with the answer's dispatch and combine equals the
    single-process layer (output, input and expert gradients) on 2, 3 and 4 ranks."""
    for case in LAYER_CASES:
        name = _case_name(*case)
        try:
            results = launch(_layer_run, case[0], dispatch, combine, *case[1:], backend="traced", show=None, timeout=60)
        except WorkerError as e:
            on_group = " Is every collective on the layer's group (group=group)?" if case[-1] > 1 else ""
            return wrong(f"with {name}, a rank failed: {e.failed.get(e.rank, e)}. Do both sides of every "
                         f"exchange agree on how many rows go where, on any number of ranks?{on_group}")
        feedback = _judge_layer(results, name, subgroup=case[-1] > 1)
        if feedback is not None:
            return feedback
    return correct("the single-process layer on 2-4 ranks; only the rows needed.")


# ------------------------------------------------------------------ Exercise 4: predict the bytes

BYTES_DIMS = {2: 96, 3: 160, 4: 192}  # a token (4 dim B) > HEADER_SLACK (N-1): one token more or less is out; varied
HEADER_SLACK = 200  # bytes per peer gloo may add (measured: 144 B per peer per all_to_all_single, torch 2.15)


def random_send_counts(world_size, seed):
    """A (N, N) matrix: row i = how many tokens rank i sends to each rank; at least 2 to itself."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 9, (world_size, world_size), generator=g)
    counts.diagonal().add_(2)
    return counts


def _bytes_run(rank, world_size, send_counts, dim):
    send = send_counts[rank].tolist()
    receive = send_counts[:, rank].tolist()
    x = torch.randn(sum(send), dim)
    out = torch.empty(sum(receive), dim)
    dist.barrier()  # the connections' setup traffic done before measuring
    with wire.measure() as m:
        dist.all_to_all_single(out, x, receive, send)
    return m.sent


SEED = random.randrange(1 << 30)  # drawn once per process: no table of answers fits, and a second try reuses the runs


@functools.cache
def _measured_sends(world_size, seed):
    """The bytes each rank sent in the all-to-all of random_send_counts(world_size, seed): measured once per
    kernel (the answer does not change what goes on the wire, so a second try compares with the same run)."""
    counts, dim = random_send_counts(world_size, seed), BYTES_DIMS[world_size]
    return tuple(launch(_bytes_run, world_size, counts, dim, show=None, timeout=60))


@exercise(
    "Exercise 4 (bytes sent)",
    hint="row `rank` of send_counts says how many tokens this rank sends to each rank; each token is dim float32 "
    "values; and one of those chunks never leaves the process.",
)
def bytes_sent(predict):
    """Exercise 4: predict the bytes a rank sends in one all-to-all, then compare with the wire."""
    for world_size in (2, 3, 4):
        seed = SEED + world_size
        counts, dim = random_send_counts(world_size, seed), BYTES_DIMS[world_size]
        measured = _measured_sends(world_size, seed)
        for rank in range(world_size):
            guess = predict(counts.clone(), rank, dim)
            if isinstance(guess, torch.Tensor) and guess.numel() == 1 and not guess.is_floating_point():
                guess = int(guess)  # a 0-d (or 1-element) integer tensor: its value
            if not isinstance(guess, numbers.Real) or isinstance(guess, bool):
                return wrong(f"return a number of bytes (an int); got {guess!r}.")
            payload = (int(counts[rank].sum()) - int(counts[rank, rank])) * dim * 4
            if payload <= guess <= min(measured[rank], payload + HEADER_SLACK * (world_size - 1)):
                continue  # the tokens' bytes, plus at most gloo's headers
            with_own = guess == payload + int(counts[rank, rank]) * dim * 4
            received = guess == (int(counts[:, rank].sum()) - int(counts[rank, rank])) * dim * 4
            mistakes = [said for matches, said in (
                (with_own, "its row with its own chunk: a rank's own chunk is copied in memory, the wire never sees it "
                           "(measured)."),
                (received, "what the rank receives (its column of send_counts); it sends its row."),
                (guess * 4 == payload, "its payload in values, not bytes: a float32 value is 4 bytes."),
            ) if matches]
            if len(mistakes) > 1:  # these random counts make two mistakes the same number: name both
                return wrong("that is " + " It is also ".join(mistakes))
            if mistakes:
                return wrong("that is " + mistakes[0])
            return wrong(f"on {world_size} ranks, dim = {dim}, with send_counts = {counts.tolist()}, rank {rank} sent "
                         f"{measured[rank]:,} B (gloo adds ~{144 * (world_size - 1)} B of headers); you predicted {guess:,}.")
    return correct("what the wire measured on 2, 3 and 4 ranks, less gloo's headers.")


# ------------------------------------------------------------------ Exercise 5: the EP x DP gradient sync

SYNC_MESHES = [(4, 2), (2, 2), (4, 1)]  # (ranks, dp): 2x2, then pure DP, then pure EP
STEPS, LR = 1, 0.1  # one step: a wrong expert update does not yet change the router's gradient


def _mean_loss(layer_output, target):
    y, aux = layer_output
    return ((y - target) ** 2).mean() + 0.01 * aux


def train_ep_dp(rank, world_size, dp, sync):
    """One SGD step of the expert-parallel layer on a (dp, ep) mesh, gradients synced by ``sync(layer, dp_group)``."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, world_size // dp), mesh_dim_names=("dp", "ep"))
    layer = ep.ExpertParallelMoE(freeze_up_biases(make_moe(4, 2, 1.0)), mesh.get_group("ep"))
    optimizer = torch.optim.SGD(layer.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        x, target = make_tokens(10 * step + rank, 8)
        _mean_loss(layer(x), target).backward()
        sync(layer, mesh.get_group("dp"))
        optimizer.step()
    per_rank = 4 // mesh.size(1)
    first = mesh.get_local_rank("ep") * per_rank
    return {"router": layer.router.weight.detach(),
            "experts": {first + i: [p.detach() for p in e.parameters()] for i, e in enumerate(layer.experts)}}


def freeze_up_biases(moe):
    """Freeze every expert's first bias: a model with frozen parameters (no gradient to sync)."""
    for expert in moe.experts:
        expert.up.bias.requires_grad_(False)
    return moe


def train_one_process(world_size):
    """The same steps in one process: the mean of the ranks' losses."""
    moe = freeze_up_biases(make_moe(4, 2, 1.0))
    optimizer = torch.optim.SGD(moe.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        losses = [_mean_loss(moe(x), target) for x, target in (make_tokens(10 * step + r, 8) for r in range(world_size))]
        (sum(losses) / world_size).backward()
        optimizer.step()
    return moe


def compare_training(results, moe):
    """(router equal on every rank, experts equal on every rank) against one process."""
    router = all(torch.allclose(r["router"], moe.router.weight, rtol=1e-9, atol=1e-12) for r in results)
    experts = all(torch.allclose(p, q, rtol=1e-9, atol=1e-12)
                  for r in results for e, params in r["experts"].items() for p, q in zip(params, moe.experts[e].parameters()))
    return router, experts


@exercise(
    "Exercise 5 (EP x DP gradient sync)",
    hint="skip frozen parameters (no .grad). After backward, an expert's gradient already holds every token of its expert-parallel group; "
    "the router's holds only this rank's. Each rank's loss counts 1/(all ranks) in the mean.",
    finished=("course.parallel.expert_parallel.sync_gradients",),
)
def ep_dp_sync(sync):
    """Exercise 5: fix the gradient sync; trained on 2x2, 2x1 and 1x4 meshes (dp x ep) it must match one process."""
    for world_size, dp in SYNC_MESHES:
        mesh = f"{dp} x {world_size // dp} mesh (dp x ep)"
        try:
            results = launch(train_ep_dp, world_size, dp, sync, show=None, timeout=60)
        except WorkerError as e:
            return wrong(f"on a {mesh} whose experts have frozen biases (requires_grad=False: no .grad), a rank "
                         f"failed: {e.failed.get(e.rank, e)}. Skip the parameters that do not train.")
        router, experts = compare_training(results, train_one_process(world_size))
        if not router and not experts:
            return wrong(f"on a {mesh}, neither the router nor the experts train like one process.")
        if not router:
            return wrong(f"on a {mesh}, the experts are right but the router is not: it is replicated on every rank, "
                         "and each rank's router gradient holds only its own tokens.")
        if not experts:
            return wrong(f"on a {mesh}, the router is right but the experts are not: which ranks hold the same experts, "
                         "and by what must their sum be divided?")
    return correct("on 2x2, 2x1 and 1x4 meshes, frozen biases: like one process.")
