"""Checks for notebook 15 (expert parallelism)."""

import copy
import numbers

import torch
import torch.distributed as dist

from course.parallel import expert_parallel as ep
from course.classroom import guard
from course.observe import tracing, wire
from course.classroom.exercises import correct, exercise, wrong
from course.runtime.launcher import WorkerError, launch

DIM, HIDDEN = 8, 16
ALL_TO_ALL = {"all_to_all", "all_to_all_single"}


# ------------------------------------------------------------------ Exercise 1: dispatch and combine

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
    per_rank = n_experts // len(members)
    first = members.index(rank) * per_rank
    expert_grads_ok = all(
        torch.allclose(p.grad if p.grad is not None else torch.zeros_like(p),
                       q.grad if q.grad is not None else torch.zeros_like(q), rtol=1e-9, atol=1e-9)
        for local, expert in enumerate(layer.experts)
        for p, q in zip(expert.parameters(), reference.experts[first + local].parameters())
    )
    return {
        "ops": sorted({(c.op, "all ranks" if g is None else "the ep group", _what(c, x)) for g in groups
                       for c in tracing.collectives(g)}),
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
    return None


@exercise(
    "Exercise 1 (dispatch and combine)",
    hint="dispatch: first an all-to-all of the counts (each rank sends each rank the counts of that rank's experts), "
    "then rows per rank = counts summed per rank, and AllToAll.apply(x_sorted, rows to receive, rows to send, group); "
    "combine: the same exchange backwards, split sizes swapped.",
    finished=("course.parallel.expert_parallel.dispatch", "course.parallel.expert_parallel.combine"),
)
def dispatch_combine(dispatch, combine):
    """Exercise 1: the expert-parallel layer with the answer's dispatch and combine equals the
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
    cases = "; ".join(_case_name(*case) for case in LAYER_CASES)
    return correct(f"{cases}: outputs, input gradients and expert gradients equal the single-process layer's, "
                   "with all-to-alls only.")


# ------------------------------------------------------------------ Exercise 2: predict the bytes

BYTES_DIMS = {2: 96, 3: 160, 4: 128}  # >= 384 B per token: more than gloo's headers; varied, so dim must be used
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
    with wire.measure() as m:
        dist.all_to_all_single(out, x, receive, send)
    return m.sent


@exercise(
    "Exercise 2 (bytes sent)",
    hint="row `rank` of send_counts says how many tokens this rank sends to each rank; each token is dim float32 "
    "values; and one of those chunks never leaves the process.",
)
def bytes_sent(predict):
    """Exercise 2: predict the bytes a rank sends in one all-to-all, then compare with the wire."""
    for world_size, seed in ((2, 0), (3, 1), (4, 2)):
        counts, dim = random_send_counts(world_size, seed), BYTES_DIMS[world_size]
        measured = launch(_bytes_run, world_size, counts, dim, show=None, timeout=60)
        for rank in range(world_size):
            guess = predict(counts.clone(), rank, dim)
            if isinstance(guess, torch.Tensor) and guess.numel() == 1 and not guess.is_floating_point():
                guess = int(guess)  # a 0-d (or 1-element) integer tensor: its value
            if not isinstance(guess, numbers.Real) or isinstance(guess, bool):
                return wrong(f"return a number of bytes (an int); got {guess!r}.")
            payload = (int(counts[rank].sum()) - int(counts[rank, rank])) * dim * 4
            if measured[rank] - HEADER_SLACK * (world_size - 1) <= guess <= measured[rank]:
                continue
            if guess == payload + int(counts[rank, rank]) * dim * 4:
                return wrong("a rank's own chunk is copied in memory: the wire never sees it (measured).")
            if guess == (int(counts[:, rank].sum()) - int(counts[rank, rank])) * dim * 4:
                return wrong("that is what the rank receives (its column of send_counts); it sends its row.")
            if guess * 4 == payload:
                return wrong("count bytes: a float32 value is 4 bytes.")
            return wrong(f"on {world_size} ranks, dim = {dim}, with send_counts = {counts.tolist()}, rank {rank} sent "
                         f"{measured[rank]:,} B (gloo adds ~{144 * (world_size - 1)} B of headers); you predicted {guess:,}.")
    return correct("2, 3 and 4 ranks, dim 96, 160 and 128, 9 ranks' worth of uneven counts: every prediction is what the wire measured, "
                   "less gloo's headers.")


# ------------------------------------------------------------------ Exercise 3: the EP x DP gradient sync

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
    "Exercise 3 (EP x DP gradient sync)",
    hint="skip frozen parameters (no .grad). After backward, an expert's gradient already holds every token of its expert-parallel group; "
    "the router's holds only this rank's. Each rank's loss counts 1/(all ranks) in the mean.",
    finished=("course.parallel.expert_parallel.sync_gradients",),
)
def ep_dp_sync(sync):
    """Exercise 3: fix the gradient sync; trained on 2x2, 1x2 and 1x4 meshes (dp x ep) it must match one process."""
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
    return correct("on 2x2, 2x1 and 1x4 meshes (dp x ep), experts with frozen biases, one SGD step: the router and "
                   "every expert equal one process's.")
